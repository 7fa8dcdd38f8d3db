"""Pictures people read faster than tables: the memory-vs-slowdown curve of a sweep, and the
memory timeline of one plan. matplotlib (``pip install memfit[plot]``), PNG or SVG by the file's
extension, 800 px wide; each function returns the Figure so that tests can read what was drawn.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from memfit.errors import MemfitError
from memfit.jsonio import check_writable, write_atomic

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

FORMATS = (".png", ".svg")
STYLE = {  # strategy -> (label, colour, marker)
    "ilp": ("memfit plan (ILP optimum)", "#1f77b4", "o"),
    "full": ("checkpoint every unit", "#d62728", "s"),
    "every-k": ("every k-th unit", "#ff7f0e", "^"),
    "sqrt": ("sqrt(N) segments", "#9467bd", "v"),
    "first-k": ("first k units", "#8c564b", "D"),
    "greedy": ("greedy by bytes/second", "#2ca02c", "P"),
    "none": ("checkpoint nothing", "#7f7f7f", "*"),
}


def check_plot_path(path: str | os.PathLike[str]) -> None:
    """Refuse an unknown extension, an unwritable place or a missing matplotlib before any work
    is done (a profile can take minutes)."""
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix not in FORMATS:
        raise MemfitError(f"{path}: a plot is written as .png or .svg, by the file's extension")
    check_writable(path, "plot")
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MemfitError("plots need matplotlib: pip install 'memfit[plot]'") from None
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    return plt


def _unit(largest: float) -> tuple[str, float]:
    return ("GiB", 2.0**30) if largest >= 4 * 2**30 else ("MiB", 2.0**20)


def curve(frame: pd.DataFrame, path: str | os.PathLike[str] | None, *, title: str,
          device_memory: int | None = None) -> Figure:
    """x: peak memory, y: slowdown (%). The ILP frontier as a step line, each baseline's distinct
    plans as markers, measured points (columns ``measured_peak_bytes``/``measured_overhead``)
    as hollow markers of the same colour, the un-checkpointed point, the device's memory."""
    plt = _pyplot()
    fits = frame[frame["predicted_peak_bytes"].notna()]
    if fits.empty:
        raise MemfitError("nothing fits any budget of the sweep: there is no curve to draw")
    peaks = [float(v) for v in fits["predicted_peak_bytes"]]
    measured = "measured_peak_bytes" in frame and frame["measured_peak_bytes"].notna().any()
    if measured:
        peaks += [float(v) for v in frame["measured_peak_bytes"].dropna()]
    unit, scale = _unit(max([*peaks, device_memory or 0]))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    order = [s for s in STYLE if s in set(fits["strategy"])]
    for strategy in order:
        rows = fits[fits["strategy"] == strategy]
        label, colour, marker = STYLE[strategy]
        plans = rows.drop_duplicates("policies").sort_values("predicted_peak_bytes")
        x = [float(v) / scale for v in plans["predicted_peak_bytes"]]
        y = [float(v) * 100 for v in plans["predicted_overhead"]]
        if strategy == "ilp":
            ax.step(x, y, where="post", color=colour, linewidth=2, label=label, zorder=3)
            ax.plot(x, y, linestyle="none", marker=marker, color=colour, zorder=3)
        else:
            ax.plot(x, y, linestyle="none", marker=marker, markersize=7, color=colour, label=label, alpha=0.85)
        if measured:
            m = plans[plans["measured_peak_bytes"].notna()]
            ax.plot([float(v) / scale for v in m["measured_peak_bytes"]],
                    [float(v) * 100 for v in m["measured_overhead"]], linestyle="none", marker=marker,
                    markersize=10, markerfacecolor="none", markeredgecolor=colour,
                    label=f"{label}, measured" if strategy == "ilp" else None)
    plain = fits[fits["checkpointed"] == 0]
    if not plain.empty:
        ax.plot([float(plain["predicted_peak_bytes"].iloc[0]) / scale], [0.0], linestyle="none", marker="*",
                markersize=14, color=STYLE["none"][1], label="no checkpointing")
    return _finish_curve(fig, ax, path, title=title, unit=unit, scale=scale, device_memory=device_memory)


