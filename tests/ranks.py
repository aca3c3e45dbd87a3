"""What one rank of a gloo process group runs in the tests of planning across ranks (`memory_budget/test_ranks.py`).

Spawned processes import the module of their target: this one imports torch and hf_offload only, not transformers,
so that starting a rank that only plans takes a second, not ten.
"""

import functools
import os

import torch

from hf_offload import InfeasibleBudgetError
from hf_offload.memory_budget.profile import LayerProfile, StepProfile
from hf_offload.memory_budget.ranks import RankAgreement
from hf_offload.memory_budget.search import choose_plan
from hf_offload.memory_budget.simulate import MeasuredStep


def plan_on_rank(rank: int, port: int, results) -> None:
    """One of two gloo ranks: what `RankAgreement.rank_zeros_plan` gives it for a budget that fits, one that does not,
    and the same with a measured plan that meets it (measured on rank 0 alone, as the closed loop's plans are),
    planned on rank 0 alone."""
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
                make_plan = functools.partial(choose_plan, profile, budget_bytes, 0, steps)
                chosen = RankAgreement().rank_zeros_plan(make_plan)
                outcomes.append(("plan", chosen.code, chosen.measured))
            except InfeasibleBudgetError as error:
                outcomes.append(("refused", error.minimum_bytes, error.lowest_plan.code, str(error)))
    finally:
        torch.distributed.destroy_process_group()
        results.put((rank, outcomes))


def train_on_rank(rank: int, port: int, results, lengths: tuple[tuple[int, ...], ...], budget: int,
                  available_gib: tuple[float, ...], max_tokens: int | None = None,
                  sharded: bool = False) -> None:  # fmt: skip
    """One of two gloo ranks training the budget tests' tiny Llama (`budget_runs.tiny_llama`) under `budget` in CPU
    test mode, each on its own sequence lengths and with its own host memory available (`available_gib`, of 128 GiB,
    two local ranks), and the run's longest step put at `max_tokens` (`memory_budget_max_tokens`). With `sharded`,
    each rank trains on its half of every sequence (`budget_runs.train`'s `shard`), as under context parallelism.

    Puts, per step, the plan in force (code and tokens) and the pool's cap; whether the losses and gradients equal
    those of the same steps without offloading, bitwise; and the most host memory this rank's pool could take."""
    from budget_runs import Unchanged, tiny_llama, train  # transformers: imported by the ranks that train only

    from hf_offload import get_act_offloading_ctx_manager, host_memory

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    available = int(available_gib[rank] * 2**30)
    host_memory.read_host_memory = lambda root="/": host_memory.HostMemory(128 * 2**30, available)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mine, shard = lengths[rank], (rank, 2) if sharded else None
        baseline = train(tiny_llama(), Unchanged(), steps=len(mine), lengths=mine, shard=shard)
        model = tiny_llama()
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget,
                                                 memory_budget_max_tokens=max_tokens)  # fmt: skip
        steps = []

        def record() -> None:
            plan = context.memory_plan
            steps.append(None if plan is None else (plan.code, plan.tokens, context._host_pool().cap_bytes))

        trained = train(model, context, steps=len(mine), lengths=mine, after_step=record, shard=shard)
        exact = len(trained) == len(baseline) and all(torch.equal(a, b) for a, b in zip(trained, baseline))
        outcome = (steps, exact, context.host_caps().most_bytes)
    except Exception as error:  # the parent asserts on it
        outcome = ("error", repr(error))
    finally:
        torch.distributed.destroy_process_group()
        results.put((rank, outcome))


def fsdp2_train_on_rank(rank: int, port: int, results, budget: int) -> None:
    """One of two gloo ranks training the budget tests' tiny Llama (`budget_runs.tiny_llama`) sharded by FSDP2
    (`fully_shard` on each decoder layer and on the model, on the CPU) under `budget` in CPU test mode, and again
    without offloading.

    Puts the plan code in force after each step, whether the losses and gradients (this rank's shards) equal those
    of the same steps without offloading, bitwise, and what the plan's profile counted of the first layer's gathered
    parameters, its gradients and the model's (the first layer's whole parameters, its local shards, the model's
    local shards and its whole parameters)."""
    from budget_runs import Unchanged, tiny_llama, train  # transformers: imported by the ranks that train only
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_offload import get_act_offloading_ctx_manager

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))

    def sharded():
        model = tiny_llama()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [getattr(tensor, "_local_tensor", tensor) for tensor in tensors]

    try:
        baseline = local(train(sharded(), Unchanged(), steps=5, lengths=(64,)))
        model = sharded()
        # Tiling off: a tiled MLP or layer sums in another order, so only the other actions are bitwise comparable.
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget, tile_mlp=False,
                                                 tile_layer=False)  # fmt: skip
        codes = []
        trained = local(train(model, context, steps=5, lengths=(64,), after_step=lambda: codes.append(
            None if context.memory_plan is None else context.memory_plan.code)))  # fmt: skip
        exact = len(trained) == len(baseline) and all(torch.equal(a, b) for a, b in zip(trained, baseline))
        # What the plan's profile counted of the first layer, against the layer's whole and local parameter bytes.
        profile, first = context.budget_controller.profile, model.model.layers[0]
        counted = (profile.layers[0].gathered_parameter_bytes, profile.layers[0].parameter_gradient_bytes,
                   profile.gradient_bytes)  # fmt: skip
        truth = (sum(p.numel() * p.element_size() for p in first.parameters()),
                 sum(t.numel() * t.element_size() for t in local(list(first.parameters()))),
                 sum(t.numel() * t.element_size() for t in local(list(model.parameters()))),
                 sum(p.numel() * p.element_size() for p in model.parameters()))  # fmt: skip
        outcome = (codes, exact, counted, truth)
    except Exception as error:  # the parent asserts on it
        outcome = ("error", repr(error))
    finally:
        torch.distributed.destroy_process_group()
        results.put((rank, outcome))
