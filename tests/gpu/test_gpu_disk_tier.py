"""The disk tier on CUDA (`disk_offload_dir`, docs/DESIGN.md, The disk tier): with a pinned pool capped far below a
step's saved tensors, what the pool refuses goes D2H into pinned staging buffers, to files and back, and training is
bitwise the same as without offloading; every byte written is read back, and no file outlives its step or the context.

Correctness only: the disk tier's speed is not measured here.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from _gpu_models import assert_bitwise_equal, build_model, dispose, make_batch, make_ctx, mlp_saving_3_gib, run_steps

from hf_offload import OffloadActivations, host_memory
from hf_offload.host_memory import read_host_memory

MIB = 2**20


def _files(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]


@pytest.mark.parametrize("span", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("ckpt", ["off", "nonreentrant"])
@pytest.mark.parametrize("use_streams", [True, False], ids=["streams", "no-streams"])
def test_a_tiny_pinned_cap_spills_to_disk_bitwise(tmp_path, record, span: str, ckpt: str, use_streams: bool) -> None:
    """A tiny Llama whose pool holds 256 KiB: most layer inputs and activations are spilled, and the losses and
    gradients of three steps equal those without offloading, bit for bit."""
    kw = dict(dtype="fp32", ckpt=ckpt)
    reference_model, model = build_model("llama", **kw), build_model("llama", **kw)
    batch = make_batch("llama")
    reference = run_steps(reference_model, batch, steps=3, span=span)
    del reference_model
    # A step this short sets its peak in the optimizer: without min_peak_reduction=None offloading would stand aside
    # after the measured first step, and nothing would reach the disk in the steps checked below.
    ctx = make_ctx(model, use_streams=use_streams, min_offload_size=1024, max_pinned_bytes=256 * 1024,
                   disk_offload_dir=str(tmp_path), disk_reserve_bytes=0, min_peak_reduction=None)  # fmt: skip
    run_directory = ctx._disk.directory
    try:
        got = run_steps(model, batch, steps=3, ctx=ctx, span=span)
        assert_bitwise_equal(reference, got, f"disk {ckpt} {span}")
        for stats in got.stats[1:]:  # the first step's counts may settle after it (writes confirmed later)
            assert stats["bytes_spilled_to_disk"] > 0
            assert stats["bytes_spilled_to_disk"] == stats["bytes_read_from_disk"]
        record(f"spilled_mib_{ckpt}_{span}", got.stats[-1]["bytes_spilled_to_disk"] / MIB, show=True)
        gc.collect()
        assert _files(tmp_path) == []
    finally:
        dispose(ctx)
    del ctx
    gc.collect()
    assert not run_directory.exists()


def test_an_mlp_spills_gib_to_disk_bitwise(tmp_path, record) -> None:
    """An MLP whose step saves about 3 GiB with a pool of 256 MiB: most of it goes through the staging buffers to the
    disk and back, and the gradients of two steps are those without the engine, bit for bit."""
    grads = mlp_saving_3_gib()

    reference = grads(None)
    engine = OffloadActivations(max_pinned_bytes=256 * MIB, disk_offload_dir=str(tmp_path), disk_reserve_bytes=0)
    for _ in range(2):
        got = grads(engine)
        assert all(torch.equal(a, b) for a, b in zip(got, reference))
    stats = engine.get_stats()
    record("mlp_spilled_mib", stats["bytes_spilled_to_disk"] / MIB, show=True)
    record("mlp_disk_wait_s", stats["disk_wait_s"], show=True)
    assert stats["bytes_spilled_to_disk"] > 1024 * MIB
    assert stats["bytes_spilled_to_disk"] == stats["bytes_read_from_disk"]
    gc.collect()
    assert _files(tmp_path) == []
    engine.remove_hooks()
    assert engine._disk.closed and list(tmp_path.iterdir()) == []


def test_no_staging_buffer_is_pinned_past_the_hosts_reserve(tmp_path, monkeypatch, record) -> None:
    """The host read as 64 MiB above the reserve whatever is pinned: the pool takes none of the MLP's 128 MiB tensors,
    and neither may the disk tier's staging buffers, which count against no cap but stop at the host's reserve, so
    the tensors stay on the GPU, bitwise, and nothing reaches the disk. (The host's real available memory moves by
    hundreds of MiB between tests, so the reading stands still.)"""
    grads = mlp_saving_3_gib()
    reference = grads(None)
    total = read_host_memory().total_bytes
    reserve = total // 2
    still = host_memory.HostMemory(total, reserve + 64 * MIB)
    monkeypatch.setattr(host_memory, "read_host_memory", lambda root="/": still)
    engine = OffloadActivations(max_pinned_bytes=256 * MIB, disk_offload_dir=str(tmp_path), disk_reserve_bytes=0,
                                host_memory_reserve_bytes=reserve)  # fmt: skip
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(grads(engine), reference))
    stats = engine.get_stats()
    record("kept_host_reserve_mib", stats["bytes_kept_host_reserve"] / MIB, show=True)
    assert stats["tensors_kept_host_reserve"] > 0 and stats["bytes_spilled_to_disk"] == 0
    assert engine._staging == []
    engine.remove_hooks()
