"""The disk tier: host copies that the pinned pool cannot hold, written to files and read back ahead of need.

At 512K tokens an 8B model's 32 layer inputs are 128 GiB, more than a host of 64-90 GB can pin; past the pool's cap
(or its reserve) those inputs stay on the GPU without it. A layer's backward there takes seconds, so a disk that reads
1-2 GB/s keeps up with a 4 GiB layer input read far enough ahead. This module is that third tier, on its own: what it
writes, with which threads, and when each file, buffer and thread ends. The engine spills what the pool refuses
through it with the option `disk_offload_dir` (`engine/disk_copies.py`, experimental); the planner does not count its
room and bandwidth yet (`measure_disk_bandwidth`).

**Files.** `DiskTier(directory, reserve_bytes)` makes one private run directory, `hf_offload-<pid>-<random>` (mode
0700, `tempfile.mkdtemp`), under `directory` (the option `disk_offload_dir`; by default `tempfile.gettempdir()`), and
writes into it one file per spilled tensor, `<n>.bin`, of the tensor's exact size, and nothing anywhere else. The
directory is made and a file written in it at construction: a directory that is missing, read-only or not a
directory is a `DiskOffloadDirError` (a `ValueError`) there, naming the option and the path, not a failure in the
middle of a step. Direct I/O (`O_DIRECT`) is probed there too: where the file system takes it, the aligned part of each
transfer (whole 4 KiB blocks from a 4 KiB-aligned address: pinned chunks are page-aligned) bypasses the page cache, so
that 100 GB written on a host short of RAM neither evicts the page cache nor doubles in it; the rest of a transfer
(an odd tail, an unaligned buffer, a file system that refuses, tmpfs) goes through the page cache, on the same file
descriptor (`O_DIRECT` is cleared with `fcntl`). Either way the bytes read back are the bytes written.

**Free space.** Before every spill the free space of the run directory's file system (`shutil.disk_usage`, the room
an unprivileged user has), less the bytes queued but not yet written, must stay at least `reserve_bytes` after the
tensor: else `spill` returns None, the caller keeps the tensor where it was, and `refusal` / `refusal_message` say
why (one warning's text, for the engine to log once; `REFUSAL_REASONS`). Processes sharing a disk each check on their
own: they could cross the reserve together by the writes they have in flight, no more.

**Threads.** `threads` worker threads (2 by default; daemon threads `hf_offload-disk-<i>`) do every transfer, so the
forward's thread and autograd's threads only queue work (a few microseconds); `os.write` and `os.readv` release the
GIL, so the transfers run beside training. Reads go before queued writes (a backward waits on a read; a write only
frees its source), and a read is queued only once its file is written (`_SpillFile.after_write`): no worker ever waits
for another, so one thread cannot deadlock. Transfers move 64 MiB per system call and stop between two when the tier
closes, so `close()` waits for no more than that; so does the exit hook, which must wait (10 s at most) before the
interpreter finalizes: a daemon thread still running then is ended as it next takes the GIL, which aborts the process
where that happens inside torch (a worker that frees the last reference to a source tensor).

**Lifetimes.**
- The source of a spill is referenced by the tier until its write ended and never written to. The caller must not
  change it, nor hand its memory to another copy (a pool block back to the pool, a staging buffer to the next tensor),
  until `handle.written()` has answered. True: the file holds the bytes and the source may go. False (an I/O error,
  the disk full despite the check, the handle released or the tier closed before the write): the bytes are still in
  the source, which the caller keeps; nothing is lost. The engine should keep the source until the write is
  confirmed, and only then let it go.
- The destination of `read_into` is referenced until the returned future is done, and must not be read or reused
  before: the read writes into it from a worker thread.
- A file lives from its write until the first of `handle.release()`, the end of a `read_into(..., release=True)` (read
  or failed), the handle's garbage collection (`weakref.finalize`), or the tier's end. A read in flight keeps its
  handle, a handle its tier: no file outlives what refers to it, and no tier dies under a live handle.
- The run directory and its threads live until `close()` (or `with DiskTier(...)`'s end, an exception or Ctrl-C
  included; closing twice does nothing), the tier's garbage collection, or the interpreter's exit: the module's one
  piece of state, `_LIVE_RUNS`, holds every tier's run that is not closed, for an `atexit` hook that closes them all.
  What no Python code runs after (SIGKILL, a SIGTERM nobody handles, `os._exit`, a power cut) leaves a directory
  `hf_offload-<pid>-*` behind, which may be deleted once that process is gone.

**Failures.** Nothing on a worker thread raises into training. A write that fails resolves its handle to False with
the error in `write_error`, removes its partial file and leaves the source alone. A read that fails (the file gone,
an I/O error) raises `DiskTierError` from its future, and its bytes are lost: after the write was confirmed the
engine freed the source, since keeping a second copy is what the host cannot afford. A disk that cannot read back
what it wrote is a broken machine, like a failing DIMM: the engine should let that error end the step, and the run
resume from its checkpoint.

**Locks.** `spill`, `read_into`, `release` and `stats` may be called from any thread (the forward's, autograd's, a
finalizer's). `_Run.lock` (reentrant: the tier's finalizer, which garbage collection may run inside a locked section,
takes it again) guards the closed flag, the bytes queued, the live files and the counters, and is held while a write
creates its file, so that no file appears after `close()` removed the directory. `_Run.ready` (a condition, also
reentrant) guards the two queues. `_SpillFile.lock` guards whether its write ended and the reads that wait for it. A
handle's finalizer takes no lock (one `dict.pop` forgets its file). A release sets `released` before it unlinks, and
a write checks it after its file exists, so one of them removes the file whichever comes first. Order: `_Run.lock`
before `_Run.ready`; a task runs with no lock held.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from .units import MIB, format_bytes

try:
    import fcntl
except ImportError:  # not POSIX: no direct I/O to switch off
    fcntl = None

__all__ = [
    "REFUSAL_REASONS",
    "DiskHandle",
    "DiskOffloadDirError",
    "DiskTier",
    "DiskTierError",
    "DiskTierStats",
    "measure_disk_bandwidth",
]

# Why a spill was refused (`DiskTier.refusal`), with the words a warning explains each reason in.
REFUSAL_REASONS: dict[str, str] = {
    "reserve": "writing it would have left less free disk space than the disk tier's reserve",
    "disk_usage": "the free space of the disk tier's file system could not be read",
    "closed": "the disk tier was closed",
}

_ALIGNMENT = 4096  # direct I/O's unit: a 4 KiB-sector disk's logical block, a multiple of a 512-byte one's
_IO_CHUNK_BYTES = 64 * MIB  # bytes per system call; a closing tier stops between two
_EXIT_WAIT_SECONDS = 10.0  # at the interpreter's exit, the longest wait for the workers to stop
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | _O_CLOEXEC

# Every tier's run that is not closed yet, for the exit hook below: the module's only state.
_LIVE_RUNS: set[_Run] = set()


class DiskOffloadDirError(ValueError):
    """The directory named for the disk tier (`disk_offload_dir`) cannot hold its files."""


class DiskTierError(RuntimeError):
    """A spilled tensor that cannot be written or read back: released, the tier closed, or the disk failed."""


@dataclass
class DiskTierStats:
    """What a tier did so far (`DiskTier.stats()` returns a copy).

    Attributes:
        tensors_spilled, bytes_spilled: writes that ended with the bytes in their file.
        tensors_read, bytes_read: reads that brought the bytes back.
        files_live, bytes_live: files on disk now.
        bytes_pending: spills queued or being written.
        write_seconds, read_seconds: the workers' time in transfers.
        write_wait_seconds, read_wait_seconds: the time callers blocked on them (`DiskHandle.written`,
            `DiskTier.wait`): where the disk held training up.
        write_failures, read_failures: transfers that an I/O error ended (not a release, not the tier closing).
        refusals: spills refused, by reason (`REFUSAL_REASONS`).
    """

    tensors_spilled: int = 0
    bytes_spilled: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    files_live: int = 0
    bytes_live: int = 0
    bytes_pending: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    write_wait_seconds: float = 0.0
    read_wait_seconds: float = 0.0
    write_failures: int = 0
    read_failures: int = 0
    refusals: Counter[str] = field(default_factory=Counter)


class _Run:
    """A tier's directory, worker threads and counters: what its finalizer and the exit hook close, apart from the
    tier object (a finalizer must not refer to what it finalizes)."""

    def __init__(self, directory: Path, threads: int, direct_io: bool) -> None:
        self.directory = directory
        self.direct_io = direct_io
        self.lock = threading.RLock()
        self.closed = False
        self.stats = DiskTierStats()
        self.live: dict[Path, int] = {}  # file -> its bytes
        self.refusal: str | None = None
        self.refusal_message: str | None = None
        self.ready = threading.Condition(threading.RLock())
        self._reads: deque[tuple[Future, Callable[[], None]]] = deque()
        self._writes: deque[tuple[Future, Callable[[], None]]] = deque()
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"hf_offload-disk-{index}", daemon=True)
                         for index in range(threads)]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def is_closed(self) -> bool:
        return self.closed

    def free_bytes(self) -> int:
        """The disk's free space (for an unprivileged user), less the bytes queued to be written."""
        return shutil.disk_usage(self.directory).free - self.stats.bytes_pending

    def submit(self, future: Future, task: Callable[[], None], read: bool) -> None:
        """Queues `task`, whose outcome `future` gets; a closed tier fails it at once."""
        with self.ready:
            if not self._stopping:
                (self._reads if read else self._writes).append((future, task))
                self.ready.notify()
                return
        future.set_exception(DiskTierError("the disk tier was closed"))

    def _work(self) -> None:
        while True:
            with self.ready:
                while not self._reads and not self._writes:
                    if self._stopping:
                        return
                    self.ready.wait()
                future, task = (self._reads or self._writes).popleft()
            if future.set_running_or_notify_cancel():
                try:
                    task()
                except BaseException as error:
                    future.set_exception(error)
                else:
                    future.set_result(None)
            del future, task  # the source or destination a task refers to goes with it, not with the next task

    def refuse(self, reason: str, message: str) -> None:
        with self.lock:
            self.stats.refusals[reason] += 1
            self.refusal, self.refusal_message = reason, message

    def wrote(self, file: _SpillFile, seconds: float, error: BaseException | None) -> None:
        with self.lock:
            self.stats.bytes_pending = max(self.stats.bytes_pending - file.nbytes, 0)
            self.stats.write_seconds += seconds
            if error is None:
                self.stats.tensors_spilled += 1
                self.stats.bytes_spilled += file.nbytes
                if not file.released and not self.closed:
                    self.live[file.path] = file.nbytes
            elif isinstance(error, OSError):
                self.stats.write_failures += 1

    def read(self, nbytes: int, seconds: float, error: BaseException | None) -> None:
        with self.lock:
            self.stats.read_seconds += seconds
            if error is None:
                self.stats.tensors_read += 1
                self.stats.bytes_read += nbytes
            elif isinstance(error, OSError):
                self.stats.read_failures += 1

    def waited(self, seconds: float, read: bool) -> None:
        with self.lock:
            if read:
                self.stats.read_wait_seconds += seconds
            else:
                self.stats.write_wait_seconds += seconds

    def forget(self, path: Path) -> None:
        # No lock: a finalizer calls it, which garbage collection may run on a thread holding `ready`; one dict.pop is
        # atomic by itself.
        self.live.pop(path, None)

    def snapshot(self) -> DiskTierStats:
        with self.lock:
            return replace(self.stats, refusals=Counter(self.stats.refusals), files_live=len(self.live),
                           bytes_live=sum(self.live.values()))  # fmt: skip

    def close(self, wait_seconds: float | None) -> None:
        """Stops the workers (what is queued fails at once, a transfer stops within 64 MiB), waits for them (at most
        `wait_seconds` in all; None: as long as they take) and removes the run directory with every file in it."""
        with self.lock:
            if self.closed:
                return
            self.closed = True  # from here on no write creates a file (`_SpillFile.write`)
        _LIVE_RUNS.discard(self)
        with self.ready:
            self._stopping = True
            self.ready.notify_all()
        deadline = None if wait_seconds is None else time.monotonic() + wait_seconds
        for thread in self._threads:
            if thread is not threading.current_thread():  # a finalizer that runs on a worker
                thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        shutil.rmtree(self.directory, ignore_errors=True)
        with self.lock:
            self.live.clear()
            self.stats.bytes_pending = 0


