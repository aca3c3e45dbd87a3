"""Host copies: what the forward copies to the host, how long each copy and its GPU original live, and the forward
window.

Lifetimes:
  * Each offloaded storage span is a `_HostCopy`, owned by the `_SavedTensor` handles that autograd keeps in
    its graph. The graph's lifetime is the copy's lifetime: when backward frees a node (or the whole graph is
    dropped because backward never ran), the copy dies and returns its pinned block to the pool. The engine
    holds only weak references to copies, so nothing outlives the graph that saved it.
  * The GPU original stays referenced until its D2H copy has finished (the *forward window*); the allocator
    could otherwise hand its memory to a new tensor while the copy still reads it. Finished copies are
    released by polling their events; the compute stream waits only when the window (bytes, and optionally
    a tensor count) is full.
  * Reloads go into memory allocated on the compute stream, so once the compute stream has waited on the
    reload's event the buffer follows ordinary compute-stream lifetime rules (no `record_stream`). Because
    that memory may have just been freed by compute-stream kernels still queued, the H2D stream first waits
    for the compute stream.
  * Pinned blocks are reused only by D2H copies; at the start of each step the D2H stream waits for the H2D
    stream, so a block is never overwritten while an earlier reload still reads it.

A `_Step` is one forward's copies in save order, which backward's prefetch walks down (`prefetch`), and where that
forward ended: the copies still in flight then, in GPU time, from which the tail planner (`policy.TailPlanner`)
learns at the next step which of the last copies to keep on the GPU (`_mark_end_of_forward`, `_first_unfinished`).

`_HostCopies` is the engine's part: the pinned pool, the step's copies and their deduplication by storage, the tail,
and the copies out and their window.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..host_memory import HostBlock, HostCaps, PinnedHostPool, host_memory_cap, host_reserve
from ..options import MIB
from ..policy import TailPlanner, storage_span
from .regions import _kept
from .streams import _Lane


class _HostCopy:
    """One storage span copied to the host, shared by every saved tensor that lies inside it."""

    __slots__ = (
        "engine", "lane", "pool", "block", "host", "dtype", "start", "numel", "nbytes", "position", "step",
        "source", "d2h_done", "reloaded", "reload_done", "prefetched", "consumed", "users", "unpacks_left",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, engine: _HostCopies, lane: _Lane, pool: PinnedHostPool, block: HostBlock,
                 tensor: torch.Tensor, start: int, numel: int, position: int, step: _Step) -> None:  # fmt: skip
        self.engine = engine  # a graph that still holds copies keeps its engine alive for the backward
        self.lane = lane
        self.pool = pool
        self.block = block
        self.host = block.view(tensor.dtype, numel)  # the span's bytes on the host, as elements of its dtype
        self.dtype = tensor.dtype
        self.start = start  # first element of the span in the original storage
        self.numel = numel
        self.nbytes = numel * tensor.element_size()
        self.position = position  # index among the step's offload candidates (the tail planner's numbering)
        self.step = step
        self.source: torch.Tensor | None = None  # the GPU span, held while its copy may still read it
        self.d2h_done: Any = None
        self.reloaded: torch.Tensor | None = None  # the span back on the GPU
        self.reload_done: Any = None
        self.prefetched = False  # reloaded ahead of need: counts against the prefetch window until unpacked
        self.consumed = False  # every user has unpacked in the current backward
        self.users = 0
        self.unpacks_left = 0

    def __del__(self) -> None:
        # A reload nobody consumed may still be writing into its compute-stream buffer: keep the allocator from
        # reusing that memory until the H2D stream is past it.
        if self.reloaded is not None and self.reload_done is not None and not self.reload_done.query():
            self.reloaded.record_stream(self.lane.h2d.stream)
        self.pool.free(self.block)


class _SavedTensor:
    """What autograd stores in place of an offloaded tensor: its copy and its geometry within the copy."""

    __slots__ = ("copy", "size", "stride", "offset")

    def __init__(self, copy: _HostCopy, tensor: torch.Tensor) -> None:
        self.copy = copy
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset() - copy.start


class _Step:
    """One forward pass's offloaded copies, in save order, and the backward's prefetch cursor over them."""

    __slots__ = ("copies", "cursor", "backward_started", "prefetch_window_bytes", "end_of_forward", "prefetch_points",
                 "by_position", "burst_node", "burst", "__weakref__")  # fmt: skip

    def __init__(self) -> None:
        # Backward unpacks in roughly the reverse order of the saves, and a storage saved several times (a layer
        # norm's output read by q, k and v) is first unpacked by its last saver: a copy is listed again at each
        # later save, so that walking down the list reaches it when backward needs it first.
        self.copies: list[weakref.ref[_HostCopy]] = []
        self.cursor = -1  # next entry (walking down) that backward may prefetch
        self.backward_started = False
        self.prefetch_window_bytes = 0  # set when backward starts
        # Where the forward ended (the tail region or the first unpack): for each copy still in flight then,
        # (its position, a compute-stream marker, its completion event). Read at the next step, in GPU time.
        self.end_of_forward: list[tuple[int, Any, Any]] | None = None
        # Gradient hooks made by `prefetch_hook` for this step. With none, unpacks prefetch themselves; with some,
        # unpacks start only the reloads that no point started in time in an earlier step (`prefetch`: the learner's
        # `unpack_reloads`).
        self.prefetch_points = 0
        self.by_position: dict[int, weakref.ref[_HostCopy]] | None = None  # made when a reload first needs it
        # The autograd node whose saved tensors backward is unpacking (its sequence number), and the copies (position,
        # users) unpacked for it so far: see `_PrefetchLearner.note_burst`.
        self.burst_node: int | None = None
        self.burst: list[tuple[int, int]] = []


class _HostCopies:
    """The forward's copies to the host: the pinned pool, the step's copies, the tail and the forward window.

    A part of `OffloadActivations` (a mixin: its methods run in the pack hook, for every saved tensor, under the
    engine's lock). It reads the engine's options and windows (`forward_window_bytes`), its lanes (`streams`) and
    statistics (`_stats`).
    """

    def _init_host_copies(self) -> None:
        self._pool: PinnedHostPool | None = None  # created at first use: the cap reads the memory available then
        self._planner = TailPlanner(self.options.keep_tail, max_tail_bytes=self.options.forward_window_bytes)
        self._step = _Step()
        self._dedup: dict[int, tuple[weakref.ref, weakref.ref[_HostCopy]]] = {}  # storage ptr -> (storage, copy)

    def _offload(self, tensor: torch.Tensor) -> Any:
        start, numel = storage_span(tensor)
        nbytes = numel * tensor.element_size()
        storage = tensor.untyped_storage()
        shared = self._dedup.get(storage.data_ptr())
        if shared is not None:
            shared_storage, shared_copy = shared[0](), shared[1]()
            if (shared_storage is storage and shared_copy is not None and shared_copy.dtype == tensor.dtype
                    and shared_copy.start <= start
                    and start + numel <= shared_copy.start + shared_copy.numel):  # fmt: skip
                self._stats.kept("duplicate", nbytes)
                self._step.copies.append(shared[1])
                return self._saved(shared_copy, tensor)
        position = self._planner.candidates_seen
        if self._planner.next_candidate(tensor.dtype, tensor.dim(), nbytes):
            self._stats.kept("tail", nbytes)
            return _kept(tensor)
        block = self._host_pool().allocate(nbytes)
        if block is None:
            if self._disk is not None:  # the disk tier (`disk_copies`), only with `disk_offload_dir`
                return self._spill(tensor, storage, start, numel, nbytes, position)
            self._host_refused(nbytes)
            return _kept(tensor)
        lane = self._lane(tensor.device)
        copy = _HostCopy(self, lane, self._pool, block, tensor, start, numel, position, self._step)
        # Detached: a differentiable view would tie the graph to the copy (see `_kept`).
        self._copy_out(lane, copy, tensor.detach().as_strided((numel,), (1,), start))
        self._step.copies.append(weakref.ref(copy))
        self._dedup[storage.data_ptr()] = (weakref.ref(storage), weakref.ref(copy))
        self._stats.offloaded(nbytes)
        return self._saved(copy, tensor)

    def _saved(self, copy: _HostCopy, tensor: torch.Tensor) -> _SavedTensor:
        copy.users += 1
        copy.unpacks_left += 1
        return _SavedTensor(copy, tensor)

    def _copy_out(self, lane: _Lane, copy: _HostCopy, span: torch.Tensor) -> None:
        if lane.d2h is None:
            copy.host.copy_(span, non_blocking=True)  # ordered on the compute stream: span may go now
            return
        compute = lane.compute_stream()  # before any stream switch: see `streams`
        self._make_room(lane, copy.nbytes, compute)
        lane.d2h.wait_for(compute)  # the span's producer kernels first
        with lane.d2h.entered_from(compute):
            copy.host.copy_(span, non_blocking=True)
        copy.d2h_done = self._device_module.Event(enable_timing=True)  # timed: see `_first_unfinished`
        copy.d2h_done.record(lane.d2h.stream)
        copy.source = span
        lane.inflight.append(copy)
        lane.inflight_bytes += copy.nbytes

    def _make_room(self, lane: _Lane, nbytes: int, compute: Any) -> None:
        """Releases finished copies; if the window is still full, makes compute wait for the oldest ones."""
        self._release_finished(lane)
        while lane.inflight and (
            lane.inflight_bytes + nbytes > self.forward_window_bytes
            or (self.options.max_fwd_stash_size is not None and len(lane.inflight) >= self.options.max_fwd_stash_size)
        ):
            self._retire_oldest(lane, compute)

    def _release_finished(self, lane: _Lane) -> None:
        # One D2H stream per lane finishes its copies in order, so only the front can be done.
        while lane.inflight and lane.inflight[0].d2h_done.query():
            self._release(lane, lane.inflight.popleft())

    def _drain_inflight(self, lane: _Lane) -> None:
        compute = lane.compute_stream()
        while lane.inflight:
            self._retire_oldest(lane, compute)

    def _retire_oldest(self, lane: _Lane, compute: Any) -> None:
        """Makes compute wait for the oldest copy, then releases its original: later compute-stream reuse of that
        memory is ordered after the copy."""
        oldest = lane.inflight.popleft()
        self._wait(compute, oldest.d2h_done)
        self._release(lane, oldest)

    @staticmethod
    def _release(lane: _Lane, copy: _HostCopy) -> None:
        """Drops a GPU original whose copy is done, or that the compute stream already waits for."""
        lane.inflight_bytes -= copy.nbytes
        copy.source = None

    @staticmethod
    def _drop_source(copy: _HostCopy) -> None:
        """Drops a GPU original kept past backward's start; its copy may still be reading it, and the host copy
        must stay intact for a second backward (retain_graph)."""
        if copy.source is not None and not copy.d2h_done.query():
            copy.source.record_stream(copy.lane.d2h.stream)
        copy.source = None

    def _mark_end_of_forward(self, step: _Step, drain: bool) -> None:
        """Records, once per step, which copies were still in flight when the forward ended.

        The host runs ahead of the GPU, so "not finished yet" seen from the host says little; a compute-stream
        marker compared with each copy's completion event later says whether the copy really finished after
        the forward's compute did (and so stalled it, or had to stay on the GPU).
        """
        if step.end_of_forward is not None:
            return
        step.end_of_forward = []
        for lane in self._lanes.values():
            self._release_finished(lane)
            if not lane.inflight:
                continue
            compute = lane.compute_stream()
            marker = self._device_module.Event(enable_timing=True)
            marker.record(compute)
            step.end_of_forward += [(c.position, marker, c.d2h_done) for c in lane.inflight if c.step is step]
            if drain:
                self._drain_inflight(lane)

    def cap_tail(self, max_bytes: int | None) -> None:
        """Bound the tail (the last offload candidates of the forward, kept on the GPU) for the steps to come.

        Used by a memory plan (`apply_settings`) chosen because its measured steps met the budget: its later steps
        must not keep more of the tail than those did, and the tail only grows.

        Args:
            max_bytes: the bound, in bytes; None (or anything above it) restores the option `forward_window_bytes`.
        """
        bound = self.options.forward_window_bytes
        self._planner.set_max_tail_bytes(bound if max_bytes is None else min(bound, max_bytes))

    def _host_pool(self) -> PinnedHostPool:
        if self._pool is None:
            cap = host_memory_cap(self.options.max_pinned_memory_fraction, self.options.max_pinned_bytes)
            reserve = host_reserve(self.options.host_memory_reserve_bytes, self.options.memory_budget is not None)
            self._pool = PinnedHostPool(cap, pin_memory=self.use_pin_memory, reserve=reserve,
                                        on_growth=self._stats.pool_grown)  # fmt: skip
        return self._pool

    def host_caps(self) -> HostCaps:
        """The pinned host memory a memory plan may count on now: the pool's cap, and how far it may grow past it (a
        default cap under a memory budget, down to the reserve; a cap the user set is kept)."""
        hard = self.options.max_pinned_memory_fraction is not None or self.options.max_pinned_bytes is not None
        return self._host_pool().caps(growable=not hard and self.options.memory_budget is not None)

    def set_host_cap(self, cap_bytes: int) -> None:
        """Makes `cap_bytes` the pool's cap (a memory plan's, through `apply_settings`: at most
        `host_caps().most_bytes`); the reserve is still checked at each growth."""
        self._host_pool().cap_bytes = cap_bytes

    def _pinned_bytes(self) -> int:
        return 0 if self._pool is None else self._pool.capacity

    def _host_refused(self, nbytes: int) -> None:
        """Counts a tensor the pool had no room for, and says once why (its cap, the host's reserve, a failure)."""
        pool = self._pool
        if pool.refusal == "reserve":
            self.warn_once("host_reserve", "the host's available memory reached the reserve the pinned pool leaves "
                           f"({pool.reserve.reserve_bytes / MIB:.0f} MiB) with the pool at "
                           f"{pool.capacity / MIB:.0f} MiB: further activations stay on the GPU. Lower "
                           "host_memory_reserve_bytes (host_memory_reserve_mib) if the host has the room.")  # fmt: skip
            self._stats.kept("host_reserve", nbytes)
        elif pool.refusal == "failed":
            self.warn_once("pinned_alloc_failed", f"allocating pinned host memory failed ({pool.failure}) with the "
                           f"pool at {pool.capacity / MIB:.0f} MiB: the pool grows no more, and activations that do "
                           "not fit it stay on the GPU.")  # fmt: skip
            self._stats.kept("pinned_alloc_failed", nbytes)
        else:
            self.warn_once("over_host_cap", f"the pinned host pool reached its cap ({pool.cap_bytes / MIB:.0f} MiB): "
                           "further activations stay on the GPU. Raise max_pinned_memory_fraction or "
                           "max_pinned_bytes if the host has room.")  # fmt: skip
            self._stats.kept("over_host_cap", nbytes)


def _first_unfinished(end_of_forward: list[tuple[int, Any, Any]]) -> int | None:
    """Position of the first copy that completed after the forward's compute ended (in GPU time), if any."""
    unfinished = []
    for position, marker, done in end_of_forward:
        done.synchronize()  # the step is over on the host; on the GPU these finished long ago
        if marker.elapsed_time(done) > 0:
            unfinished.append(position)
    return min(unfinished, default=None)
