"""The caching allocator's model (memfit/measure/allocator.py) against PyTorch's own, on a GPU:
each scenario built and trained three steps in a fresh process, every allocation recorded
(``torch.cuda.memory._record_memory_history``), the trace replayed through the model; the model's
reserved peak beside ``torch.cuda.max_memory_reserved()``, and its allocated peak beside
``max_memory_allocated()`` (equal when the replay saw every block).

    python benchmarks/allocator_check.py                          # on a CUDA machine: the small built-ins
    python benchmarks/allocator_check.py --scenarios gpt-small bert-large --precision amp-bf16
    python benchmarks/allocator_check.py --trace snapshot.pickle  # replay a saved snapshot, anywhere

Issue 38 asks for this: a reserved figure predicted from the step's own allocation sequence
instead of a fixed margin. The CPU tests check the model on sequences whose answer follows from
PyTorch's rules (tests/test_allocator.py); this checks it on real ones.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
from dataclasses import replace

from memfit.budget import format_bytes
from memfit.measure.allocator import replay
from memfit.report import table

SMALL = ["gpt-small", "cnn-mixed", "nanogpt", "vit-tiny", "hf-gpt2", "hf-llama", "bert-large"]


def one(name: str, precision: str | None, steps: int, save: str | None) -> dict[str, object]:
    """In this process (a fresh one): build, train ``steps`` steps recorded, replay."""
    import torch

    from memfit.measure.inputs import Inputs
    from memfit.measure.step import StepState, default_loss, training_step
    from memfit.scenarios import load_scenario

    sc = load_scenario(name)
    step = sc.train_step if precision is None else replace(sc.train_step, precision=precision)
    if (step.precision or "").startswith("amp"):  # autocast over fp32 weights, as gpu_check builds it
        sc = replace(sc, dtype="float32")
    torch.cuda.memory._record_memory_history(context=None, max_entries=10_000_000)
    model, inputs = sc.build("cuda")
    inp = Inputs.of(inputs)
    state = StepState(step, model)
    model.train()
    for _ in range(steps):
        state.zero_grad()
        training_step(model, inp, default_loss, state)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if save:
        with open(save, "wb") as f:
            pickle.dump(snapshot, f)
    model_of = replay(snapshot["device_traces"][torch.cuda.current_device()])
    return {"scenario": f"{name} ({step.describe()})", "reserved": torch.cuda.max_memory_reserved(),
            "allocated": torch.cuda.max_memory_allocated(), "model_reserved": model_of.peak_reserved,
            "model_allocated": model_of.peak_allocated}


def row(r: dict[str, object]) -> list[str]:
    real, mod = int(r["reserved"]), int(r["model_reserved"])  # type: ignore[call-overload]
    return [str(r["scenario"]), format_bytes(int(r["allocated"])), format_bytes(int(r["model_allocated"])),  # type: ignore[call-overload]
            format_bytes(real), format_bytes(mod), f"{(mod - real) / real * 100:+.2f}%" if real else "-"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=SMALL)
    parser.add_argument("--precision", help="the step's precision instead of the scenario's (fp32, amp-bf16, ...)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trace", help="replay this saved snapshot (torch.cuda.memory._snapshot(), pickled) only")
    parser.add_argument("--save", help="with one scenario: also pickle its snapshot to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process's scenario
    args = parser.parse_args()
    if args.trace:
        with open(args.trace, "rb") as f:
            snapshot = pickle.load(f)
        for i, trace in enumerate(snapshot["device_traces"]):
            if trace:
                m = replay(trace)
                print(f"device {i}: {len(trace)} events; the model reserves {format_bytes(m.peak_reserved)} "
                      f"at most, allocates {format_bytes(m.peak_allocated)}")
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("allocator_check records PyTorch's CUDA allocator: run it on a GPU (or --trace a saved snapshot)")
    if args.one:
        print(json.dumps(one(args.one, args.precision, args.steps, args.save)))
        return
    rows = []
    for name in args.scenarios:  # a fresh process each: nothing reserved before the build
        cmd = [sys.executable, __file__, "--one", name, "--steps", str(args.steps)]
        cmd += ["--precision", args.precision] if args.precision else []
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: FAILED\n{proc.stderr[-2000:]}", flush=True)
            continue
        rows.append(row(json.loads(proc.stdout.strip().splitlines()[-1])))
        print(" | ".join(rows[-1]), flush=True)
    print(table(["scenario (step)", "allocated peak", "model's", "reserved peak", "model's", "model error"], rows))


if __name__ == "__main__":
    main()
