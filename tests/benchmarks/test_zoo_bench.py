"""benchmarks/zoo.py (the memory budget swept over 1B-8B-class shapes) on CPU: the sweep's logic and checks
(benchmarks/harness/zoo.py) on results made up by hand, then the script end to end in its --device cpu mode (tiny
shapes, hf-offload's CPU test mode), cut by its time budget, and with its child dying in a mode. Keeps the GPU sweep's
logic from rotting between GPU runs."""

from __future__ import annotations

import datetime
import json
import re
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import zoo as zoo_script  # noqa: E402
from harness import report, zoo  # noqa: E402

GIB = 2**30
REFERENCE = 40 * GIB  # none's peak in the made-up shape


def _result(mode: str, status: str = "ok", median: float = 0.3, peaks: list[float] | None = None, **extra) -> dict:
    """A mode's result as harness.worker writes it: per-step peaks in GiB (None: no peak counter)."""
    res = {"scenario": "M36", "mode": mode, "status": status, "notes": [], "wall_s": 5.0, **extra}
    if status == "ok":
        res["median_s"] = median
        res.setdefault("p25_s", median)
        res["per_step"] = [{"step": i + 1, "s": median} for i in range(len(peaks or [0, 0]))]
        if peaks is not None:
            for step, peak in zip(res["per_step"], peaks):
                step["peak_bytes"] = int(peak * GIB)
            res["peak_bytes"] = int(peaks[-1] * GIB)
            res["peak_gib"] = peaks[-1]
    return res


def _plan(percent: float, median: float, peaks: list[float], code: str = "CCKK", status: str = "ok", **extra) -> dict:
    budget = zoo.budget_of(percent, REFERENCE)
    res = _result(zoo.plan_mode(percent), status, median, peaks if status == "ok" else None, **extra)
    res["memory_budget"] = {"option": budget, "percent": percent, "reference": "none"}
    if status == "ok":
        res["plan"] = {"code": code, "budget_bytes": budget, "predicted_peak_bytes": max(peaks or [1]) * GIB,
                       "predicted_step_s": median}  # fmt: skip
        res["warmup_steps"] = 2
        for step in res["per_step"][2:]:
            step["plan"] = code
    return res


def _simple() -> list[dict]:
    """none 0.3 s at 40 GiB, ckpt 0.33 s at 21.3 GiB (21.5 in a warm-up step), ckpt+hfo 0.34 s at 20 GiB."""
    return [
        _result("none", peaks=[40, 40]),
        _result("ckpt", median=0.33, peaks=[21.5, 21.3]),
        _result("ckpt+hfo", median=0.34, peaks=[20, 20]),
    ]


def test_budget_percentages_round_up_to_a_budget_the_peak_fits():
    assert zoo.plan_mode(60) == "plan@60" and zoo.plan_mode(33.4712) == "plan@33.47"
    for nbytes in (1, 12345678901, int(21.5 * GIB), REFERENCE - 1):
        percent = zoo.percent_at_least(nbytes, REFERENCE)
        assert zoo.budget_of(percent, REFERENCE) >= nbytes > zoo.budget_of(percent - 0.01, REFERENCE)


def test_the_sweep_runs_the_simple_plans_the_probe_then_the_budgets_from_the_named_minimum():
    results: list[dict] = []
    assert zoo.next_mode(results, None) == "none"
    results = _simple()
    assert zoo.next_mode(results, REFERENCE) == zoo.PROBE_MODE
    assert zoo.next_mode(results, None) is None  # none did not finish: nothing to budget a share of
    results.append(_result(zoo.PROBE_MODE, "infeasible", minimum_bytes=int(19 * GIB)))  # 47.5% of none's peak
    ckpt_percent = zoo.percent_at_least(int(21.5 * GIB), REFERENCE)  # every step's peak, the warm-up's included
    assert ckpt_percent == 53.75  # ckpt+hfo's 20 GiB is 50%, on the grid
    assert zoo.sweep_modes(results, REFERENCE) == ["plan@50", "plan@53.75"] + [f"plan@{p}" for p in range(55, 96, 5)]
    assert zoo.next_mode(results, REFERENCE) == "plan@50"
    results += [_plan(p, 0.3, [1, 1]) for p in (50, ckpt_percent)]
    assert zoo.next_mode(results, REFERENCE) == "plan@55"
    results += [_plan(p, 0.3, [1, 1]) for p in range(55, 96, 5)]
    assert zoo.next_mode(results, REFERENCE) is None
    # a coarser grid, a lower top; a probe that failed otherwise starts the grid at the lowest simple plan's peak
    coarse = ["plan@50", "plan@53.75", "plan@60", "plan@80"]  # the simple plans' peaks, then the grid
    assert zoo.sweep_modes(results, REFERENCE, grid_step=20, top=80) == coarse
    failed = _simple() + [_result(zoo.PROBE_MODE, "error")]
    assert zoo.sweep_modes(failed, REFERENCE, grid_step=20, top=80)[0] == "plan@50"  # ckpt+hfo: 20 GiB = 50%


def test_checks_a_b_c():
    results = _simple() + [
        _result(zoo.PROBE_MODE, "infeasible", minimum_bytes=int(19 * GIB)),
        _plan(45, 0.40, [], status="infeasible"),  # 18 GiB: no simple plan fits, a refusal is right
        _plan(50, 0.345, [20.1, 19.9, 19.0, 19.0]),  # ckpt+hfo fits (20 GiB): 0.345 <= 1.02 x 0.34; a step over
        _plan(55, 0.30, [20, 20, 21, 21.9]),  # ckpt fits too (21.5 GiB): 0.30 beats both
        _plan(60, 0.40, [20, 20, 22, 22]),  # 0.40 > 1.02 x 0.33
        _plan(65, 0.30, [], status="infeasible"),  # 26 GiB refused while ckpt's 21.5 GiB fits: (c) fails
        _plan(70, 0.30, [], status="OOM"),
    ]
    rows = {row["mode"]: row for row in zoo.budget_checks(results)}
    assert zoo.PROBE_MODE not in rows
    assert (rows["plan@45"]["a"], rows["plan@45"]["b"], rows["plan@45"]["c"]) == (None, None, True)
    r50 = rows["plan@50"]
    assert r50["fastest_fitting"] == "ckpt+hfo" and r50["x_fastest"] == pytest.approx(0.345 / 0.34)
    assert (r50["a"], r50["b"], r50["steps_over"], r50["c"]) == (True, False, [1], True)
    assert rows["plan@55"]["fastest_fitting"] == "ckpt" and rows["plan@55"]["a"] is True and rows["plan@55"]["b"]
    assert rows["plan@60"]["a"] is False and rows["plan@60"]["b"] is True
    assert rows["plan@65"]["c"] is False and rows["plan@65"]["simple_fitting"] == ["ckpt", "ckpt+hfo"]
    assert rows["plan@70"]["b"] is False
    summary = zoo.shape_summary(results, REFERENCE)
    assert summary["checks"]["a"] == {"pass": 2, "fail": ["plan@60"], "n/a": 3, "pass_first": 2}
    assert summary["checks"]["b"]["fail"] == ["plan@50", "plan@70"]
    assert summary["checks"]["c"]["fail"] == ["plan@65"]
    assert summary["did_not_finish"] == ["plan@70 (OOM)"] and not summary["passed"]
    assert summary["lowest_feasible_percent"] == 50 and summary["named_minimum_bytes"] == int(19 * GIB)
    text = "\n".join(zoo.shape_markdown(summary))
    assert (
        "(c) no budget refused that a simple plan meets: 4 passed, 1 failed (plan@65: ckpt peaked at "
        f"{int(21.5 * GIB):,} bytes; ckpt+hfo peaked at {20 * GIB:,} bytes), 1 n/a"
    ) in text
    assert "verdict: **FAIL**" in text


