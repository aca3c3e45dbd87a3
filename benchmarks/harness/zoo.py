"""The shape zoo's sweep (``benchmarks/zoo.py``, issue 20's target 2), without torch: which mode of a shape runs next
given what the shape has measured so far, the three checks per budget, and the markdown of the results.

Per shape the sweep runs the simple plans (``none``, ``ckpt``, ``ckpt+hfo``), then ``plan@1``: a budget of 1% of
none's peak, which no plan meets, so that the library's refusal (``InfeasibleBudgetError``) names the smallest budget
that works. Then the budgets: every multiple of the grid step (5%) from that minimum up to 95% of none's peak, and the
measured peak of each simple plan below 95% (the smallest budget that plan meets: where check (c) bites hardest).

The checks of each budget:
  (a) the plan's step is at most 1.02x the fastest simple plan's whose peak (every step's) fits the budget, each
      step time the lower quartile of the mode's timed steps (`STEP_TIME`: short steps are paced by the host, whose
      stalls add 10-40% to some steps and not others, in every mode alike; medians of a few steps differed by up
      to 15% between two runs of one plan);
  (b) the peak of every step, the profiled ones included, is within the budget;
  (c) the budget is not refused (InfeasibleBudgetError) when a simple plan's measured peak is within it.
Without a peak counter (CPU) (a) and (c) have nothing to compare with and (b) nothing to check: they read n/a.

Every mode's result is run.py's (``harness.worker``), so the files are run.py's format: ``harness.report`` writes a
shape's markdown and JSON, and ``pareto.py`` draws its chart.
"""

from __future__ import annotations

import math
from typing import Any

from . import GIB
from .modes import PLAN_PREFIX, parse_mode
from .report import Result, budget_bytes, fmt

SIMPLE_MODES = ("none", "ckpt", "ckpt+hfo")
# A budget far below any plan's peak: its refusal names the smallest budget that works for the shape.
PROBE_PERCENT = 1
PROBE_MODE = f"{PLAN_PREFIX}{PROBE_PERCENT}"
TIME_TOLERANCE = 1.02  # check (a)
STEP_TIME = "p25_s"  # check (a)'s step time: the lower quartile of a mode's timed steps
GRID_STEP = 5  # percent of none's peak
GRID_TOP = 95


def step_peaks(r: Result | None) -> list[int] | None:
    """The peak of each step of a mode, warm-up and profiled steps included; None without a peak counter."""
    steps = (r or {}).get("per_step") or []
    if not steps or any("peak_bytes" not in step for step in steps):
        return None
    return [step["peak_bytes"] for step in steps]


def peak_all(r: Result | None) -> int | None:
    peaks = step_peaks(r)
    return max(peaks) if peaks else None


def plan_mode(percent: float) -> str:
    """The plan mode of ``percent``% of the reference: plan@60, plan@33.47."""
    return f"{PLAN_PREFIX}{round(percent, 2):g}"


def budget_of(percent: float, reference: int) -> int:
    """The budget of plan@``percent``, as ``modes.budget_share`` makes it."""
    return math.floor(reference * percent / 100)


def percent_at_least(nbytes: int, reference: int) -> float:
    """The smallest percentage, in hundredths, whose budget is at least ``nbytes``."""
    percent = math.ceil(nbytes * 10000 / reference) / 100
    while budget_of(percent, reference) < nbytes:  # float rounding
        percent = round(percent + 0.01, 2)
    return percent


def _ok(r: Result | None) -> bool:
    return r is not None and r.get("status") == "ok"


def named_minimum(results: list[Result]) -> int | None:
    """The smallest budget that works, as the probe's refusal named it (None before the probe, or if it was not
    refused)."""
    probe = next((r for r in results if r["mode"] == PROBE_MODE), None)
    return probe.get("minimum_bytes") if probe and probe.get("status") == "infeasible" else None


