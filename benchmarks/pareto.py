#!/usr/bin/env python3
"""Pareto chart of run.py (and zoo.py) results: step time (x the `none` mode of the same run) against peak memory,
one panel per scenario, every finished mode a labelled point and the plan@P points joined by a line in order of P.

Usage:
  python benchmarks/pareto.py benchmarks/results/<date>-<device>-S1.json [MORE.json ...] --out FILE.png [--percent]

Give several files to put the runs of one scenario split across calls into one panel: each point's ratio (and,
with --percent, its share) is to the `none` of its own file, and a mode found in several files is drawn from the
last one given. Points without a measured peak (a CPU run) or without a finished `none` in their file are left out,
and the script says which.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")  # files only: no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `harness` sits next to this file
from harness.modes import parse_mode  # noqa: E402  (mode names only: no torch needed)

MARKERS = ["s", "^", "v", "D", "P", "X", "<", ">", "p", "h", "*"]
# Step-time ratios worth a labelled tick; `_ticks` keeps those in range that do not crowd each other.
TICK_LADDER = [0.9, 0.95, 1, 1.02, 1.05, 1.1, 1.15, 1.2, 1.3, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


class Point(NamedTuple):
    mode: str
    x_none: float  # median step time / none's, same run
    peak_gib: float  # max_memory_allocated over the timed steps
    peak_share: float  # peak / none's peak, same run


def load_points(paths: list[Path]) -> tuple[dict[str, dict[str, Point]], list[str]]:
    """The points of every finished mode, by scenario and mode, and a line for each result left out."""
    points: dict[str, dict[str, Point]] = {}
    left_out = []
    for path in paths:
        results = json.loads(path.read_text())["results"]
        nones = {r["scenario"]: r for r in results if r["mode"] == "none" and r.get("status") == "ok"}
        for r in results:
            why = _why_left_out(r, nones.get(r["scenario"]))
            if why:
                left_out.append(f"{path.name}: {r['scenario']} {r['mode']}: {why}")
                continue
            none = nones[r["scenario"]]
            points.setdefault(r["scenario"], {})[r["mode"]] = Point(
                r["mode"], r["median_s"] / none["median_s"], r["peak_gib"], r["peak_gib"] / none["peak_gib"]
            )
    return points, left_out


def _why_left_out(r: dict[str, Any], none: dict[str, Any] | None) -> str | None:
    if r.get("status") != "ok":
        return r.get("status", "?")
    if r.get("peak_gib") is None:
        return "no measured peak (not a CUDA run)"
    if none is None or none.get("peak_gib") is None:
        return "no finished none in its file to compare with"
    return None


def plot(points: dict[str, dict[str, Point]], out: Path, percent: bool, title: str) -> None:
    """One panel per scenario: peak on x (GiB, or % of none's), step time x none on y (log scale: the slow
    offloaders are 2-6x, the plans within 1.3x); lower left is better. Every mode but the plans is a marker of its
    own, named in the legend, the same in every panel."""
    scenarios = sorted(points)
    others = list(dict.fromkeys(m for s in scenarios for m in points[s] if parse_mode(m).budget_percent is None))
    colors = [plt.get_cmap("tab10")(k) for k in range(1, 10)]  # tab10 without its blue, the plans' line
    styles = {
        mode: ("black" if mode == "none" else colors[i % len(colors)], MARKERS[i % len(MARKERS)])
        for i, mode in enumerate(others)
    }

    def x_of(p: Point) -> float:
        return 100 * p.peak_share if percent else p.peak_gib

    fig, axes = plt.subplots(1, len(scenarios), figsize=(8.5 * len(scenarios), 5.5), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        by_mode = points[scenario]
        plans = sorted(
            (p for p in by_mode.values() if parse_mode(p.mode).budget_percent is not None),
            key=lambda p: parse_mode(p.mode).budget_percent,
        )
        if plans:
            ax.plot(
                [x_of(p) for p in plans],
                [p.x_none for p in plans],
                "o-",
                color="tab:blue",
                markersize=4,
                label="plan@P: memory budget\nP% of none's peak",
                zorder=2,
            )
            for i, p in enumerate(plans):  # alternately below and above the line, so that neighbours do not collide
                ax.annotate(
                    f"{parse_mode(p.mode).budget_percent:g}%",
                    (x_of(p), p.x_none),
                    textcoords="offset points",
                    xytext=(3, -10 if i % 2 else 4),
                    fontsize=7,
                    color="tab:blue",
                )
        for p in by_mode.values():
            if p.mode in styles:
                color, marker = styles[p.mode]
                ax.scatter([x_of(p)], [p.x_none], color=color, marker=marker, s=45, label=p.mode, zorder=3)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(FixedLocator(_ticks([p.x_none for p in by_mode.values()])))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.set_title(f"{scenario}: step time vs. peak memory")
        ax.set_xlabel("peak, % of none's" if percent else "peak GiB (max_memory_allocated)")
        ax.set_ylabel("step time, x none (log scale)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def _ticks(values: list[float]) -> list[float]:
    """Ladder values within the data's range, each at least 4% of the (log) range above the previous one, so that
    labels never overlap."""
    low, high = min(values) * 0.98, max(values) * 1.02
    span = math.log(high / low)
    ticks: list[float] = []
    for t in TICK_LADDER:
        if low <= t <= high and (not ticks or math.log(t / ticks[-1]) >= 0.04 * span):
            ticks.append(t)
    return ticks


def _script(command: str) -> str:
    """The benchmark script a result's command ran (run.py's, or zoo.py's, which writes the same format)."""
    return next((word for word in command.split() if word.endswith(".py")), "benchmarks/run.py")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="JSON files written by benchmarks/run.py or zoo.py")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--percent", action="store_true", help="peak as a percentage of none's, not in GiB")
    args = ap.parse_args(argv)

    points, left_out = load_points(args.results)
    for line in left_out:
        print(f"left out: {line}")
    if not points:
        print("nothing to plot: no finished mode with a measured peak and a finished none", file=sys.stderr)
        return 1
    metas = [json.loads(path.read_text())["meta"] for path in args.results]
    devices = sorted({m.get("device_name", "?") for m in metas})
    dates = sorted({m.get("date", "?") for m in metas})
    # One file name per line: a run split across calls names several, which would not fit on one line.
    scripts = sorted({_script(m.get("command", "")) for m in metas})
    plot(
        points,
        args.out,
        args.percent,
        f"{', '.join(devices)}; {', '.join(dates)}; {', '.join(scripts)}:\n"
        + "\n".join(path.name for path in args.results),
    )
    print(f"wrote {args.out}: " + "; ".join(f"{s} {len(m)} modes" for s, m in sorted(points.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
