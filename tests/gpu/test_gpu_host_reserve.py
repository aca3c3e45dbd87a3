"""The host memory reserve with real pinned memory (docs/DESIGN.md, Host memory): the pool stops growing where the
host's available memory reaches the reserve, as read at each growth; a failed cudaHostRegister leaves no error behind
for the next kernel; and the engine keeps what the reserve refuses on the GPU, with gradients bitwise equal.

Sized for a host of about 128 GiB: each test pins at most a few GiB above a reserve set just below the memory available
when it starts, so it never takes the host anywhere near running out.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _gpu_models import mlp_saving_3_gib

from hf_offload import OffloadActivations
from hf_offload.host_memory import HostReserve, PinnedHostPool, _pinned_exactly, read_host_memory

GIB, MIB = 2**30, 2**20


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    # Pinned blocks the earlier tests freed stay in torch's host cache: a pool that takes them back grows without
    # lowering MemAvailable, so the reserve would not be met where these tests expect it (after the bitwise, trainer
    # and QLoRA tests on the H100: 5 GiB pinned against 3). torch 2.11 empties that cache only privately.
    empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty_host_cache = empty_host_cache or getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()


@pytest.mark.parametrize("chunk_mib", [256, 64], ids=["chunks", "exact-size-registrations"])
def test_real_pinned_growth_stops_at_the_reserve(record, chunk_mib: int) -> None:
    """A reserve 3 GiB below the memory available now, a cap far above it: the pool grows (in chunks from PyTorch's
    pinned allocator, or in requests past the largest chunk pinned at their exact size by cudaHostRegister) until a
    growth would cross the reserve, and no further; the host's available memory stays above the reserve throughout,
    and pinned memory shows in MemAvailable (which is what makes the reserve's reads mean something)."""
    _settle()
    before = read_host_memory().available_bytes
    reserve = before - 3 * GIB
    grown: list[tuple[int, float]] = []
    pool = PinnedHostPool(cap_bytes=16 * GIB, pin_memory=True, chunk_bytes=chunk_mib * MIB,
                          reserve=HostReserve(reserve, local_ranks=1),
                          on_growth=lambda nbytes, seconds: grown.append((nbytes, seconds)))  # fmt: skip
    request = 200 * MIB  # past the 64 MiB chunk: pinned exactly; within 256 MiB chunks: carved from them
    blocks, lowest = [], before
    while len(blocks) < 64:
        block = pool.allocate(request)
        lowest = min(lowest, read_host_memory().available_bytes)
        if block is None:
            break
        blocks.append(block)
    record("pinned_gib", pool.capacity / GIB, show=True)
    record("available_above_reserve_gib", (lowest - reserve) / GIB, show=True)
    record("pinning_s_per_gib", sum(seconds for _, seconds in grown) / (pool.capacity / GIB), show=True)
    assert sum(nbytes for nbytes, _ in grown) == pool.capacity  # every growth reported, with the time it took
    assert pool.refusal == "reserve" and pool.failure is None
    assert 1.5 * GIB <= pool.capacity <= 3 * GIB + chunk_mib * MIB  # what the reserve left, give or take the host
    assert lowest >= reserve
    assert before - read_host_memory().available_bytes >= pool.capacity * 0.8  # pinned memory is not available
    source = torch.randint(0, 255, (request,), dtype=torch.uint8, device="cuda")
    for block in blocks[:3]:  # the blocks are real pinned memory: asynchronous copies through them are exact
        host = block.view(torch.uint8, request)
        assert host.is_pinned()
        host.copy_(source, non_blocking=True)
        back = torch.empty_like(source)
        back.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, source)
    del blocks, pool, host
    _settle()


def test_a_failed_cuda_host_register_is_a_refusal_that_leaves_no_error_for_the_next_kernel(record, monkeypatch):
    """Registering memory that is registered already fails (cudaErrorHostMemoryAlreadyRegistered). torch's binding
    returns the error without reading it back, so it stays CUDA's last error; the pool must report a refusal, and the
    next kernel launch must not raise that stale error in the middle of the model."""
    registered = _pinned_exactly(8 * MIB)  # registered once, for real
    cudart = torch.cuda.cudart()

    class RegistersTwice:
        """cudaHostRegister of the already registered buffer, whatever is asked: a real failure of the runtime."""

        def __getattr__(self, name):
            return getattr(cudart, name)

        def cudaHostRegister(self, pointer, nbytes, flags):  # noqa: N802 (CUDA's name)
            return cudart.cudaHostRegister(registered.data_ptr(), 8 * MIB, flags)

    # Without the pool's clearing, is the error left pending for the next launch? (Recorded: what the fix is for.)
    error = int(RegistersTwice().cudaHostRegister(0, 0, 0))
    try:
        torch.ones(4, device="cuda").mul_(2)
        torch.cuda.synchronize()
        stale_raised = False
    except RuntimeError:
        stale_raised = True
    record("register_error", error)
    record("stale_error_raised_by_the_next_launch", stale_raised, show=True)
    assert error != 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: RegistersTwice())
    pool = PinnedHostPool(cap_bytes=GIB, pin_memory=True, chunk_bytes=64 * MIB)
    assert pool.allocate(100 * MIB) is None  # past the largest chunk: pinned exactly, by the failing registration
    assert pool.refusal == "failed" and "cudaHostRegister" in pool.failure
    x = torch.randn(256, 256, device="cuda")
    y = (x @ x).sum()  # kernel launches after the failure: no stale error raised
    torch.cuda.synchronize()
    assert torch.isfinite(y)
    assert pool.allocate(100 * MIB) is None and pool.refusal == "failed"  # not tried again


def test_the_engine_keeps_what_the_reserve_refuses_on_the_gpu_bitwise(record) -> None:
    """An MLP whose step saves about 3 GiB, a reserve 512 MiB below the memory available now: part of the step goes
    to the host, the rest stays on the GPU (`host_reserve`, one warning), and the gradients are those without the
    engine, bit for bit, over two steps."""
    _settle()
    grads = mlp_saving_3_gib()

    reference = grads(None)
    assert all(torch.equal(a, b) for a, b in zip(reference, grads(None)))  # the baseline repeats itself
    reserve = read_host_memory().available_bytes - 512 * MIB
    engine = OffloadActivations(host_memory_reserve_bytes=reserve)
    for _ in range(2):
        got = grads(engine)
        assert all(torch.equal(a, b) for a, b in zip(got, reference))
    stats = engine.get_stats()
    record("offloaded_mib", stats["bytes_offloaded"] / MIB, show=True)
    record("kept_by_reserve_mib", stats["bytes_kept_host_reserve"] / MIB, show=True)
    assert stats["tensors_offloaded"] > 0 and stats["tensors_kept_host_reserve"] > 0
    assert stats["pinned_bytes"] <= 512 * MIB + 256 * MIB
    assert read_host_memory().available_bytes >= reserve
