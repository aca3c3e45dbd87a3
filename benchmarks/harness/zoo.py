"""The shape zoo's sweep (``benchmarks/zoo.py``), without torch: which mode of a shape runs next
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

Check (a)'s re-check: a mode's step time drifts with the host by more than the 2% that (a) allows between two runs
minutes apart, so every budget that (a) fails is measured again after the shape's sweep, the standard way to confirm
a measured regression: its reference (the simple plan that (a) compared it with) and its plan alternately, `ref,
plan` ``pairs`` times (ABAB for 2), on one model built for the re-check, so that both sides see the same drift. Its
(a) is then judged again on the lower quartile of each side's re-check steps, pooled over its runs; that is the
budget's verdict, the first ratio stays in the report. A re-check is a measurement like the sweep's: the plan's
re-check steps count for (b) too.

Check (c)'s re-check: a simple plan's peak moves between two runs of it by the caching allocator's blocks (on an
H200, ckpt+hfo on gemma2-2b-2k peaked at 25,724,275,712 and 25,731,091,456 bytes, one process, the same requests),
so a budget at one run's peak may not be met by the next. Every refused budget that (c) fails runs each simple plan
that fitted it once more, built afresh as in the sweep; a simple plan whose re-run peaks over the budget did not meet
it, and (c) is judged again on those that did (with re-checks on, ``pairs`` > 0).

Every mode's result is run.py's (``harness.worker``), so the files are run.py's format: ``harness.report`` writes a
shape's markdown and JSON, and ``pareto.py`` draws its chart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from . import GIB, lower_quartile
from .modes import PLAN_PREFIX, parse_mode
from .report import Result, budget_bytes, fmt, timed_plan_change

SIMPLE_MODES = ("none", "ckpt", "ckpt+hfo")
# The plan each simple mode is, every layer alike: keep, checkpoint keeping the input, checkpoint offloading it.
SIMPLE_PLAN_LETTERS = {"none": "K", "ckpt": "c", "ckpt+hfo": "C"}
# A budget far below any plan's peak: its refusal names the smallest budget that works for the shape.
PROBE_PERCENT = 1
PROBE_MODE = f"{PLAN_PREFIX}{PROBE_PERCENT}"
TIME_TOLERANCE = 1.02  # check (a)
STEP_TIME = "p25_s"  # check (a)'s step time: the lower quartile of a mode's timed steps
GRID_STEP = 5  # percent of none's peak
GRID_TOP = 95
RECHECK_PAIRS = 2  # check (a)'s re-check: ref, plan, ref, plan


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


def steps_over(peaks: list[int], budget: int) -> list[int]:
    """The steps (from 1) whose peak went over the budget."""
    return [i + 1 for i, peak in enumerate(peaks) if peak > budget]


def budget_checks(results: list[Result], rechecks: Sequence[Result] = (), pairs: int = 0) -> list[dict[str, Any]]:
    """Checks (a), (b) and (c) of every budget of the sweep (the probe excepted), in the order run. Each check is
    True, False, or None (nothing to check: no peak counter, no simple plan that fits, a budget refused). With
    ``pairs``, a budget whose (a) failed is judged again on its re-check runs in ``rechecks`` (`apply_recheck`)."""
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
            "timed_plan_change": timed_plan_change(r),
            "step_s": r.get(STEP_TIME) if status == "ok" else None,
            "median_s": r.get("median_s") if status == "ok" else None,
            "peak_all_bytes": peak_all(r),
            "fastest_fitting": fastest["mode"] if fastest else None,
            "fastest_fitting_s": fastest[STEP_TIME] if fastest else None,
            "simple_fitting": [s["mode"] for s in fits],
            "x_fastest": None,
            # Every plan it ran is the very plan of the simple plan (a) compares it with: an (a) failure is then
            # that plan's time moving between runs, not a choice of the planner's.
            "reference_plan": None,
            "steps_over": None,
            "a": None,
            "b": None,
            "c": None,
            "error": r.get("error") if status != "ok" else None,
            "recheck": None,  # (a)'s re-check, where the first measurement failed it
            "recheck_steps_over": {},
        }
        if status == "ok":
            if fastest is not None:
                row["x_fastest"] = r[STEP_TIME] / fastest[STEP_TIME]
                letter = SIMPLE_PLAN_LETTERS[fastest["mode"]]
                row["reference_plan"] = bool(row["codes"]) and all(set(code) == {letter} for code in row["codes"])
                row["a"] = row["x_fastest"] <= TIME_TOLERANCE
            peaks = step_peaks(r)
            if peaks is not None and budget is not None:
                row["steps_over"] = steps_over(peaks, budget)
                row["b"] = not row["steps_over"]
            row["c"] = True
        elif status == "infeasible":
            row["c"] = not fits if simple else None
            if row["c"] is False:
                row["c_against"] = refused_against(r, fits, results)
                if pairs:
                    apply_c_recheck(row, _rechecks_of(rechecks, r["mode"], "c"))
        elif status == "OOM":
            row["b"] = False  # the step outgrew the device, so the budget below it
        row["a_first"] = row["a"]
        if pairs and row["a"] is False:
            apply_recheck(row, _rechecks_of(rechecks, r["mode"], "a"), pairs)
        rows.append(row)
    return rows


def refused_against(refused: Result, fits: list[Result], results: list[Result]) -> str:
    """What a refused budget that (c) fails was up against: the peak of each simple plan that meets it, and of the
    lowest plan the refusal names where a budget of the sweep ran that plan alone, each allocated and, where counted,
    requested. Equal requested peaks are the same bytes asked for; the allocated peaks then differ by the caching
    allocator's blocks alone (`harness.measure.StepPeaks`)."""

    def peaks(r: Result) -> str:
        requested = r.get("peak_requested_all_bytes")
        return f"{peak_all(r):,} bytes" + (f" (requested {requested:,})" if requested is not None else "")

    parts = [f"{s['mode']} peaked at {peaks(s)}" for s in fits]
    named = re.search(r"plan '([A-Za-z]+)'", refused.get("error") or "")
    lowest = named.group(1) if named else None
    alone = [r for r in results if r.get("status") == "ok" and peak_all(r) is not None
             and {step.get("plan") for step in r.get("per_step", []) if step.get("plan")} == {lowest}]  # fmt: skip
    if lowest is not None and alone:
        parts.append(f"the lowest plan {_code_text(lowest)}, alone at {alone[0]['mode']}: {peaks(alone[0])}")
    return "; ".join(parts)


