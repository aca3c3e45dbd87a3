"""The disk tier (`hf_offload/disk_tier.py`) on its own: bytes spilled to files come back bitwise, the disk's reserve
is kept, every file goes when what refers to it goes (also at the interpreter's exit), and a failing disk never
raises into the caller nor costs it the source."""

import errno
import gc
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hf_offload import disk_tier
from hf_offload.disk_tier import DiskHandle, DiskOffloadDirError, DiskTier, DiskTierError, measure_disk_bandwidth

ROOT = Path(__file__).resolve().parents[1]
KIB = 1024
Usage = namedtuple("Usage", "total used free")


def random_tensor(nbytes: int, dtype: torch.dtype, seed: int = 0, aligned: bool = True) -> torch.Tensor:
    """`nbytes` random bytes (NaNs and all) seen as `dtype`, at a 4 KiB-aligned address or 64 bytes past one."""
    buffer = disk_tier._page_aligned_bytes(nbytes + 64)
    buffer = buffer[:nbytes] if aligned else buffer[64:]
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buffer.view(dtype)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def files(tier: DiskTier) -> list[str]:
    return sorted(os.listdir(tier.directory))


@pytest.fixture
def gate(monkeypatch):
    """Writes wait until the event is set: a write kept in flight for as long as a test needs."""
    event, write_all = threading.Event(), disk_tier._write_all

    def held(*args):
        assert event.wait(10)
        write_all(*args)

    monkeypatch.setattr(disk_tier, "_write_all", held)
    yield event
    event.set()


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize(
    "nbytes, dtype",
    [(2, torch.bfloat16), (510, torch.bfloat16), (4096, torch.float32), (12_345, torch.uint8),
     (3 * 4096 + 8, torch.int64), (1 << 20, torch.bool), (99_000, torch.complex64)],
)  # fmt: skip
def test_spilled_bytes_come_back_bitwise(tmp_path, direct_io, nbytes, dtype):
    with DiskTier(tmp_path, 0, direct_io=direct_io) as tier:
        for aligned in (True, False):
            source = random_tensor(nbytes, dtype, seed=nbytes, aligned=aligned)
            kept = raw(source).clone()  # as bytes: a clone of booleans other than 0 and 1 makes them 0 and 1
            handle = tier.spill(source)
            assert handle.written() and handle.write_error is None and handle.nbytes == nbytes
            assert os.path.getsize(handle.path) == nbytes
            destination = torch.empty_like(source)
            tier.wait(handle.read_into(destination))
            assert torch.equal(raw(destination), kept) and torch.equal(raw(source), kept)


def direct(fd: int) -> bool:
    """Whether `fd` has O_DIRECT set now."""
    return bool(disk_tier.fcntl.fcntl(fd, disk_tier.fcntl.F_GETFL) & os.O_DIRECT)


def test_direct_io_moves_the_aligned_blocks_and_the_page_cache_the_rest(tmp_path, monkeypatch):
    transfers, transfer = [], disk_tier._transfer

    def spy(fd, view, move, direct_bytes, closed):
        transfers.append((move.__name__, direct_bytes, direct(fd)))
        transfer(fd, view, move, direct_bytes, closed)

    monkeypatch.setattr(disk_tier, "_transfer", spy)
    with DiskTier(tmp_path, 0) as tier:
        if not tier.direct_io:
            pytest.skip(f"{tmp_path}'s file system does not take O_DIRECT")
        for aligned in (True, False):
            source = random_tensor(2 * 4096 + 100, torch.uint8, aligned=aligned)
            destination = random_tensor(source.numel(), torch.uint8, seed=1, aligned=aligned)
            tier.wait(tier.spill(source).read_into(destination))
            assert torch.equal(destination, source)
    assert transfers == [("_write_some", 8192, True), ("_read_some", 8192, True),
                         ("_write_some", 0, False), ("_read_some", 0, False)]  # fmt: skip
    with DiskTier(tmp_path, 0, direct_io=False) as buffered:
        assert not buffered.direct_io


def test_a_file_system_that_refuses_a_direct_transfer_gets_it_through_the_page_cache(tmp_path, monkeypatch):
    refused = []

    def refusing(real):
        def move(fd, view):
            if direct(fd):
                refused.append(real.__name__)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, view)

        return move

    monkeypatch.setattr(disk_tier, "_write_some", refusing(disk_tier._write_some))
    monkeypatch.setattr(disk_tier, "_read_some", refusing(disk_tier._read_some))
    with DiskTier(tmp_path, 0) as tier:
        if not tier.direct_io:
            pytest.skip(f"{tmp_path}'s file system does not take O_DIRECT")
        source, destination = random_tensor(5 * 4096 + 3, torch.uint8), random_tensor(5 * 4096 + 3, torch.uint8, 1)
        handle = tier.spill(source)
        tier.wait(handle.read_into(destination))
        assert torch.equal(destination, source) and handle.written()
        assert refused == ["_write_some", "_read_some"] and tier.stats().write_failures == 0


