"""benchmarks/dynamic_padding.py (dynamic padding under a tight memory budget) on CPU: its check on steps made up by
hand, then the script end to end in its --device cpu mode (a tiny Llama, hf-offload's CPU test mode): the minimum read
from the library's refusal, the budget 1% above it, every step recorded with its plan and what the library said. Keeps
the GPU benchmark's logic from rotting between GPU runs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import dynamic_padding  # noqa: E402


def _step(step: int, tokens: int, peak: int | None, notice: bool = False) -> dict:
    return {"step": step, "tokens": tokens, "seq": tokens // 2, "s": tokens / 1000, "peak_bytes": peak, "plan": "CC",
            "plan_tokens": 1300, "warned": notice, "over_budget_notice": notice}  # fmt: skip


def test_a_step_over_the_budget_needs_a_notice_at_it_or_at_an_earlier_step_as_long():
    record = {
        "budget_bytes": 100,
        "middle_seq": 550,
        "settings": {"steps": 6, "first_steps": 1},
        "steps": [
            _step(1, 1000, 90),
            _step(2, 1200, 110, notice=True),  # over, and said so
            _step(3, 1100, 105),  # over, shorter than step 2: covered by its notice
            _step(4, 1300, 120),  # over, longer than any step with a notice: not covered
            _step(5, 1000, 95),
            _step(6, 1300, 101),  # covered by nothing either: step 4 said nothing
        ],
    }
    checks = dynamic_padding.check(record)
    assert checks["steps_over_budget"] == [2, 3, 4, 6]
    assert checks["steps_over_budget_without_notice"] == [4, 6]
    assert checks["budget_held_or_announced"] is False and checks["no_exception"]
    # After the first step: at most 550 a sequence, steps 3 and 5 (1.1 and 1.0 s); longer, steps 2, 4 and 6.
    assert checks["step_s_by_length"] == {"at_most_middle": {"median_s": 1.05, "steps": 2},
                                          "longer": {"median_s": 1.3, "steps": 3}}  # fmt: skip
    assert checks["plans_by_tokens"] == [(1300, "CC")]
    record["steps"][3]["over_budget_notice"] = True
    assert dynamic_padding.check(record)["budget_held_or_announced"] is True
    record["exception"] = {"step": 6}
    assert not dynamic_padding.check(record)["no_exception"]
    # without a peak counter (CPU) the budget cannot be checked
    for step in record["steps"]:
        step["peak_bytes"] = None
    assert dynamic_padding.check(record)["budget_held_or_announced"] is None


def test_cpu_run_end_to_end(tmp_path):
    assert dynamic_padding.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "dynamic_padding-cpu.json").read_text())
    settings = record["settings"]
    steps = record["steps"]
    assert len(steps) == settings["steps"] == 24 and "exception" not in record
    # the first steps at the middle length, the others within the range
    middle = (settings["min_seq"] + settings["max_seq"]) // 2
    assert [s["seq"] for s in steps[: settings["first_steps"]]] == [middle] * settings["first_steps"]
    assert all(settings["min_seq"] <= s["seq"] <= settings["max_seq"] for s in steps)
    assert len({s["seq"] for s in steps}) > 5
    # the minimum from the library's refusal, the budget 1% above it
    minimum = record["minimum"]
    assert minimum["how"] == "InfeasibleBudgetError.minimum_bytes" and "smallest" in minimum["message"]
    assert record["budget_bytes"] == math.ceil(minimum["minimum_bytes"] * 1.01)
    # profiled steps have no plan yet, the later ones one planned for at least their tokens
    assert steps[0]["plan"] is None and steps[1]["plan"] is None
    assert all(s["plan"] and s["plan_tokens"] >= s["tokens"] for s in steps[2:])
    # steps longer than the planned one that no plan fits say so: the first as a warning, the later ones in the log
    checks = record["checks"]
    noticed = checks["steps_with_over_budget_notice"]
    assert noticed and checks["steps_with_a_warning"][0] == noticed[0] and not checks["notices_naming_another_step"]
    assert all(steps[n - 1]["notice_forward"] == n for n in noticed)  # "at training forward N": the step itself
    assert all(steps[n - 1]["tokens"] > middle * settings["batch"] for n in noticed)
    assert checks["no_exception"] and checks["budget_held_or_announced"] is None  # no peak counter on CPU
    md = (tmp_path / "dynamic_padding-cpu.md").read_text()
    assert "verdict: **pass**" in md and md.count("\n| ") == len(steps) + 1
    assert f"- step time after the first {settings['first_steps']} steps (median): at most {middle} a sequence: " in md
    log = (tmp_path / "dynamic_padding-cpu.log").read_text()
    assert "finding the minimum" in log and f"step {len(steps)}:" in log
