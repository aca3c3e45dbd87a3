"""Plans kept by the step length they were made for (`plans_by_length`): which one a step runs, and the lengths new
plans are made for."""

from __future__ import annotations

import math

from step_profiles import s1_profile

from hf_offload.memory_budget.plans_by_length import LENGTH_STEP, SHORTEST_PLANNED_SHARE, PlansByLength
from hf_offload.memory_budget.search import plan_of

FIRST = 16384


def plan_at(tokens: int, code: str = "C" * 16):
    profile = s1_profile().scaled(tokens)
    return plan_of(profile, code, 10**12), profile


def test_lengths_are_the_first_plans_tokens_times_a_power_of_the_length_step():
    plans = PlansByLength()
    plans.keep(*plan_at(FIRST), generation=0)
    assert plans.first_tokens == FIRST and plans.length_for(FIRST) == FIRST
    for tokens in (FIRST - 1, 12000, 9000, 8193, 8192, 5000, 20000):
        length = plans.length_for(tokens)
        assert length >= tokens
        power = round(math.log(length / FIRST, LENGTH_STEP))
        assert length == math.ceil(round(FIRST * LENGTH_STEP**power, 6)), (tokens, length)  # a whole power
        assert plans.length_for(tokens) < tokens * LENGTH_STEP + 1  # the smallest such power
    # No plan for fewer tokens than a share of the first plan's: very short steps share one.
    assert plans.length_for(10) == plans.length_for(math.ceil(FIRST * SHORTEST_PLANNED_SHARE)) == FIRST // 4


def test_a_step_runs_the_plan_kept_for_the_shortest_length_at_least_its_own():
    plans = PlansByLength()
    long_plan, long_profile = plan_at(FIRST)
    short_plan, short_profile = plan_at(8192, "c" * 16)
    plans.keep(long_plan, long_profile, generation=0)
    plans.keep(short_plan, short_profile, generation=0)
    assert plans.first_tokens == FIRST  # the first plan anchors the lengths
    assert plans.covering(8000, generation=0, in_force=long_plan).plan is short_plan
    assert plans.covering(8192, generation=0, in_force=long_plan).plan is short_plan
    assert plans.covering(9000, generation=0, in_force=long_plan).plan is long_plan
    assert plans.covering(FIRST + 1, generation=0, in_force=long_plan) is None  # longer than any: plan anew
    # What the controller knows changed: plans of an earlier generation go, but the one in force.
    assert plans.covering(8000, generation=1, in_force=long_plan).plan is long_plan
    assert list(plans.kept) == [FIRST]
