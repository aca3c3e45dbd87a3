"""What the sequence-tiled ops (`tiled_mlp`, `tiled_layer`) share: the chunks' bounds, the autocast state their
recompute replays, the dtypes whose gradients they sum in fp32, and the decoder layers a user names by index."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..model import find_decoder_layers, unwrap_model

__all__ = [
    "LOW_PRECISION",
    "autocast_states",
    "chunk_bounds",
    "layer_indices",
    "check_tokens_per_chunk",
    "ForwardsReplaced",
    "selected_decoder_layers",
]

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


def check_tokens_per_chunk(tokens_per_chunk: object) -> int:
    """`tokens_per_chunk` as an int, or a ValueError naming it."""
    if (
        isinstance(tokens_per_chunk, bool)
        or not isinstance(tokens_per_chunk, numbers.Integral)
        or tokens_per_chunk <= 0
    ):
        raise ValueError(f"tokens_per_chunk must be a positive int, got {tokens_per_chunk!r}")
    return int(tokens_per_chunk)


def layer_indices(layers: Iterable[int] | None, count: int) -> list[int]:
    """The decoder layers named by `layers` (indices, negative from the end; None for all), each once, in the order
    given; a ValueError for anything else."""
    if layers is None:
        return list(range(count))
    indices: list[int] = []
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not -count <= index < count:
            raise ValueError(f"layers must name decoder layers by index, from 0 to {count - 1} (or -{count} to -1), "
                             f"got {index!r}")  # fmt: skip
        index = int(index) % count
        if index not in indices:
            indices.append(index)
    return indices


_NOT_SET = object()


class ForwardsReplaced:
    """What an `apply_tiled_*` changed: the modules whose `forward` it replaced; `remove()` gives each its own back.

    Also a context manager: `with apply_tiled_mlp(model, 4096): ...` tiles inside the block only. A replacement has
    an `active` attribute: switched off, it passes every call through.
    """

    def __init__(self) -> None:
        self._replaced: list[tuple[str, nn.Module, Any, Any]] = []

    def replace(self, name: str, module: nn.Module, forward: Any) -> None:
        """Makes `forward` the module's, remembering the instance attribute it had (or that it had none)."""
        previous = module.__dict__.get("forward", _NOT_SET)
        module.forward = forward
        self._replaced.append((name, module, forward, previous))

    @property
    def names(self) -> list[str]:
        """The modules' names, relative to the unwrapped model (`model.layers.0.mlp`, ...)."""
        return [name for name, *_ in self._replaced]

    def remove(self) -> None:
        """Restore each module's `forward` exactly (no instance attribute again, or the one it had); idempotent.

        If something replaced a module's `forward` after us (and wraps ours), that attribute is left to its owner and
        ours is switched off instead: from then on it passes every call through untiled.
        """
        for _, module, forward, previous in reversed(self._replaced):
            forward.active = False
            if module.__dict__.get("forward") is forward:
                if previous is _NOT_SET:
                    del module.forward
                else:
                    module.forward = previous
        self._replaced.clear()

    def __enter__(self) -> ForwardsReplaced:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self._replaced)


def selected_decoder_layers(
    model: nn.Module, layers: Iterable[int] | None, purpose: str
) -> list[tuple[int, str, nn.Module]]:
    """The decoder layers an `apply_tiled_*` call selects: (index, name, layer), `layers` checked by `layer_indices`.

    Raises:
        ValueError: the model has no decoder layers (`purpose` says what the caller needed them for), or an index is
            out of range.
    """
    inner = unwrap_model(model)
    decoder_layers = find_decoder_layers(inner)
    if not decoder_layers:
        raise ValueError(f"{type(inner).__name__} has no decoder layers (modules of a GradientCheckpointingLayer "
                         f"class): {purpose}")  # fmt: skip
    return [(index, *decoder_layers[index]) for index in layer_indices(layers, len(decoder_layers))]
