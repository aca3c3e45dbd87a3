"""The disk tier wired into the engine (`disk_offload_dir`), on CPU tensors in the CPU test mode.

A pinned cap of 8 KiB makes the pool refuse most of a small MLP's saved tensors; with `disk_offload_dir` they go to
files and come back bitwise. With stand-in streams (`stand_in_streams`) the engine takes its streamed path: staging
buffers, D2H events, reads started by the prefetch and copied on the H2D stream.
"""

from __future__ import annotations

import errno
import gc
import logging
import shutil
from pathlib import Path

import pytest
import torch
from stand_in_streams import use_stand_in_streams
from test_engine import assert_bitwise_equal, cpu_engine, grads_of, round_trip, tiny_mlp

from hf_offload import OffloadActivations, OffloadOptions, disk_tier
from hf_offload.disk_tier import DiskOffloadDirError
from hf_offload.host_memory import read_host_memory


def disk_engine(tmp_path: Path, streams: bool, **options) -> OffloadActivations:
    options.setdefault("disk_reserve_bytes", 0)
    options.setdefault("max_pinned_bytes", 8192)
    engine = cpu_engine(disk_offload_dir=str(tmp_path), **options)
    return use_stand_in_streams(engine) if streams else engine


def files_in(tmp_path: Path) -> list[Path]:
    return sorted(path for path in tmp_path.rglob("*") if path.is_file())


@pytest.mark.parametrize("checkpointing", ["off", "non_reentrant"])
@pytest.mark.parametrize("streams", [False, True], ids=["cpu-mode", "stand-in-streams"])
def test_spilled_tensors_come_back_bitwise_and_leave_no_file(tmp_path, checkpointing: str, streams: bool) -> None:
    model = tiny_mlp()
    reference = grads_of(model, None, checkpointing=checkpointing)
    # Checkpointed, the MLP saves its 2 KiB input only: a pool of none spills it.
    engine = disk_engine(tmp_path, streams, max_pinned_bytes=8192 if checkpointing == "off" else 0)
    engine.update_model_params(model)
    for _ in range(3):
        assert_bitwise_equal(grads_of(model, engine, checkpointing=checkpointing), reference)
        stats = engine.get_stats()
        assert stats["bytes_spilled_to_disk"] > 0
        assert stats["bytes_spilled_to_disk"] == stats["bytes_read_from_disk"]
        assert stats["tensors_kept_over_host_cap"] == 0  # the disk took what the pool refused
        gc.collect()
        assert files_in(tmp_path) == []  # each file went with its copy
    run_directory = engine.disk_tier.directory
    assert run_directory.is_dir()
    del engine
    gc.collect()
    assert not run_directory.exists() and list(tmp_path.iterdir()) == []


def test_without_a_disk_directory_the_pool_refusal_keeps_tensors_on_device(tmp_path) -> None:
    engine = cpu_engine(max_pinned_bytes=8192)
    assert engine.disk_tier is None
    assert type(engine) is OffloadActivations  # the plain hot paths, not the disk tier's
    assert type(disk_engine(tmp_path, streams=False)).__mro__[1] is OffloadActivations
    grads_of(tiny_mlp(), engine)
    stats = engine.get_stats()
    assert stats["tensors_kept_over_host_cap"] > 0
    assert stats["bytes_spilled_to_disk"] == stats["bytes_read_from_disk"] == stats["disk_wait_s"] == 0


@pytest.mark.parametrize("streams", [False, True], ids=["cpu-mode", "stand-in-streams"])
def test_a_retained_graph_reads_its_files_again(tmp_path, streams: bool) -> None:
    engine = disk_engine(tmp_path, streams)
    probes = [torch.randn(64, 64) for _ in range(4)]
    x = torch.ones(64, requires_grad=True)
    with engine:
        y = (x * probes[0] * probes[1]).sin() * probes[2] * probes[3]
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    y.sum().backward()
    assert torch.equal(x.grad, first)
    assert engine.get_stats()["bytes_spilled_to_disk"] > 0
    del y
    gc.collect()
    assert files_in(tmp_path) == []


@pytest.mark.parametrize("streams", [False, True], ids=["cpu-mode", "stand-in-streams"])
def test_an_exception_in_the_step_leaves_no_file(tmp_path, streams: bool) -> None:
    model = tiny_mlp()
    engine = disk_engine(tmp_path, streams)
    engine.update_model_params(model)
    with pytest.raises(RuntimeError, match="in the middle"):
        with engine:
            loss = model(torch.randn(16, 32, requires_grad=True)).pow(2).mean()
            raise RuntimeError("in the middle of a step")
    del loss
    gc.collect()
    engine.remove_hooks()  # nothing holds a file any more: the tier closes
    assert engine._disk.closed and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("streams", [False, True], ids=["cpu-mode", "stand-in-streams"])