def test_a_tensor_of_0_bytes_gets_a_handle_and_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100, 100, 0))  # a full disk: writing 0 bytes is fine
    with DiskTier(tmp_path, 1 << 30) as tier:
        handle = tier.spill(torch.empty(0, 7, dtype=torch.bfloat16))
        assert handle is not None and handle.nbytes == 0 and handle.path is None and handle.written()
        future = handle.read_into(torch.empty(0))
        assert future.done() and future.result() is None
        handle.release()
        stats = tier.stats()
        assert files(tier) == [] and stats.files_live == 0 and stats.bytes_spilled == 0 and not stats.refusals


def test_many_threads_spill_and_read_back_at_once(tmp_path):
    sizes = [1 + (seed * 7919) % (300 * KIB) for seed in range(48)]

    def round_trip(seed: int) -> tuple[bool, DiskHandle]:
        source = random_tensor(sizes[seed], torch.uint8, seed, aligned=seed % 3 != 0)
        handle = tier.spill(source)
        destination = torch.empty_like(source)
        tier.wait(handle.read_into(destination, release=seed % 2 == 0))  # may be queued before its write ends
        return torch.equal(destination, source), handle

    with DiskTier(tmp_path, 0, threads=2) as tier, ThreadPoolExecutor(4) as callers:
        outcomes = list(callers.map(round_trip, range(48)))
        stats = tier.stats()
        assert all(equal for equal, _ in outcomes)
        assert stats.tensors_spilled == stats.tensors_read == 48
        assert stats.bytes_spilled == stats.bytes_read == sum(sizes)
        kept = [handle for _, handle in outcomes if not handle.released]
        assert stats.files_live == len(files(tier)) == len(kept) == 24
        assert stats.bytes_live == sum(handle.nbytes for handle in kept)
        assert stats.bytes_pending == 0 and stats.write_failures == stats.read_failures == 0


def test_a_read_goes_before_the_writes_queued_ahead_of_it(tmp_path, gate, monkeypatch):
    order, read_all = [], disk_tier._read_all
    monkeypatch.setattr(disk_tier, "_read_all", lambda *args: (order.append("read"), read_all(*args))[1])
    with DiskTier(tmp_path, 0, threads=1) as tier:
        gate.set()
        first = tier.spill(random_tensor(4 * KIB, torch.uint8))
        assert first.written()
        gate.clear()
        held, queued = tier.spill(random_tensor(KIB, torch.uint8, 1)), tier.spill(random_tensor(KIB, torch.uint8, 2))
        read = first.read_into(torch.empty(4 * KIB, dtype=torch.uint8))
        queued._file.after_write(lambda: order.append("queued write"))
        gate.set()
        tier.wait(read)
        assert held.written() and queued.written() and order == ["read", "queued write"]


def test_a_spill_that_would_cross_the_reserve_is_refused(tmp_path, monkeypatch, gate):
    free = 1 << 20
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, (1 << 30) - free, free))
    with DiskTier(tmp_path, 512 * KIB) as tier:
        assert tier.room_bytes() == 512 * KIB  # what a memory plan may count on
        assert tier.spill(random_tensor(600 * KIB, torch.uint8)) is None
        assert files(tier) == [] and tier.refusal == "reserve" and tier.stats().refusals == {"reserve": 1}
        assert "600.00 KiB" in tier.refusal_message and "512.00 KiB" in tier.refusal_message
        assert "stay where they were" in tier.refusal_message
        # Writes queued and not yet on disk count: the disk still reports 1 MiB free while 400 KiB wait to be written.
        handle = tier.spill(random_tensor(400 * KIB, torch.uint8))
        assert handle is not None and tier.stats().bytes_pending == 400 * KIB and tier.room_bytes() == 112 * KIB
        assert tier.spill(random_tensor(200 * KIB, torch.uint8)) is None and tier.stats().refusals == {"reserve": 2}
        gate.set()
        assert handle.written() and tier.stats().bytes_pending == 0
        assert tier.spill(random_tensor(200 * KIB, torch.uint8)) is not None
    assert tier.room_bytes() == 0  # closed


def test_a_disk_whose_free_space_cannot_be_read_is_refused(tmp_path, monkeypatch):
    def unreadable(path):
        raise OSError(errno.EIO, "Input/output error")

    with DiskTier(tmp_path, 0) as tier:
        monkeypatch.setattr(shutil, "disk_usage", unreadable)
        assert tier.spill(random_tensor(KIB, torch.uint8)) is None and tier.refusal == "disk_usage"
        assert tier.room_bytes() == 0
        assert "Input/output error" in tier.refusal_message and files(tier) == []