def test_check_a_compares_the_lower_quartiles_of_the_steps():
    """The host's stalls add time to some steps of every mode: a plan whose median a few stalls raised, but whose
    lower quartile is that of the fastest simple plan, passes; the median alone would fail it."""
    from harness.measure import lower_quartile

    results = _simple() + [
        _result(zoo.PROBE_MODE, "infeasible", minimum_bytes=int(19 * GIB)),
        _plan(55, 0.40, [20, 20, 21, 21.4], p25_s=0.33),
    ]
    (row,) = zoo.budget_checks(results)
    assert row["fastest_fitting"] == "ckpt" and row["x_fastest"] == pytest.approx(1.0) and row["a"] is True
    assert row["median_s"] == 0.40 and row["step_s"] == 0.33
    assert lower_quartile([0.30, 0.31, 0.45, 0.50, 0.30, 0.29]) == pytest.approx(0.3)
    assert lower_quartile([0.3]) == 0.3


def test_no_peak_counter_leaves_a_and_b_without_anything_to_check():
    results = [_result(m) for m in zoo.SIMPLE_MODES] + [
        _result(zoo.PROBE_MODE, "infeasible", minimum_bytes=1_000_000),
        _plan(60, 0.05, None),
    ]
    (row,) = zoo.budget_checks(results)
    assert (row["a"], row["b"], row["c"]) == (None, None, True)
    assert zoo.reference_bytes(results, 2_500_000) == 2_500_000
    assert zoo.shape_summary(results, 2_500_000)["passed"]


def test_the_simple_plans_the_library_measured_are_reported():
    """Which simple plans the library's closed loop measured itself in a budget's run (the profiled safe plan, its
    trial of plain checkpointing), with their fastest step (what the library compares plans by), and how many other
    plans it measured."""
    results = [*_simple(), _plan(60, 0.3, [20, 20], code="ccKK")]
    results[-1]["plan"]["measured_s"] = {"CCCC": [0.33], "cccc": [0.28, 0.29], "ccKK": [0.27, 0.27, 0.26]}
    (row,) = zoo.budget_checks(results)
    assert row["library_measured"] == "C 0.330 s, c 0.280 s, +1 other"
    text = "\n".join(zoo.shape_markdown(zoo.shape_summary(results, REFERENCE)))
    assert "| simple plans the library measured (fastest step) |" in text
    assert "| C 0.330 s, c 0.280 s, +1 other |" in text
    # A plan only the first step ran: its peak measured, no time (the library's JSON has null for it)
    results[-1]["plan"]["measured_s"] = {"CCCC": [None], "cccc": [None, 0.29, 0.28]}
    (row,) = zoo.budget_checks(results)
    assert row["library_measured"] == "C (peak only), c 0.280 s"


def test_a_budget_whose_timed_steps_ran_more_than_one_plan_is_named():
    """The closed loop may still be checking its plans when the warm-up ends (it changes plans as late as step 18):
    the timed steps then time a mix of plans. A change at the first timed step is not one (they all ran one plan);
    a change after it is, in the budget's line and in the shape's summary."""
    first = _plan(60, 0.3, [20] * 6, code="ccKK")  # warm-up 2 steps: steps 3-6 are timed
    first["per_step"][2]["plan"] = "cccc"  # changed at step 4, after the first timed step
    at_start = _plan(65, 0.3, [20] * 6, code="ccKK")
    at_start["per_step"][1]["plan"] = "cccc"  # warm-up's last step ran another: the timed steps ran one plan
    results = [*_simple(), first, at_start]
    rows = {row["mode"]: row for row in zoo.budget_checks(results)}
    assert rows["plan@60"]["timed_plan_change"] == 4
    assert rows["plan@65"]["timed_plan_change"] is None
    text = "\n".join(zoo.shape_markdown(zoo.shape_summary(results, REFERENCE)))
    assert (
        "budgets whose timed steps ran more than one plan (the closed loop still checking its plans): plan@60 "
        "(changed at step 4)" in text
    )
    assert "changed it at step 4, after the 2 warm-up steps" in report.mode_details(first)
    assert "more than one plan" not in (report.mode_details(at_start) or "")


def test_an_a_failure_that_ran_its_references_own_plan_says_so():
    """A budget whose every plan is the very plan of the simple plan (a) compares it with (`C` on every layer against
    ckpt+hfo, `c` against ckpt, `K` against none) and fails (a) did nothing the planner chose differently: its time
    moved between runs. The report says so where it counts the failure."""
    results = _simple() + [
        _plan(50, 0.40, [19, 19, 19, 19], code="CCCC"),  # only ckpt+hfo fits: its own plan, 1.176x
        _plan(55, 0.40, [20, 20, 21, 21], code="cccc"),  # ckpt fits (0.33 s): its own plan, 1.212x
        _plan(60, 0.40, [20, 20, 22, 22], code="ccKK"),  # another plan: a planner's choice
        _plan(65, 0.30, [20, 20, 22, 22], code="cccc"),  # its own plan, but passes
    ]
    rows = {row["mode"]: row for row in zoo.budget_checks(results)}
    own = [rows[m]["reference_plan"] for m in ("plan@50", "plan@55", "plan@60", "plan@65")]
    assert own == [True, True, False, True]
    assert rows["plan@55"]["fastest_fitting"] == "ckpt"
    text = "\n".join(zoo.shape_markdown(zoo.shape_summary(results, REFERENCE)))
    assert "| 1.176 | **NO** (ckpt+hfo's own plan) |" in text
    assert "| 1.212 | **NO** (ckpt's own plan) |" in text
    assert "| 1.212 | **NO** |" in text  # plan@60
    assert "3 failed (plan@50 (ckpt+hfo's own plan), plan@55 (ckpt's own plan), plan@60)" in text
    results[-3]["per_step"][1]["plan"] = "CCCC"  # another plan ran first (the profiled safe plan): not ckpt's own
    assert not {row["mode"]: row for row in zoo.budget_checks(results)}["plan@55"]["reference_plan"]


def test_a_c_failure_names_the_peaks_it_was_up_against_allocated_and_requested():
    """A budget at a simple plan's peak, refused because the library's lowest plan peaked a few MB higher: the report
    gives both peaks and, where the allocator counted them, the bytes each requested, which tell a plan that asks for
    more from one whose allocator's blocks came out larger (gemma2-2b-2k on the H200)."""
    simple = _simple()
    simple[2]["peak_requested_all_bytes"] = 19 * GIB  # ckpt+hfo: 20 GiB allocated
    refused = _plan(50, 0.3, [], status="infeasible",
                    error="the memory budget of 20.00 GiB is below the smallest peak this step can reach, 20.01 GiB "
                          "(21485413171 bytes; plan 'CCCC', peak at head)")  # fmt: skip
    lowest = _plan(55, 0.3, [20.01] * 4, code="CCCC", peak_requested_all_bytes=19 * GIB)
    other = _plan(60, 0.3, [20.5] * 4, code="cCCC")  # another plan: not the one the refusal names
    results = [*simple, refused, lowest, other]
    rows = {row["mode"]: row for row in zoo.budget_checks(results)}
    assert rows["plan@50"]["c"] is False
    against = rows["plan@50"]["c_against"]
    assert against == (f"ckpt+hfo peaked at {20 * GIB:,} bytes (requested {19 * GIB:,}); the lowest plan `C` x 4, "
                       f"alone at plan@55: {int(20.01 * GIB):,} bytes (requested {19 * GIB:,})")  # fmt: skip
    text = "\n".join(zoo.shape_markdown(zoo.shape_summary(results, REFERENCE)))
    assert f"1 failed (plan@50: {against})" in text
    del lowest["peak_requested_all_bytes"]  # results measured before requested bytes were counted
    refused["error"] = "below the smallest peak"  # a refusal that names no plan
    expected = f"ckpt+hfo peaked at {20 * GIB:,} bytes (requested {19 * GIB:,})"
    assert zoo.budget_checks(results)[0]["c_against"] == expected


