"""``python -m memfit.cli``: the command line, as the ``memfit`` script runs it."""

from memfit.cli import entry

if __name__ == "__main__":  # not in a spawned rank, which imports this module as __mp_main__
    entry()