def test_a_failed_write_resolves_its_handle_and_leaves_the_source(tmp_path, monkeypatch):
    def disk_full(fd, data, direct, closed):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "_write_all", disk_full)
    with DiskTier(tmp_path, 0) as tier:
        source = random_tensor(64 * KIB, torch.bfloat16)
        kept = raw(source).clone()
        handle = tier.spill(source)  # does not raise
        assert handle.written() is False and isinstance(handle.write_error, OSError)
        assert handle.write_error.errno == errno.ENOSPC
        assert torch.equal(raw(source), kept) and files(tier) == []  # the file it had made is gone
        read = handle.read_into(torch.empty_like(source))
        with pytest.raises(DiskTierError, match="was not written .*No space left"):
            tier.wait(read)
        stats = tier.stats()
        assert stats.write_failures == 1 and stats.bytes_spilled == 0 and stats.files_live == stats.bytes_pending == 0


def test_a_failed_read_raises_a_clear_error_when_awaited(tmp_path):
    with DiskTier(tmp_path, 0) as tier:
        handle = tier.spill(random_tensor(8 * KIB, torch.uint8))
        assert handle.written()
        os.unlink(handle.path)  # the file lost behind the tier's back
        read = handle.read_into(torch.empty(8 * KIB, dtype=torch.uint8))
        with pytest.raises(DiskTierError, match=re.escape(f"reading 8.00 KiB back from {handle.path} failed")):
            tier.wait(read)
        assert tier.stats().read_failures == 1 and tier.stats().bytes_read == 0


def test_files_go_on_release_and_on_a_read_that_releases(tmp_path):
    with DiskTier(tmp_path, 0) as tier:
        released, read_once, kept = (tier.spill(random_tensor(KIB, torch.uint8, seed)) for seed in range(3))
        assert all(handle.written() for handle in (released, read_once, kept)) and len(files(tier)) == 3
        released.release()
        released.release()
        tier.wait(read_once.read_into(torch.empty(KIB, dtype=torch.uint8), release=True))
        assert files(tier) == [kept.path.name] and tier.stats().files_live == 1 and tier.stats().bytes_live == KIB
        with pytest.raises(DiskTierError, match="released before it was read"):
            tier.wait(released.read_into(torch.empty(KIB, dtype=torch.uint8)))


def test_a_handle_released_or_dropped_while_it_is_written_leaves_no_file(tmp_path, gate):
    with DiskTier(tmp_path, 0) as tier:
        released = tier.spill(random_tensor(KIB, torch.uint8))
        dropped = tier.spill(random_tensor(KIB, torch.uint8, 1))
        waiting = tier.spill(random_tensor(KIB, torch.uint8, 2))
        released.release()
        del dropped
        gc.collect()
        gate.set()
        assert waiting.written() and released.written() is False
        assert files(tier) == [waiting.path.name] and tier.stats().files_live == 1


def test_a_collected_handle_removes_its_file(tmp_path):
    with DiskTier(tmp_path, 0) as tier:
        handle = tier.spill(random_tensor(KIB, torch.uint8))
        assert handle.written() and len(files(tier)) == 1
        del handle
        gc.collect()
        assert files(tier) == [] and tier.stats().files_live == 0


def test_close_removes_everything_and_refuses_what_comes_after(tmp_path):
    tier = DiskTier(tmp_path, 0)
    handles = [tier.spill(random_tensor(KIB, torch.uint8, seed)) for seed in range(3)]
    assert all(handle.written() for handle in handles) and tier.directory.is_dir()
    tier.close()
    assert list(tmp_path.iterdir()) == [] and tier.closed and tier.stats().files_live == 0
    tier.close()  # twice: nothing
    assert tier.spill(random_tensor(KIB, torch.uint8)) is None and tier.refusal == "closed"
    with pytest.raises(DiskTierError, match="closed"):
        tier.wait(handles[0].read_into(torch.empty(KIB, dtype=torch.uint8)))
    handles[1].release()
    assert list(tmp_path.iterdir()) == []


def test_close_stops_the_write_in_flight_and_fails_the_queued_ones(tmp_path, gate):
    tier = DiskTier(tmp_path, 0, threads=1)
    held, queued = tier.spill(random_tensor(KIB, torch.uint8)), tier.spill(random_tensor(KIB, torch.uint8, 1))
    read = queued.read_into(torch.empty(KIB, dtype=torch.uint8))

    def release_the_held_write_once_closing():
        while not tier.closed:
            time.sleep(0.001)
        gate.set()

    threading.Thread(target=release_the_held_write_once_closing, daemon=True).start()
    tier.close()
    assert held.written() is False and queued.written() is False
    assert isinstance(queued.write_error, DiskTierError) and "closed" in str(queued.write_error)
    with pytest.raises(DiskTierError):
        read.result(timeout=5)
    assert list(tmp_path.iterdir()) == []


