"""Per-rank peak against its prediction, run after run, under tensor parallelism on gloo CPU ranks:
the test's Llama or GPT-NeoX (``tests/test_tp.py``: TP 2, with or without sequence parallelism) profiled,
planned and trained in the user's loop, ``--runs`` times in fresh rank processes, each rank's
measured peak beside its own profile's prediction. The CPU meter's fidelity under collectives
(frees on gloo's worker threads) is a matter of chance per run, which one test run cannot show.

    python benchmarks/rank_fidelity.py                  # TP 2 + SP, 10 runs (~2 min)
    python benchmarks/rank_fidelity.py --no-sp --runs 5
    python benchmarks/rank_fidelity.py --model gpt-neox
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from memfit.steps.parallel import spawn_ranks
    from tests import test_tp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="fresh pairs of ranks (default 10)")
    ap.add_argument("--no-sp", action="store_true", help="plain TP 2, no sequence parallelism")
    ap.add_argument("--model", choices=sorted(test_tp.MODELS), default="llama", help="default llama")
    args = ap.parse_args()
    errors = []
    for run in range(args.runs):
        got = spawn_ranks(test_tp._rank, 2, "cpu", not args.no_sp, args.model)
        row = [(measured - predicted) / predicted for predicted, measured in got["ranks"]]
        errors += row
        print(f"run {run + 1:2}: " + "  ".join(f"rank {r} {p:>10,} B predicted, {e:+.2%}"
                                               for r, ((p, _), e) in enumerate(zip(got["ranks"], row, strict=True))),
              flush=True)
    exact = sum(e == 0 for e in errors)
    print(f"{exact} of {len(errors)} rank peaks to the byte; largest error {max(map(abs, errors)):.2%}")


if __name__ == "__main__":
    main()
