"""The CUDA caching allocator at long context: fragmentation, and the setting that avoids it.

At long context a step allocates tensors of several GiB that vary in size from layer to layer (a layer's recompute,
its gradients, the reloads). With the caching allocator's default fixed-size segments, the memory freed by one layer
is reserved in segments that the next layer's tensors may not fit into: measured on an H100 at 196,608 tokens (8B
shape, LoRA), a step ran out of memory with 61.9 GiB allocated and 9.9 GiB reserved but unallocated.
`expandable_segments:True` lets a segment grow in place instead, which removes that waste; it must be set before CUDA
starts (`PYTORCH_CUDA_ALLOC_CONF`, read once when the allocator is created), so the library can only say so.
What it can do later is give cached segments back to the device before a step that needs more than is left outside
them (`release_unusable_cache`).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch import nn

from .compile_guard import eager_only

__all__ = ["LONG_CONTEXT_TOKENS", "expandable_segments_enabled", "LongContextCheck", "release_unusable_cache"]

# A step of this many tokens or more is long context: its layers' tensors are GiB-sized.
LONG_CONTEXT_TOKENS = 32768
_SETTING_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments_enabled() -> bool:
    """Whether the allocator was asked for expandable segments in the environment (the last mention wins)."""
    enabled = False
    for name in _SETTING_NAMES:
        for entry in os.environ.get(name, "").split(","):
            key, _, value = entry.partition(":")
            if key.strip() == "expandable_segments":
                enabled = value.strip().lower() == "true"
    return enabled


class LongContextCheck:
    """A forward pre-hook (with kwargs) for the first decoder layer: warns once per engine, with the fix, when a CUDA
    step of `LONG_CONTEXT_TOKENS` or more runs without expandable segments.

    Args:
        engine: the offloading context (its `warn_once` keeps the warning to one); held weakly, as every hook of the
            library holds it, so that a model outliving its context does not keep it alive.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)

    @eager_only
    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        engine = self._engine()
        if engine is None or not isinstance(hidden, torch.Tensor) or hidden.device.type != "cuda":
            return
        tokens = hidden.shape[:-1].numel()
        if tokens >= LONG_CONTEXT_TOKENS and not expandable_segments_enabled():
            engine.warn_once("expandable_segments", f"hf_offload: a step of {tokens} tokens runs without the "
                             "CUDA allocator's expandable segments: at long context, memory freed by one layer is "
                             "often reserved in blocks the next cannot use (fragmentation), and the step runs out of "
                             "memory below the budget. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the "
                             "environment before CUDA starts (before the script, or the notebook's kernel, "
                             "starts)")  # fmt: skip

    def __deepcopy__(self, memo: dict) -> LongContextCheck:
        return self  # never copy the engine with a model


def release_unusable_cache(peak_bytes: int, device: torch.device | None = None) -> bool:
    """Give the allocator's cached, unallocated segments back to the device when the room outside them is less than
    a coming step needs (`peak_bytes` in all).

    Cached segments are reused only by tensors that fit in their free blocks; a step that needs more than the
    memory never reserved must otherwise hope they do. `torch.cuda.empty_cache()` synchronises and costs the next
    allocations a `cudaMalloc`, so it is called only when the room is short, not every step.

    Args:
        peak_bytes: the step's predicted peak (allocated bytes).
        device: the CUDA device; None for the current one. Nothing happens without CUDA.

    Returns:
        Whether the cache was emptied.
    """
    if not torch.cuda.is_available():
        return False
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    if reserved == allocated or total - reserved >= peak_bytes - allocated:
        return False
    torch.cuda.empty_cache()
    return True
