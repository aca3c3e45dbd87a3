"""The disk tier in the engine: the copies the pinned pool refuses, spilled to files (`hf_offload.disk_tier`).

Only with the option `disk_offload_dir`. Without it the engine holds no tier and nothing here runs: only an engine
with one becomes a subclass (`_with_disk`) whose methods poll the tier (`_release_finished`, `_prefetch`, `_reload`,
`_reload_now`), so the hooks of an engine without it do no work and no lookup more than before; the pack hook asks
`self._disk` once, where the pool refused a copy.

Lifetimes, on a GPU:
  * A refused tensor's span goes D2H into a pinned staging buffer on the D2H stream, after an event on the compute
    stream, as a pool block's copy does (`_copy_out`); its GPU original stays referenced until the copy's event has
    completed. The staging set is at most two buffers, each as large as the largest tensor spilled so far, allocated
    at first need and counted against no cap and no memory plan, but never past the host's reserve (the pool's): a
    tensor with no staging buffer to be had stays on the GPU (`host_reserve`, or `pinned_alloc_failed`); a spill
    that finds both busy waits for the older one's write (`disk_wait_s`).
  * Once that event has completed (polled where finished copies are, `_release_finished`, and at the forward's end),
    the staging buffer is spilled (`DiskTier.spill`) and the GPU original let go. A spill refused (the disk's reserve)
    keeps the original instead: the tensor stays on the GPU, counted as `disk_reserve`.
  * The staging buffer is the tier's until `handle.written()` answers: True, it goes back to the set; False (a disk
    error), its bytes are copied back to the GPU on the compute stream and the tensor stays there (`disk_failed`), the
    buffer free once that copy's event has completed. No byte is ever only in a buffer that is reused.
  * Backward reads the file back into a staging buffer on the tier's workers: started ahead by the prefetch (`_reload`:
    the prefetch window's walk down the step's copies), once a buffer is free, then copied H2D on the H2D stream as
    `_reload` does, when a later unpack or prefetch point sees the read done. A copy needed before that (a miss) is
    read at its unpack, into a staging buffer if one is free (else pageable memory), and copied on the compute stream,
    as `_reload_now` does. A staging buffer is free again once its H2D copy's event has completed.
  * A file goes when its copy dies (backward freed the node that saved it, or the graph was dropped), not when it is
    read: a retained graph (`retain_graph=True`) reads it again. The run directory goes when the engine does, when
    `remove_hooks` finds no file left, or at the interpreter's exit (`DiskTier`).
In the CPU test mode there are no streams: the span is cloned to the host and spilled at once (at most two clones
waiting for their writes), and an unpack reads the file back into a new tensor.

A memory plan counts the tier's room past the pinned pool (`disk_tier`, `DiskTier.room_bytes`) and its measured
bandwidths (`memory_budget.simulate`'s model of the step).
"""

from __future__ import annotations

import shutil
import time
import weakref
from collections import deque
from concurrent import futures
from typing import Any

import torch

from ..disk_tier import DiskTier
from ..host_memory import default_host_memory_reserve
from .host_copies import _HostCopies, _HostCopy
from .prefetch import _Prefetch
from .regions import _kept
from .streams import _Lane

# The staging buffers a GPU engine holds at most: one filling from the GPU or writing while the other writes.
_STAGING_BUFFERS = 2


# Each engine class's subclass with the disk tier's methods (`_with_disk`).
_WITH_DISK: dict[type, type] = {}


