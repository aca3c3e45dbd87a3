"""The pinned host pool that offloaded activations live in, and the host memory it may take.

Allocating pinned memory (cudaHostAlloc) costs about 0.4 s per GB and synchronises the device, so it must never
happen per tensor per step. The pool grows during the first step, to what that step needs, and every later
step carves its tensors out of the same chunks: each step frees what the previous one used (the backward releases
it), so the same sequence of requests fits again. Chunks start small and double (each new chunk is as large as the
pool so far, up to a largest chunk size), so a small need reserves little and a large one takes few allocations.

The pool is capped. By default the cap is a fraction of the host memory available when the pool is created,
divided by the number of local ranks (`LOCAL_WORLD_SIZE`), since every process on the host runs its own pool.
A request past the cap returns None and the engine keeps that tensor on the GPU: the host is never driven out
of memory.

The reserve (`HostReserve`) is a floor of available host memory that the pool never takes the host below: each
growth reads the memory available at that moment (`read_host_memory`: `MemAvailable`, and a cgroup's limit where
there is one) and is refused when it would leave less than the reserve, whatever the cap says. Under a memory
budget the planner may raise the cap past the default fraction, to this process's share of what lies above the
reserve (`HostReserve.room_bytes`; `HostCaps` says how far, `memory_budget/host.py` when). A pinned allocation that
fails is a refusal too: the pool stops growing and the engine keeps what does not fit on the GPU.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from .units import GIB

__all__ = [
    "PinnedHostPool",
    "HostBlock",
    "HostCaps",
    "HostMemory",
    "HostReserve",
    "DEFAULT_PINNED_MEMORY_FRACTION",
    "default_host_memory_reserve",
    "host_caps",
    "host_memory_cap",
    "host_reserve",
    "local_world_size",
    "read_host_memory",
]

# The cap's fraction of the available host memory when `max_pinned_memory_fraction` is left unset (None).
DEFAULT_PINNED_MEMORY_FRACTION = 0.5
# The default reserve (`default_host_memory_reserve`): 10% of the host's memory, at least 8 GiB, at most a quarter.
_RESERVE_SHARE = 0.10
_RESERVE_AT_LEAST = 8 * GIB
_RESERVE_AT_MOST_SHARE = 0.25

_ALIGNMENT = 512  # bytes; keeps every block aligned for any dtype and for fast DMA
_SMALLEST_CHUNK_BYTES = 2 * 2**20
_LARGEST_CHUNK_BYTES = 256 * 2**20
# Blocks kept for reuse, at most: steps of one shape reuse a few dozen; steps whose lengths vary make new ranges.
_MAX_REMEMBERED_BLOCKS = 1024


def _align(nbytes: int) -> int:
    return (nbytes + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


def local_world_size() -> int:
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)


def host_memory_cap(max_pinned_memory_fraction: float | None, max_pinned_bytes: int | None) -> int:
    """Bytes this process's pool may hold: an explicit cap, or its share of the available host memory (the fraction
    `DEFAULT_PINNED_MEMORY_FRACTION` of it when `max_pinned_memory_fraction` is None)."""
    if max_pinned_bytes is not None:
        return max_pinned_bytes
    if max_pinned_memory_fraction is None:
        max_pinned_memory_fraction = DEFAULT_PINNED_MEMORY_FRACTION
    available = psutil.virtual_memory().available
    return int(available * max_pinned_memory_fraction) // local_world_size()


@dataclass(frozen=True)
class HostMemory:
    """The host's memory as this process may use it, in bytes: its total and what is available now."""

    total_bytes: int
    available_bytes: int


