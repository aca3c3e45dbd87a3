"""`EngineSettings`: what a memory plan sets in the engine, given in one call (`OffloadActivations.apply_settings`).

The memory budget's side (`memory_budget.plan_application`) makes one from each plan it applies, and the engine takes
it whole: the engine imports nothing of the budget and knows nothing of its controller, which only ever sets it
through these. A setting left None stays as it is: the profiled steps' plans size no windows and cap nothing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # `plan`'s annotation only
    from ..memory_budget.simulate import Plan

__all__ = ["CopyWindows", "EngineSettings"]


class CopyWindows(NamedTuple):
    """The copy windows a plan sizes for its layers, which know how many bytes they let leave and come back at once
    (`OffloadActivations.use_windows`, in this order).

    Args:
        forward_bytes: the forward copies in flight, in bytes (> 0).
        prefetch_bytes: what backward reloads ahead of need, in bytes; None sizes it per step.
        head_prefetch_bytes: what the output head's backward may reload ahead, at most; None: as much as the prefetch
            window.
    """

    forward_bytes: int
    prefetch_bytes: int | None
    head_prefetch_bytes: int | None


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """A memory plan's settings of the engine.

    Args:
        stand_aside: whether offloading stands aside (`"planned"`): the plan moves nothing, so that its steps cost
            what they cost without the library. False: it rejoins, if a plan had it stand aside.
        windows: the copy windows; None: as they are.
        tail_cap_bytes: the most the tail (the last offload candidates of the forward, kept on the GPU) may keep
            (`OffloadActivations.cap_tail`); None: as it is.
        host_cap_bytes: the pinned pool's cap (`OffloadActivations.set_host_cap`); None: as it is.
        plan: the plan these settings are of, which `OffloadActivations.memory_plan` returns; None for the profiled
            steps' plans.
    """

    stand_aside: bool
    windows: CopyWindows | None = None
    tail_cap_bytes: int | None = None
    host_cap_bytes: int | None = None
    plan: Plan | None = None
