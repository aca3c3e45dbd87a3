"""How much pinned host memory a plan takes: the pool's cap, or more, down to the host's reserve, where that is what
makes the step fit.

The pool's default cap (half the available host memory, shared by the ranks of a host: `host_memory.py`) keeps a
plain offloader safe. A plan knows what each GiB of host buys, so under a memory budget `choose_plan_with_host` plans
within that cap first and raises it, up to what the host's reserve leaves (`host_memory.HostCaps.most_bytes`), only
when no plan fits within it, or only one that tiles where the raised cap lets a plan tile less: nothing (tiled
gradients are not bitwise), or MLPs only where it tiled whole layers. Then the plan says so (`Plan.host_growth`) and
its table prints how much host it took and why.

Only to fit or to tile less, not to run faster. Pinned memory is taken from everything else on the host for the
whole run (page cache, data loader workers, other jobs) and cannot be swapped; growing the pool costs about 0.4 s per
GB and synchronises the device; and what more host would buy when a plan already fits is speed from offloading saved
tensors instead of recomputing them, the step model's least reliable prediction (plans with whole layers offloaded ran
up to 1.5x plain checkpointing on the H100 zoo, where the model expected them faster). A sure cost for an unsure gain:
the default cap holds unless the budget cannot be met without more, or only with layers tiled whole. Those are slow by
measurement, not by the step model: on an H100, an 8B-class model's step of 327,680 tokens took 398 s with every layer
tiled whole and 306 s with every MLP tiled; with 8 of its 32 layers tiled whole and 42.5 GiB pinned, 321 s, against
286 s for a plan with 60 GiB pinned that tiled MLPs only. Pure: the standard library, `units.py` and the
budget's pure modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..units import format_bytes
from .profile import StepProfile
from .search import InfeasibleBudgetError
from .simulate import Plan

__all__ = ["choose_plan_with_host"]


def choose_plan_with_host(choose: Callable[[StepProfile], Plan], profile: StepProfile, most_cap_bytes: int,
                          reserve_bytes: int = 0) -> Plan:  # fmt: skip
    """The plan `choose` makes within the pool's cap (`profile.host_cap_bytes`), or with the cap raised to
    `most_cap_bytes` where that is what makes the step fit.

    The cap is raised when, within it, no plan fits (an `InfeasibleBudgetError`) or only one that tiles, and with the
    raised cap a plan fits that tiles less (`_tiling`: nothing, or MLPs only where the default's tiles layers whole).
    That plan then has `host_cap_bytes` = `most_cap_bytes`, `host_default_cap_bytes` = the cap, and `host_growth`
    saying why.

    Args:
        choose: makes a plan from a profile (`search.choose_plan` with the budget, margin and measured plans).
        profile: the step, with the pool's cap as `host_cap_bytes`.
        most_cap_bytes: the most the pool may hold (`HostCaps.most_bytes`); at most the cap: never raised.
        reserve_bytes: the host's reserve that bounds it, for the reason's text (0: not named).

    Raises:
        InfeasibleBudgetError: no plan fits even with the most host: the refusal made with it (the lowest minimum),
            saying how much host it counted; its lowest-memory plan takes that host, for a step that must run anyway.

    Example (`profile`: 4 layers, each with an input of 64 MiB, whose lowest peak offloads three inputs):
        >>> import dataclasses
        >>> from hf_offload.memory_budget.search import choose_plan
        >>> from hf_offload.units import GIB
        >>> capped = dataclasses.replace(profile, host_cap_bytes=GIB // 16)  # room for one input
        >>> plan = choose_plan_with_host(lambda p: choose_plan(p, int(12.1 * GIB)), capped, GIB // 4)
        >>> plan.code, plan.host_cap_bytes / GIB, plan.host_default_cap_bytes / GIB
        ('CCCK', 0.25, 0.0625)
        >>> plan.host_growth
        'no plan fits the budget within it'
    """
    refusal: InfeasibleBudgetError | None = None
    try:
        plan: Plan | None = choose(profile)
    except InfeasibleBudgetError as error:
        plan, refusal = None, error
    if plan is not None and not _tiling(plan) or most_cap_bytes <= profile.host_cap_bytes:
        if plan is None:
            raise _with_what_dominates(refusal, choose, profile)
        return plan
    why = "no exact plan fits the budget within it" if plan is not None else "no plan fits the budget within it"
    bound = f", down to the host memory reserve of {format_bytes(reserve_bytes)}" if reserve_bytes else ""
    grown_profile = dataclasses.replace(profile, host_cap_bytes=most_cap_bytes)
    try:
        grown = choose(grown_profile)
    except InfeasibleBudgetError as error:
        if plan is not None:
            return plan
        lowest = dataclasses.replace(error.lowest_plan, host_default_cap_bytes=profile.host_cap_bytes,
                                     host_growth=f"{why}: the lowest-memory plan, over the budget{bound}")  # fmt: skip
        grown_by = f"from its cap of {format_bytes(profile.host_cap_bytes)} to {format_bytes(most_cap_bytes)}"
        raise _with_what_dominates(
            InfeasibleBudgetError(f"{error} (That is with the pinned host pool grown {grown_by}{bound}.)",
                                  error.budget_bytes, error.minimum_bytes, lowest), choose, grown_profile,
        ) from None  # fmt: skip
    if plan is not None and _tiling(grown) >= _tiling(plan):
        return plan  # tiled as much either way: the default cap is enough for that
    if plan is not None and _tiling(grown):
        why = "no plan without layers tiled whole fits the budget within it"
    return dataclasses.replace(grown, host_default_cap_bytes=profile.host_cap_bytes, host_growth=f"{why}{bound}")


def _with_what_dominates(refusal: InfeasibleBudgetError, choose: Callable[[StepProfile], Plan],
                         profile: StepProfile) -> InfeasibleBudgetError:  # fmt: skip
    """`refusal` (made within `profile.host_cap_bytes`), saying whether host or GPU memory is what the step lacks
    (a length no plan fits names the least of each it needs): the same step planned with room on the host
    for every layer's saved tensors either fits, with that much host, or does not, and needs that much GPU memory
    whatever the host."""
    unlimited = sum(max(layer.saved_bytes, layer.input_bytes) for layer in profile.layers)
    if unlimited <= profile.host_cap_bytes:
        lacks = " GPU memory is what this step lacks: the host has room for every layer's saved tensors."
    else:
        try:
            plan = choose(dataclasses.replace(profile, host_cap_bytes=unlimited))
        except InfeasibleBudgetError as error:
            needs, on_host = error.minimum_bytes, error.lowest_plan.predicted.host_bytes
            lacks = (f" GPU memory is what this step lacks: with any host, it needs at least {format_bytes(needs)}"
                     + (f" (with {format_bytes(on_host)} of pinned host memory)." if needs < refusal.minimum_bytes
                        else ", as more host memory would lower nothing."))  # fmt: skip
        else:
            lacks = (f" Host memory is what this step lacks: a plan fits the budget with "
                     f"{format_bytes(plan.predicted.host_bytes)} of pinned host memory, where this host gives the pool "
                     f"{format_bytes(profile.host_cap_bytes)}.")  # fmt: skip
    return InfeasibleBudgetError(f"{refusal}{lacks}", refusal.budget_bytes, refusal.minimum_bytes,
                                 refusal.lowest_plan)  # fmt: skip


def _tiling(plan: Plan) -> int:
    """How much the plan tiles: 0 nothing, 1 MLPs only, 2 whole layers. Tiled gradients are not bitwise, and layers
    tiled whole are slower than tiled MLPs (the module docstring's figures): the host's room that lowers it is worth
    taking."""
    return 2 if plan.tiled_whole_layers else 1 if plan.tiled_layers else 0