def _code_text(code: str) -> str:
    """A plan code for the report: `C` x 26 where every layer is alike."""
    return f"`{code[0]}` x {len(code)}" if len(set(code)) == 1 else f"`{code}`"


def recheck_modes(row: dict[str, Any], pairs: int) -> list[str]:
    """A budget's re-check runs in order: the simple plan that (a) compared it with, then its plan, ``pairs`` times
    (back to back, so that both sides see the same drift of the host)."""
    return [row["fastest_fitting"], row["mode"]] * pairs


class Recheck(NamedTuple):
    """The next run of a budget's re-check: ``modes_left[0]``, the ``run``-th (from 1) of its runs: check (a)'s ABAB
    (``check`` "a"), or check (c)'s re-run of each simple plan that fitted a refused budget ("c")."""

    budget: str
    run: int
    modes_left: list[str]
    check: str = "a"

    @property
    def tag(self) -> dict[str, Any]:
        """What the run's result carries (``"recheck"``), to be told from the sweep's run of the same mode."""
        return {"budget": self.budget, "run": self.run, "check": self.check}


def _rechecks_of(rechecks: Sequence[Result], budget: str, check: str) -> list[Result]:
    """The re-check runs of ``budget`` for ``check`` ("a" in results written before (c) had one)."""
    return [x for x in rechecks if x["recheck"]["budget"] == budget and x["recheck"].get("check", "a") == check]


def next_recheck(results: list[Result], rechecks: list[Result], pairs: int) -> Recheck | None:
    """The next re-check run of a shape whose sweep is done: the budgets that failed (a) at their first measurement,
    in the order run; any status counts as done, and a budget one of whose runs did not finish is not run on (its
    re-check cannot be judged); then the refused budgets that failed (c), each simple plan that fitted them once.
    None when every re-check is done, or ``pairs`` is 0."""
    if not pairs:
        return None
    rows = budget_checks(results)
    for row in rows:
        if row["a"] is not False:
            continue
        done = _rechecks_of(rechecks, row["mode"], "a")
        order = recheck_modes(row, pairs)
        if len(done) < len(order) and all(_ok(x) for x in done):
            return Recheck(row["mode"], len(done) + 1, order[len(done) :])
    for row in rows:
        if row["c"] is not False:
            continue
        done = _rechecks_of(rechecks, row["mode"], "c")
        if len(done) < len(row["simple_fitting"]):
            return Recheck(row["mode"], len(done) + 1, row["simple_fitting"][len(done) :], "c")
    return None


