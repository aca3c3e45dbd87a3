"""What one rank of a gloo process group runs in the tests of planning across ranks
(`tests/memory_budget/test_controller.py`).

Spawned processes import the module of their target: this one imports torch and hf_offload only, not transformers,
so that starting each rank takes a second, not ten.
"""

import functools

import torch

from hf_offload import InfeasibleBudgetError
from hf_offload.memory_budget.controller import _same_on_every_rank
from hf_offload.memory_budget.profile import LayerProfile, StepProfile
from hf_offload.memory_budget.search import choose_plan
from hf_offload.memory_budget.simulate import MeasuredStep


def plan_on_rank(rank: int, port: int, results) -> None:
    """One of two gloo ranks: what `_same_on_every_rank` gives it for a budget that fits, one that does not, and the
    same with a measured plan that meets it (measured on rank 0 alone, as the closed loop's plans are), planned on
    rank 0 alone."""
    layer = LayerProfile(saved_bytes=1000, selective_bytes=500, input_bytes=100, forward_s=0.001, backward_s=0.002,
                         selective_recompute_s=0.0005)  # fmt: skip
    profile = StepProfile(layers=[layer] * 2, static_bytes=10_000, head_bytes=100, backward_working_bytes=100,
                          head_s=0.001, other_s=0.0, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, host_cap_bytes=10**9,
                          tokens=16)  # fmt: skip
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    outcomes = []
    try:
        measured = [MeasuredStep("CC", step_s=0.01, peak_bytes=10_001)] if rank == 0 else []
        for budget_bytes, steps in ((10**6, []), (10_001, []), (10_001, measured)):
            try:
                chosen = _same_on_every_rank(functools.partial(choose_plan, profile, budget_bytes, 0, steps))
                outcomes.append(("plan", chosen.code, chosen.measured))
            except InfeasibleBudgetError as error:
                outcomes.append(("refused", error.minimum_bytes, error.lowest_plan.code, str(error)))
    finally:
        torch.distributed.destroy_process_group()
        results.put((rank, outcomes))