def test_an_exception_inside_the_with_block_leaves_no_file(tmp_path):
    with pytest.raises(KeyError), DiskTier(tmp_path, 0) as tier:
        handle = tier.spill(random_tensor(KIB, torch.uint8))
        assert handle.written() and files(tier)
        raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_collected_tier_removes_its_directory_and_a_live_handle_keeps_it(tmp_path):
    tier = DiskTier(tmp_path, 0)
    handle = tier.spill(random_tensor(KIB, torch.uint8))
    directory = tier.directory
    del tier
    gc.collect()
    assert handle.written() and directory.is_dir() and os.listdir(directory) == [handle.path.name]
    destination = torch.empty(KIB, dtype=torch.uint8)
    handle._tier.wait(handle.read_into(destination))
    assert torch.equal(destination, random_tensor(KIB, torch.uint8))
    del handle, destination
    gc.collect()
    assert list(tmp_path.iterdir()) == []


EXITING = """
import os, sys, torch
from hf_offload.disk_tier import DiskTier
tier = DiskTier(sys.argv[1], 0)
first = tier.spill(torch.full((1 << 20,), 7, dtype=torch.uint8))
assert first.written()
in_flight = [tier.spill(torch.zeros(32 << 20, dtype=torch.uint8)) for _ in range(4)]
print(tier.directory, len(os.listdir(tier.directory)), flush=True)
if sys.argv[2] == "interrupt":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_the_interpreter_exit_removes_the_directory(tmp_path, how):
    done = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path), how], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)  # fmt: skip
    assert len(done.stdout.split()) == 2, done.stderr
    directory, written = done.stdout.split()
    assert Path(directory).parent == tmp_path and int(written) >= 1  # it had written there
    assert ("KeyboardInterrupt" in done.stderr) == (how == "interrupt") and (done.returncode == 0) == (how == "exit")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_cannot_hold_files_is_an_error_naming_the_option(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for path, reason in [(a_file, "Not a directory"), (tmp_path / "missing", "No such file or directory")]:
        expected = re.escape(f"disk_offload_dir='{path}' cannot hold") + f".*{reason}"
        with pytest.raises(DiskOffloadDirError, match=expected):
            DiskTier(path, 0)
    assert issubclass(DiskOffloadDirError, ValueError) and sorted(tmp_path.iterdir()) == [a_file]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only directory")
def test_a_read_only_directory_is_an_error_naming_the_option(tmp_path):
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o500)
    expected = re.escape(f"disk_offload_dir='{read_only}' cannot hold") + ".*Permission denied"
    with pytest.raises(DiskOffloadDirError, match=expected):
        DiskTier(read_only, 0)


def test_what_is_not_a_contiguous_cpu_tensor_of_the_right_size_is_refused_at_the_call(tmp_path):
    with DiskTier(tmp_path, 0) as tier:
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            tier.spill(torch.zeros(4, 4).t())
        handle = tier.spill(torch.zeros(16))
        with pytest.raises(ValueError, match="destination has 32 bytes, the spilled tensor 64"):
            handle.read_into(torch.zeros(8))
    with pytest.raises(ValueError, match="reserve_bytes"):
        DiskTier(tmp_path, -1)


def test_waits_are_counted(tmp_path, gate):
    with DiskTier(tmp_path, 0) as tier:
        handle = tier.spill(random_tensor(KIB, torch.uint8))
        threading.Timer(0.1, gate.set).start()
        assert handle.written()
        tier.wait(handle.read_into(torch.empty(KIB, dtype=torch.uint8)))
        stats = tier.stats()
        assert 0.05 < stats.write_wait_seconds < 5 and 0 <= stats.read_wait_seconds < 5
        assert stats.write_seconds >= 0.05  # the worker's time, the held write's included


def test_the_bandwidth_is_measured_on_a_scratch_file_that_goes(tmp_path, monkeypatch):
    with DiskTier(tmp_path, 0) as tier:
        write, read = measure_disk_bandwidth(tier, 4 << 20)
        assert write > 1e6 and read > 1e6  # bytes per second: any disk beats 1 MB/s
        assert files(tier) == [] and tier.stats().bytes_spilled == 0
        monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 29, 1 << 21))
        with pytest.raises(DiskTierError, match="too little room to measure with 4.00 MiB"):
            measure_disk_bandwidth(tier, 4 << 20)
