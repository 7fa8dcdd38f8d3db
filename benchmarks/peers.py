"""memfit beside the tools a user would pick instead, on one model, at the same memory levels,
timed in one interleaved run.

    python benchmarks/peers.py --scenario gpt-small --points 6 --csv peers.csv --plot peers.png
    python benchmarks/peers.py --scenario hf-gpt2 --points 6 --rounds 9

Levels at which memfit makes the same plan share one configuration, timed once.
    python benchmarks/peers.py --scenario gpt-small --rockmate-python ~/rockmate-env/bin/python

Tools (see peer_tools.py): memfit (``granularity="fine"``); torch.compile with
``activation_memory_budget`` swept 0.1 ... 0.9 (aot_eager; at each level the compiled copy with
the highest peak within it); PyTorch's ``sac_milp`` (per-operator CPU times, scaled to memfit's
measured step); every layer, every other layer, core attention only. The levels are spread
evenly between the lowest peak memfit can plan and the plain step's peak. Rockmate is no
dependency: with ``--rockmate-python PATH`` (a Python where ``import rockmate`` works) it runs at
memfit's levels in that Python (rockmate_worker.py), before the timing here so that the two never
run at once, and is timed against that process's own plain step.

Every configuration is built at once; its peak is measured with one meter (memfit's
``measure_steps``, a steady-state step), its gradients compared with the plain model's, and all
are timed in one series: each timed step after an untimed step of its own, the order reversing
every round, GC held off; slowdowns are medians of per-round ratios to the plain eager step.
A tool that cannot reach a level is a row too, with the reason.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from peer_tools import SacMilp, budget_backend, hand_made, plan_summary, same_gradients

import memfit
from memfit.budget import format_bytes
from memfit.jsonio import write_atomic
from memfit.measure.inputs import Inputs
from memfit.measure.step import StepState, default_loss, make_optimizer
from memfit.measure.timing import alternate, median_ratio, timed_step
from memfit.policy import Policies
from memfit.report import table
from memfit.runtime.harness import StepRun, measure_steps
from memfit.scenarios import load_scenario
from memfit.units import find_units

COMPILE_BUDGETS = [round(0.1 * k, 1) for k in range(1, 10)]
ROCKMATE_TIMEOUT_S = 3600


@dataclass
class Config:
    tool: str
    how: str
    model: torch.nn.Module | None
    runner: Any
    plan_s: float
    opt: Any = None
    run: Any = None  # the measured steady-state step (peak, losses, gradients)
    equal: str = ""
    times: list[float] = field(default_factory=list)
    own_slowdown: float | None = None  # timed in a process of its own (Rockmate): its ratio to that plain step

    @property
    def peak(self) -> int:
        return self.run.peak_bytes


@dataclass
class Row:
    tool: str
    level: int  # the memory level asked for (a hand-made choice: its own measured peak)
    config: Config | None
    why: str = ""  # for a tool that reached no configuration at this level


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="gpt-small", help="a built-in scenario measured on the CPU")
    parser.add_argument("--points", type=int, default=6, help="memory levels")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--csv", help="write every row here")
    parser.add_argument("--plot", help="measured peak vs slowdown, one series per tool (.png/.svg)")
    parser.add_argument("--rockmate-python", metavar="PATH", help="a Python where rockmate imports: Rockmate "
                        "runs there at memfit's levels (without it, Rockmate is left out)")
    args = parser.parse_args()
    for name in ("cache_size_limit", "recompile_limit"):  # one compiled graph per budget: keep them all
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    sc = load_scenario(args.scenario)
    model, raw = sc.build("cpu")
    inputs = Inputs.of(raw)
    units = find_units(model, sc.units)
    plain = make_config("plain", "", model, 0.0, raw, sc.step_optimizer)
    started = time.perf_counter()
    prof = memfit.profile(model, raw, units=sc.units, optimizer=sc.step_optimizer, granularity="fine")
    profile_s = time.perf_counter() - started
    print(f"memfit profile (fine): {profile_s:.1f} s", flush=True)
    lo, hi = memfit.min_budget_bytes(prof, fine=True), plain.peak
    levels = [int(lo + (hi - lo) * (k + 0.5) / args.points) for k in range(args.points)]

    rows: list[Row] = []
    configs = [plain]
    ours: dict[tuple[str, ...], Config] = {}  # one configuration per distinct plan, timed once

    def memfit_config(sched: memfit.Schedule, plan_s: float) -> Config:
        key = tuple(sched.policies.values())
        if key not in ours:
            ours[key] = make_config("memfit", f"fine plan: {plan_summary(sched.policies)}", model, plan_s, raw,
                                    sc.step_optimizer, sched.policies)
            configs.append(ours[key])
        return ours[key]

    for level in levels:
        started = time.perf_counter()
        sched = memfit.plan(prof, level, granularity="fine")
        rows.append(Row("memfit", level, memfit_config(sched, profile_s + time.perf_counter() - started)))

    compiled = []
    for b in COMPILE_BUDGETS:
        started = time.perf_counter()
        cfg = make_config("torch.compile", f"activation_memory_budget={b}", model, 0.0, raw, sc.step_optimizer,
                          backend=budget_backend(b))
        cfg.plan_s = time.perf_counter() - started  # compiling is its planning
        compiled.append(cfg)
    for level in levels:
        fits = [c for c in compiled if c.peak <= level]
        if not fits:
            rows.append(Row("torch.compile", level, None, "no budget in 0.1..0.9 reaches it (lowest: "
                            f"{format_bytes(min(c.peak for c in compiled))})"))
            continue
        best = max(fits, key=lambda c: c.peak)
        rows.append(Row("torch.compile", level, best))
        if best not in configs:
            configs.append(best)

    def loss(m: torch.nn.Module, raw_inputs: Any) -> torch.Tensor:
        inp = Inputs.of(raw_inputs)
        return default_loss(m(*inp.args, **inp.kwargs))

    peer = SacMilp(lambda: sc.build("cpu"), loss, lambda m: make_optimizer(sc.optimizer, m.parameters()),
                   prof.step_s)
    print(f"sac_milp statistics: {peer.stats_s:.1f} s", flush=True)
    for level in levels:
        decisions, bound, solve_s = peer.plan(level)
        if bound < 0:
            rows.append(Row("sac_milp", level, None, "the MILP found no solution within the budget"))
            continue
        twin = copy.deepcopy(model)
        peer.apply(twin, decisions)
        how = ", ".join(f"{k[len(peer.root) + 1:]} {v:.0%}" for k, v in decisions.items()) or "nothing"
        cfg = make_config("sac_milp", f"discards {how}; its bound {format_bytes(bound)}", twin,
                          peer.stats_s + solve_s, raw, sc.step_optimizer, ready=True)
        rows.append(Row("sac_milp", level, cfg))
        configs.append(cfg)

    for kind in ("every", "every-other", "attention"):
        twin = copy.deepcopy(model)
        how = hand_made(kind, twin, units)
        cfg = make_config(f"by hand: {kind}", how, twin, 0.0, raw, sc.step_optimizer, ready=True)
        configs.append(cfg)
        # memfit at the memory the hand-made choice measured, so that each has a level to meet
        level = cfg.peak
        rows.append(Row(cfg.tool, level, cfg))
        started = time.perf_counter()
        # the integer model rounds bytes up: every layer checkpointed is predicted a few bytes
        # above its measured peak, so memfit plans at that prediction (and the row checks the
        # measured peak against the hand-made choice's)
        floor = memfit.min_budget_bytes(prof, fine=True)
        try:
            sched = memfit.plan(prof, floor if level < floor <= level + 4096 else level, granularity="fine")
        except memfit.InfeasibleBudgetError as exc:
            rows.append(Row("memfit", level, None, str(exc)))
            continue
        rows.append(Row("memfit", level, memfit_config(sched, profile_s + time.perf_counter() - started)))

    for cfg in configs[1:]:
        cfg.equal = same_gradients(plain.run, cfg.run)
    if args.rockmate_python:  # here, before the timing below: the two never run at once
        rows += rockmate_rows(args.rockmate_python, args.scenario, sorted({r.level for r in rows
                                                                           if r.tool == "memfit"}), args.rounds)

    def step(k: int) -> float:
        cfg = configs[k]
        return timed_step(cfg.runner, inputs, default_loss, cfg.opt, torch.device("cpu"))

    for cfg, t in zip(configs, alternate(step, len(configs), args.rounds), strict=True):
        cfg.times = t
    report(args, sc.name, plain, rows)


def make_config(tool: str, how: str, model: torch.nn.Module, plan_s: float, raw: Any, optimizer: str | None,
                policies: Policies | None = None, backend: Any = None, ready: bool = False) -> Config:
    """A copy of ``model`` (or ``model`` itself when ``ready``) set up as the tool says, its
    steady-state peak measured; the copy compiles on that first step when ``backend`` is given."""
    m = model if ready else copy.deepcopy(model)
    if policies:
        from memfit.runtime.apply import set_policies

        set_policies(m, policies)
    run = measure_steps(m, raw, optimizer=optimizer, compile=backend)
    runner = m if backend is None else torch.compile(m, backend=backend)  # finds the compiled graph
    cfg = Config(tool, how, m, runner, plan_s, StepState(memfit.TrainStep(optimizer), m), run)
    print(f"{tool} {how}: {format_bytes(cfg.peak)}", flush=True)
    return cfg


def rockmate_rows(python: str, scenario: str, levels: list[int], rounds: int) -> list[Row]:
    """Rockmate at ``levels``, run by rockmate_worker.py under ``python`` in a process of its own;
    whatever stops it (no such Python, no rockmate there, no schedule) is a row with the reason."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rockmate_worker.py")
    print(f"rockmate: running {worker} under {python}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rockmate.json")
        cmd = [python, worker, "--scenario", scenario, "--levels", *map(str, levels), "--rounds", str(rounds),
               "--out", out]
        try:  # its own messages go to stderr; Rockmate's chatter on stdout is dropped
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, timeout=ROCKMATE_TIMEOUT_S, check=False)
            result = {"error": f"the Rockmate worker exited with status {done.returncode} and no result (see above)"}
            if os.path.exists(out):
                with open(out, encoding="utf-8") as f:
                    result = json.load(f)
        except OSError as exc:
            result = {"error": f"cannot run {python}: {exc.strerror or exc}"}
        except subprocess.TimeoutExpired:
            result = {"error": f"the Rockmate worker ran past {ROCKMATE_TIMEOUT_S} s"}
    return parse_rockmate(result, levels)


