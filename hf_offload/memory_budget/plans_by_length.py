"""The plans a run has made, by the step length each was made for: which one a step of a given length runs.

Steps of one run differ in length (dynamic padding, packing's last batch). The controller keeps each plan it makes
by its tokens; a step runs the plan kept for the shortest length at least its own (`PlansByLength.covering`), or a
plan made for its length step (`PlansByLength.length_for`) where that kept plan was made for much longer steps. Plans
made before what the controller knows changed (a generation: the memory held grew, the closed loop corrected a plan)
are dropped. Pure Python, like the rest of the planning.
"""

from __future__ import annotations

import dataclasses
import math

from .profile import StepProfile
from .simulate import Plan

__all__ = ["KeptPlan", "LENGTH_STEP", "PlansByLength", "SHORTEST_PLANNED_SHARE"]

# Plans are made for the first plan's tokens times a power of this (a step of 19%: a 2x range of shorter steps makes
# at most 4 more plans), and for no fewer tokens than this share of the first plan's.
LENGTH_STEP = 2**0.25
SHORTEST_PLANNED_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class KeptPlan:
    """A plan made during the run, with the profile it was made from and the generation of what the controller knew
    then."""

    plan: Plan
    profile: StepProfile
    generation: int


class PlansByLength:
    """The plans made so far, by the tokens each was made for; the first plan's tokens anchor the lengths."""

    def __init__(self) -> None:
        self.kept: dict[int, KeptPlan] = {}
        self.first_tokens = 0

    def keep(self, plan: Plan, profile: StepProfile, generation: int) -> None:
        """Keeps `plan` (made from `profile` in `generation`) for the steps of its length."""
        self.first_tokens = self.first_tokens or plan.tokens
        self.kept[plan.tokens] = KeptPlan(plan, profile, generation)

    def covering(self, tokens: int, generation: int, in_force: Plan | None) -> KeptPlan | None:
        """The plan kept for the shortest length at least `tokens`, None if none is that long. Drops the plans of
        other generations first, but the one in force."""
        self.kept = {length: kept for length, kept in self.kept.items()
                     if kept.generation == generation or kept.plan is in_force}  # fmt: skip
        covering = [kept for length, kept in self.kept.items() if length >= tokens]
        return min(covering, key=lambda candidate: candidate.plan.tokens, default=None)

    def length_for(self, tokens: int) -> int:
        """The length a plan for a step of `tokens` is made for: the first plan's tokens times the smallest power of
        `LENGTH_STEP` that reaches `tokens`, and no less than `SHORTEST_PLANNED_SHARE` of them (a plan for every
        length would re-plan, and re-apply, at almost every step of dynamic padding)."""
        anchor = self.first_tokens
        target = max(tokens, math.ceil(anchor * SHORTEST_PLANNED_SHARE))

        def length(power: int) -> int:  # rounded first: 32 * 2**-1 is 16.000000000000004 in floating point
            return math.ceil(round(anchor * LENGTH_STEP**power, 6))

        power = math.floor(math.log(target / anchor, LENGTH_STEP))
        while length(power) < target:
            power += 1
        return length(power)