def sweep_modes(
    results: list[Result], reference: int, grid_step: float = GRID_STEP, top: float = GRID_TOP
) -> list[str]:
    """The budgets of a shape's sweep, as plan modes in increasing order; [] until the probe ran."""
    done = {r["mode"]: r for r in results}
    probe = done.get(PROBE_MODE)
    if probe is None:
        return []
    simple_peaks = [peak_all(done.get(m)) for m in SIMPLE_MODES[1:] if _ok(done.get(m))]
    simple_peaks = [p for p in simple_peaks if p is not None]
    lowest = named_minimum(results)
    if lowest is None:  # the probe ran a plan (no minimum) or failed: from the grid's bottom, or the simple plans'
        lowest = 0 if _ok(probe) or not simple_peaks else min(simple_peaks)
    steps = int(math.floor(top / grid_step + 1e-9))
    percents = {round(k * grid_step, 6) for k in range(1, steps + 1) if budget_of(k * grid_step, reference) >= lowest}
    percents |= {percent_at_least(p, reference) for p in simple_peaks if p <= budget_of(top, reference)}
    return [plan_mode(p) for p in sorted(percents)]


def next_mode(
    results: list[Result], reference: int | None, grid_step: float = GRID_STEP, top: float = GRID_TOP
) -> str | None:
    """The mode a shape runs next, given its results so far (any status counts as done); None when its sweep is
    complete, or cannot go on (no reference: `none` did not finish)."""
    done = {r["mode"] for r in results}
    for mode in SIMPLE_MODES:
        if mode not in done:
            return mode
    if reference is None:
        return None
    if PROBE_MODE not in done:
        return PROBE_MODE
    return next((m for m in sweep_modes(results, reference, grid_step, top) if m not in done), None)


def reference_bytes(results: list[Result], cpu_reference: int | None) -> int | None:
    """What plan@P budgets P% of: none's peak over its timed steps, or on CPU (no peak counter) a given number."""
    none = next((r for r in results if r["mode"] == "none"), None)
    if _ok(none) and none.get("peak_bytes"):
        return none["peak_bytes"]
    return cpu_reference


def budget_checks(results: list[Result]) -> list[dict[str, Any]]:
    """Checks (a), (b) and (c) of every budget of the sweep (the probe excepted), in the order run. Each check is
    True, False, or None (nothing to check: no peak counter, no simple plan that fits, a budget refused)."""
    simple = [r for r in results if r["mode"] in SIMPLE_MODES and _ok(r) and peak_all(r) is not None]
    rows = []
    for r in results:
        mode = parse_mode(r["mode"])
        if not mode.planned or r["mode"] == PROBE_MODE:
            continue
        budget = budget_bytes(r)
        fits = [s for s in simple if budget is not None and peak_all(s) <= budget]
        fastest = min(fits, key=lambda s: s[STEP_TIME]) if fits else None
        status = r.get("status")
        row: dict[str, Any] = {
            "mode": r["mode"],
            "percent": mode.budget_percent,
            "budget_bytes": budget,
            "status": status,
            "plan": r.get("plan", {}).get("code"),
            "codes": list(dict.fromkeys(s["plan"] for s in r.get("per_step", []) if s.get("plan"))),
            "library_measured": library_measured(r),
            "step_s": r.get(STEP_TIME) if status == "ok" else None,
            "median_s": r.get("median_s") if status == "ok" else None,
            "peak_all_bytes": peak_all(r),
            "fastest_fitting": fastest["mode"] if fastest else None,
            "fastest_fitting_s": fastest[STEP_TIME] if fastest else None,
            "simple_fitting": [s["mode"] for s in fits],
            "x_fastest": None,
            "steps_over": None,
            "a": None,
            "b": None,
            "c": None,
            "error": r.get("error") if status != "ok" else None,
        }
        if status == "ok":
            if fastest is not None:
                row["x_fastest"] = r[STEP_TIME] / fastest[STEP_TIME]
                row["a"] = row["x_fastest"] <= TIME_TOLERANCE
            peaks = step_peaks(r)
            if peaks is not None and budget is not None:
                row["steps_over"] = [i + 1 for i, p in enumerate(peaks) if p > budget]
                row["b"] = not row["steps_over"]
            row["c"] = True
        elif status == "infeasible":
            row["c"] = not fits if simple else None
        elif status == "OOM":
            row["b"] = False  # the step outgrew the device, so the budget below it
        rows.append(row)
    return rows


