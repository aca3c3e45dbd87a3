"""When a plan may grow the pinned pool past its cap (`memory_budget/host.py`): only where no plan fits within it, or
only one that tiles where more host gives one that tiles less (nothing, or MLPs only); and how the plan says so."""

from __future__ import annotations

import re

import pytest
from step_profiles import long_profile, tiled_layer_profile

from hf_offload.memory_budget.host import choose_plan_with_host
from hf_offload.memory_budget.search import InfeasibleBudgetError, choose_plan
from hf_offload.memory_budget.simulate import Plan
from hf_offload.units import GIB, format_bytes


class Chooser:
    """`choose_plan` for one budget, counting the host caps it was asked to plan with."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes, self.caps = budget_bytes, []

    def __call__(self, profile) -> Plan:
        self.caps.append(profile.host_cap_bytes)
        return choose_plan(profile, self.budget_bytes)


def test_a_plan_that_fits_exactly_within_the_cap_is_chosen_without_asking_for_more() -> None:
    """More host would let more inputs go (a lower peak, a plan no faster): the cap holds."""
    choose = Chooser(120 * GIB)
    plan = choose_plan_with_host(choose, long_profile(host_cap_bytes=32 * GIB), 64 * GIB, 8 * GIB)
    assert choose.caps == [32 * GIB]
    assert plan.code == "C" * 16 + "c" * 15 + "K" and plan.host_cap_bytes == 32 * GIB
    assert (plan.host_default_cap_bytes, plan.host_growth) == (0, "")
    assert "Host:" not in plan.format_table()


def test_where_no_plan_fits_within_the_cap_the_plan_grows_the_pool() -> None:
    choose = Chooser(60 * GIB)
    with pytest.raises(InfeasibleBudgetError):
        choose(long_profile(host_cap_bytes=8 * GIB))
    plan = choose_plan_with_host(choose, long_profile(host_cap_bytes=8 * GIB), 64 * GIB, 8 * GIB)
    assert choose.caps[1:] == [8 * GIB, 64 * GIB]
    assert plan.host_cap_bytes == 64 * GIB and plan.host_default_cap_bytes == 8 * GIB
    assert plan.host_growth == "no plan fits the budget within it, down to the host memory reserve of 8.00 GiB"
    assert plan.predicted.host_bytes > 8 * GIB and plan.fits()


def test_where_only_a_tiled_plan_fits_within_the_cap_the_plan_grows_the_pool_for_an_exact_one() -> None:
    choose = Chooser(80 * GIB)
    assert choose(long_profile(host_cap_bytes=32 * GIB)).tiled_layers  # within the cap: not bitwise
    plan = choose_plan_with_host(choose, long_profile(host_cap_bytes=32 * GIB), 64 * GIB)
    assert plan.code == "C" * 31 + "K" and not plan.tiled_layers
    assert plan.host_growth == "no exact plan fits the budget within it"  # no reserve named: none given
    lines = plan.format_table().splitlines()
    assert lines[1] == "Host: 62.00 GiB pinned of a 64.00 GiB cap (default 32.00 GiB), grown because no exact plan " \
                       "fits the budget within it"  # fmt: skip
    assert Plan.from_dict(plan.to_dict()) == plan  # broadcast to the other ranks with its host


def test_a_plan_that_tiles_either_way_keeps_to_the_cap() -> None:
    choose = Chooser(70 * GIB)
    plan = choose_plan_with_host(choose, long_profile(host_cap_bytes=32 * GIB), 64 * GIB)
    assert choose.caps == [32 * GIB, 64 * GIB]
    assert plan.tiled_layers and plan.host_cap_bytes == 32 * GIB and plan.host_growth == ""


def test_a_cap_that_may_not_grow_is_planned_with_as_it_is() -> None:
    """The refusal names what the step lacks: here host memory, as with room on the host for every layer's
    tensors (the last cap planned with, never taken) a plan fits this budget."""
    choose = Chooser(60 * GIB)
    with pytest.raises(InfeasibleBudgetError) as error:
        choose_plan_with_host(choose, long_profile(host_cap_bytes=8 * GIB), 8 * GIB)
    assert choose.caps[0] == 8 * GIB and choose.caps[1] > 64 * GIB
    assert "pinned host pool grown" not in str(error.value)
    assert str(error.value).endswith("Host memory is what this step lacks: a plan fits the budget with 62.00 GiB of "
                                     "pinned host memory, where this host gives the pool 8.00 GiB.")  # fmt: skip
    assert choose_plan_with_host(Chooser(80 * GIB), long_profile(host_cap_bytes=32 * GIB), 0).tiled_layers


def test_a_budget_no_host_can_meet_is_refused_with_the_most_host_and_says_so() -> None:
    choose = Chooser(30 * GIB)
    with pytest.raises(InfeasibleBudgetError) as error:
        choose_plan_with_host(choose, long_profile(host_cap_bytes=8 * GIB), 64 * GIB, 8 * GIB)
    with pytest.raises(InfeasibleBudgetError) as within:
        choose(long_profile(host_cap_bytes=8 * GIB))
    assert error.value.minimum_bytes < within.value.minimum_bytes  # the most host's minimum: the lowest
    assert ("(That is with the pinned host pool grown from its cap of 8.00 GiB to 64.00 GiB, down to the host memory "
            "reserve of 8.00 GiB.)") in str(error.value)  # fmt: skip
    # More host lowers nothing: the GPU's memory is what this step lacks.
    assert str(error.value).endswith(f"GPU memory is what this step lacks: with any host, it needs at least "
                                     f"{format_bytes(error.value.minimum_bytes)}, as more host memory would lower "
                                     "nothing.")  # fmt: skip
    # Where the cap may not grow, the same budget names both: the GPU memory it needs with more host, and that host.
    with pytest.raises(InfeasibleBudgetError) as capped:
        choose_plan_with_host(Chooser(30 * GIB), long_profile(host_cap_bytes=8 * GIB), 8 * GIB)
    assert re.search(r"GPU memory is what this step lacks: with any host, it needs at least [\d.]+ GiB \(with "
                     r"[\d.]+ GiB of pinned host memory\)\.$", str(capped.value))  # fmt: skip
    lowest = error.value.lowest_plan  # what a later step that must run anyway runs on, with that host
    assert lowest.host_cap_bytes == 64 * GIB and lowest.host_default_cap_bytes == 8 * GIB
    assert lowest.host_growth == ("no plan fits the budget within it: the lowest-memory plan, over the budget, down "
                                  "to the host memory reserve of 8.00 GiB")  # fmt: skip


def test_where_only_layers_tiled_whole_fit_within_the_cap_the_plan_grows_the_pool_for_an_exact_one() -> None:
    """A layer tiled whole is no more exact than a tiled MLP: the host's room that avoids it is worth taking."""
    from hf_offload.memory_budget.search import plan_of

    def choose(profile) -> Plan:  # within the default cap only layers tiled whole fit; with more host, plain `C`
        code = "C" * 31 + "K" if profile.host_cap_bytes > 32 * GIB else "L" * 32
        return plan_of(profile, code, 200 * GIB)

    plan = choose_plan_with_host(choose, tiled_layer_profile(host_cap_bytes=32 * GIB), 64 * GIB)
    assert plan.code == "C" * 31 + "K" and plan.host_cap_bytes == 64 * GIB
    assert plan.host_growth == "no exact plan fits the budget within it"


