"""What the two sequence-tiled ops (`mlp_op`, `layer_op`) share: the chunks' bounds, the autocast state their
recompute replays and the dtypes whose gradients they sum in fp32."""

from __future__ import annotations

import torch

__all__ = ["LOW_PRECISION", "autocast_states", "chunk_bounds"]

# Weight gradients of these dtypes are summed over the chunks in fp32: the untiled backward rounds each weight
# gradient once, at the end of one fp32-accumulating matrix product; a sum of the chunks' rounded products in bf16
# would round once more per chunk.
LOW_PRECISION = (torch.float16, torch.bfloat16)

AutocastState = tuple[str, bool, torch.dtype, bool]


def autocast_states(device_type: str) -> list[AutocastState]:
    """Autocast as the forward saw it, for the device of the input and for the CPU, so that the recompute in backward
    (which runs outside any `torch.autocast` block of the user's) computes in the same dtypes. Without it a layer run
    under bf16 autocast would be recomputed in fp32: other numbers and twice the memory."""
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
            for kind in dict.fromkeys((device_type, "cpu"))
            if torch.amp.is_autocast_available(kind)]  # fmt: skip


def chunk_bounds(length: int, per_chunk: int) -> list[tuple[int, int]]:
    """`[(start, end)]` of consecutive chunks of `per_chunk` over `length`; the last chunk takes the rest."""
    return [(start, min(start + per_chunk, length)) for start in range(0, length, per_chunk)]