@atexit.register
def _close_live_runs() -> None:
    """At the interpreter's exit, after a normal end, an exception or Ctrl-C: every tier still open is closed, and its
    workers stopped before the interpreter finalizes. A daemon thread still running then is ended as it next takes
    the GIL, which aborts the process where that happens inside torch (a worker that frees the last reference to a
    source tensor: "terminate called without an active exception"). The wait is bounded, for a disk that hangs."""
    for run in list(_LIVE_RUNS):
        run.close(_EXIT_WAIT_SECONDS)


class _SpillFile:
    """One spilled tensor's file, shared by its handle, its handle's finalizer and the tasks: never the handle itself,
    so that the handle can be collected while its write runs."""

    __slots__ = ("run", "path", "nbytes", "released", "error", "lock", "_ended", "_waiting")

    def __init__(self, run: _Run, path: Path, nbytes: int) -> None:
        self.run, self.path, self.nbytes = run, path, nbytes
        self.released = False
        self.error: BaseException | None = None  # why the write failed, once it ended
        self.lock = threading.Lock()
        self._ended = nbytes == 0  # nothing to write
        self._waiting: list[Callable[[], None]] = []

    def write(self, data: np.ndarray) -> None:
        """The write task, on a worker: creates the file, writes `data` to it, records the outcome and starts the reads
        waiting for it."""
        run, error, start = self.run, None, time.perf_counter()
        try:
            if self.released:
                raise DiskTierError(f"{self.path} was released before it was written")
            with run.lock:  # close() sets `closed` under this lock before it removes the directory
                if run.closed:
                    raise DiskTierError("the disk tier was closed before the tensor was written")
                fd, direct = _open(self.path, _WRITE_FLAGS, run.direct_io and _direct_bytes(data) > 0)
            try:
                _write_all(fd, data, direct, run.is_closed)
            finally:
                os.close(fd)
            if self.released:
                raise DiskTierError(f"{self.path} was released while it was written")
        except BaseException as failure:
            error = failure
            _unlink(self.path)  # a partial file, a released one, or none
            raise
        finally:
            run.wrote(self, time.perf_counter() - start, error)
            self._end(error)

    def _end(self, error: BaseException | None) -> None:
        with self.lock:
            self.error, self._ended = error, True
            waiting, self._waiting = self._waiting, []
        for start in waiting:
            start()

    def after_write(self, start: Callable[[], None]) -> None:
        """Calls `start` once the write ended: now, or on the worker that ends it."""
        with self.lock:
            if not self._ended:
                self._waiting.append(start)
                return
        start()

    def remove(self) -> None:
        """Removes the file, now or when its write ends; idempotent, and safe from any thread and from a finalizer."""
        self.released = True  # before the unlink: a write that ends later sees it and removes the file itself
        if self.nbytes:
            _unlink(self.path)
            self.run.forget(self.path)