def apply_recheck(row: dict[str, Any], runs: list[Result], pairs: int) -> None:
    """Judges (a) of a budget that failed it again on its re-check ``runs``: the plan's lower quartile over its runs'
    timed steps against the reference's over its runs'. ``row["recheck"]`` says what came of it: "judged" (``x``,
    the ratio, and ``a``, the budget's verdict now), "time" (the time limit left it undone: the first verdict stays),
    or "incomplete" (a run did not finish: the first verdict stays). The plan's runs count for (b) as the sweep's
    run does: a step over the budget, or an OOM, fails it."""
    plan_runs = [x for x in runs if x["mode"] == row["mode"]]
    budget = row["budget_bytes"]
    for x in plan_runs:
        peaks = step_peaks(x) or []
        if peaks:
            row["peak_all_bytes"] = max(row["peak_all_bytes"] or 0, *peaks)
        over = steps_over(peaks, budget) if budget is not None else []
        if over:
            row["recheck_steps_over"][x["recheck"]["run"]] = over
    if row["recheck_steps_over"] or any(x.get("status") == "OOM" for x in plan_runs):
        row["b"] = False
    expected = recheck_modes(row, pairs)
    unfinished = [x for x in runs if not _ok(x)]
    recheck: dict[str, Any] = {
        "pairs": pairs,
        "runs": [{"mode": x["mode"], "status": x.get("status"), "step_s": x.get(STEP_TIME)} for x in runs],
    }
    if unfinished and any(x.get("status") != "timeout" for x in unfinished):
        recheck["state"] = "incomplete"
        recheck["why"] = ", ".join(f"{x['mode']} run {x['recheck']['run']}: {x.get('status')}" for x in unfinished)
    elif unfinished or len(runs) < len(expected):
        recheck["state"] = "time"
    else:
        pooled = {side: [t for x in runs if x["mode"] == side for t in x["times"]] for side in set(expected)}
        recheck["plan_s"] = lower_quartile(pooled[row["mode"]])
        recheck["ref_s"] = lower_quartile(pooled[row["fastest_fitting"]])
        recheck["x"] = recheck["plan_s"] / recheck["ref_s"]
        # How far the reference's own runs moved apart: the same plan, a minute apart. Beyond the 2% (a) judges, the
        # verdict says more of the machine than of the planner (host-paced shapes on an H200: 30-50%).
        ref_runs = [lower_quartile(x["times"]) for x in runs if x["mode"] == row["fastest_fitting"]]
        recheck["ref_spread"] = max(ref_runs) / min(ref_runs) - 1
        recheck["state"] = "judged"
        row["a"] = recheck["x"] <= TIME_TOLERANCE
    row["recheck"] = recheck


def apply_c_recheck(row: dict[str, Any], runs: list[Result]) -> None:
    """Judges (c) of a refused budget that failed it again on its re-check ``runs``, one of each simple plan that
    fitted it: a simple plan meets the budget if its re-run did too. ``row["c_recheck"]`` holds each re-run's peak
    (None where it did not finish, which judges nothing: that plan still counts as meeting the budget); (c) stays
    failed until every re-run is in."""
    peaks = {x["mode"]: peak_all(x) if _ok(x) else None for x in runs}
    row["c_recheck"] = peaks
    if any(mode not in peaks for mode in row["simple_fitting"]):
        return
    budget = row["budget_bytes"]
    met = [mode for mode in row["simple_fitting"] if peaks[mode] is None or peaks[mode] <= budget]
    row["c"] = not met


def c_recheck_text(row: dict[str, Any]) -> str:
    """A refused budget's (c) re-check in a few words: each simple plan's re-run peak against the budget."""
    peaks = row.get("c_recheck")
    if not peaks:
        return ""
    parts = [f"{mode} {'did not finish' if peak is None else f'{peak:,} bytes'}" for mode, peak in peaks.items()]
    return f"re-run: {', '.join(parts)} (budget {row['budget_bytes']:,})"


