"""What one rank of two runs in the memory budget's two-rank GPU test (`test_gpu_multidevice.py`): spawned processes
import the module of their target, and this one has no test in it."""

from __future__ import annotations

import os
import traceback

import torch
from _gpu_models import build_model, dispose, make_batch, make_ctx, step_peaks

# NVLink multicast stays off on these shared hosts (the device's KINDS.md), in every process NCCL starts in.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SIZE = dict(hidden=1024, layers=6, heads=16, kv_heads=8, intermediate=2816, vocab=1000)
# Attention whose memory grows with the tokens, as the planner scales a step's: eager attention holds its
# tokens x tokens weights, and a plan made for 4096 tokens from a profile at 2048 peaked 24% over a budget its
# linear scaling predicted it met (two ranks on one H100, `ccKKKK`, 10.35 GB against 8.34).
ATTENTION = "sdpa"


def _plan_and_tokens(ctx) -> tuple | None:
    plan = ctx.memory_plan
    return None if plan is None else (plan.code, plan.tokens)


def budget_on_rank(rank: int, port: int, results, lengths: tuple[tuple[int, ...], ...], share: float) -> None:
    """Rank `rank` of two: trains a 6-layer Llama on its own sequence lengths without offloading, then under a budget
    of `share` of the largest peak any rank reached without it; puts the budget, every step's peak and plan, and
    whether the losses equal those without offloading bitwise. Each rank on its own GPU over NCCL where there are
    two; else both on the one GPU, over gloo (each process counts its own peak)."""
    os.environ.update(MULTICAST_OFF, LOCAL_WORLD_SIZE="2")
    two = torch.cuda.device_count() >= 2
    torch.cuda.set_device(rank if two else 0)
    torch.use_deterministic_algorithms(True)
    torch.distributed.init_process_group("nccl" if two else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=2)  # fmt: skip
    try:
        mine = lengths[rank]

        def batch(step: int) -> dict:
            return make_batch("llama", batch=1, seq=mine[step], seed=step)

        model = build_model("llama", dtype="bf16", seq=max(mine), attn=ATTENTION, **SIZE)
        none_peaks, reference = step_peaks(model, batch, None, len(mine))
        largest = torch.tensor(max(none_peaks), device="cuda" if two else "cpu")
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
        budget = int(share * largest.item())
        model = build_model("llama", dtype="bf16", seq=max(mine), attn=ATTENTION, **SIZE)
        ctx = make_ctx(model, memory_budget=budget, tile_mlp=False, tile_layer=False)  # tiles are not bitwise
        try:
            plans: list = []
            peaks, losses = step_peaks(model, batch, ctx, len(mine), plans, describe=_plan_and_tokens)
        finally:
            dispose(ctx)
        exact = all(torch.equal(a, b) for a, b in zip(losses, reference))
        outcome = {"budget": budget, "peaks": peaks, "none_peaks": none_peaks, "plans": plans, "exact": exact,
                   "backend": torch.distributed.get_backend()}  # fmt: skip
    except Exception:  # the parent asserts on it
        outcome = {"error": traceback.format_exc()[-3000:]}
    finally:
        torch.distributed.destroy_process_group()
        results.put((rank, outcome))