class DiskHandle:
    """One tensor spilled to a file by `DiskTier.spill`: its write, its reads and its file's lifetime (the module's
    docstring says when each ends).

    Attributes:
        nbytes: the tensor's bytes; `path`: its file (None for a tensor of 0 bytes, which gets none).
    """

    __slots__ = ("nbytes", "path", "_tier", "_file", "_write", "_finalizer", "__weakref__")

    def __init__(self, tier: DiskTier, file: _SpillFile, write: Future) -> None:
        self.nbytes, self.path = file.nbytes, (file.path if file.nbytes else None)
        self._tier, self._file, self._write = tier, file, write
        self._finalizer = weakref.finalize(self, file.remove)
        self._finalizer.atexit = False  # at exit the tier's run removes the directory whole

    def write_done(self) -> bool:
        """Whether the write ended, either way (a poll; `written` then answers at once)."""
        return self._write.done()

    def written(self, timeout: float | None = None) -> bool:
        """Waits up to `timeout` seconds (None: as long as it takes) for the write to end: True when the file holds the
        bytes, False when it failed (`write_error` says why) and they are only in the source. Either way the source is
        the caller's again. Raises TimeoutError (`concurrent.futures`') when the write had not ended by then. The time
        it blocked counts as `write_wait_seconds`."""
        if not self._write.done():
            start = time.perf_counter()
            try:
                futures.wait([self._write], timeout)
            finally:
                self._tier._run.waited(time.perf_counter() - start, read=False)
        return self._write.exception(timeout=0) is None

    @property
    def write_error(self) -> BaseException | None:
        """Why the write failed (an OSError from the disk, a DiskTierError when released or closed first), once it
        ended; None while it runs or when it succeeded."""
        return self._write.exception(timeout=0) if self._write.done() else None

    @property
    def released(self) -> bool:
        return self._file.released

    def read_into(self, destination: torch.Tensor, *, release: bool = False) -> Future[None]:
        """Reads the bytes back into `destination` (a contiguous CPU tensor of `nbytes` bytes, of any dtype: a pinned
        buffer) on a worker thread, once the write ended; may be called before it has. Bitwise the bytes written.

        Returns a future whose `result()` raises `DiskTierError` when the write had failed, the file was released or
        the tier closed first, or the read failed (`DiskTier.wait` counts the time it blocks). `destination` must not
        be used before the future is done. `release=True` removes the file once the read ended, either way: for a
        tensor needed once (the engine's reloads), no file is left and no release to call.
        """
        data = _bytes_of(destination, "destination")
        if data.nbytes != self.nbytes:
            raise ValueError(f"destination has {data.nbytes} bytes, the spilled tensor {self.nbytes}")
        result: Future[None] = Future()
        if not self.nbytes:
            result.set_result(None)
            return result
        file = self._file

        def start() -> None:
            if file.error is not None:
                result.set_exception(DiskTierError(f"{file.path} was not written ({file.error}): nothing to read"))
                if release:
                    file.remove()
            else:
                self._tier._run.submit(result, lambda: self._read(data, release), read=True)

        file.after_write(start)
        return result

    def _read(self, data: np.ndarray, release: bool) -> None:
        """The read task, on a worker; it refers to the handle, so a read in flight keeps its file."""
        file, error, start = self._file, None, time.perf_counter()
        run = file.run
        try:
            if file.released or run.closed:
                what = f"{file.path} was released" if file.released else "the disk tier was closed"
                raise DiskTierError(f"{what} before it was read back")
            fd, direct = _open(file.path, _READ_FLAGS, run.direct_io and _direct_bytes(data) > 0)
            try:
                _read_all(fd, data, direct, run.is_closed)
            finally:
                os.close(fd)
        except OSError as failure:
            error = failure
            message = f"reading {format_bytes(file.nbytes)} back from {file.path} failed: {failure}"
            raise DiskTierError(message) from failure
        except BaseException as failure:
            error = failure
            raise
        finally:
            run.read(file.nbytes, time.perf_counter() - start, error)
            if release:
                file.remove()

    def release(self) -> None:
        """Removes the file (at once, or as its write ends); idempotent. Reads queued after it fail."""
        self._finalizer()

    def __repr__(self) -> str:
        state = "released" if self.released else "written" if self._file._ended and not self._file.error else "open"
        return f"DiskHandle({format_bytes(self.nbytes)}, {state}, {self.path})"


