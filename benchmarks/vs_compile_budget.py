"""memfit's plans against torch.compile's own activation memory budget, on a built-in scenario.

    python benchmarks/vs_compile_budget.py                       # gpt-small, budgets 0.1 ... 0.9, 9 rounds (~12 min)
    python benchmarks/vs_compile_budget.py --budgets 0.3 0.6 --rounds 9 --plot frontier.png
    python benchmarks/vs_compile_budget.py --scenario nanogpt --budgets 0.6 0.3 0.1   # attention written out

For each ``torch._functorch.config.activation_memory_budget`` the model is compiled (backend
aot_eager, whose partitioner then recomputes what its runtime estimates say is cheapest) and its
steady-state peak measured. At that peak memfit plans three times from one fine profile: at module
granularity and with ``granularity="fine"`` (children, op sets, ``derive`` levels), both run
eagerly, and the fine plan for the compiled step (``memfit.plan_compiled``, aot_eager at the
default budget, from the profile's figures moved once to the compiled step's,
``compiled_figures``): its options handed to the same partitioner as selective-checkpoint
policies (runtime/unit_forward.py), so the two compiled columns differ only in what is kept;
or, where it was timed the fastest beside memfit's own plans, the compiler's own plan at the
largest budget that fits (steps/compiled_budget.py), which the plan column then names.
Every configuration is built at once and timed in one interleaved series (each timed step after
an untimed step of its own, the order reversing every round, GC held off), medians over
--rounds rounds; slowdowns are against the plain eager step of the same rounds, with two standard
errors of each median (±). A second plain copy is timed as a configuration too (the A/A control):
its "slowdown" is the noise of the series. Beside the fine plan's measured slowdown, the one it
was planned at (``Schedule.predicted_overhead``): where memfit is behind, whether its prices or its
options are to blame. With --threads 1 (the default) steps are single-threaded
and timed by their thread's CPU time (memfit.measure.timing.clock), which scatters about half as
much as the wall clock on a shared machine. Freed CPU memory is kept for reuse
(``memfit.keep_freed_cpu_memory``, as the memfit command does), so no step faults its pages in.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from peer_tools import plan_summary, training_copy

import memfit
from memfit.budget import format_bytes
from memfit.measure.inputs import Inputs
from memfit.measure.step import StepState, default_loss
from memfit.measure.timing import alternate, median_ratio, ratio_uncertainty, timed_step
from memfit.policy import Policies
from memfit.report import table
from memfit.runtime.harness import measure_steps
from memfit.scenarios import load_scenario
from memfit.steps.compiled import compiled_figures


@dataclass
class Config:
    label: str
    runner: Any
    model: torch.nn.Module
    opt: Any
    peak: int = 0
    times: list[float] | None = None
    grads: dict[str, Any] | None = None
    policies: Policies | None = None
    predicted: float = float("nan")  # a plan's predicted slowdown
    plan: str = ""  # what it is, where its policies do not say


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=float, nargs="+", default=[round(0.1 * k, 1) for k in range(1, 10)])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds of the fine profile")
    parser.add_argument("--scenario", default="gpt-small", help="a built-in scenario the CPU can run")
    parser.add_argument("--plot", help="draw both frontiers (memory, slowdown) to this .png/.svg")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: timed by thread CPU time)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # as the memfit command does: glibc keeps freed memory, as CUDA's caching allocator does. By
    # default it hands large blocks back, and steps fault their pages in again: 4,064 faults a step
    # for uneven-gpt's plain step, 1,792 for a derive plan, none for the compiled one (whose order
    # of allocations reuses its blocks), so the fault count, not the recompute, set part of the gap
    memfit.keep_freed_cpu_memory()
    for name in ("cache_size_limit", "recompile_limit"):  # one entry per budget: keep every one compiled
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    sc = load_scenario(args.scenario)
    model, raw_inputs = sc.build("cpu")
    inputs = Inputs.of(raw_inputs)
    prof = memfit.profile(model, raw_inputs, units=sc.units, optimizer=sc.step_optimizer, repeat=args.repeat,
                          granularity="fine")

    def config(label: str, policies: Policies | None = None, budget: float | None = None) -> Config:
        m, backend, runner = training_copy(model, policies, budget)
        cfg = Config(label, runner, m, StepState(sc.train_step, m), policies=policies)
        # a steady-state step, as validate measures it (compiles, for a budget: the runner's
        # backend is the same object, so it finds this compilation)
        run = measure_steps(m, raw_inputs, optimizer=sc.step_optimizer, compile=backend)
        cfg.peak, cfg.grads = run.peak_bytes, run.grads
        print(f"{label}: {format_bytes(cfg.peak)} ({cfg.peak:,} bytes)", flush=True)  # a plan fits to the byte
        return cfg

    figures = compiled_figures(model, raw_inputs, prof, "aot_eager")  # once for every budget's compiled plan
    configs = [config("plain eager"), config("plain eager (A/A control)")]
    rows: list[tuple[float, Config, Config | None, Config | None, Config | None]] = []
    for b in args.budgets:
        compiled = config(f"compile {b:.1f}", budget=b)
        plans = []
        for granularity in ("module", "fine"):
            try:
                s = memfit.plan(prof, compiled.peak, granularity=granularity)
            except memfit.InfeasibleBudgetError:
                plans.append(None)
                continue
            plans.append(config(f"memfit {granularity} @ {b:.1f}", s.policies))
            plans[-1].predicted = s.predicted_overhead
        try:  # measures compiled plans until one fits; resets Dynamo, so the copies above compile again
            s = memfit.plan_compiled(model, raw_inputs, prof, compiled.peak, "aot_eager", granularity="fine",
                                     figures=figures)
            plans.append(config(f"memfit fine compiled @ {b:.1f}", s.policies, s.compile.get("memory_budget", 1.0)))
            if s.strategy == "compiler":  # timed fastest beside memfit's own plans (steps/compiled_budget.py)
                plans[-1].plan = f"the compiler's own, memory budget {s.compile['memory_budget']:g}"
        except memfit.InfeasibleBudgetError:
            plans.append(None)
        rows.append((b, compiled, *plans))
        configs += [c for c in (compiled, *plans) if c is not None]

    def step(k: int) -> float:
        cfg = configs[k]
        return timed_step(cfg.runner, inputs, default_loss, cfg.opt, torch.device("cpu"))

    times = alternate(step, len(configs), args.rounds)
    for cfg, t in zip(configs, times, strict=True):
        cfg.times = t

    def slowdown(cfg: Config | None) -> float:
        if cfg is None or cfg.times is None:
            return float("nan")
        return median_ratio(configs[0].times or [], cfg.times) - 1

    def sure(cfg: Config) -> float:
        return ratio_uncertainty(configs[0].times or [], cfg.times or [])

    def cell(cfg: Config | None) -> list[str]:
        return ["does not fit", "-"] if cfg is None else [
            format_bytes(cfg.peak), f"{slowdown(cfg) * 100:+.1f}% ±{sure(cfg) * 100:.1f}"]

    def same(cfg: Config) -> str:  # the partitioner may recompute dropout with a fresh mask (pytorch#190758)
        plain = configs[0].grads or {}
        return "yes" if all(torch.equal(g, plain[n]) for n, g in (cfg.grads or {}).items()) else "NO"

    out = [[f"{b:.1f}", *cell(c), same(c), *cell(m), *cell(f), f"{f.predicted * 100:+.1f}%" if f else "-",
            plan_summary(f.policies) if f else "-", *cell(fc), (fc.plan or plan_summary(fc.policies)) if fc else "-"]
           for b, c, m, f, fc in rows]
    print(f"\nplain eager step {statistics.median(configs[0].times or [0]) * 1e3:.1f} ms, peak "
          f"{format_bytes(configs[0].peak)}; medians over {args.rounds} interleaved rounds, {args.threads} thread(s); "
          f"A/A control {slowdown(configs[1]) * 100:+.1f}% ±{sure(configs[1]) * 100:.1f}")
    print(table(["budget", "compile peak", "compile", "compile grads equal", "memfit module peak", "module",
                 "memfit fine peak", "fine", "fine predicted", "fine plan", "compiled fine peak", "compiled fine",
                 "compiled fine plan"], out))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for idx, name, style in ((1, "torch.compile activation_memory_budget (aot_eager)", "o-"),
                                 (2, "memfit, module granularity", "s--"), (3, "memfit, fine granularity", "^-"),
                                 (4, "memfit, fine granularity, compiled (aot_eager)", "v-")):
            pts = sorted((r[idx].peak / 2**20, slowdown(r[idx]) * 100) for r in rows if r[idx] is not None)
            ax.plot([p for p, _ in pts], [s for _, s in pts], style, label=name)
        ax.set_xlabel("measured peak (MiB)")
        ax.set_ylabel("slowdown vs plain eager step (%)")
        ax.set_title(f"{args.scenario} on the CPU: memory vs time")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
