"""What the compiler keeps at one activation memory budget against what a compiled memfit plan keeps.

    python benchmarks/compiled_saved.py --scenario uneven-gpt.toml --budget 0.6 --plans derive:products \\
        "derive:products*5,derive:projections"             # ~2 min; with --rounds 21, ~5 min

The model is compiled twice or more with aot_eager: under ``activation_memory_budget`` (the
compiler's choice), and at the default budget with each memfit plan set on its units (``OPTION``
on every unit, or a comma list of ``OPTION[*N]`` given unit by unit). For each, the values the
partitioned forward graph saves for the backward are summed by the module that made them (its
``nn_module_stack``, memfit's own forward wrapper left out of the path) and the op, and the
steady-state peak is measured; the rows where the two differ are printed, so the bytes between
two peaks can be named. With --rounds, every configuration and the plain eager step (twice: the
A/A control) are then timed in one interleaved series (memfit.measure.timing.alternate, thread
CPU time with one thread), slowdowns against the plain eager step, ± two standard errors.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import torch
from peer_tools import training_copy
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import min_cut_rematerialization_partition

import memfit
from memfit.budget import format_bytes
from memfit.measure.inputs import Inputs
from memfit.measure.step import StepState, default_loss
from memfit.measure.timing import alternate, median_ratio, ratio_uncertainty, timed_step
from memfit.policy import Policies, parse
from memfit.report import table
from memfit.runtime.harness import measure_steps
from memfit.scenarios import load_scenario
from memfit.units import find_units

Key = tuple[str, str, tuple[int, ...]]


def plan_of(text: str, units: list[str]) -> Policies:
    """``OPTION`` on every unit, or ``OPTION[*N],...`` unit by unit in order."""
    if "," not in text and "*" not in text:
        return dict.fromkeys(units, parse(text))
    options = [parse(o) for part in text.split(",") for o, _, n in [part.partition("*")] for _ in range(int(n or 1))]
    if len(options) != len(units):
        raise SystemExit(f"{text!r} names {len(options)} options for {len(units)} units")
    return dict(zip(units, options, strict=True))


def saved_values(model: torch.nn.Module, raw: Any, policies: Policies | None, budget: float) -> Counter[Key]:
    """Bytes the partitioned forward graph saves for the backward, by (module, op, shape)."""
    graphs: list[torch.fx.GraphModule] = []

    def forward_compiler(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(gm)
        return boxed_nop(gm, example)

    inner = aot_autograd(fw_compiler=forward_compiler, bw_compiler=boxed_nop,
                         partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return inner(gm, example)

    m, _, _ = training_copy(model, policies)
    measure_steps(m, raw, optimizer=None, steps=1, compile=backend)
    torch.compiler.reset()
    out: Counter[Key] = Counter()
    for gm in graphs:
        for node in list(gm.graph.output_node().args[0])[1:]:  # the first output is the model's
            value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if not isinstance(value, torch.Tensor):
                continue
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            where = "input" if node.op == "placeholder" else stack[-1][0] if stack else "(the model)"
            for noise in ("L['self'].", "L['fn'].", "forward.module.ref().", "L['own'].__self__."):
                where = where.replace(noise, "")
            op = "" if node.op == "placeholder" else str(node.target).removeprefix("aten.").removesuffix(".default")
            out[(where, op, tuple(value.shape))] += value.numel() * value.element_size()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="uneven-gpt.toml", help="a built-in scenario, or a scenario file")
    parser.add_argument("--budget", type=float, default=0.6, help="the compiler's activation_memory_budget")
    parser.add_argument("--plans", nargs="+", default=["derive:products"], metavar="PLAN",
                        help="memfit plans: OPTION on every unit, or OPTION[*N],... unit by unit")
    parser.add_argument("--rounds", type=int, default=0, help="interleaved timing rounds (0: memory only)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    memfit.keep_freed_cpu_memory()
    torch._dynamo.config.recompile_limit = 64  # a compiled copy per configuration
    sc = load_scenario(args.scenario)
    model, raw = sc.build("cpu")
    units = find_units(model, sc.units)
    configs: list[tuple[str, Policies | None, float | None]] = [
        ("plain eager", None, None), ("plain eager (A/A)", None, None), ("compiled plain", {}, 1.0),
        (f"compile {args.budget}", None, args.budget), *((p, plan_of(p, units), 1.0) for p in args.plans)]
    compiler = saved_values(model, raw, None, args.budget)
    print(f"saved for the backward at compile {args.budget}: {format_bytes(sum(compiler.values()))}")
    for text, policies, _ in configs[4:]:
        ours = saved_values(model, raw, policies, 1.0)
        print(f"\n{text}: {format_bytes(sum(ours.values()))} saved; rows that differ (MiB, compile | memfit):")
        rows = [[f"{where} {op} {list(shape)}", f"{compiler[k] / 2**20:.3f}", f"{ours[k] / 2**20:.3f}"]
                for k in sorted(set(compiler) | set(ours)) if compiler[k] != ours[k] for where, op, shape in [k]]
        print(table(["module, op, shape", "compile", "memfit"], rows))
    built = []
    for label, policies, budget in configs:
        m, backend, runner = training_copy(model, policies, budget)
        peak = measure_steps(m, raw, optimizer=sc.step_optimizer, compile=backend).peak_bytes
        built.append((label, runner, StepState(sc.train_step, m), peak))
    if args.rounds <= 0:
        print(table(["configuration", "peak"], [[label, format_bytes(peak)] for label, _, _, peak in built]))
        return
    inputs = Inputs.of(raw)
    times = alternate(lambda k: timed_step(built[k][1], inputs, default_loss, built[k][2], torch.device("cpu")),
                      len(built), args.rounds)
    print(f"\n{args.rounds} interleaved rounds, one thread, thread CPU time; slowdown against the plain eager step")
    def slowdown(t: list[float]) -> str:
        return f"{(median_ratio(times[0], t) - 1) * 100:+.1f}% ±{ratio_uncertainty(times[0], t) * 100:.1f}"

    rows = [[label, format_bytes(peak), slowdown(t)] for (label, _, _, peak), t in zip(built, times, strict=True)]
    print(table(["configuration", "peak", "slowdown"], rows))


if __name__ == "__main__":
    main()