class DiskTier:
    """Spills host copies to files in a private directory and reads them back (the module's docstring says how).

    Args:
        directory: where the run directory goes (the option `disk_offload_dir`); None: `tempfile.gettempdir()`.
        reserve_bytes: free disk space every spill leaves.
        threads: worker threads that do the transfers.
        direct_io: use `O_DIRECT` where the file system takes it (probed here); False: always through the page cache.

    Attributes:
        directory: the run directory, which holds the files; `direct_io`: whether transfers use `O_DIRECT`.

    Raises:
        DiskOffloadDirError: `directory` is missing, not a directory, or not writable.
    """

    def __init__(self, directory: str | os.PathLike[str] | None, reserve_bytes: int, *, threads: int = 2,
                 direct_io: bool = True) -> None:  # fmt: skip
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be at least 0, not {reserve_bytes}")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        parent = Path(tempfile.gettempdir() if directory is None else directory)
        try:
            run_directory = Path(tempfile.mkdtemp(prefix=f"hf_offload-{os.getpid()}-", dir=parent))
        except OSError as error:
            raise DiskOffloadDirError(_unusable_directory(parent, directory, error)) from error
        try:
            probed = _probe_direct_io(run_directory)
        except OSError as error:
            shutil.rmtree(run_directory, ignore_errors=True)
            raise DiskOffloadDirError(_unusable_directory(parent, directory, error)) from error
        self.reserve_bytes = reserve_bytes
        self.directory = run_directory
        self.direct_io = direct_io and probed
        self._run = _Run(run_directory, threads, self.direct_io)
        self._names = 0
        _LIVE_RUNS.add(self._run)
        self._finalizer = weakref.finalize(self, self._run.close, None)
        self._finalizer.atexit = False  # `_close_live_runs` closes it at exit, with a bounded wait

    @property
    def closed(self) -> bool:
        return self._run.closed

    @property
    def refusal(self) -> str | None:
        """Why the last refused spill was refused (a key of `REFUSAL_REASONS`), or None."""
        return self._run.refusal

    @property
    def refusal_message(self) -> str | None:
        """A warning's text for the last refusal, with its figures."""
        return self._run.refusal_message

    def room_bytes(self) -> int:
        """What spills may take now before the disk's free space falls to the reserve (queued writes counted): the
        room a memory plan may count on. 0 once closed, or where the free space cannot be read."""
        run = self._run
        with run.lock:
            if run.closed:
                return 0
            try:
                return max(0, run.free_bytes() - self.reserve_bytes)
            except OSError:
                return 0

    def spill(self, source: torch.Tensor) -> DiskHandle | None:
        """Queues the write of `source`'s bytes (a contiguous CPU tensor: a pinned staging buffer, a host block) to a
        new file and returns its handle, or None where the disk's free space would fall below the reserve or the tier
        is closed (`refusal` says which): the caller then keeps the tensor where it was. `source` must not be changed
        or reused until `handle.written()` has answered. A tensor of 0 bytes gets a handle and no file."""
        data = _bytes_of(source, "source")
        nbytes, run = data.nbytes, self._run
        with run.lock:  # one check at a time: each counts the bytes the others queued
            if run.closed:
                return self._refuse("closed", nbytes, f"the disk tier in {run.directory} was closed")
            if nbytes:
                try:
                    free = run.free_bytes()
                except OSError as error:
                    return self._refuse("disk_usage", nbytes, f"the free space of {run.directory} is unknown ({error})")
                if free - nbytes < self.reserve_bytes:
                    return self._refuse("reserve", nbytes, self._too_little(free))
                run.stats.bytes_pending += nbytes
            self._names += 1
            file = _SpillFile(run, run.directory / f"{self._names}.bin", nbytes)
            write: Future[None] = Future()
            if nbytes:
                run.submit(write, lambda: file.write(data), read=False)
            else:
                write.set_result(None)
        return DiskHandle(self, file, write)

    def _too_little(self, free: int) -> str:
        reserve = format_bytes(self.reserve_bytes)
        return f"{format_bytes(max(free, 0))} free in {self.directory}, with the disk tier's reserve of {reserve}"

    def _refuse(self, reason: str, nbytes: int, why: str) -> None:
        self._run.refuse(reason, f"hf_offload: the disk tier did not take a tensor of {format_bytes(nbytes)}: {why}; "
                                 f"tensors it does not take stay where they were")  # fmt: skip
        return None

    def wait(self, read: Future[None], timeout: float | None = None) -> None:
        """Waits for a `read_into` future and raises its error (TimeoutError, `concurrent.futures`', after `timeout`
        seconds); the time it blocked counts as `read_wait_seconds`."""
        if not read.done():
            start = time.perf_counter()
            try:
                futures.wait([read], timeout)
            finally:
                self._run.waited(time.perf_counter() - start, read=True)
        read.result(timeout=0)

    def stats(self) -> DiskTierStats:
        return self._run.snapshot()

    def close(self) -> None:
        """Stops the workers (queued transfers fail, one in flight stops within 64 MiB), waits for them, and removes
        the run directory with every file; later spills are refused. Closing again does nothing."""
        self._finalizer()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DiskTier({self.directory}, reserve {format_bytes(self.reserve_bytes)}, direct I/O "
                f"{'on' if self.direct_io else 'off'}{', closed' if self.closed else ''})")  # fmt: skip