def read_host_memory(root: str = "/") -> HostMemory:
    """The host's memory now: `MemTotal` and `MemAvailable` of `/proc/meminfo` (the kernel's estimate of what can be
    allocated without swapping, page cache it can drop included), each lowered to the room under a cgroup v2 memory
    limit where this process or a cgroup above it has one (a container's: past it the process is killed, whatever
    the host has). Without `/proc/meminfo`, psutil's figures.

    Args:
        root: the file system's root, for tests (a folder holding `proc/` and `sys/fs/cgroup/`).
    """
    base = Path(root)
    try:
        fields = {}
        for line in (base / "proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields[name] = int(value.split()[0]) * 1024  # kB
        total, available = fields["MemTotal"], fields["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        memory = psutil.virtual_memory()
        total, available = memory.total, memory.available
    for limit, room in _cgroup_limits(base):
        total, available = min(total, limit), min(available, room)
    return HostMemory(total, max(available, 0))


def _cgroup_limits(root: Path) -> list[tuple[int, int]]:
    """(limit, room under it) of each cgroup v2 memory limit from this process's cgroup up to the root: the room is
    the limit less what the cgroup uses, its inactive page cache (which the kernel drops first) not counted."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
        path = next(line[3:] for line in lines if line.startswith("0::"))
    except (OSError, StopIteration):
        return []
    limits = []
    folder = root / "sys/fs/cgroup" / path.strip("/")
    while True:
        try:
            limit = (folder / "memory.max").read_text().strip()
            if limit != "max":
                used = int((folder / "memory.current").read_text())
                stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
                used -= int(stat.get("inactive_file", 0))
                limits.append((int(limit), int(limit) - max(used, 0)))
        except (OSError, ValueError):
            pass
        if folder == root / "sys/fs/cgroup" or folder.parent == folder:
            return limits
        folder = folder.parent


def default_host_memory_reserve(total_bytes: int) -> int:
    """The reserve when `host_memory_reserve_bytes` is None under a memory budget: 10% of the host's memory, at least
    8 GiB, at most a quarter of it.

    What it keeps is what the training process and the host need beside the pinned pool, none of which the pool can
    give back while a step runs: the kernel and its page cache, the process's own pageable memory (the dataset,
    tokenised batches, data loader workers, a checkpoint staged on its way to disk) and whatever else runs. 8 GiB
    covers that on a workstation; 10% grows it with the hosts that run more beside (several ranks, more workers); a
    quarter keeps a small host (16 GiB: 4 GiB) usable.

    Example:
        >>> [round(default_host_memory_reserve(n * GIB) / GIB, 1) for n in (16, 64, 128, 1024)]
        [4.0, 8.0, 12.8, 102.4]
    """
    return int(min(max(_RESERVE_AT_LEAST, total_bytes * _RESERVE_SHARE), total_bytes * _RESERVE_AT_MOST_SHARE))


class HostReserve:
    """A floor of available host memory that the pools of one host never cross, shared by its local ranks.

    Args:
        reserve_bytes: the floor: memory left available on the host (or in the container) whatever the pools take.
        local_ranks: the processes on this host that each run a pool (`local_world_size()` by default).
        read: reads the host's memory now; None: `read_host_memory` (looked up at each read, so that tests may
            replace it).
    """

    def __init__(self, reserve_bytes: int, local_ranks: int | None = None,
                 read: Callable[[], HostMemory] | None = None) -> None:  # fmt: skip
        self.reserve_bytes = reserve_bytes
        self.local_ranks = local_world_size() if local_ranks is None else max(local_ranks, 1)
        self._read = read

    def read(self) -> HostMemory:
        """The host's memory now."""
        return (self._read or read_host_memory)()

    def room_bytes(self, held_bytes: int) -> int:
        """The most a pool that holds `held_bytes` may hold in all: those, plus its share of the memory available
        above the reserve (1 / `local_ranks` of it: ranks that each take their share leave the reserve, and memory
        one of them holds is no longer available to the others)."""
        above = self.read().available_bytes - self.reserve_bytes
        return held_bytes + max(above, 0) // self.local_ranks

    def allows(self, nbytes: int) -> bool:
        """Whether taking `nbytes` more now leaves the reserve available, as read at this moment."""
        return self.read().available_bytes - nbytes >= self.reserve_bytes


