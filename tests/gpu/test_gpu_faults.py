"""Faults inside a step: a real CUDA out-of-memory error in the middle of the forward, raised by the caching
allocator after the first layers have offloaded their activations, must leave nothing behind (device memory,
pinned blocks) and must not change the next steps by a single bit."""

from __future__ import annotations

import gc

import pytest
import torch
from _gpu_models import assert_bitwise_equal, assert_offloaded, build_model, dispose, make_batch, make_ctx, run_steps

SIZE = dict(hidden=256, layers=3, seq=256)  # the fault goes into layer 1: layer 0 has offloaded by then


class AllocatorOOM:
    """A forward pre-hook that, when armed, asks the caching allocator for the device's whole memory. That is
    more than is free even after the allocator has emptied its cache (the model's weights stay resident), so the
    allocator itself raises torch.cuda.OutOfMemoryError, at the point of the forward where the hook sits."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, module: torch.nn.Module, args) -> None:
        if self.armed:
            device = next(module.parameters()).device
            _, total = torch.cuda.mem_get_info(device)
            torch.empty(total, dtype=torch.uint8, device=device)


def oom_step(model, batch, ctx, fault: AllocatorOOM) -> None:
    """One forward under the context that runs out of memory in the middle layer; the error is caught."""
    fault.armed = True
    try:
        with ctx:
            model(**batch, use_cache=False)
    except torch.cuda.OutOfMemoryError:
        pass  # `except ... as e` would keep the traceback, and with it the aborted forward's tensors, alive
    else:
        pytest.fail("the oversized allocation did not raise torch.cuda.OutOfMemoryError")
    finally:
        fault.armed = False


def train(model, batch, ctx=None, fault: AllocatorOOM | None = None, device="cuda"):
    """Three steps with one AdamW, and an out-of-memory forward after the first when a fault is given. Returns
    the first step, the last two, and what the fault left behind."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = run_steps(model, batch, steps=1, ctx=ctx, device=device, optimizer=optimizer)
    left = {}
    if fault is not None:
        gc.collect()
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        oom_step(model, batch, ctx, fault)
        left["aborted_step"] = ctx.get_stats()  # its counters: the fault struck after copies had left
        gc.collect()  # frames of the caught error may sit in reference cycles, holding the aborted forward
        torch.cuda.synchronize(device)
        left["device_bytes"] = torch.cuda.memory_allocated(device) - baseline
        left["pinned_in_use"] = ctx._pool.bytes_in_use()
        left["inflight_copies"] = sum(len(lane.inflight) for lane in ctx._lanes.values())
    return first, run_steps(model, batch, steps=2, ctx=ctx, device=device, optimizer=optimizer), left


@pytest.mark.parametrize("ckpt", ["off", "nonreentrant"])
def test_oom_in_forward_leaves_nothing_and_next_steps_exact(ckpt, device, record):
    kw = dict(dtype="bf16", device=device, ckpt=ckpt, **SIZE)
    batch = make_batch("llama", device=device, seq=SIZE["seq"])
    ref_first, ref_next, _ = train(build_model("llama", **kw), batch, device=device)

    model = build_model("llama", **kw)
    fault = AllocatorOOM()
    model.model.layers[len(model.model.layers) // 2].register_forward_pre_hook(fault)
    ctx = make_ctx(model, min_offload_size=1024)
    try:
        first, after, left = train(model, batch, ctx, fault, device=device)
    finally:
        dispose(ctx)
    aborted = left.pop("aborted_step")
    record("", {"ckpt": ckpt, "aborted_step_bytes_offloaded": aborted.get("bytes_offloaded"), **left}, show=True)

    assert_offloaded([aborted], f"ckpt={ckpt} aborted step")  # else the fault tested nothing of the engine
    assert left["device_bytes"] == 0, (
        f"device memory after the OOM step is {left['device_bytes']} bytes above "
        f"the baseline ({left['inflight_copies']} copies still in the forward window)"
    )
    assert left["pinned_in_use"] == 0, f"{left['pinned_in_use']} pinned bytes still in use after the OOM step"
    assert_bitwise_equal(ref_first, first, f"ckpt={ckpt} before the OOM")
    assert_bitwise_equal(ref_next, after, f"ckpt={ckpt} after the OOM")
    assert_offloaded(after.stats, f"ckpt={ckpt} after the OOM")
