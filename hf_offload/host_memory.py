"""The pinned host pool that offloaded activations live in.

Allocating pinned memory (cudaHostAlloc) costs about 0.4 s per GB and synchronises the device, so it must never
happen per tensor per step. The pool grows during the first step, to what that step needs, and every later
step carves its tensors out of the same chunks: each step frees what the previous one used (the backward releases
it), so the same sequence of requests fits again. Chunks start small and double (each new chunk is as large as the
pool so far, up to a largest chunk size), so a small need reserves little and a large one takes few allocations.

The pool is capped. By default the cap is a fraction of the host memory available when the pool is created,
divided by the number of local ranks (`LOCAL_WORLD_SIZE`), since every process on the host runs its own pool.
A request past the cap returns None and the engine keeps that tensor on the GPU: the host is never driven out
of memory.
"""

from __future__ import annotations

import os
import threading
import weakref

import psutil
import torch

__all__ = ["PinnedHostPool", "HostBlock", "host_memory_cap", "local_world_size"]

_ALIGNMENT = 512  # bytes; keeps every block aligned for any dtype and for fast DMA
_SMALLEST_CHUNK_BYTES = 2 * 2**20
_LARGEST_CHUNK_BYTES = 256 * 2**20
# Blocks kept for reuse, at most: steps of one shape reuse a few dozen; steps whose lengths vary make new ranges.
_MAX_REMEMBERED_BLOCKS = 1024


def _align(nbytes: int) -> int:
    return (nbytes + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


def local_world_size() -> int:
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)


def host_memory_cap(max_pinned_memory_fraction: float, max_pinned_bytes: int | None) -> int:
    """Bytes this process's pool may hold: an explicit cap, or its share of the available host memory."""
    if max_pinned_bytes is not None:
        return max_pinned_bytes
    available = psutil.virtual_memory().available
    return int(available * max_pinned_memory_fraction) // local_world_size()


def _pinned_exactly(nbytes: int) -> torch.Tensor:
    """A host buffer of exactly `nbytes`, page-locked by registering it with CUDA.

    Used for requests past the largest chunk, such as a layer's input at long context (2.4 GiB at 320K tokens of an
    8B model): PyTorch's pinned allocator would round such a request up to a power of two and hold 4 GiB of the cap
    for it; registering an ordinary buffer pins what is asked. The buffer is unregistered when the tensor is collected
    before its memory is freed, as `torch.distributed`'s state-dict staging does with the same calls.
    """
    chunk = torch.empty(nbytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(chunk.data_ptr(), nbytes, 0))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {error}")
    weakref.finalize(chunk, cudart.cudaHostUnregister, chunk.data_ptr())
    return chunk


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
        cap_bytes: the most host memory the pool may hold.
        pin_memory: page-locked chunks (for the accelerator's fast asynchronous copies).
        chunk_bytes: the largest chunk the doubling grows to (a larger request still gets a chunk of its own, of its
            exact size on CUDA).
    """

    def __init__(self, cap_bytes: int, pin_memory: bool, chunk_bytes: int = _LARGEST_CHUNK_BYTES) -> None:
        self.cap_bytes = cap_bytes
        self.pin_memory = pin_memory
        self.chunk_bytes = chunk_bytes
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
        room = self.cap_bytes - self.capacity
        if size > room:
            room += self._release_free_chunks()
        if self.pin_memory and size > self.chunk_bytes and torch.cuda.is_available():
            if size > room:
                return None
            return self._add_chunk(_pinned_exactly(size), size)
        # PyTorch's pinned allocator rounds every allocation up to a power of two; asking for exactly that keeps
        # the pool's accounting (and so its cap) equal to the pinned memory really held.
        doubling = min(self.chunk_bytes, max(_SMALLEST_CHUNK_BYTES, self.capacity))
        chunk_size = max(size, min(doubling, room))
        if self.pin_memory:
            chunk_size = 1 << (chunk_size - 1).bit_length()
            if chunk_size > room:
                chunk_size >>= 1  # the largest power of two that still fits under the cap
        if not size <= chunk_size <= room:
            return None
        return self._add_chunk(torch.empty(chunk_size, dtype=torch.uint8, pin_memory=self.pin_memory), size)

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

    def bytes_in_use(self) -> int:
        with self._lock:
            return self.capacity - sum(length for ranges in self._free for _, length in ranges)