def test_the_disk_reserve_keeps_tensors_on_device_with_one_warning(tmp_path, monkeypatch, caplog,
                                                                    streams: bool) -> None:  # fmt: skip
    model = tiny_mlp()
    reference = grads_of(model, None)
    engine = disk_engine(tmp_path, streams, disk_reserve_bytes=2**30)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=2**30 + 1024))
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for _ in range(2):
            assert_bitwise_equal(grads_of(model, engine), reference)
    stats = engine.consume_stats()
    assert stats["tensors_kept_disk_reserve"] > 0
    assert stats["bytes_spilled_to_disk"] == stats["bytes_read_from_disk"]
    assert sum("the disk tier did not take" in record.getMessage() for record in caplog.records) == 1
    assert files_in(tmp_path) == []


@pytest.mark.parametrize("streams", [False, True], ids=["cpu-mode", "stand-in-streams"])
def test_a_failed_write_keeps_the_tensor_on_device(tmp_path, monkeypatch, caplog, streams: bool) -> None:
    model = tiny_mlp()
    reference = grads_of(model, None)
    engine = disk_engine(tmp_path, streams)

    def disk_full(*args) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "_write_all", disk_full)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for _ in range(2):
            assert_bitwise_equal(grads_of(model, engine), reference)
    stats = engine.consume_stats()
    assert stats["tensors_kept_disk_failed"] > 0 and stats["bytes_spilled_to_disk"] == 0
    assert sum("writing a spilled activation" in record.getMessage() for record in caplog.records) == 1
    gc.collect()
    assert files_in(tmp_path) == []


def test_no_staging_buffer_is_taken_past_the_hosts_reserve(tmp_path, caplog) -> None:
    """The staging buffers count against no cap, but the host's reserve is the pool's: with the host at its reserve,
    what the pool refuses finds no buffer to go through to the disk and stays on the device, with one warning."""
    model = tiny_mlp()
    reference = grads_of(model, None)
    engine = disk_engine(tmp_path, streams=True, host_memory_reserve_bytes=read_host_memory().total_bytes - 1)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for _ in range(2):
            assert_bitwise_equal(grads_of(model, engine), reference)
    stats = engine.consume_stats()
    assert stats["tensors_kept_host_reserve"] > 0 and stats["bytes_spilled_to_disk"] == 0
    assert engine._staging == []
    assert sum("staging buffer" in record.getMessage() for record in caplog.records) == 1
    assert files_in(tmp_path) == []


def test_stats_summary_and_totals_count_the_disk(tmp_path) -> None:
    from hf_offload.stats import format_summary

    engine = disk_engine(tmp_path, streams=False)
    round_trip(engine, *(torch.randn(64, 64) for _ in range(4)))
    total = engine.consume_stats()
    assert total["bytes_spilled_to_disk"] == total["bytes_read_from_disk"] > 0
    assert "spilled to disk" in format_summary(total, "cpu")
    assert "spilled to disk" not in format_summary(cpu_engine().get_stats(), "cpu")


def test_an_unusable_directory_is_an_error_naming_the_option(tmp_path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with pytest.raises(DiskOffloadDirError, match="disk_offload_dir"):
        cpu_engine(disk_offload_dir=str(not_a_directory))
    with pytest.raises(DiskOffloadDirError, match="disk_offload_dir"):
        cpu_engine(disk_offload_dir=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"disk_offload_dir": ""}, "disk_offload_dir must be"),
        ({"disk_offload_dir": 3}, "disk_offload_dir must be"),
        ({"disk_reserve_bytes": 2**30}, "disk_reserve_bytes=1073741824 needs a disk_offload_dir"),
        ({"disk_offload_dir": "/tmp", "disk_reserve_bytes": -1}, "disk_reserve_bytes must be"),
    ],
)
def test_disk_options_are_validated(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        OffloadOptions(**options)


def test_the_default_reserve_is_a_tenth_of_the_disk_within_bounds(tmp_path, monkeypatch) -> None:
    from hf_offload.engine.disk_copies import default_disk_reserve_bytes

    gib = 2**30
    for total, reserve in [(1000 * gib, 100 * gib), (40 * gib, 8 * gib), (16 * gib, 4 * gib)]:
        usage = shutil.disk_usage(tmp_path)._replace(total=total)
        monkeypatch.setattr(shutil, "disk_usage", lambda path, usage=usage: usage)
        assert default_disk_reserve_bytes(str(tmp_path)) == reserve