def library_measured(r: Result) -> str:
    """The simple plans the library measured itself in a budget's run (every layer one letter: `C` the profiled
    safe plan, `c` the closed loop's trial of plain checkpointing), with their fastest step (what the library
    compares plans by), and how many other plans its closed loop measured."""
    measured = r.get("plan", {}).get("measured_s") or {}
    simple = [f"{code[0]} {min(times):.3f} s" for code, times in measured.items()
              if times and len(set(code)) == 1]  # fmt: skip
    others = sum(1 for code in measured if len(set(code)) > 1)
    return ", ".join(simple + ([f"+{others} other"] if others else []))


def shape_summary(results: list[Result], reference: int | None) -> dict[str, Any]:
    """A shape's verdict: per check how many budgets passed, failed or had nothing to check; the modes that did not
    finish; the minimum the library named against the simple plans' peaks."""
    rows = budget_checks(results)
    counts = {
        check: {
            "pass": sum(row[check] is True for row in rows),
            "fail": [row["mode"] for row in rows if row[check] is False],
            "n/a": sum(row[check] is None for row in rows),
        }
        for check in ("a", "b", "c")
    }
    failed = [f"{r['mode']} ({r.get('status')})" for r in results if r.get("status") not in ("ok", "infeasible")]
    minimum = named_minimum(results)
    by_mode = {r["mode"]: r for r in results}
    below_minimum = [
        m for m in SIMPLE_MODES if minimum is not None and (peak_all(by_mode.get(m)) or math.inf) < minimum
    ]
    feasible = [row for row in rows if row["status"] == "ok"]
    return {
        "reference_bytes": reference,
        "named_minimum_bytes": minimum,
        "simple_peaks_below_named_minimum": below_minimum,
        "lowest_feasible_percent": min((row["percent"] for row in feasible), default=None),
        "budgets_run": len(rows),
        "budgets_feasible": len(feasible),
        "checks": counts,
        "did_not_finish": failed,
        "passed": not failed and all(not counts[c]["fail"] for c in counts),
        "rows": rows,
    }


def mark(value: bool | None) -> str:
    return "n/a" if value is None else "yes" if value else "**NO**"


def size(nbytes: int | None) -> str:
    """Bytes in GiB, or in MiB below 0.1 GiB (the CPU smoke run's tiny budgets)."""
    if nbytes is None:
        return "—"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.2f} MiB"


BUDGET_HEAD = (
    "| budget | bytes | status | plan | s/step (p25) | s/step (median) | simple plans the library measured (fastest "
    "step) | fastest simple plan (p25) "
    "that fits | x it | (a) <= "
    f"{TIME_TOLERANCE:.2f}x | peak, every step | steps over | (b) peak <= budget | (c) not refused |"
)


def shape_markdown(summary: dict[str, Any]) -> list[str]:
    """The zoo's section of a shape's markdown: the checks per budget, and the counts."""
    lines = ["", "### The zoo's checks per budget", "", BUDGET_HEAD, "|" + "---|" * (BUDGET_HEAD.count(" | ") + 1)]
    for row in summary["rows"]:
        codes = row["codes"]
        plan = " -> ".join(f"`{c}`" for c in codes) if codes else (f"`{row['plan']}`" if row["plan"] else "")
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {(row['error'] or '')[:200]}"
        fastest = (
            f"{row['fastest_fitting']} {row['fastest_fitting_s']:.3f} s" if row["fastest_fitting"] else "none fits"
        )
        lines.append(
            f"| {row['mode']} | {size(row['budget_bytes'])} | {status} | {plan} | {fmt(row['step_s'])} | "
            f"{fmt(row['median_s'])} | "
            f"{row.get('library_measured', '')} | {fastest} "
            f"| {fmt(row['x_fastest'], '{:.3f}')} | {mark(row['a'])} | {size(row['peak_all_bytes'])} | "
            f"{row['steps_over'] if row['steps_over'] else '' if row['steps_over'] is None else 'none'} | "
            f"{mark(row['b'])} | {mark(row['c'])} |"
        )
    lines += [""] + [f"- {line}" for line in summary_lines(summary)]
    return lines