def library_measured(r: Result) -> str:
    """The simple plans the library measured itself in a budget's run (every layer one letter: `C` the profiled
    safe plan, `c` the closed loop's trial of plain checkpointing), with their fastest step (what the library
    compares plans by; "peak only" where only the first step ran it), and how many other plans its closed loop
    measured."""
    measured = r.get("plan", {}).get("measured_s") or {}
    timed = {code: [time for time in times if time is not None] for code, times in measured.items()}
    simple = [f"{code[0]} {min(times):.3f} s" if times else f"{code[0]} (peak only)" for code, times in timed.items()
              if len(set(code)) == 1 and measured[code]]  # fmt: skip
    others = sum(1 for code in measured if len(set(code)) > 1)
    return ", ".join(simple + ([f"+{others} other"] if others else []))


def shape_summary(
    results: list[Result], reference: int | None, rechecks: Sequence[Result] = (), pairs: int = 0
) -> dict[str, Any]:
    """A shape's verdict: per check how many budgets passed, failed or had nothing to check (for (a) also how many
    passed at their first measurement); the modes that did not finish, re-check runs included; the minimum the
    library named against the simple plans' peaks."""
    rows = budget_checks(results, rechecks, pairs)
    counts = {
        check: {
            "pass": sum(row[check] is True for row in rows),
            "fail": [row["mode"] for row in rows if row[check] is False],
            "n/a": sum(row[check] is None for row in rows),
        }
        for check in ("a", "b", "c")
    }
    counts["a"]["pass_first"] = sum(row["a_first"] is True for row in rows)
    failed = [f"{r['mode']} ({r.get('status')})" for r in results if r.get("status") not in ("ok", "infeasible")]
    failed += [
        f"{x['mode']} (re-check run {x['recheck']['run']} of {x['recheck']['budget']}: {x.get('status')})"
        for x in rechecks
        if x.get("status") not in ("ok", "infeasible")
    ]
    minimum = named_minimum(results)
    by_mode = {r["mode"]: r for r in results}
    below_minimum = [
        m for m in SIMPLE_MODES if minimum is not None and (peak_all(by_mode.get(m)) or math.inf) < minimum
    ]
    feasible = [row for row in rows if row["status"] == "ok"]
    return {
        "reference_bytes": reference,
        "recheck_pairs": pairs,
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


def budget_head(pairs: int) -> str:
    """The head of the table of checks per budget; with a re-check, its column after the first ratio's."""
    recheck = f"(a) re-check, {'AB' * pairs}: plan / ref (p25 of the runs' steps) | " if pairs else ""
    return (
        "| budget | bytes | status | plan | s/step (p25) | s/step (median) | simple plans the library measured "
        "(fastest step) | fastest simple plan (p25) that fits | x it | "
        f"{recheck}(a) <= {TIME_TOLERANCE:.2f}x | peak, every step | steps over | (b) peak <= budget | (c) not "
        "refused |"
    )


def recheck_method(pairs: int) -> str:
    """What the re-check is, in words: a line of the per-shape and summary reports (empty when it is off)."""
    if not pairs:
        return ""
    return (
        f"(a) re-check, {'AB' * pairs}: after the shape's sweep, each budget whose (a) failed runs again with the "
        f"simple plan (a) compared it with, alternately (ref, plan, {pairs} times; each run the sweep's warm-up and "
        "timed steps), so that both sides see the same drift of the host; (a) is judged again on the lower quartile "
        "of each side's timed steps pooled over its runs, and that is the budget's verdict (the first ratio stays: "
        "x it); the plan's re-check steps count for (b) too. A budget the time limit left without its re-check keeps "
        "its first verdict: not re-checked (time). (c) re-check: each refused budget that (c) fails runs each simple "
        "plan that fitted it once more, built afresh; one whose re-run peaks over the budget did not meet it, and (c) "
        "is judged on those that did"
    )


def recheck_text(recheck: dict[str, Any] | None) -> str:
    """A budget's re-check in a few words: the pooled lower quartiles and their ratio, or why it has none."""
    if recheck is None:
        return ""
    if recheck["state"] == "judged":
        spread = recheck.get("ref_spread")  # none in results written before it was measured
        return f"{recheck['plan_s']:.3f} / {recheck['ref_s']:.3f} s = {recheck['x']:.3f}x" + (
            f" (the reference's runs {100 * spread:.0f}% apart)" if spread is not None else ""
        )
    if recheck["state"] == "time":
        return "not re-checked (time)"
    return f"not judged ({recheck['why']})"


def _steps_over(row: dict[str, Any]) -> str:
    """The steps over the budget: the sweep's run's, then each re-check run's of the plan."""
    first = row["steps_over"]
    parts = [str(first) if first else "" if first is None else "none"]
    parts += [f"re-check run {run}: {steps}" for run, steps in row.get("recheck_steps_over", {}).items()]
    return "; ".join(part for part in parts if part)


def _c_cell(row: dict[str, Any]) -> str:
    """A budget's (c) verdict, and where it was re-checked, the simple plans' re-run peaks."""
    text = c_recheck_text(row)
    return mark(row["c"]) + (f" ({text})" if text else "")


def _own_plan(row: dict[str, Any]) -> str:
    """What an (a) failure's text adds where the budget ran only the plan of the simple plan it was compared with."""
    # none in results written before it was checked
    return f" ({row['fastest_fitting']}'s own plan)" if row.get("reference_plan") else ""


def shape_markdown(summary: dict[str, Any], method: bool = True) -> list[str]:
    """The zoo's section of a shape's markdown: the checks per budget, each re-check's runs, and the counts;
    ``method``: with what the re-check is (the summary says it once, in its head)."""
    pairs = summary.get("recheck_pairs", 0)
    head = budget_head(pairs)
    lines = ["", "### The zoo's checks per budget", "", head, "|" + "---|" * (head.count(" | ") + 1)]
    for row in summary["rows"]:
        codes = row["codes"]
        plan = " -> ".join(f"`{c}`" for c in codes) if codes else (f"`{row['plan']}`" if row["plan"] else "")
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {(row['error'] or '')[:200]}"
        fastest = (
            f"{row['fastest_fitting']} {row['fastest_fitting_s']:.3f} s" if row["fastest_fitting"] else "none fits"
        )
        recheck = row.get("recheck")
        verdict = mark(row["a"]) + (" (re-check)" if recheck and recheck["state"] == "judged" else "")
        if row["a"] is False:
            verdict += _own_plan(row)
        lines.append(
            f"| {row['mode']} | {size(row['budget_bytes'])} | {status} | {plan} | {fmt(row['step_s'])} | "
            f"{fmt(row['median_s'])} | "
            f"{row.get('library_measured', '')} | {fastest} "
            f"| {fmt(row['x_fastest'], '{:.3f}')} | {f'{recheck_text(recheck)} | ' if pairs else ''}{verdict} | "
            f"{size(row['peak_all_bytes'])} | {_steps_over(row)} | {mark(row['b'])} | {_c_cell(row)} |"
        )
    lines += [""] + ([f"- {recheck_method(pairs)}"] if method and pairs else [])
    lines += [f"- {line}" for line in summary_lines(summary)]
    return lines


def summary_lines(summary: dict[str, Any]) -> list[str]:
    counts = summary["checks"]
    pairs = summary.get("recheck_pairs", 0)
    rows = {row["mode"]: row for row in summary["rows"]}

    def line(check: str, what: str) -> str:
        c = counts[check]
        failures, sep = c["fail"], ", "
        passed = f"{c['pass']} passed"
        if check == "a" and pairs:  # how many needed the re-check, and what it found for those that still fail
            passed += f" ({c['pass_first']} first time, {c['pass'] - c['pass_first']} on re-check)"
            failures = [f"{m}: {recheck_text(rows[m]['recheck'])}" if rows[m]["recheck"] else m for m in failures]
            sep = "; "
        if check == "a":
            failures = [text + _own_plan(rows[m]) for text, m in zip(failures, c["fail"])]
        if check == "c":  # what it was up against and its re-check: none in results written before they existed
            details = {m: "; ".join(part for part in (rows[m].get("c_against"), c_recheck_text(rows[m])) if part)
                       for m in failures}  # fmt: skip
            failures = [f"{m}: {details[m]}" if details[m] else m for m in failures]
            sep = "; "
        failed = f"{len(failures)} failed" + (f" ({sep.join(failures)})" if failures else "")
        return f"({check}) {what}: {passed}, {failed}, {c['n/a']} n/a"

    minimum = summary["named_minimum_bytes"]
    reference = summary["reference_bytes"]
    named = (
        f"smallest budget the library named (refusing {PROBE_MODE}): {size(minimum)}"
        + (f" ({100 * minimum / reference:.1f}% of the reference)" if reference else "")
        if minimum is not None
        else f"smallest budget the library named: none ({PROBE_MODE} did not end in a refusal)"
    )
    below = summary["simple_peaks_below_named_minimum"]
    mixed = [row for row in summary["rows"] if row.get("timed_plan_change")]
    return [
        *recheck_lines(summary),
        line("a", f"step <= {TIME_TOLERANCE:.2f}x the fastest simple plan that fits"),
        line("b", "peak <= budget on every step, profiled steps included"),
        line("c", "no budget refused that a simple plan meets"),
        named
        + (f"; simple plans whose peak is below it: {', '.join(below)}" if below else "")
        + f"; lowest feasible budget run: {fmt(summary['lowest_feasible_percent'], '{:g}%')}",
        "budgets whose timed steps ran more than one plan (the closed loop still checking its plans): "
        + (", ".join(f"{row['mode']} (changed at step {row['timed_plan_change']})" for row in mixed) or "none"),
        f"did not finish: {', '.join(summary['did_not_finish']) or 'none'}; verdict: "
        + ("**pass**" if summary["passed"] else "**FAIL**"),
    ]


def recheck_lines(summary: dict[str, Any]) -> list[str]:
    """Each re-checked budget's runs in the order run (each run's lower quartile) and the pooled ratio that judged
    it; each refused budget's (c) re-check."""
    lines = []
    for row in summary["rows"]:
        if row.get("c_recheck"):
            lines.append(f"{row['mode']}: refused while {', '.join(row['simple_fitting'])} fitted it; (c)'s "
                         f"{c_recheck_text(row)}: (c) {mark(row['c'])}")  # fmt: skip
        recheck = row.get("recheck")
        if not recheck:
            continue
        runs = ", ".join(
            f"{run['mode']} {fmt(run['step_s'])}" + ("" if run["status"] == "ok" else f" ({run['status']})")
            for run in recheck["runs"]
        )
        verdict = f": (a) {mark(row['a'])}" if recheck["state"] == "judged" else ""
        lines.append(
            f"{row['mode']}: first {fmt(row['x_fastest'], '{:.3f}')}x {row['fastest_fitting']}; re-check runs "
            f"(s/step, p25 of each): {runs or 'none'}; {recheck_text(recheck)}{verdict}"
        )
    return lines


def _simple(r: Result | None) -> str:
    """A simple plan's cell: s/step (check (a)'s lower quartile) and peak GiB."""
    if not _ok(r):
        return r.get("status", "?") if r else "not run"
    return f"{r[STEP_TIME]:.3f}, {fmt(r.get('peak_gib'), '{:.1f}')}"


def _count(c: dict[str, Any] | None) -> str:
    """A check's cell: budgets passed / budgets checked."""
    if not c:
        return "—"
    first = c.get("pass_first", c["pass"])  # (a): the rest passed on re-check
    return (
        f"{c['pass']}/{c['pass'] + len(c['fail'])}"
        + (f" ({first} first time)" if first != c["pass"] else "")
        + (" **FAIL**" if c["fail"] else "")
    )


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
    rechecked = any((data["meta"].get("zoo") or {}).get("recheck_pairs") for _, data in shapes)
    lines += [
        "",
        "(a), (b), (c): budgets that passed / budgets with something to check (n/a: no peak counter, no simple plan "
        "that fits the budget, or a refused budget for (a) and (b))"
        + ("; (a)'s (N first time): N passed at their first measurement, the rest on re-check" if rechecked else "")
        + f". Not run (time budget): {', '.join(not_run) or 'none'}.",
    ]
    for name, data in shapes:
        summary = data["meta"].get("zoo")
        if not summary:
            continue
        lines += ["", f"## {name}", "", data["meta"].get("describe", ""), ""]
        lines += shape_markdown(summary, method=False)[1:]
    return "\n".join(lines) + "\n"