def measure_disk_bandwidth(tier: DiskTier, nbytes: int = 64 * MIB) -> tuple[float, float]:
    """Writes `nbytes` to a scratch file in the tier's directory and reads them back on this thread, as the workers
    do (direct I/O where the tier uses it), and returns (write, read) bytes per second, for the planner. Through the
    page cache, the write is timed to `fsync` and the cache is dropped before the read, so that the figures are the
    disk's, not memory's. Counted in no statistic; the file is removed.

    Raises:
        DiskTierError: the tier is closed, or the disk has not `nbytes` to spare above the reserve.
    """
    run = tier._run
    array = _page_aligned_bytes(nbytes).random_(0, 256).numpy()  # incompressible, for a file system that compresses
    path = run.directory / "bandwidth.bin"
    with run.lock:
        if run.closed:
            raise DiskTierError("the disk tier was closed")
        free = run.free_bytes()
        if free - nbytes < tier.reserve_bytes:
            raise DiskTierError(f"too little room to measure with {format_bytes(nbytes)}: {tier._too_little(free)}")
        fd, direct = _open(path, _WRITE_FLAGS, run.direct_io and _direct_bytes(array) > 0)
    try:
        try:
            start = time.perf_counter()
            _write_all(fd, array, direct, run.is_closed)
            os.fsync(fd)
            write_seconds = time.perf_counter() - start
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        start = time.perf_counter()
        fd, direct = _open(path, _READ_FLAGS, direct)
        try:
            _read_all(fd, array, direct, run.is_closed)
        finally:
            os.close(fd)
        read_seconds = time.perf_counter() - start
    finally:
        _unlink(path)
    return nbytes / max(write_seconds, 1e-9), nbytes / max(read_seconds, 1e-9)