def summary_lines(summary: dict[str, Any]) -> list[str]:
    counts = summary["checks"]

    def line(check: str, what: str) -> str:
        c = counts[check]
        failed = f"{len(c['fail'])} failed" + (f" ({', '.join(c['fail'])})" if c["fail"] else "")
        return f"({check}) {what}: {c['pass']} passed, {failed}, {c['n/a']} n/a"

    minimum = summary["named_minimum_bytes"]
    reference = summary["reference_bytes"]
    named = (
        f"smallest budget the library named (refusing {PROBE_MODE}): {size(minimum)}"
        + (f" ({100 * minimum / reference:.1f}% of the reference)" if reference else "")
        if minimum is not None
        else f"smallest budget the library named: none ({PROBE_MODE} did not end in a refusal)"
    )
    below = summary["simple_peaks_below_named_minimum"]
    return [
        line("a", f"step <= {TIME_TOLERANCE:.2f}x the fastest simple plan that fits"),
        line("b", "peak <= budget on every step, profiled steps included"),
        line("c", "no budget refused that a simple plan meets"),
        named
        + (f"; simple plans whose peak is below it: {', '.join(below)}" if below else "")
        + f"; lowest feasible budget run: {fmt(summary['lowest_feasible_percent'], '{:g}%')}",
        f"did not finish: {', '.join(summary['did_not_finish']) or 'none'}; verdict: "
        + ("**pass**" if summary["passed"] else "**FAIL**"),
    ]


def _simple(r: Result | None) -> str:
    """A simple plan's cell: s/step (check (a)'s lower quartile) and peak GiB."""
    if not _ok(r):
        return r.get("status", "?") if r else "not run"
    return f"{r[STEP_TIME]:.3f}, {fmt(r.get('peak_gib'), '{:.1f}')}"


def _count(c: dict[str, Any] | None) -> str:
    """A check's cell: budgets passed / budgets checked."""
    if not c:
        return "—"
    return f"{c['pass']}/{c['pass'] + len(c['fail'])}" + (" **FAIL**" if c["fail"] else "")


def summary_markdown(shapes: list[tuple[str, dict[str, Any]]], header: list[str], not_run: list[str]) -> str:
    """The whole sweep's markdown: one row per shape, then each shape's checks. ``shapes``: (name, its JSON as
    written, with the zoo's summary in ``meta["zoo"]``); ``not_run``: shapes the time budget left out."""
    head = (
        "| shape | what | none s (p25), GiB | ckpt s (p25), GiB | ckpt+hfo s (p25), GiB | named minimum (% none) | "
        "budgets run "
        "(feasible) | (a) | (b) | (c) | verdict |"
    )
    lines = header + ["", head, "|" + "---|" * (head.count(" | ") + 1)]
    for name, data in shapes:
        summary = data["meta"].get("zoo") or {}
        results = {r["mode"]: r for r in data["results"]}
        minimum, reference = summary.get("named_minimum_bytes"), summary.get("reference_bytes")
        named = size(minimum) + (f" ({100 * minimum / reference:.0f}%)" if minimum and reference else "")
        checks = " | ".join(_count(summary.get("checks", {}).get(c)) for c in ("a", "b", "c"))
        verdict = "pass" if summary.get("passed") else "**FAIL**" if summary else "—"
        if summary and not data["meta"].get("zoo_complete"):
            verdict += " (partial)"
        lines.append(
            f"| {name} | {data['meta'].get('describe', '')} | "
            + " | ".join(_simple(results.get(m)) for m in SIMPLE_MODES)
            + f" | {named} | {summary.get('budgets_run', 0)} ({summary.get('budgets_feasible', 0)}) | {checks} | "
            f"{verdict} |"
        )
    lines += [
        "",
        f"(a), (b), (c): budgets that passed / budgets with something to check (n/a: no peak counter, no simple plan "
        f"that fits the budget, or a refused budget for (a) and (b)). Not run (time budget): "
        f"{', '.join(not_run) or 'none'}.",
    ]
    for name, data in shapes:
        summary = data["meta"].get("zoo")
        if not summary:
            continue
        lines += ["", f"## {name}", "", data["meta"].get("describe", ""), ""]
        lines += shape_markdown(summary)[1:]
    return "\n".join(lines) + "\n"
