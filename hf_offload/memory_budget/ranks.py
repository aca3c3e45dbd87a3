"""What the ranks of a distributed run agree on for a memory budget: one plan, made for the largest rank's step.

Every rank must run the same plan: ranks that checkpoint different layers can hang FSDP or DeepSpeed ZeRO-3, whose
recomputations gather parameters. So rank 0 plans and broadcasts its plan. But a plan fits every rank only if it is
made for every rank's step: with padding-free packing the ranks' batches have different lengths in one step, rank 0's
may be the shortest, and the host of several ranks leaves each its own room for pinned memory. So before each plan the
ranks agree on the largest step and the smallest host caps, and decide together whether to re-plan at all: a rank
that entered a plan's broadcast alone would wait for the others forever.

The agreements are small integer messages exchanged over a gloo group of their own, on the host: over NCCL, each
would wait for the device to finish the work queued before it. `AgreedHostCaps` holds the host caps agreed before
the latest plan, which every plan made since counts on.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..engine import OffloadActivations
from ..host_memory import HostCaps
from .search import InfeasibleBudgetError
from .simulate import Plan

__all__ = ["RanksOfThisRun", "AgreedHostCaps", "RankAgreement"]


class RankAgreement:
    """The collective decisions of a memory budget under `torch.distributed`, over a gloo process group.

    Every method is a collective: every rank must call it, in the same order, with lists of the same length.

    Args:
        group: the gloo group the agreements run in (None: the default group, which must then be gloo's).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @classmethod
    def of_this_run(cls) -> RankAgreement | None:
        """The agreement among this run's ranks; None when this process runs alone (no process group, or one rank).

        The default group's backend is used where it is gloo; under NCCL a gloo group is made (a collective of the
        default group: every rank must get here at the same point of its run)."""
        if runs_alone():
            return None
        if torch.distributed.get_backend() == "gloo":
            return cls()
        return cls(torch.distributed.new_group(backend="gloo"))

    def largest(self, values: Sequence[int]) -> list[int]:
        """Each value's largest over the ranks."""
        tensor = torch.tensor(list(values), dtype=torch.int64)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    def smallest_host_caps(self, caps: HostCaps) -> HostCaps:
        """The host caps every rank can count on: the smallest of each over the ranks (the reserve is the host's)."""
        default, most = self.largest([-caps.default_bytes, -caps.most_bytes])
        return HostCaps(-default, -most, caps.reserve_bytes)

    def rank_zeros_plan(self, make_plan: Callable[[], Plan]) -> Plan:
        """Rank 0's plan, on every rank; `make_plan` runs on rank 0 only.

        Raises:
            InfeasibleBudgetError: rank 0's refusal, on every rank: raised on rank 0 alone, it would leave the others
                waiting in the broadcast.
        """
        message: list[Any] = [None]
        if torch.distributed.get_rank() == 0:
            try:
                message = [{"plan": make_plan().to_dict()}]
            except InfeasibleBudgetError as error:
                message = [{"refused": (str(error), error.budget_bytes, error.minimum_bytes,
                                        error.lowest_plan.to_dict())}]  # fmt: skip
        torch.distributed.broadcast_object_list(message, src=0, group=self.group)
        if "refused" in message[0]:
            text, budget_bytes, minimum_bytes, lowest = message[0]["refused"]
            raise InfeasibleBudgetError(text, budget_bytes, minimum_bytes, Plan.from_dict(lowest))
        return Plan.from_dict(message[0]["plan"])


class AgreedHostCaps:
    """The pinned host memory a plan may count on: this rank's pool's, or under torch.distributed the smallest of the
    ranks' pools' as agreed before the latest plan (rank 0 plans for every rank, and sets every rank's cap).

    Args:
        engine: the offloading context whose pinned pool it is, held weakly.
    """

    def __init__(self, engine: OffloadActivations) -> None:
        self._engine = weakref.ref(engine)
        self._agreed: HostCaps | None = None

    def agree(self, ranks: RankAgreement | None) -> None:
        """Under torch.distributed (`ranks`), before each plan: the host caps that every rank's pool can count on."""
        engine = self._engine()
        if ranks is not None and engine is not None:
            self._agreed = ranks.smallest_host_caps(engine.host_caps())

    def caps(self) -> HostCaps:
        """The caps a plan counts on now. Only while the engine lives."""
        return self._agreed or self._engine().host_caps()


class RanksOfThisRun:
    """The ranks' agreement of this run (`RankAgreement.of_this_run`), made at its first use: the first plan, which
    every rank reaches at once (making it can be a collective)."""

    def __init__(self) -> None:
        self._agreement: RankAgreement | None = None
        self._known = False

    def agreement(self) -> RankAgreement | None:
        """The ranks' agreement, None when this process trains alone."""
        if not self._known:
            self._agreement, self._known = RankAgreement.of_this_run(), True
        return self._agreement


def runs_alone() -> bool:
    """Whether this process trains alone: no process group, or one of a single rank."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not distributed or torch.distributed.get_world_size() == 1