def host_reserve(reserve_bytes: int | None, memory_budget: bool) -> HostReserve | None:
    """The reserve a pool keeps: `reserve_bytes` where the user gave it (0 included); else, under a memory budget
    (`memory_budget`), `default_host_memory_reserve` of this host, and without one none (the cap alone, as before
    there was a reserve)."""
    if reserve_bytes is None and memory_budget:
        reserve_bytes = default_host_memory_reserve(read_host_memory().total_bytes)
    return None if reserve_bytes is None else HostReserve(reserve_bytes)


@dataclass(frozen=True)
class HostCaps:
    """The pinned host memory a memory plan may count on, in bytes.

    Args:
        default_bytes: without growing the pool past its cap: the cap (the default fraction's, or the user's), and no
            more than the reserve leaves.
        most_bytes: the most it may grow to: down to the reserve where the cap is the default one under a budget,
            else `default_bytes`.
        reserve_bytes: the reserve (0 without one).
    """

    default_bytes: int
    most_bytes: int
    reserve_bytes: int = 0


def host_caps(cap_bytes: int, held_bytes: int, reserve: HostReserve | None, growable: bool) -> HostCaps:
    """What a pool with cap `cap_bytes`, holding `held_bytes` now, may count on.

    Args:
        cap_bytes: the pool's cap when it was made (the default fraction's share, or the user's explicit cap).
        held_bytes: what the pool holds now (its chunks, used or not): no longer counted as available on the host.
        reserve: the host's reserve, or None (no floor: the cap alone).
        growable: the cap may be raised past `cap_bytes` (the default cap, under a memory budget); False for a cap
            the user set, which is kept.

    Example:
        >>> reserve = HostReserve(10 * GIB, local_ranks=2, read=lambda: HostMemory(128 * GIB, 100 * GIB))
        >>> caps = host_caps(25 * GIB, 0, reserve, growable=True)
        >>> caps.default_bytes / GIB, caps.most_bytes / GIB
        (25.0, 45.0)
    """
    if reserve is None:
        return HostCaps(cap_bytes, cap_bytes)
    room = reserve.room_bytes(held_bytes)
    default = min(cap_bytes, room)
    return HostCaps(default, max(default, room) if growable else default, reserve.reserve_bytes)


def _pinned_exactly(nbytes: int) -> torch.Tensor:
    """A host buffer of exactly `nbytes`, page-locked by registering it with CUDA.

    Used for requests past the largest chunk, such as a layer's input at long context (2.4 GiB at 320K tokens of an
    8B model): PyTorch's pinned allocator would round such a request up to a power of two and hold 4 GiB of the cap
    for it; registering an ordinary buffer pins what is asked. The buffer is unregistered when the tensor is collected
    before its memory is freed, as `torch.distributed`'s state-dict staging does with the same calls.
    """
    chunk = torch.empty(nbytes, dtype=torch.uint8)
    # Fault its pages in first, a byte a page, on torch's intra-op threads. Registering would fault them itself, on
    # one thread, while it holds the CUDA driver's lock; PyTorch's pinned allocator also maps the pages before it
    # registers them (`pinned_use_cuda_host_register`), for that reason.
    chunk[:: mmap.PAGESIZE].zero_()
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(chunk.data_ptr(), nbytes, 0))
    if error != 0:
        _clear_last_cuda_error()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {error}")
    weakref.finalize(chunk, cudart.cudaHostUnregister, chunk.data_ptr())
    return chunk


def _clear_last_cuda_error() -> None:
    """Clears the error a failed CUDA runtime call left behind. torch's binding of cudaHostRegister returns its error
    without reading it back, so it stays the runtime's last error, which the check after the next kernel launch reads
    and raises: a crash somewhere in the model, long after the refusal the pool handled. One small launch, whose
    check raises that error here, where it is caught, reads and clears it."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


class HostBlock:
    """A byte range of one pool chunk, owned by one offloaded copy until it is freed.

    The pool makes each block once and hands the same object out again whenever the same range is allocated (every
    step after the first allocates the same ranges), so the views of a block are made once too: slicing a chunk costs
    about 14 us of host time per copy, and a short step is paced by the host (`benchmarks/hook_cost.py`).
    """

    __slots__ = ("chunk", "offset", "nbytes", "_views")

    def __init__(self, chunk: torch.Tensor, offset: int, nbytes: int) -> None:
        self.chunk = chunk
        self.offset = offset
        self.nbytes = nbytes
        self._views: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The block's first `numel` elements as a flat tensor of `dtype` (a view: no allocation)."""
        view = self._views.get((dtype, numel))
        if view is None:
            view = self.chunk[self.offset : self.offset + numel * dtype.itemsize].view(dtype)
            self._views[(dtype, numel)] = view
        return view


