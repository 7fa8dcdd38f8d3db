"""Whole training steps of a scheduled model: checking a plan against the plain step (``validate``),
planning a ``torch.compile``d step (``compiled``), per-rank profiles and checks on a process group
(``parallel``), and pipeline stages (``pipeline``: a schedule's order of actions and its step time;
``stages``: each stage profiled and planned for its own micro-batches). Above the profiler and the
runtime, below the command line (tests/test_layers.py)."""