def _unusable_directory(parent: Path, directory: str | os.PathLike[str] | None, error: OSError) -> str:
    reason = error.strerror or str(error)
    if directory is None:
        return (f"the system's temporary directory {str(parent)!r} cannot hold the disk tier's files ({reason}): "
                f"name a writable directory with disk_offload_dir")  # fmt: skip
    return (f"disk_offload_dir={str(parent)!r} cannot hold the disk tier's files ({reason}): name a writable "
            f"directory, or leave disk_offload_dir unset for the system's temporary directory "
            f"({tempfile.gettempdir()!r})")  # fmt: skip


def _bytes_of(tensor: torch.Tensor, name: str) -> np.ndarray:
    """`tensor`'s bytes as a flat uint8 array over its memory (no copy)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU tensor (a pinned buffer, a host block), not a "
                         f"{'contiguous' if tensor.is_contiguous() else 'non-contiguous'} {tensor.layout} tensor on "
                         f"{tensor.device}")  # fmt: skip
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _page_aligned_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised CPU byte tensor at a 4 KiB-aligned address, as pinned chunks are (direct I/O needs it)."""
    raw = torch.empty(nbytes + _ALIGNMENT, dtype=torch.uint8)
    offset = -raw.data_ptr() % _ALIGNMENT
    return raw[offset : offset + nbytes]


