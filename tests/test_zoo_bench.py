"""benchmarks/zoo.py (issue 20's shape zoo) on CPU: the sweep's logic and checks (benchmarks/harness/zoo.py) on
results made up by hand, then the script end to end in its --device cpu mode (tiny shapes, hf-offload's CPU test
mode), cut by its time budget, and with its child dying in a mode. Keeps the GPU sweep's logic from rotting between
GPU runs."""

from __future__ import annotations

import json
import re
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import zoo as zoo_script  # noqa: E402
from harness import zoo  # noqa: E402

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
    assert summary["checks"]["a"] == {"pass": 2, "fail": ["plan@60"], "n/a": 3}
    assert summary["checks"]["b"]["fail"] == ["plan@50", "plan@70"]
    assert summary["checks"]["c"]["fail"] == ["plan@65"]
    assert summary["did_not_finish"] == ["plan@70 (OOM)"] and not summary["passed"]
    assert summary["lowest_feasible_percent"] == 50 and summary["named_minimum_bytes"] == int(19 * GIB)
    text = "\n".join(zoo.shape_markdown(summary))
    assert "(c) no budget refused that a simple plan meets: 4 passed, 1 failed (plan@65), 1 n/a" in text
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


# ------------------------------------------------------------------------------------------- the script, on CPU

FAST = ["--device", "cpu", "--grid-step", "20", "--plan-steps", "3+1", "--simple-steps", "1+1"]
FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _shape_json(out: Path, shape: str) -> dict:
    (path,) = out.glob(f"*-zoo-{shape}.json")
    return json.loads(path.read_text())


def test_cpu_sweep_end_to_end(tmp_path, monkeypatch):
    bundle_dir = tmp_path / "OUT"
    monkeypatch.setenv("OUT", str(bundle_dir))
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
        "cpu_reference_bytes": None,
    }
    env = {"device_name": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0"}}  # fmt: skip
    results = _simple() + [
        _result(zoo.PROBE_MODE, "infeasible", minimum_bytes=int(19 * GIB)),
        _plan(50, 0.345, [20.1, 19.9, 19.0, 19.0]),
        _plan(55, 0.30, [20, 20, 21, 21.9]),
    ]
    meta = zoo_script.shape_meta(spec, env, "M36")
    meta["modes"] = [r["mode"] for r in results]
    files = zoo_script.ReportFiles.at(tmp_path, "2026-01-01-nvidia-h100-80gb-hbm3-zoo-M36")
    zoo_script.write_shape(files, meta, env, results, final=True)
    assert zoo_script.main(["--report-only", "--out", str(tmp_path), "--shapes", "M36,llama3.2-1b"]) == 1  # a FAIL
    assert (tmp_path / "2026-01-01-nvidia-h100-80gb-hbm3-zoo-M36-pareto.png").stat().st_size > 10_000
    text = (tmp_path / "2026-01-01-nvidia-h100-80gb-hbm3-zoo.md").read_text()
    assert (
        "| M36 | Qwen2.5-3B shape: " in text and "| 0.300, 40.0 | 0.330, 21.3 | 0.340, 20.0 | 19.00 GiB (48%)" in text
    )
    assert "| 2/2 | 1/2 **FAIL** | 2/2 | **FAIL** |" in text  # (b): plan@50's first step went over its budget
    assert "Not run (time budget): llama3.2-1b." in text