def shape_curves(frames: Mapping[str, pd.DataFrame], path: str | os.PathLike[str] | None, *, title: str,
                 device_memory: int | None = None) -> Figure:
    """One memfit curve (the ILP's plans, a step line) per input shape of a sweep, each shape's
    un-checkpointed point as a star of its colour: what each length costs at each budget."""
    plt = _pyplot()
    fits = {name: f[(f["strategy"] == "ilp") & f["predicted_peak_bytes"].notna()] for name, f in frames.items()}
    if all(f.empty for f in fits.values()):
        raise MemfitError("nothing fits any budget of the sweep: there is no curve to draw")
    peaks = [float(v) for f in fits.values() for v in f["predicted_peak_bytes"]]
    unit, scale = _unit(max([*peaks, device_memory or 0]))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    colours = plt.get_cmap("viridis")
    for k, (name, rows) in enumerate(fits.items()):
        colour = colours(k / max(1, len(fits) - 1) * 0.85)
        plans = rows.drop_duplicates("policies").sort_values("predicted_peak_bytes")
        x = [float(v) / scale for v in plans["predicted_peak_bytes"]]
        y = [float(v) * 100 for v in plans["predicted_overhead"]]
        ax.step(x, y, where="post", color=colour, linewidth=2, label=name, zorder=3)
        ax.plot(x, y, linestyle="none", marker="o", color=colour, zorder=3)
        plain = plans[plans["checkpointed"] == 0]
        if not plain.empty:
            ax.plot([float(plain["predicted_peak_bytes"].iloc[0]) / scale], [0.0], linestyle="none", marker="*",
                    markersize=14, color=colour)
    return _finish_curve(fig, ax, path, title=title, unit=unit, scale=scale, device_memory=device_memory,
                         legend="memfit plan (ILP optimum), *: no checkpointing")


def _finish_curve(fig: Figure, ax: Any, path: str | os.PathLike[str] | None, *, title: str, unit: str, scale: float,
                  device_memory: int | None, legend: str | None = None) -> Figure:
    """What every memory-vs-slowdown plot has: the device's usable memory as a line, the axes,
    title, grid and legend; saved when ``path`` is given."""
    if device_memory:
        ax.axvline(device_memory / scale, color="black", linestyle="--", linewidth=1,
                   label=f"usable device memory ({device_memory / scale:.1f} {unit})")
    ax.set_xlabel(f"peak memory of the training step ({unit})")
    ax.set_ylabel("slowdown against no checkpointing (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", title=legend)
    fig.tight_layout()
    if path is not None:
        _save(fig, path)
    return fig


Levels = Sequence[Sequence[Any]]  # (phase label, live bytes at its start, its peak) per phase