def _rerun(budget: str, run: int, mode: str, times: list[float], peaks: list[float] | None = None) -> dict:
    """A run of ``budget``'s re-check (its ``run``-th): ``mode`` with these timed steps' seconds (4 warm-up steps
    before them) and, for the plan, its steps' peaks in GiB (default: under every budget here)."""
    from harness import lower_quartile

    steps = len(times) + 4
    if mode == budget:
        res = _plan(float(budget[len("plan@") :]), 0.0, peaks or [19.0] * steps)
    else:
        res = _result(mode, peaks=[20.0] * steps)
    for step, s in zip(res["per_step"], [0.5] * 4 + times):
        step["s"] = s
    res.update(times=times, p25_s=lower_quartile(times), median_s=sorted(times)[len(times) // 2])
    res["recheck"] = {"budget": budget, "run": run}
    return res


def _recheck_shape() -> tuple[list[dict], list[dict]]:
    """A shape whose budgets failed (a) at first (x ckpt+hfo's 0.34 s, or ckpt's 0.33 s where that fits), and their
    re-check runs: plan@50 passes on it, plan@55 fails it again (and a step of its run 4 goes over the budget),
    plan@60 has one run of four (the time ran out), plan@70's run 2 crashed; plan@65 passed first."""
    results = _simple() + [
        _result(zoo.PROBE_MODE, "infeasible", minimum_bytes=int(19 * GIB)),
        _plan(50, 0.40, [19, 19, 19, 19]),  # 20 GiB: ckpt+hfo fits (0.34 s): 1.176x
        _plan(55, 0.40, [20, 20, 21, 21]),  # 22 GiB: ckpt fits too (0.33 s): 1.212x
        _plan(60, 0.36, [20, 20, 22, 22]),
        _plan(65, 0.30, [20, 20, 22, 22]),  # 0.909x: no re-check
        _plan(70, 0.36, [20, 20, 22, 22]),
    ]
    rechecks = [
        # the steps are pooled per side: the plan's lower quartile 0.335 s (its first run's), the reference's
        # 0.330 s (its second's): 1.015x, which neither pair alone (0.985x, 1.212x) nor a median would give
        _rerun("plan@50", 1, "ckpt+hfo", [0.34] * 6),
        _rerun("plan@50", 2, "plan@50", [0.335] * 6),
        _rerun("plan@50", 3, "ckpt+hfo", [0.33] * 6),
        _rerun("plan@50", 4, "plan@50", [0.40] * 6),
        _rerun("plan@55", 1, "ckpt", [0.33] * 6),
        _rerun("plan@55", 2, "plan@55", [0.36] * 6),
        _rerun("plan@55", 3, "ckpt", [0.33] * 6),
        _rerun("plan@55", 4, "plan@55", [0.36] * 6, peaks=[20, 22.5] + [20] * 8),
        _rerun("plan@60", 1, "ckpt", [0.33] * 6),
        _rerun("plan@70", 1, "ckpt", [0.33] * 6),
        {
            "scenario": "M36",
            "mode": "plan@70",
            "status": "crashed",
            "error": "crashed (exit 3)",
            "notes": [],
            "recheck": {"budget": "plan@70", "run": 2},
        },  # fmt: skip
    ]
    return results, rechecks


def test_recheck_runs_ref_and_plan_alternately_after_the_budgets_that_failed_a():
    results, rechecks = _recheck_shape()
    assert zoo.next_recheck(results, [], 0) is None  # --recheck-pairs 0: no re-check
    first = zoo.next_recheck(results, [], 2)
    assert (first.budget, first.run, first.modes_left) == ("plan@50", 1, ["ckpt+hfo", "plan@50"] * 2)
    assert first.tag == {"budget": "plan@50", "run": 1, "check": "a"}
    assert zoo.next_recheck(results, [], 3).modes_left == ["ckpt+hfo", "plan@50"] * 3
    # plan@50's and plan@55's re-checks done, plan@60's first run done: its second is next
    task = zoo.next_recheck(results, rechecks[:9], 2)
    assert (task.budget, task.run, task.modes_left) == ("plan@60", 2, ["plan@60", "ckpt", "plan@60"])
    # plan@70's re-check stops at its crashed run (it cannot be judged); plan@65 passed, so nothing is left
    assert zoo.next_recheck(results, rechecks + [_rerun("plan@60", k, m, [0.33] * 6) for k, m in
                                                 ((2, "plan@60"), (3, "ckpt"), (4, "plan@60"))], 2) is None  # fmt: skip


def test_recheck_judges_a_again_on_the_pooled_steps_of_each_side():
    from harness import lower_quartile

    results, rechecks = _recheck_shape()
    rows = {row["mode"]: row for row in zoo.budget_checks(results, rechecks, 2)}
    r50, r55, r60, r65, r70 = (rows[f"plan@{p}"] for p in (50, 55, 60, 65, 70))
    # plan@50: failed at first, passes on the re-check; the first ratio is kept
    assert (r50["a_first"], r50["a"], r50["recheck"]["state"]) == (False, True, "judged")
    assert r50["x_fastest"] == pytest.approx(0.40 / 0.34)
    assert r50["recheck"]["plan_s"] == pytest.approx(lower_quartile([0.335] * 6 + [0.40] * 6)) == pytest.approx(0.335)
    assert r50["recheck"]["ref_s"] == pytest.approx(0.33) and r50["recheck"]["x"] == pytest.approx(0.335 / 0.33)
    assert r50["recheck"]["ref_spread"] == pytest.approx(0.34 / 0.33 - 1)  # the reference's runs: 0.34 and 0.33 s
    assert [run["mode"] for run in r50["recheck"]["runs"]] == ["ckpt+hfo", "plan@50"] * 2
    # plan@55: fails both; its re-check's run 4 went over the budget at its 2nd step: (b) fails too
    assert (r55["a_first"], r55["a"], r55["recheck"]["x"]) == (False, False, pytest.approx(0.36 / 0.33))
    assert r55["steps_over"] == [] and r55["recheck_steps_over"] == {4: [2]} and r55["b"] is False
    assert r55["peak_all_bytes"] == int(22.5 * GIB)
    # plan@60: one run of four (the time ran out): the first verdict stays
    assert (r60["a"], r60["recheck"]["state"]) == (False, "time") and "x" not in r60["recheck"]
    # plan@70: a run crashed: not judged, the first verdict stays, and the crash is a mode that did not finish
    assert (r70["a"], r70["recheck"]["state"]) == (False, "incomplete") and "crashed" in r70["recheck"]["why"]
    assert (r65["a"], r65["recheck"]) == (True, None)  # passed at first: not re-checked
    assert all(row["b"] for row in (r50, r60, r65, r70))
    summary = zoo.shape_summary(results, REFERENCE, rechecks, 2)
    assert summary["checks"]["a"] == {"pass": 2, "fail": ["plan@55", "plan@60", "plan@70"], "n/a": 0, "pass_first": 1}
    assert summary["checks"]["b"]["fail"] == ["plan@55"]
    assert summary["did_not_finish"] == ["plan@70 (re-check run 2 of plan@70: crashed)"] and not summary["passed"]
    # without a re-check (--recheck-pairs 0, or results from before it) the first verdicts stand
    plain = {row["mode"]: row for row in zoo.budget_checks(results, rechecks, 0)}
    assert plain["plan@50"]["a"] is False and plain["plan@55"]["b"] is True and plain["plan@50"]["recheck"] is None


def test_the_report_shows_the_first_ratio_and_the_rechecks():
    results, rechecks = _recheck_shape()
    summary = zoo.shape_summary(results, REFERENCE, rechecks, 2)
    text = "\n".join(zoo.shape_markdown(summary))
    assert "| x it | (a) re-check, ABAB: plan / ref (p25 of the runs' steps) | (a) <= 1.02x |" in text
    plan50 = "| 1.176 | 0.335 / 0.330 s = 1.015x (the reference's runs 3% apart) | yes (re-check) | 19.00 GiB | none |"
    plan55 = (
        "| 1.212 | 0.360 / 0.330 s = 1.091x (the reference's runs 0% apart) | **NO** (re-check) | 22.50 GiB | none; "
    )
    assert plan50 in text and plan55 + "re-check run 4: [2] |" in text
    assert "| 1.091 | not re-checked (time) | **NO** |" in text  # plan@60
    assert "| 1.091 | not judged (plan@70 run 2: crashed) | **NO** |" in text
    assert "| 0.909 |  | yes |" in text  # plan@65
    assert "- (a) re-check, ABAB: after the shape's sweep, each budget whose (a) failed runs again" in text
    assert (
        "- plan@50: first 1.176x ckpt+hfo; re-check runs (s/step, p25 of each): ckpt+hfo 0.340, plan@50 0.335, "
        "ckpt+hfo 0.330, plan@50 0.400; 0.335 / 0.330 s = 1.015x (the reference's runs 3% apart): (a) yes" in text
    )
    assert (
        "(a) step <= 1.02x the fastest simple plan that fits: 2 passed (1 first time, 1 on re-check), 3 failed "
        "(plan@55: 0.360 / 0.330 s = 1.091x (the reference's runs 0% apart); plan@60: not re-checked (time); "
        "plan@70: not judged (plan@70 run 2: crashed)), 0 n/a" in text
    )
    # without a re-check, the table is the one from before it
    assert "re-check" not in "\n".join(zoo.shape_markdown(zoo.shape_summary(results, REFERENCE)))


def test_a_refused_budget_that_c_fails_reruns_the_simple_plans_that_fitted_it_and_is_judged_on_their_reruns():
    """A simple plan's peak moves between its runs by the allocator's blocks (ckpt+hfo on gemma2-2b-2k: 25,724,275,712
    and 25,731,091,456 bytes, H200): a budget at one run's peak, refused, is judged again once each simple plan that
    fitted it has run once more, built afresh. A re-run over the budget did not meet it; one that did not finish
    judges nothing."""
    refused = _plan(50, 0.3, [], status="infeasible", error="below the smallest peak this step can reach")
    results = [*_simple(), refused]  # plan@50's budget is 20 GiB: ckpt+hfo's peak, which fits it
    assert zoo.budget_checks(results)[0]["c"] is False
    task = zoo.next_recheck(results, [], 2)
    assert (task.budget, task.run, task.modes_left, task.check) == ("plan@50", 1, ["ckpt+hfo"], "c")
    assert task.tag == {"budget": "plan@50", "run": 1, "check": "c"}
    assert zoo.next_recheck(results, [], 0) is None  # with re-checks off, none

    def rerun(peak_gib: float | None) -> dict:
        res = _result("ckpt+hfo", status="ok" if peak_gib else "crashed", peaks=[peak_gib] * 2 if peak_gib else None)
        res["recheck"] = task.tag
        return res

    over = rerun(20 + 6.5 / 1024)  # 6.5 MiB over, as on the H200
    assert zoo.next_recheck(results, [over], 2) is None
    row = zoo.budget_checks(results, [over], 2)[0]
    assert row["c"] is True and row["c_recheck"] == {"ckpt+hfo": int((20 + 6.5 / 1024) * GIB)}
    summary = zoo.shape_summary(results, REFERENCE, [over], 2)
    text = "\n".join(zoo.shape_markdown(summary))
    rerun_text = f"re-run: ckpt+hfo {int((20 + 6.5 / 1024) * GIB):,} bytes (budget {20 * GIB:,})"
    assert f"| yes ({rerun_text}) |" in text
    assert f"- plan@50: refused while ckpt+hfo fitted it; (c)'s {rerun_text}: (c) yes" in text
    assert summary["checks"]["c"]["fail"] == []
    for again in (rerun(20), rerun(None)):  # met the budget again, or did not finish: (c) still fails
        row = zoo.budget_checks(results, [again], 2)[0]
        assert row["c"] is False, again["status"]
    text = "\n".join(zoo.shape_markdown(zoo.shape_summary(results, REFERENCE, [rerun(20)], 2)))
    assert f"(plan@50: ckpt+hfo peaked at {20 * GIB:,} bytes; re-run: ckpt+hfo {20 * GIB:,} bytes" in text
    # without re-checks (--recheck-pairs 0, or results from before (c) had one) the first verdict stands
    assert zoo.budget_checks(results, [over], 0)[0]["c"] is False


# ------------------------------------------------------------------------------------------- the script, on CPU

FAST = ["--device", "cpu", "--grid-step", "20", "--plan-steps", "3+1", "--simple-steps", "1+1"]
FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _shape_json(out: Path, shape: str) -> dict:
    (path,) = out.glob(f"*-zoo-{shape}.json")
    return json.loads(path.read_text())


def test_cpu_sweep_end_to_end(tmp_path, monkeypatch):
    bundle_dir = tmp_path / "OUT"
    monkeypatch.setenv("OUT", str(bundle_dir))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # inherited by the children
    out = tmp_path / "zoo"
    assert zoo_script.main([*FAST, "--out", str(out)]) == 0
    for shape in ("tiny", "tiny-lora-plain"):
        data = _shape_json(out, shape)
        results = {r["mode"]: r for r in data["results"]}
        assert [r["mode"] for r in data["results"]][:4] == ["none", "ckpt", "ckpt+hfo", zoo.PROBE_MODE]
        assert all(results[m]["status"] == "ok" for m in zoo.SIMPLE_MODES)
        probe = results[zoo.PROBE_MODE]
        assert probe["status"] == "infeasible" and "smallest" in probe["error"] and probe["minimum_bytes"] > 0
        budgets = [m for m in results if m.startswith("plan@") and m != zoo.PROBE_MODE]
        # the grid (every 20% of the reference) from the first budget at or above the named minimum
        minimum_percent = 100 * probe["minimum_bytes"] / 2_500_000
        assert budgets == [f"plan@{p}" for p in (20, 40, 60, 80) if p >= minimum_percent]
        assert all(results[m]["status"] == "ok" and results[m]["plan"]["code"] for m in budgets)
        # the closed loop's steps, whole, for replaying a plan offline: each with the peak its prediction counted
        steps = [step for m in budgets for samples in results[m]["plan"]["measurements"].values() for step in samples]
        assert steps and all("predicted_peak_bytes" in step and "peak_exact" in step for step in steps)
        # every first-step loss equal bitwise: the same weights and data in every mode, offloading exact
        assert len({r["loss1_bits"] for r in results.values() if r.get("loss1_bits")}) == 1
        summary = data["meta"]["zoo"]
        assert data["meta"]["zoo_complete"] and summary["passed"] and not summary["did_not_finish"]
        assert [row["mode"] for row in summary["rows"]] == budgets and all(row["c"] for row in summary["rows"])
        md = next(out.glob(f"*-zoo-{shape}.md")).read_text()
        assert "### The zoo's checks per budget" in md and "### Memory-budget plans" in md
    (summary_md,) = out.glob("*-zoo.md")
    text = summary_md.read_text()
    assert "| tiny | " in text and "| tiny-lora-plain | " in text and "Not run (time budget): none." in text
    # the allocator's settings move allocated peaks (a block up to 1 MiB over the request by default): both reports say
    assert "- CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert "- CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in md
    # $OUT gets three files: the archive of everything, the summary and the log
    assert sorted(p.name for p in bundle_dir.iterdir()) == sorted(
        [f"{summary_md.stem}.tar.gz", summary_md.name, f"{summary_md.stem}.log"]
    )
    with tarfile.open(bundle_dir / f"{summary_md.stem}.tar.gz") as tar:
        names = [Path(n).name for n in tar.getnames()]
    assert f"{summary_md.stem}-tiny.json" in names and f"{summary_md.stem}.log" in names
    assert all(FILE_NAME.match(p.name) for p in [*out.iterdir(), *bundle_dir.iterdir()]) and all(
        FILE_NAME.match(n) for n in names
    )
    # --report-only makes the summary again from the JSON files alone (an extracted archive)
    summary_md.unlink()
    assert zoo_script.main(["--device", "cpu", "--out", str(out), "--report-only", "--no-charts"]) == 0
    assert summary_md.read_text() == text
    # results no run is working on (committed ones, an extracted archive) are never cleared
    (out / zoo_script.PROGRESS).unlink()
    assert zoo_script.main([*FAST, "--out", str(out)]) == 2 and summary_md.exists()


def test_a_later_call_goes_on_in_the_extracted_archive_of_the_last(tmp_path, monkeypatch, capsys):
    """On one GPU the whole zoo takes several 10-minute calls, over more than one day: the archive a call brings back,
    extracted and carried to the next call, is where that call goes on. The shapes done stay as they are, the others
    are swept into the same files (the first call's stem, whatever the date), and the log goes on."""
    bundle_dir = tmp_path / "OUT"
    monkeypatch.setenv("OUT", str(bundle_dir))
    assert zoo_script.main([*FAST, "--shapes", "tiny", "--out", str(tmp_path / "first"), "--no-charts"]) == 0
    (archive,) = bundle_dir.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "carried", filter="data")
    (folder,) = (tmp_path / "carried").iterdir()
    stem = folder.name
    assert not (folder / zoo_script.PROGRESS).exists()  # no run's working folder: a run without --resume keeps off it
    tiny = _shape_json(folder, "tiny")

    class NextYear(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2031, 1, 1, tzinfo=tz)

    monkeypatch.setattr(zoo_script.datetime, "datetime", NextYear)
    both = ["--shapes", "tiny,tiny-lora-plain", "--out", str(folder), "--resume", "--no-charts"]
    assert zoo_script.main([*FAST, *both]) == 0
    assert sorted(p.name for p in folder.glob("*-zoo-*.json")) == [f"{stem}-tiny-lora-plain.json", f"{stem}-tiny.json"]
    assert _shape_json(folder, "tiny")["results"] == tiny["results"]  # not swept again
    assert _shape_json(folder, "tiny-lora-plain")["meta"]["zoo_complete"]
    log = (folder / zoo_script.LIVE_LOG).read_text()
    assert "] tiny none: " in log and "] tiny-lora-plain none: " in log  # the first call's lines, then the second's
    with tarfile.open(bundle_dir / f"{stem}.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {f"{stem}-tiny.json", f"{stem}-tiny-lora-plain.json", zoo_script.BUNDLED_PROGRESS} <= names
    # a sweep measures one library: going on with another (a commit to hf_offload in between) is refused
    progress = json.loads((folder / zoo_script.PROGRESS).read_text())
    progress["env"]["versions"]["hf_offload-src"] = "0" * 12
    (folder / zoo_script.PROGRESS).write_text(json.dumps(progress))
    assert zoo_script.main([*FAST, *both]) == 2
    assert "ran hf_offload-src 000000000000, this working tree holds " in capsys.readouterr().err


def test_sweeps_on_two_gpus_at_once_make_one_summary(tmp_path, monkeypatch):
    """--gpus 2: each shape swept in a run of its own on its own GPU, at the same time, in <out>/gpu<i>; their shape
    files gathered in --out, one summary naming every sweep's command, and one bundle."""
    bundle_dir = tmp_path / "OUT"
    monkeypatch.setenv("OUT", str(bundle_dir))
    out = tmp_path / "zoo"
    assert zoo_script.main([*FAST, "--gpus", "2", "--out", str(out), "--no-charts"]) == 0
    for index, shape in enumerate(("tiny", "tiny-lora-plain")):
        (swept,) = (out / f"gpu{index}").glob("*-zoo-*.json")
        assert swept.name.endswith(f"-zoo-{shape}.json")
        data = _shape_json(out, shape)
        assert data["meta"]["zoo_complete"] and data["meta"]["zoo"]["passed"]
        assert f"--shapes {shape} --out {out / f'gpu{index}'}" in data["meta"]["command"]
        assert "--gpus" not in data["meta"]["command"]
    (summary_md,) = out.glob("*-zoo.md")
    text = summary_md.read_text()
    assert "| tiny | " in text and "| tiny-lora-plain | " in text and text.count("--shapes tiny") == 2
    assert sorted(p.name for p in bundle_dir.iterdir()) == sorted(
        [f"{summary_md.stem}.tar.gz", summary_md.name, f"{summary_md.stem}.log"]
    )
    log = (bundle_dir / f"{summary_md.stem}.log").read_text()
    assert "2 sweeps at once: GPU 0: tiny; GPU 1: tiny-lora-plain" in log and "GPU 0: exit 0; GPU 1: exit 0" in log
    assert zoo_script.main([*FAST, "--gpus", "2", "--out", str(out), "--no-charts", "--shapes", "tiny"]) == 0  # again
    assert [p.name.rsplit("-zoo-", 1)[1] for p in out.glob("*-zoo-*.json")] == ["tiny.json"]  # the last run's only


def test_time_budget_stops_cleanly(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "zoo"
    started = time.time()
    zoo_script.main(["--device", "cpu", "--max-minutes", "0.2", "--out", str(out), "--no-charts"])
    assert time.time() - started < 0.2 * 60 + 12  # the child stops itself before the limit; the parent then ends
    (summary_md,) = out.glob("*-zoo.md")
    text = summary_md.read_text()
    # the default grid (every 5%) on two shapes does not fit in 12 s: what ran is partial, the rest not run
    assert "**partial**" in text or "Not run (time budget): tiny-lora-plain" in text
    for path in out.glob("*-zoo-*.json"):
        data = json.loads(path.read_text())
        assert all(r["status"] in ("ok", "infeasible") for r in data["results"])


def test_a_child_that_dies_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setenv(zoo_script.CRASH_ENV, "tiny:ckpt")
    out = tmp_path / "zoo"
    assert zoo_script.main([*FAST, "--shapes", "tiny", "--out", str(out), "--no-charts"]) == 1  # the crash fails it
    data = _shape_json(out, "tiny")
    results = {r["mode"]: r for r in data["results"]}
    assert results["ckpt"]["status"] == "crashed" and "exit 3" in results["ckpt"]["error"]
    assert results["ckpt+hfo"]["status"] == "ok" and results[zoo.PROBE_MODE]["status"] == "infeasible"
    assert data["meta"]["zoo_complete"] and data["meta"]["zoo"]["did_not_finish"] == ["ckpt (crashed)"]


def test_report_only_draws_a_chart_and_checks_made_up_gpu_results(tmp_path, monkeypatch):
    """The summary and the chart from a shape's files alone, with peaks as the GPU measures them."""
    monkeypatch.delenv("OUT", raising=False)
    spec = {
        "date": "2026-01-01",
        "command": "python benchmarks/zoo.py",
        "seed": 1,
        "device": "cuda",
        "simple_steps": [2, 3],
        "plan_steps": [6, 3],
        "grid_step": 5,
        "top": 95,
        "recheck_pairs": 2,
        "cpu_reference_bytes": None,
    }
    env = {"device_name": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0"}}  # fmt: skip
    results = _simple() + [
        _result(zoo.PROBE_MODE, "infeasible", minimum_bytes=int(19 * GIB)),
        _plan(50, 0.345, [20.1, 19.9, 19.0, 19.0]),
        _plan(55, 0.30, [20, 20, 21, 21.9]),
    ]
    # what plan@55's closed loop measured and learned, as the worker records it from the library's controller
    results[-1]["plan"] |= {
        "measured_s": {"CCCC": [None, 0.331], "cccc": [0.3, 0.305], "CCKK": [0.302, 0.3, 0.301]},
        "learned": "the model's times x0.800, 1.19 ms per layer that offloads its input, 0.21 ms per layer that "
        "offloads its saved tensors (from 'cccc', 'CCCC', 'CCKK')",
        "profile": {"peak_correction_bytes": 2_129_920, "head_reload_hidden_bytes": 0},
    }
    meta = zoo_script.shape_meta(spec, env, "M36")
    meta["modes"] = [r["mode"] for r in results]
    files = zoo_script.ReportFiles.at(tmp_path, "2026-01-01-nvidia-h100-80gb-hbm3-zoo-M36")
    zoo_script.write_shape(files, meta, env, results, [], final=True)
    files.md.unlink()  # --report-only writes each shape's report again, from its JSON
    assert zoo_script.main(["--report-only", "--out", str(tmp_path), "--shapes", "M36,llama3.2-1b"]) == 1  # a FAIL
    assert (
        "the closed loop measured `CCCC` 0.331 s (1 step), `cccc` 0.300 s (2 steps), `CCKK` 0.300 s (3 steps); it "
        "learned the model's times x0.800, 1.19 ms per layer that offloads its input" in files.md.read_text()
    )
    assert "of the step model's peaks: every point raised by 2,129,920 bytes" in files.md.read_text()
    assert (tmp_path / "2026-01-01-nvidia-h100-80gb-hbm3-zoo-M36-pareto.png").stat().st_size > 10_000
    text = (tmp_path / "2026-01-01-nvidia-h100-80gb-hbm3-zoo.md").read_text()
    assert (
        "| M36 | Qwen2.5-3B shape: " in text and "| 0.300, 40.0 | 0.330, 21.3 | 0.340, 20.0 | 19.00 GiB (48%)" in text
    )
    assert "| 2/2 | 1/2 **FAIL** | 2/2 | **FAIL** |" in text  # (b): plan@50's first step went over its budget
    assert "Not run (time budget): llama3.2-1b." in text


# ----------------------------------------------------------- the child's re-check, on made-up step times and peaks

MIB = 2**20
# The made-up shape's step seconds, one entry a run in the order run (an extra run finds none and fails the test):
# plan@50 fails (a) at first against ckpt+hfo (1.23x) and passes its re-check; plan@60 fails both against ckpt.
STEP_S = {
    "none": [0.010],
    "ckpt": [0.012] * 3,
    "ckpt+hfo": [0.013] * 3,
    "plan@50": [0.016, 0.013, 0.013],
    "plan@60": [0.015] * 3,
    "plan@80": [0.011],
}
PEAK_MIB = {"none": 100, "ckpt": 60, "ckpt+hfo": 50}  # a plan's: its budget less 1 MiB


class SweepClock:
    """The zoo's clock (``time`` in benchmarks/zoo.py) in a test: it moves only when a mode runs, MODE_S each, so what
    the child's time allows does not depend on how busy the machine running the tests is (on 2 busy cores the
    sweep's own work took 5 s of a 7 s deadline)."""

    MODE_S = 0.5
    strftime = staticmethod(time.strftime)  # the log's clock stays the real one

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


class MadeUpWorker:
    """``harness.worker.run_mode_safely`` for the child's loop on CPU: each mode's result at once, its peaks and step
    times made up (the GPU's, scaled down), so that (a) is judged; records what it was asked to run, and moves
    ``clock`` as a mode's run would."""

    def __init__(self, clock: SweepClock) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.models: list[object] = []  # the shared model each run was given (None: a model of its own)
        self.step_s = {mode: list(times) for mode, times in STEP_S.items()}
        self.clock = clock

    def __call__(self, spec: dict, shared: object = None) -> dict:
        mode, warmup, steps = spec["mode"], spec["warmup"], spec["steps"]
        self.calls.append((mode, warmup, steps))
        self.models.append(shared)
        self.clock.now += SweepClock.MODE_S
        res = {"scenario": spec["scenario"], "mode": mode, "status": "ok", "notes": [], "wall_s": 2.0}
        if mode == zoo.PROBE_MODE:  # the named minimum: ckpt+hfo's peak, 50% of none's
            return res | {"status": "infeasible", "error": "below the smallest", "minimum_bytes": 50 * MIB}
        budget = spec["memory_budget"]["option"] if spec["memory_budget"] else None
        peak = budget - MIB if budget else PEAK_MIB[mode] * MIB
        step_s = self.step_s[mode].pop(0)
        res["per_step"] = [{"step": i + 1, "s": step_s, "peak_bytes": peak} for i in range(warmup + steps)]
        res.update(times=[step_s] * steps, median_s=step_s, p25_s=step_s, warmup_steps=warmup)
        res.update(peak_bytes=peak, peak_gib=peak / GIB, peak_all_gib=peak / GIB)
        if budget:
            res["plan"] = {"code": "CK", "budget_bytes": budget, "predicted_peak_bytes": peak,
                           "predicted_step_s": step_s}  # fmt: skip
        return res


def _sweep(out: Path, seconds: float, clock: SweepClock):
    """The zoo's child for the shape tiny in ``out``, with ``seconds`` left on ``clock`` (its own time estimates
    decide)."""
    spec = {
        "out": str(out), "device": "cpu", "seed": 1, "bw_bytes": 0, "simple_steps": [1, 2], "plan_steps": [3, 2],
        "grid_step": 20, "top": 95, "recheck_pairs": 2, "cpu_reference_bytes": 2_500_000, "date": "2026-01-01",
        "command": "python benchmarks/zoo.py", "shapes": ["tiny"], "deadline": 0.0,
    }  # fmt: skip
    sweep = zoo_script.Sweep(spec)
    sweep.spec["deadline"] = clock.time() + seconds
    return sweep


def test_the_child_rechecks_within_its_time_and_goes_on_with_resume(tmp_path, monkeypatch):
    """A shape's sweep, then its re-checks; the first child's time is enough for the sweep (each mode is estimated
    at 2-5 s of overhead) and not for a re-check (four runs, 8 s): it stops, and the report says so. The next
    child (--resume) runs the re-checks, ABAB, with each kind's steps; the verdicts and the files follow."""
    import harness.worker
    import torch

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the child's setting, not this process's
    clock = SweepClock()
    monkeypatch.setattr(zoo_script, "time", clock)
    worker = MadeUpWorker(clock)
    monkeypatch.setattr(harness.worker, "run_mode_safely", worker)
    out = tmp_path / "zoo"
    out.mkdir()
    sweep = _sweep(out, 7.0, clock)
    sweep.run()
    sweep_order = ["none", "ckpt", "ckpt+hfo", zoo.PROBE_MODE, "plan@50", "plan@60", "plan@80"]
    assert [mode for mode, _, _ in worker.calls] == sweep_order
    assert worker.models == [None] * len(sweep_order)  # the sweep's runs build their own
    data = _shape_json(out, "tiny")
    assert data["rechecks"] == [] and not data["meta"]["zoo_complete"]
    rows = {row["mode"]: row for row in data["meta"]["zoo"]["rows"]}
    assert [rows[m]["recheck"]["state"] for m in ("plan@50", "plan@60")] == ["time", "time"]
    assert rows["plan@80"]["recheck"] is None and rows["plan@80"]["a"] is True
    (summary_md,) = out.glob("*-zoo.md")
    assert "| 1.231 | not re-checked (time) | **NO** |" in summary_md.read_text()

    worker.calls.clear()
    worker.models.clear()
    _sweep(out, 600.0, clock).run()
    assert worker.calls == [
        ("ckpt+hfo", 1, 2), ("plan@50", 3, 2), ("ckpt+hfo", 1, 2), ("plan@50", 3, 2),
        ("ckpt", 1, 2), ("plan@60", 3, 2), ("ckpt", 1, 2), ("plan@60", 3, 2),
    ]  # fmt: skip
    # each budget's re-check runs on one model of its own, shared by its four runs
    assert all(m is not None for m in worker.models) and len({id(m) for m in worker.models}) == 2
    assert len({id(m) for m in worker.models[:4]}) == 1 and worker.models[0] is not worker.models[4]
    data = _shape_json(out, "tiny")
    assert [r["mode"] for r in data["results"]] == sweep_order == data["meta"]["modes"]  # one result a mode
    assert [(r["mode"], r["recheck"]["budget"], r["recheck"]["run"]) for r in data["rechecks"]][:2] == [
        ("ckpt+hfo", "plan@50", 1), ("plan@50", "plan@50", 2)
    ]  # fmt: skip
    assert data["meta"]["zoo_complete"] and data["meta"]["zoo_settings"]["recheck_pairs"] == 2
    summary = data["meta"]["zoo"]
    assert summary["checks"]["a"] == {"pass": 2, "fail": ["plan@60"], "n/a": 0, "pass_first": 1}
    shape_md = next(out.glob("*-zoo-tiny.md")).read_text()
    summary_text = summary_md.read_text()
    for text in (shape_md, summary_text):
        assert "| 1.231 | 0.013 / 0.013 s = 1.000x (the reference's runs 0% apart) | yes (re-check) |" in text
        assert "| 1.250 | 0.015 / 0.012 s = 1.250x (the reference's runs 0% apart) | **NO** (re-check) |" in text
    assert "| 2/3 (1 first time) **FAIL** |" in summary_text
    assert summary_text.count("- (a) re-check, ABAB: after the shape's sweep") == 1  # in the summary's head
    # --report-only makes the same summary from the JSON files
    summary_md.unlink()
    report_only = ["--device", "cpu", "--shapes", "tiny", "--out", str(out), "--report-only", "--no-charts"]
    assert zoo_script.main(report_only) == 1  # plan@60 fails
    assert summary_md.read_text() == summary_text


def test_the_child_reruns_the_simple_plan_a_refused_budget_fitted_on_a_model_of_its_own(tmp_path, monkeypatch):
    """plan@50's budget is ckpt+hfo's peak and the library refuses it: after the sweep and (a)'s re-checks, the child
    runs ckpt+hfo once more, built afresh as in the sweep; its re-run peaks 1 MiB higher, so (c) passes on it."""
    import harness.worker
    import torch

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    clock = SweepClock()
    monkeypatch.setattr(zoo_script, "time", clock)

    class RefusingWorker(MadeUpWorker):
        def __call__(self, spec: dict, shared: object = None) -> dict:
            if spec["mode"] == "plan@50":
                self.calls.append((spec["mode"], spec["warmup"], spec["steps"]))
                self.models.append(shared)
                return {"scenario": spec["scenario"], "mode": "plan@50", "status": "infeasible", "notes": [],
                        "error": "below the smallest peak this step can reach", "wall_s": 2.0}  # fmt: skip
            res = super().__call__(spec, shared)
            if spec["mode"] == "ckpt+hfo" and [call[0] for call in self.calls].count("ckpt+hfo") == 2:
                for step in res["per_step"]:
                    step["peak_bytes"] += MIB
            return res

    worker = RefusingWorker(clock)
    monkeypatch.setattr(harness.worker, "run_mode_safely", worker)
    out = tmp_path / "zoo"
    out.mkdir()
    _sweep(out, 600.0, clock).run()
    assert [mode for mode, _, _ in worker.calls] == [
        "none", "ckpt", "ckpt+hfo", zoo.PROBE_MODE, "plan@50", "plan@60", "plan@80",
        "ckpt", "plan@60", "ckpt", "plan@60", "ckpt+hfo",
    ]  # fmt: skip
    assert worker.models[-1] is None and worker.models[-2] is not None  # (c)'s re-run builds its own model
    data = _shape_json(out, "tiny")
    assert data["rechecks"][-1]["recheck"] == {"budget": "plan@50", "run": 1, "check": "c"}
    rows = {row["mode"]: row for row in data["meta"]["zoo"]["rows"]}
    assert rows["plan@50"]["c"] is True and rows["plan@50"]["c_recheck"] == {"ckpt+hfo": 51 * MIB}
    assert data["meta"]["zoo"]["checks"]["c"]["fail"] == []


def test_a_recheck_run_that_dies_is_recorded_as_one(tmp_path, monkeypatch):
    """The parent records the run its child died in; a re-check's goes with the re-check runs, the sweep's results
    stay one a mode, and the next child leaves that budget (its re-check cannot be judged) for the next one."""
    monkeypatch.delenv("OUT", raising=False)
    results, rechecks = _recheck_shape()
    spec = {"date": "2026-01-01", "command": "python benchmarks/zoo.py", "seed": 1, "device": "cuda",
            "simple_steps": [2, 6], "plan_steps": [10, 6], "grid_step": 5, "top": 95, "recheck_pairs": 2,
            "cpu_reference_bytes": None}  # fmt: skip
    env = {"device_name": "NVIDIA H100 80GB HBM3"}
    meta = zoo_script.shape_meta(spec, env, "M36")
    meta["modes"] = [r["mode"] for r in results]
    files = zoo_script.ReportFiles.at(tmp_path, "2026-01-01-nvidia-h100-80gb-hbm3-zoo-M36")
    zoo_script.write_shape(files, meta, env, results, rechecks[:8], final=False)  # plan@50's and plan@55's
    running = {"shape": "M36", "mode": "ckpt", "started": time.time(), "recheck": {"budget": "plan@60", "run": 1}}
    progress = {"env": env, "stem": "2026-01-01-nvidia-h100-80gb-hbm3-zoo", "running": running}
    zoo_script.record_interrupted(tmp_path, spec, progress, "crashed", "crashed (exit 3) after 9 s")
    data = json.loads(files.json.read_text())
    assert [r["mode"] for r in data["results"]] == data["meta"]["modes"] == meta["modes"]
    assert len(data["rechecks"]) == 9 and data["rechecks"][-1]["recheck"] == {"budget": "plan@60", "run": 1}
    summary = data["meta"]["zoo"]
    assert summary["did_not_finish"] == ["ckpt (re-check run 1 of plan@60: crashed)"]
    assert next(row for row in summary["rows"] if row["mode"] == "plan@60")["recheck"]["state"] == "incomplete"
    task = zoo.next_recheck(data["results"], data["rechecks"], 2)
    assert (task.budget, task.run) == ("plan@70", 1)


def test_recheck_pairs_option():
    assert zoo_script.parse_args([]).recheck_pairs == zoo.RECHECK_PAIRS == 2
    assert zoo_script.parse_args(["--recheck-pairs", "0"]).recheck_pairs == 0
    with pytest.raises(SystemExit):
        zoo_script.parse_args(["--recheck-pairs", "-1"])


def test_modes_on_a_shared_model_take_turns_on_one_build():
    """A re-check's runs on one model (``harness.worker.SharedModel``), for real on CPU (the tiny shape, hf-offload's
    test mode): the first run builds it, the others reuse it with their own checkpointing and an optimizer without
    state, and each run's offload context (a memory plan's layer changes included) comes off the model when the run
    ends."""
    from harness.worker import SharedModel, run_mode_safely
    from transformers.modeling_layers import GradientCheckpointingLayer

    def spec(mode: str, budget: int | None = None) -> dict:
        memory_budget = {"option": budget, "percent": 80.0, "reference": "made up"} if budget else None
        return {"scenario": "tiny", "mode": mode, "device": "cpu", "seed": 1, "span": "step", "warmup": 3,
                "steps": 1, "hfo_opts": {"device_type": "cpu"}, "deterministic": False, "result_path": "",
                "profile_path": None, "memory_budget": memory_budget}  # fmt: skip

    shared = SharedModel()
    first = run_mode_safely(spec("ckpt+hfo"), shared)
    model = shared.built.model
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    forwards = [layer.forward for layer in layers]

    def our_hooks() -> list:
        hooks = [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
        return [h for h in hooks if getattr(h, "__module__", type(h).__module__).startswith("hf_offload")]

    assert first["status"] == "ok" and "shared_model" not in first and our_hooks() == []
    optimizer, state_at_steps = shared.built.optimizer, []
    original_step = optimizer.step

    def step(*args, **kwargs):
        state_at_steps.append(len(optimizer.state))
        return original_step(*args, **kwargs)

    optimizer.step = step
    plan = run_mode_safely(spec("plan@80", 2_000_000), shared)
    assert state_at_steps[0] == 0 < state_at_steps[1]  # the run began without the last run's optimizer state
    assert plan["status"] == "ok" and plan["shared_model"] and plan["plan"]["code"]
    assert shared.built.model is model and our_hooks() == [] and [layer.forward for layer in layers] == forwards
    plain = run_mode_safely(spec("none"), shared)
    assert plain["status"] == "ok" and plain["shared_model"]
    assert not any(layer.gradient_checkpointing for layer in layers)
    ckpt = run_mode_safely(spec("ckpt"), shared)
    assert ckpt["status"] == "ok" and all(layer.gradient_checkpointing for layer in layers)
    # every run reports what building the model told the first one
    assert plain["liger"] == first["liger"] and plain["optimizer"] == first["optimizer"]
    # the model trained on through the runs: each run's first step starts from the weights the last one left
    assert len({r["loss1"] for r in (first, plan, plain, ckpt)}) == 4
    compiled = run_mode_safely(spec("ckpt/regional"), shared)
    assert compiled["status"] == "error" and "shared model" in compiled["error"]
    other = run_mode_safely({**spec("ckpt"), "seed": 2}, shared)
    assert other["status"] == "error" and "built for" in other["error"]


def test_the_gradient_fingerprint_sums_the_bits_of_every_gradient():
    """``harness.measure.grad_fingerprint`` (summed on the host since it added 128 MiB to a device peak): the int64
    sums of each gradient's raw bits, folded in parameter order; one flipped bit changes it."""
    import torch
    from harness.measure import grad_fingerprint

    params = [torch.nn.Parameter(torch.randn(5, 7, dtype=dtype)) for dtype in (torch.bfloat16, torch.float32)]
    params.append(torch.nn.Parameter(torch.randn(3)))  # no gradient: skipped, but counted in the order
    for p in params[:2]:
        p.grad = torch.randn_like(p)
    expected = 0
    for k, p in enumerate(params[:2]):
        bits = p.grad.view({2: torch.int16, 4: torch.int32}[p.element_size()]).flatten().tolist()
        expected = (expected * 1000003 + (k + 1) * sum(bits)) % (1 << 64)
    assert grad_fingerprint(params) == f"{expected:016x}"
    params[1].grad.view(torch.int32)[0, 0] ^= 1
    assert grad_fingerprint(params) != f"{expected:016x}"


def test_a_steps_peaks_fold_the_counters_a_reset_inside_it_would_lose(monkeypatch):
    """``harness.measure.StepPeaks`` on a made-up CUDA counter: the memory budget resets the device's peak counters
    inside a step; the step's allocated, reserved and requested peaks are still the whole step's."""
    import torch
    from harness.measure import StepPeaks

    counters = {"allocated": 0, "reserved": 0, "requested": 0}

    def reset(device=None):
        counters.update(allocated=0, reserved=0, requested=0)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: counters["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_stats",
                        lambda device=None: {"requested_bytes.all.peak": counters["requested"]})  # fmt: skip
    peaks = StepPeaks(torch.device("cuda"))
    with peaks:
        peaks.start_step()
        counters.update(allocated=100, reserved=128, requested=90)
        torch.cuda.reset_peak_memory_stats()  # the memory budget's, mid-step
        counters.update(allocated=60, reserved=64, requested=59)
        assert peaks.step_peak() == (100, 128) and peaks.requested_peak() == 90
        peaks.start_step()
        counters.update(allocated=70, reserved=64, requested=69)
        assert peaks.step_peak() == (70, 64) and peaks.requested_peak() == 69
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})  # an allocator that counts no requests
    assert peaks.requested_peak() is None