def test_where_layers_are_tiled_whole_within_the_cap_the_pool_grows_for_a_plan_that_tiles_only_mlps() -> None:
    """Layers tiled whole are slower than tiled MLPs (on an H100, 8 of 32 layers tiled whole: 321 s a step, against
    286 s for MLPs tiled alone with more host): the host's room that trades the one for the other is worth taking;
    a plan tiled whole either way keeps to the cap."""
    from hf_offload.memory_budget.search import plan_of

    def choose(profile) -> Plan:  # within the default cap, 8 layers tiled whole; with more host, MLPs tiled only
        code = "T" * 32 if profile.host_cap_bytes > 32 * GIB else "T" * 24 + "l" * 8
        return plan_of(profile, code, 200 * GIB)

    plan = choose_plan_with_host(choose, tiled_layer_profile(host_cap_bytes=32 * GIB), 64 * GIB, 8 * GIB)
    assert plan.code == "T" * 32 and plan.host_cap_bytes == 64 * GIB and plan.host_default_cap_bytes == 32 * GIB
    assert plan.host_growth == ("no plan without layers tiled whole fits the budget within it, down to the host "
                                "memory reserve of 8.00 GiB")  # fmt: skip

    def whole_either_way(profile) -> Plan:
        return plan_of(profile, "T" * 28 + "l" * 4 if profile.host_cap_bytes > 32 * GIB else "T" * 24 + "l" * 8,
                       200 * GIB)  # fmt: skip

    kept = choose_plan_with_host(whole_either_way, tiled_layer_profile(host_cap_bytes=32 * GIB), 64 * GIB)
    assert kept.code == "T" * 24 + "l" * 8 and kept.host_cap_bytes == 32 * GIB and kept.host_growth == ""