def _direct_bytes(data: np.ndarray) -> int:
    """How many of `data`'s first bytes direct I/O may move: whole aligned blocks, from an aligned address."""
    if data.ctypes.data % _ALIGNMENT:
        return 0
    return data.nbytes // _ALIGNMENT * _ALIGNMENT


def _probe_direct_io(directory: Path) -> bool:
    """Writes a file in `directory` through the page cache (its OSError: the directory is not usable), then with
    `O_DIRECT`: whether the file system takes direct I/O."""
    path = directory / "probe.bin"
    try:
        fd = os.open(path, _WRITE_FLAGS, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
        if not _O_DIRECT or fcntl is None:
            return False
        block = _page_aligned_bytes(_ALIGNMENT).zero_().numpy()
        try:
            fd = os.open(path, os.O_WRONLY | _O_DIRECT | _O_CLOEXEC)
            try:
                return os.write(fd, memoryview(block)) == _ALIGNMENT
            finally:
                os.close(fd)
        except OSError:
            return False
    finally:
        _unlink(path)


def _open(path: Path, flags: int, direct: bool) -> tuple[int, bool]:
    """Opens `path`, with `O_DIRECT` where `direct` and the file system takes it; returns the fd and whether it did."""
    if direct:
        try:
            return os.open(path, flags | _O_DIRECT, 0o600), True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


def _write_some(fd: int, view: memoryview) -> int:
    return os.write(fd, view)


def _read_some(fd: int, view: memoryview) -> int:
    return os.readv(fd, [view])


def _write_all(fd: int, data: np.ndarray, direct: bool, closed: Callable[[], bool]) -> None:
    _transfer(fd, memoryview(data), _write_some, _direct_bytes(data) if direct else 0, closed)


def _read_all(fd: int, data: np.ndarray, direct: bool, closed: Callable[[], bool]) -> None:
    _transfer(fd, memoryview(data), _read_some, _direct_bytes(data) if direct else 0, closed)


def _transfer(fd: int, view: memoryview, move: Callable[[int, memoryview], int], direct_bytes: int,
              closed: Callable[[], bool]) -> None:  # fmt: skip
    """Moves `view`'s bytes through `fd` from its position, 64 MiB a call: the first `direct_bytes` with the fd's
    `O_DIRECT` set (it is, where they are not 0), the rest with it cleared. A file system that refuses a direct
    transfer (EINVAL) or moves part of a block gets the rest through the page cache. Stops when `closed()`."""
    done, total, fd_direct = 0, len(view), direct_bytes > 0
    while done < total:
        if closed():
            raise DiskTierError("the disk tier was closed during a transfer")
        if fd_direct and (done >= direct_bytes or done % _ALIGNMENT):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
            fd_direct = False
        end = min(done + _IO_CHUNK_BYTES, direct_bytes if fd_direct else total)
        try:
            moved = move(fd, view[done:end])
        except OSError as error:
            if not (fd_direct and error.errno == errno.EINVAL):
                raise
            direct_bytes = 0  # the next turn clears O_DIRECT
            continue
        if moved <= 0:
            raise OSError(errno.EIO, f"the transfer stopped after {done} of {total} bytes (the file is shorter)")
        done += moved


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already (a release and a write's end race to it), or the directory with it
        pass