def timeline(levels: Mapping[str, Levels], path: str | os.PathLike[str] | None, *, title: str,
             budget: int | None = None, checkpointed: Collection[str] = ()) -> Figure:
    """Live memory at the start and the peak of every phase of the step, one line per series:
    ``levels["none"]`` (no checkpointing) and ``levels["plan"]`` as predicted, and
    ``levels["measured"]`` when given; the budget as a line, the plan's peak phase marked, the
    forward and backward of the ``checkpointed`` units shaded."""
    plt = _pyplot()
    plan = levels["plan"]
    unit, scale = _unit(max([budget or 0, *(peak for series in levels.values() for _, _, peak in series)]))
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=100)
    style = {"none": ("no checkpointing", "#7f7f7f", {}), "plan": ("this plan", "#1f77b4", {}),
             "measured": ("this plan, measured", "#d62728", {"linestyle": "--", "marker": "o",
                                                              "markerfacecolor": "none", "markersize": 4})}
    for key in ("none", "plan", "measured"):
        if key in levels:
            label, colour, extra = style[key]
            xs = [k for k in range(len(levels[key])) for _ in (0, 1)]
            ys = [v / scale for _, start, peak in levels[key] for v in (start, peak)]
            ax.plot(xs, ys, color=colour, label=label, linewidth=1.5, **extra)
    names = [str(name) for name, _, _ in plan]
    shaded = [k for k, name in enumerate(names) if name.partition(" ")[2] in set(checkpointed)]
    for n, k in enumerate(shaded):
        ax.axvspan(k - 0.5, k + 0.5, color="#1f77b4", alpha=0.12, linewidth=0,
                   label="checkpointed unit (its forward,\nbackward and recompute)" if n == 0 else None)
    top = max(range(len(plan)), key=lambda k: plan[k][2])
    right = top > 0.6 * len(plan)  # keep the label inside the axes
    ax.annotate(f"peak {plan[top][2] / scale:.1f} {unit}\n{plan[top][0]}", (top, plan[top][2] / scale),
                textcoords="offset points", xytext=(-20 if right else 20, -45), ha="right" if right else "left",
                fontsize=9, arrowprops={"arrowstyle": "->"}, zorder=5,
                bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": "#999999", "alpha": 0.95})
    if budget is not None:
        ax.axhline(budget / scale, color="black", linestyle=":", label=f"budget {budget / scale:.1f} {unit}", zorder=1)
    step = max(1, -(-len(names) // 20))
    ax.set_xticks(range(0, len(names), step))
    short = tick_labels(names)
    ax.set_xticklabels([short[k] for k in range(0, len(names), step)], rotation=45, fontsize=8, ha="right",
                       rotation_mode="anchor")
    ax.set_xlabel("phase of the training step (forward, loss, backward with recompute, optimizer)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title("\n".join(textwrap.fill(line, 90) for line in title.splitlines()), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # off the curves
    fig.tight_layout()
    if path is not None:
        _save(fig, path)
    return fig


def tick_labels(names: Sequence[str], width: int = 30) -> list[str]:
    """Phase names short enough to read on an axis: ``fwd``/``bwd`` for forward/backward, the
    dotted prefix every unit name shares dropped (``model.decoder.layers.10`` beside
    ``model.encoder.layers.3``: ``decoder.layers.10``; ``transformer.h.10``: ``h.10``), ``mb2`` for a
    later micro-batch, and what is still longer than ``width`` cut in its middle."""
    words = (("forward after ", "after "), ("backward before ", "bwd before "), ("forward before the units", "embed"),
             ("backward of loss and head", "bwd head, loss"), ("forward ", "fwd "), ("backward ", "bwd "),
             (" (head, loss)", ", head"), ("gradient clipping", "clip"), ("optimizer step", "optimizer"),
             (" (micro-batch ", " mb"), (" (run ", " run"))
    units = {n.split()[1] for n in names if n.startswith(("forward ", "backward ")) and len(n.split()) > 1
             and n.split()[1] not in ("after", "before", "of")}
    parts = [u.split(".")[:-1] for u in units] if len(units) > 1 else [[]]
    shared = next((k for k, c in enumerate(zip(*parts, strict=False)) if len(set(c)) > 1), min(map(len, parts)))
    if any(len(rest := u.split(".")[shared:]) == 1 and rest[0].isdigit() for u in units):
        shared = max(0, shared - 1)  # h.10, not 10
    common = ".".join(parts[0][:shared]) + "." if shared else ""
    out = []
    for name in names:
        later = name.endswith(")") and ("(micro-batch " in name or "(run " in name)
        for long, brief in words:
            name = name.replace(long, brief)
        name = name[:-1] if later else name
        name = " ".join(w[len(common):] if common and w.startswith(common) else w for w in name.split())
        out.append(name if len(name) <= width else name[:width // 2 - 1] + "…" + name[-(width // 2 - 1):])
    return out


def _save(fig: Figure, path: str | os.PathLike[str]) -> None:
    fmt = os.path.splitext(str(path))[1].lower().lstrip(".")
    write_atomic(path, lambda tmp: fig.savefig(tmp, format=fmt))