def parse_rockmate(result: dict[str, Any], levels: list[int]) -> list[Row]:
    """The worker's JSON as table rows (a Config of numbers: there is no model here to run)."""
    if result.get("error"):
        return [Row("rockmate", level, None, result["error"]) for level in levels]
    rows = []
    for r in result["rows"]:
        if r.get("why"):
            rows.append(Row("rockmate", r["level"], None, r["why"]))
            continue
        how = (f"{format_bytes(r['budget'])} for activations (its estimate: {format_bytes(r['predicted'])}), "
               f"{r['recomputed']} of {r['forward_ops']} forward ops recomputed; timed in its own process against "
               f"its own plain step ({r['plain_step_s'] * 1e3:.0f} ms there)")
        rows.append(Row("rockmate", r["level"], Config("rockmate", how, None, None, r["plan_s"], run=StepRun(
            [], {}, {}, r["peak"]), equal=r["equal"], times=[r["step_s"]], own_slowdown=r["slowdown"])))
    return rows


def report(args: argparse.Namespace, scenario: str, plain: Config, rows: list[Row]) -> None:
    def slowdown(cfg: Config) -> float:
        return cfg.own_slowdown if cfg.own_slowdown is not None else median_ratio(plain.times, cfg.times) - 1

    header = ["tool", "budget", "measured peak", "fits", "step", "slowdown", "equal gradients", "planning", "how"]
    out = []
    for r in rows:
        c = r.config
        budget = f"its own: {format_bytes(r.level)}" if r.tool.startswith("by hand") else format_bytes(r.level)
        if c is None:
            out.append([r.tool, budget, "-", "no", "-", "-", "-", "-", r.why])
            continue
        fits = "-" if r.tool.startswith("by hand") else ("yes" if c.peak <= r.level else "OVER")
        out.append([r.tool, budget, format_bytes(c.peak), fits, f"{statistics.median(c.times) * 1e3:.0f} ms",
                    f"{slowdown(c) * 100:+.1f}%", c.equal, f"{c.plan_s:.1f} s", c.how])
    print(f"\n{scenario} on the CPU: plain eager step {statistics.median(plain.times) * 1e3:.0f} ms, peak "
          f"{format_bytes(plain.peak)}; medians over {args.rounds} interleaved rounds")
    print(table(header, out))
    verdicts = []
    for level in sorted({r.level for r in rows}):
        # a peer counts where it fits and gives the plain model's gradients
        at = {r.tool: r.config for r in rows if r.level == level and r.config is not None
              and r.config.peak <= level and (r.tool == "memfit" or r.config.equal.startswith("yes"))}
        ours = at.pop("memfit", None)
        for tool, c in at.items():
            if ours is None:
                verdicts.append(f"{format_bytes(level)}: memfit does not fit, {tool} does")
                continue
            # a peer timed in a process of its own (Rockmate) is compared by slowdown, not by step time
            ratio = ((1 + slowdown(ours)) / (1 + slowdown(c)) if c.own_slowdown is not None
                     else statistics.median(ours.times) / statistics.median(c.times))
            if ratio > 1.02:
                verdicts.append(f"{format_bytes(level)}: memfit {slowdown(ours) * 100:+.1f}% is slower than {tool} "
                                f"{slowdown(c) * 100:+.1f}%")
    print("\nmemfit at most a peer's step time (+2%) wherever the peer fits with the plain gradients: "
          + ("yes, at every level" if not verdicts else "no:\n  " + "\n  ".join(verdicts)))
    if args.csv:
        def write_csv(tmp: str) -> None:
            with open(tmp, "w", newline="") as f:
                csv.writer(f).writerows([header, *out])

        write_atomic(args.csv, write_csv)
        print(f"wrote {args.csv}")
    if args.plot:
        plot(args.plot, scenario, rows, slowdown)


def plot(path: str, scenario: str, rows: list[Row], slowdown: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for tool, style in (("memfit", "o-"), ("torch.compile", "s--"), ("sac_milp", "^:"), ("rockmate", "d-.")):
        pts = sorted({(r.config.peak / 2**20, slowdown(r.config) * 100) for r in rows
                      if r.tool == tool and r.config is not None})
        ax.plot([p for p, _ in pts], [s for _, s in pts], style, label=tool)
    wrong = [r.config for r in rows if r.config is not None and r.config.equal.startswith("no")]
    if wrong:
        ax.plot([c.peak / 2**20 for c in wrong], [slowdown(c) * 100 for c in wrong], "o", mfc="none", mec="red",
                ms=13, label="gradients differ from the plain model's")
    for r in rows:
        if r.tool.startswith("by hand") and r.config is not None:
            ax.plot(r.config.peak / 2**20, slowdown(r.config) * 100, "kx")
            ax.annotate(r.tool.removeprefix("by hand: "), (r.config.peak / 2**20, slowdown(r.config) * 100),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("slowdown vs plain eager step (%)")
    ax.set_title(f"{scenario} on the CPU: memory vs time (x: by hand)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format=os.path.splitext(path)[1][1:] or "png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