def _with_disk(cls: type) -> type:
    """`cls` with the methods that poll the disk tier in place of the plain ones, made once per class."""
    if cls not in _WITH_DISK:
        methods = {"_release_finished": _DiskCopies._release_finished_and_spill,
                   "_prefetch": _DiskCopies._prefetch_and_read, "_reload": _DiskCopies._reload_any,
                   "_reload_now": _DiskCopies._reload_now_any, "__module__": cls.__module__,
                   "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}  # fmt: skip
        _WITH_DISK[cls] = type(cls.__name__, (cls,), methods)
    return _WITH_DISK[cls]


def default_disk_reserve_bytes(directory: str) -> int:
    """The disk tier's reserve where `disk_reserve_bytes` is None: the host memory reserve's rule applied to the file
    system's size (`default_host_memory_reserve`: 10%, at least 8 GiB, at most a quarter). A checkpoint, logs and the
    datasets' caches share the disk, and a checkpoint that cannot be written costs more than activations kept on the
    accelerator; a small scratch disk still takes spills."""
    return default_host_memory_reserve(shutil.disk_usage(directory).total)


class _Staging:
    """A host buffer for spilled bytes on their way to or from the disk, and what uses it now."""

    __slots__ = ("tensor", "pending", "handle", "future", "event")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # uint8, pinned on a GPU
        self.pending = False  # a D2H copy filled it, not spilled yet
        self.handle: Any = None  # a write reads it, not yet settled (`_settle_writes`)
        self.future: Any = None  # a read fills it, or filled it and its bytes are not copied out yet
        self.event: Any = None  # a copy on a stream uses it (D2H in, H2D out)

    def free(self) -> bool:
        return (not self.pending and self.handle is None and self.future is None
                and (self.event is None or self.event.query()))  # fmt: skip

    def view(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.tensor[:nbytes].view(dtype)


class _DiskCopy(_HostCopy):
    """A storage span the pool refused, spilled to a file: the same bookkeeping as a host copy, with no pool block."""

    __slots__ = ("handle", "staging", "kept", "read", "read_slot", "read_host")

    def __init__(self, engine: _DiskCopies, lane: _Lane, tensor: torch.Tensor, start: int, numel: int,
                 position: int) -> None:  # fmt: skip
        self.engine, self.lane, self.pool, self.block, self.host = engine, lane, None, None, None
        self.dtype, self.start, self.numel = tensor.dtype, start, numel
        self.nbytes = numel * tensor.element_size()
        self.position, self.step = position, engine._step
        self.source: torch.Tensor | None = None
        self.d2h_done: Any = None
        self.reloaded: torch.Tensor | None = None
        self.reload_done: Any = None
        self.prefetched = self.consumed = False
        self.users = self.unpacks_left = 0
        self.handle: Any = None  # the file's `DiskHandle`, once spilled
        self.staging: torch.Tensor | None = None  # the bytes on the host until the write is confirmed
        self.kept: torch.Tensor | None = None  # the span kept on the device: the spill refused, or its write failed
        self.read: Any = None  # a read of the file in flight (a future), into `read_host`
        self.read_slot: _Staging | None = None
        self.read_host: torch.Tensor | None = None

    def __del__(self) -> None:
        if self.reloaded is not None and self.reload_done is not None and not self.reload_done.query():
            self.reloaded.record_stream(self.lane.h2d.stream)
        if self.handle is not None:
            self.handle.release()  # the file goes now, or as its write ends


class _DiskCopies:
    """The engine's part that spills what the pool refuses (the module's docstring says how). A part of
    `OffloadActivations`; its methods run under the engine's lock."""

    def _init_disk(self) -> None:
        self._disk: DiskTier | None = None
        if self.options.disk_offload_dir is None or self.device_type is None:
            return
        directory = self.options.disk_offload_dir
        tier = DiskTier(directory, 0)  # raises DiskOffloadDirError, naming the option, for a directory it cannot use
        reserve = self.options.disk_reserve_bytes
        tier.reserve_bytes = default_disk_reserve_bytes(str(tier.directory)) if reserve is None else reserve
        self._disk = tier
        self._spilled: weakref.WeakSet[_DiskCopy] = weakref.WeakSet()  # the copies alive, for `close_disk`
        self._staging: list[_Staging] = []
        self._staging_refusal: str | None = None  # why the last staging buffer could not be had (`_staging_tensor`)
        self._disk_d2h: deque[tuple[_DiskCopy, _Staging]] = deque()  # D2H copies not spilled yet, in order
        self._disk_writes: list[tuple[weakref.ref[_DiskCopy], _Staging | None, Any]] = []  # writes not settled
        self._disk_read_queue: deque[weakref.ref[_DiskCopy]] = deque()  # prefetched, waiting for a staging buffer
        # Prefetched reads in flight or not yet copied to the device: (copy, its staging buffer, the read).
        self._disk_reads: list[tuple[weakref.ref[_DiskCopy], _Staging, Any]] = []
        # The methods that poll the tier, only on an engine with one: the hooks of an engine without one run the plain
        # methods. A subclass rather than bound methods on the instance, which would make a cycle through it.
        self.__class__ = _with_disk(type(self))

    @property
    def disk_tier(self) -> DiskTier | None:
        """The disk tier under the pinned pool (`disk_offload_dir`), or None: a memory plan counts its room."""
        return self._disk

    def close_disk(self) -> None:
        """Closes the disk tier (its writes stop, its files and run directory go) if no graph holds a spilled tensor;
        else the tier closes when the engine and the last such graph are gone, or at exit."""
        if self._disk is not None and not self._spilled:
            self._disk.close()

    # ------------------------------------------------------------------ forward

    def _spill(self, tensor: torch.Tensor, storage: Any, start: int, numel: int, nbytes: int,
               position: int) -> Any:  # fmt: skip
        """Spills a tensor the pool refused; keeps it where it is if the tier refuses it (its reserve)."""
        self.warn_once("disk_spill", "hf_offload: the pinned host pool has no room for further activations: they go "
                       f"to the disk tier in {self._disk.directory} (experimental)")  # fmt: skip
        lane = self._lane(tensor.device)
        slot = None if lane.d2h is None else self._staging_slot(nbytes, wait=True)
        if lane.d2h is not None and slot is None:
            self._staging_refused(nbytes)
            return _kept(tensor)
        span = tensor.detach().as_strided((numel,), (1,), start)
        copy = _DiskCopy(self, lane, tensor, start, numel, position)
        self._spilled.add(copy)
        if lane.d2h is None:  # the CPU test mode, or no side streams: spill a host copy at once
            while len(self._disk_writes) >= _STAGING_BUFFERS:
                self._wait_for_write(self._disk_writes[0][2])
            host = span.clone() if lane.device.type == "cpu" else span.to("cpu")
            handle = self._disk.spill(host)
            if handle is None:
                self._disk_refused("disk_reserve", nbytes)
                return _kept(tensor)
            copy.handle, copy.staging = handle, host
            self._disk_writes.append((weakref.ref(copy), None, handle))
        else:
            compute = lane.compute_stream()  # before any stream switch: see `streams`
            view = slot.view(nbytes, tensor.dtype)
            lane.d2h.wait_for(compute)  # the span's producer kernels first
            with lane.d2h.entered_from(compute):
                view.copy_(span, non_blocking=True)
            copy.d2h_done = self._device_module.Event()
            copy.d2h_done.record(lane.d2h.stream)
            copy.source, copy.staging = span, view  # the original stays until the copy's event has completed
            slot.pending, slot.event = True, copy.d2h_done
            self._disk_d2h.append((copy, slot))
        self._step.copies.append(weakref.ref(copy))
        self._dedup[storage.data_ptr()] = (weakref.ref(storage), weakref.ref(copy))
        self._stats.offloaded(nbytes)
        return self._saved(copy, tensor)

    def _disk_refused(self, reason: str, nbytes: int, offloaded: bool = False) -> None:
        """Counts a tensor the tier did not take (`disk_reserve`) or could not write (`disk_failed`), kept where it
        was, and says why once."""
        if reason == "disk_reserve":
            self.warn_once(reason, self._disk.refusal_message or "hf_offload: the disk tier refused a tensor")
        if offloaded:
            self._stats.unoffloaded(reason, nbytes)
        else:
            self._stats.kept(reason, nbytes)

    def _staging_refused(self, nbytes: int) -> None:
        """Counts a tensor kept where it was for want of a staging buffer (`_staging_tensor`), and says why once."""
        reason = self._staging_refusal
        why = "would leave the host less than its reserve" if reason == "host_reserve" else "could not be pinned"
        self.warn_once(f"disk_staging_{reason}", f"hf_offload: a staging buffer of {nbytes / 2**20:.0f} MiB for "
                       f"the disk tier {why}: activations the pool refuses stay on the {self.device_type}")  # fmt: skip
        self._stats.kept(reason, nbytes)

    def _release_finished_and_spill(self, lane: _Lane) -> None:
        _HostCopies._release_finished(self, lane)
        self._poll_disk()

    def _poll_disk(self) -> None:
        """Spills the staging buffers whose D2H copy has completed, and settles the writes that ended."""
        while self._disk_d2h and self._disk_d2h[0][1].event.query():
            copy, slot = self._disk_d2h.popleft()
            slot.pending = False
            handle = self._disk.spill(copy.staging)
            if handle is None:  # the reserve: the tensor stays on the GPU
                copy.kept, copy.staging = copy.source, None
                self._disk_refused("disk_reserve", copy.nbytes, offloaded=True)
                continue
            copy.handle = slot.handle = handle
            copy.source = None  # its copy has completed: the GPU original may go
            self._disk_writes.append((weakref.ref(copy), slot, handle))
        if self._disk_writes:
            self._settle_writes()

    def _settle_writes(self) -> None:
        """For each write that ended: the staging bytes go back to the set (written), or to the device (failed)."""
        still = []
        for ref, slot, handle in self._disk_writes:
            if not handle.write_done():
                still.append((ref, slot, handle))
                continue
            copy = ref()
            if copy is not None and copy.handle is handle:
                if handle.written():
                    self._stats.spilled(copy.nbytes)
                    copy.staging = None
                else:
                    self._write_failed(copy, handle, slot)
            if slot is not None:
                slot.handle = None
        self._disk_writes = still

    def _write_failed(self, copy: _DiskCopy, handle: Any, slot: _Staging | None) -> None:
        """A write failed: the bytes, still in the staging buffer, go back to the device, where the tensor stays."""
        self.warn_once("disk_failed", f"hf_offload: writing a spilled activation to the disk tier failed "
                       f"({handle.write_error}): it stays on the {self.device_type}, as do later ones that "
                       "fail")  # fmt: skip
        lane = copy.lane
        if lane.d2h is None:
            copy.kept = copy.staging.to(lane.device)
        else:
            compute = lane.compute_stream()
            copy.kept = torch.empty(copy.numel, dtype=copy.dtype, device=lane.device)
            copy.kept.copy_(copy.staging, non_blocking=True)  # on the compute stream
            slot.event = self._device_module.Event()
            slot.event.record(compute)
        copy.staging, copy.handle = None, None
        handle.release()
        self._disk_refused("disk_failed", copy.nbytes, offloaded=True)

    def _wait_for_write(self, handle: Any) -> None:
        start = time.perf_counter()
        handle.written()
        self._stats.disk_wait(time.perf_counter() - start)
        self._settle_writes()

    def _staging_slot(self, nbytes: int, wait: bool) -> _Staging | None:
        """A free staging buffer of at least `nbytes`, made or grown as needed (at most `_STAGING_BUFFERS`); with
        `wait`, waits for a busy one, else None when none is free. None also where a buffer that large cannot be had
        (`_staging_tensor`)."""
        while True:
            self._poll_disk()
            for slot in self._staging:
                if slot.free():
                    if slot.tensor.numel() < nbytes:
                        tensor = self._staging_tensor(nbytes)
                        if tensor is None:
                            return None
                        slot.tensor = tensor
                    return slot
            if len(self._staging) < _STAGING_BUFFERS:
                tensor = self._staging_tensor(nbytes)
                if tensor is None:
                    return None
                self._staging.append(_Staging(tensor))
                return self._staging[-1]
            if not wait:
                return None
            slot = self._staging[0]
            if slot.pending:
                self._disk_d2h[0][1].event.synchronize()  # D2H copies complete in order: the oldest first
            elif slot.event is not None and not slot.event.query():
                slot.event.synchronize()
            elif slot.handle is not None:
                self._wait_for_write(slot.handle)
            elif slot.future is not None:
                if not slot.future.done():
                    start = time.perf_counter()
                    futures.wait([slot.future])
                    self._stats.disk_wait(time.perf_counter() - start)
                self._poll_disk_reads()  # copies the read to the device, or forgets it if its copy is gone
            self._staging.append(self._staging.pop(0))  # the other one next time

    def _staging_tensor(self, nbytes: int) -> torch.Tensor | None:
        """A pinned buffer of `nbytes`; None where taking it would leave the host less than the pool's reserve (the
        staging buffers are the tier's and count against no cap, but the reserve is the host's), or where the pinned
        allocation fails. The tensor the buffer was for then stays where it is."""
        pool = self._host_pool()
        if pool.reserve is not None and not pool.reserve.allows(nbytes):
            self._staging_refusal = "host_reserve"
            return None
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.use_pin_memory)
        except RuntimeError:  # the host has no pinnable memory left
            self._staging_refusal = "pinned_alloc_failed"
            return None

    # ------------------------------------------------------------------ backward

    def _prefetch_and_read(self, step: Any, window_bytes: int | None = None, only: set[int] | None = None) -> None:
        self._poll_disk()
        self._poll_disk_reads()
        _Prefetch._prefetch(self, step, window_bytes, only)

    def _reload_any(self, copy: _HostCopy, compute: Any) -> None:
        """`_reload`, and for a spilled copy: queue its read ahead of need (the H2D copy follows once it is read)."""
        if copy.__class__ is not _DiskCopy:
            return _Prefetch._reload(self, copy, compute)
        if copy.kept is None and copy.read is None and copy.handle is not None:
            self._disk_read_queue.append(weakref.ref(copy))
            self._poll_disk_reads()
        return None

    def _poll_disk_reads(self) -> None:
        """Starts queued reads as staging buffers free up, and copies H2D the reads that are done."""
        if self._disk_writes:
            self._settle_writes()
        while self._disk_read_queue:
            copy = self._disk_read_queue[0]()
            if copy is None or copy.read is not None or copy.handle is None or copy.consumed:
                self._disk_read_queue.popleft()
                continue
            slot = self._staging_slot(copy.nbytes, wait=False)
            if slot is None:
                break
            self._disk_read_queue.popleft()
            self._start_read(copy, slot)
            self._disk_reads.append((weakref.ref(copy), slot, copy.read))
        still = []
        for ref, slot, read in self._disk_reads:
            if not read.done():
                still.append((ref, slot, read))
                continue
            copy = ref()
            if copy is None or copy.read is not read or read.exception() is not None:
                # Its copy is gone, or took the read at its unpack, or the read failed (it raises at the unpack).
                if slot.future is read:
                    slot.future = None
                continue
            self._read_to_device(copy, copy.lane.compute_stream())
        self._disk_reads = still

    def _start_read(self, copy: _DiskCopy, slot: _Staging | None) -> None:
        host = slot.view(copy.nbytes, copy.dtype) if slot is not None else torch.empty(copy.numel, dtype=copy.dtype)
        copy.read = copy.handle.read_into(host)
        copy.read_slot, copy.read_host = slot, host
        if slot is not None:
            slot.future = copy.read

    def _read_to_device(self, copy: _DiskCopy, compute: Any) -> None:
        """A prefetched read is done: copy it H2D on the H2D stream, into memory allocated on the compute stream."""
        lane, slot = copy.lane, copy.read_slot
        self._stats.read_from_disk(copy.nbytes)
        buffer = torch.empty(copy.numel, dtype=copy.dtype, device=lane.device)  # on the compute stream
        lane.h2d.wait_for(compute)  # the buffer's memory may still be in use by queued compute kernels
        with lane.h2d.entered_from(compute):
            buffer.copy_(copy.read_host, non_blocking=True)
        copy.reload_done = self._device_module.Event(enable_timing=True)  # timed: it ends a stall (see `_wait`)
        copy.reload_done.record(lane.h2d.stream)
        copy.reloaded = buffer
        if slot is not None:
            slot.future, slot.event = None, copy.reload_done  # free again once the copy has completed
        copy.read = copy.read_slot = copy.read_host = None

    def _reload_now_any(self, copy: _HostCopy, compute: Any) -> None:
        """`_reload_now`, and for a spilled copy: read it now (or wait for its read), then copy it to the device on
        the compute stream."""
        if copy.__class__ is not _DiskCopy:
            return _Prefetch._reload_now(self, copy, compute)
        self._finish_spill(copy)
        if copy.kept is not None:
            copy.reloaded, copy.reload_done = copy.kept, None
            return None
        if copy.read is None:
            slot = None if compute is None else self._staging_slot(copy.nbytes, wait=False)
            self._start_read(copy, slot)
        start = time.perf_counter()
        self._disk.wait(copy.read)  # raises DiskTierError for a file that cannot be read back: the step ends
        self._stats.disk_wait(time.perf_counter() - start)
        self._stats.read_from_disk(copy.nbytes)
        host, slot = copy.read_host, copy.read_slot
        if compute is None:  # no side streams: the host buffer is the span (CPU test mode), or copied in order
            reloaded = host if copy.lane.device.type == "cpu" else host.to(copy.lane.device)
        else:
            reloaded = torch.empty(copy.numel, dtype=copy.dtype, device=copy.lane.device)
            reloaded.copy_(host, non_blocking=True)  # on the compute stream
        if slot is not None:
            slot.future, slot.event = None, self._device_module.Event()
            slot.event.record(compute)
        copy.reloaded, copy.reload_done = reloaded, None
        copy.read = copy.read_slot = copy.read_host = None
        return None

    def _finish_spill(self, copy: _DiskCopy) -> None:
        """Brings a copy needed now past its D2H copy and its write: spilled and written, or kept on the device."""
        while any(pending is copy for pending, _ in self._disk_d2h):
            self._disk_d2h[0][1].event.synchronize()
            self._poll_disk()
        if copy.handle is not None and copy.staging is not None:
            self._wait_for_write(copy.handle)