class PinnedHostPool:
    """First-fit allocator over a few host chunks, with free-block coalescing.

    Blocks are freed from autograd's backward thread and from garbage collection, so every operation holds a
    lock. Reuse of a freed block by a later device copy is ordered by the engine (the device-to-host stream waits
    for the host-to-device stream at the start of each step), not here.

    Args:
        cap_bytes: the most host memory the pool may hold (`cap_bytes` may be changed later: a memory plan raises it;
            `default_cap_bytes` keeps this one).
        pin_memory: page-locked chunks (for the accelerator's fast asynchronous copies).
        chunk_bytes: the largest chunk the doubling grows to (a larger request still gets a chunk of its own, of its
            exact size on CUDA).
        reserve: a floor of available host memory that every growth checks as it happens; None for none.
        on_growth: called with the bytes and the seconds of each new chunk: the calling thread's time spent pinning
            (the training thread's, in a forward).

    Attributes:
        refusal: why the last request was refused: `"cap"`, `"reserve"` (growing would have left less than the
            reserve available) or `"failed"` (a pinned allocation failed; `failure` holds its error, and the pool no
            longer grows: each try costs, and synchronises the device).
    """

    def __init__(self, cap_bytes: int, pin_memory: bool, chunk_bytes: int = _LARGEST_CHUNK_BYTES,
                 reserve: HostReserve | None = None,
                 on_growth: Callable[[int, float], None] | None = None) -> None:  # fmt: skip
        self.cap_bytes = cap_bytes
        self.default_cap_bytes = cap_bytes
        self.pin_memory = pin_memory
        self.chunk_bytes = chunk_bytes
        self.reserve = reserve
        self.on_growth = on_growth
        self.refusal: str | None = None
        self.failure: str | None = None
        self._chunks: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per chunk: sorted (offset, nbytes) free ranges
        self._blocks: dict[tuple[int, int, int], HostBlock] = {}  # (chunk index, offset, nbytes) -> its block
        self._lock = threading.Lock()
        self.allocations = 0  # chunk allocations so far: flat after the first step

    @property
    def capacity(self) -> int:
        """Host bytes the pool holds (allocated chunks, used or free)."""
        return sum(chunk.numel() for chunk in self._chunks)

    def allocate(self, nbytes: int) -> HostBlock | None:
        """A block of at least `nbytes`, or None if that would take the pool past its cap."""
        size = _align(nbytes)
        with self._lock:
            for index, free_ranges in enumerate(self._free):
                for position, (offset, length) in enumerate(free_ranges):
                    if length >= size:
                        if length == size:
                            del free_ranges[position]
                        else:
                            free_ranges[position] = (offset + size, length - size)
                        return self._block(index, offset, size)
            return self._grow(size)

    def _block(self, index: int, offset: int, size: int) -> HostBlock:
        block = self._blocks.get((index, offset, size))
        if block is None:
            if len(self._blocks) >= _MAX_REMEMBERED_BLOCKS:
                self._blocks.clear()
            block = self._blocks[(index, offset, size)] = HostBlock(self._chunks[index], offset, size)
        return block

    def _grow(self, size: int) -> HostBlock | None:
        if self.failure is not None:
            self.refusal = "failed"
            return None
        room = self.cap_bytes - self.capacity
        if size > room:
            room += self._release_free_chunks()
        exact = self.pin_memory and size > self.chunk_bytes and torch.cuda.is_available()
        if exact:
            chunk_size = smallest = size
        else:
            # PyTorch's pinned allocator rounds every allocation up to a power of two; asking for exactly that keeps
            # the pool's accounting (and so its cap) equal to the pinned memory really held.
            doubling = min(self.chunk_bytes, max(_SMALLEST_CHUNK_BYTES, self.capacity))
            chunk_size = max(size, min(doubling, room))
            smallest = size
            if self.pin_memory:
                chunk_size = 1 << (chunk_size - 1).bit_length()
                smallest = 1 << (size - 1).bit_length()
                if chunk_size > room:
                    chunk_size >>= 1  # the largest power of two that still fits under the cap
        if not size <= chunk_size <= room:
            self.refusal = "cap"
            return None
        if self.reserve is not None and not self.reserve.allows(chunk_size):
            if not self.reserve.allows(smallest):  # nor the request alone: the host keeps its reserve
                self.refusal = "reserve"
                return None
            chunk_size = smallest
        started = time.perf_counter()
        try:
            chunk = self._new_chunk(chunk_size, exact)
        except (RuntimeError, MemoryError) as error:  # cudaHostAlloc or cudaHostRegister refused: degrade, not crash
            self.failure, self.refusal = f"{type(error).__name__}: {error}", "failed"
            return None
        if self.on_growth is not None:
            self.on_growth(chunk_size, time.perf_counter() - started)
        return self._add_chunk(chunk, size)

    def _new_chunk(self, nbytes: int, exact: bool) -> torch.Tensor:
        """A new chunk of `nbytes`: pinned at its exact size (`exact`), or from PyTorch's (pinned) allocator."""
        if exact:
            return _pinned_exactly(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def _release_free_chunks(self) -> int:
        """Drops the chunks no block uses and returns their bytes.

        A step longer than the first ones asks for blocks larger than the chunks those left: kept, the chunks would
        hold part of the cap that the longer step's blocks cannot use (at 320K tokens after steps of 16K, about
        4 GiB of the cap in chunks of at most 256 MiB, while each layer's input needs 2.4 GiB in one piece).
        """
        kept = [(chunk, free) for chunk, free in zip(self._chunks, self._free) if free != [(0, chunk.numel())]]
        released = self.capacity - sum(chunk.numel() for chunk, _ in kept)
        if released:
            self._chunks, self._free = [chunk for chunk, _ in kept], [free for _, free in kept]
            self._blocks.clear()  # the chunks' indices changed; blocks in use keep their own reference to their chunk
            empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)  # torch 2.12+
            if self.pin_memory and empty_host_cache is not None:
                empty_host_cache()  # PyTorch's pinned allocator caches what it gets back: give it to the OS
        return released

    def _add_chunk(self, chunk: torch.Tensor, size: int) -> HostBlock:
        """Adds `chunk` to the pool and returns its first `size` bytes as a block."""
        self.allocations += 1
        self._chunks.append(chunk)
        self._free.append([(size, chunk.numel() - size)] if chunk.numel() > size else [])
        return self._block(len(self._chunks) - 1, 0, size)

    def free(self, block: HostBlock) -> None:
        with self._lock:
            index = next(i for i, chunk in enumerate(self._chunks) if chunk is block.chunk)
            ranges = self._free[index]
            ranges.append((block.offset, block.nbytes))
            ranges.sort()
            merged = [ranges[0]]
            for offset, length in ranges[1:]:
                last_offset, last_length = merged[-1]
                if last_offset + last_length == offset:
                    merged[-1] = (last_offset, last_length + length)
                else:
                    merged.append((offset, length))
            self._free[index] = merged

    def caps(self, growable: bool) -> HostCaps:
        """What a memory plan may count on now (`host_caps`), with the cap the pool was made with; `growable`: that cap
        may be raised (a default one, under a memory budget)."""
        return host_caps(self.default_cap_bytes, self.capacity, self.reserve, growable)

    def bytes_in_use(self) -> int:
        with self._lock:
            return self.capacity - sum(length for ranges in self._free for _, length in ranges)
