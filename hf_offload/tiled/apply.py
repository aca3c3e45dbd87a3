"""The entry points of the tiled ops: `apply_tiled_mlp` and `apply_tiled_layer` tile a model's MLPs or its whole
decoder layers, and the handle each returns (`TiledMLPHandle`, `TiledLayerHandle`: `ForwardsReplaced`) undoes them.

`hf_offload.apply_tiled_mlp` is this module's. What runs over the chunks is `mlp_op`'s and `layer_op`'s; which modules
of a transformers model are tiled, and the forwards installed on them, are `integration`'s.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from torch import nn

from .integration import _TiledForward, _TiledLayerForward, layers_to_tile, mlps_to_tile

__all__ = [
    "ForwardsReplaced",
    "TiledLayerHandle",
    "TiledMLPHandle",
    "apply_tiled_layer",
    "apply_tiled_mlp",
    "check_tokens_per_chunk",
]


def check_tokens_per_chunk(tokens_per_chunk: object) -> int:
    """`tokens_per_chunk` as an int, or a ValueError naming it."""
    if (
        isinstance(tokens_per_chunk, bool)
        or not isinstance(tokens_per_chunk, numbers.Integral)
        or tokens_per_chunk <= 0
    ):
        raise ValueError(f"tokens_per_chunk must be a positive int, got {tokens_per_chunk!r}")
    return int(tokens_per_chunk)


_NOT_SET = object()
_Handle = TypeVar("_Handle", bound="ForwardsReplaced")


class ForwardsReplaced:
    """What an `apply_tiled_*` changed: the modules whose `forward` it replaced; `remove()` gives each its own back.

    Also a context manager: `with apply_tiled_mlp(model, 4096): ...` tiles inside the block only. A replacement has
    an `active` attribute: switched off, it passes every call through.
    """

    def __init__(self) -> None:
        self._replaced: list[tuple[str, nn.Module, Any, Any]] = []

    @classmethod
    def of(cls: type[_Handle], chosen: Iterable[tuple[str, nn.Module]],
           tiled_forward: Callable[[nn.Module], Any]) -> _Handle:  # fmt: skip
        """A handle that has made `tiled_forward(module)` the `forward` of each `(name, module)` chosen, in order."""
        handle = cls()
        for name, module in chosen:
            handle.replace(name, module, tiled_forward(module))
        return handle

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


class TiledMLPHandle(ForwardsReplaced):
    """What `apply_tiled_mlp` changed; `remove()` gives every tiled module its previous `forward` back."""


def apply_tiled_mlp(model: nn.Module, tokens_per_chunk: int, layers: Iterable[int] | None = None) -> TiledMLPHandle:
    """Run the MLP of each decoder layer (or of `layers`) over chunks of `tokens_per_chunk` tokens.

    Each MLP (the child `mlp` of a decoder layer found by `hf_offload.model.find_decoder_layers`) gets a tiled
    `forward` as an instance attribute; the model's code and its weights are untouched, and `remove()` on the
    returned handle restores them exactly. Every check runs before anything is changed: a call that raises leaves
    the model as it was.

    Works for a model wrapped by PEFT, DDP, DeepSpeed or `torch.compile` (it is unwrapped first), for LoRA layers
    inside the MLP (only the adapter weights are trainable, so only they get gradients), for bf16/fp16/fp32 and for
    autocast. Gradients agree with the untiled model within rounding, not bitwise (see `mlp_op`'s docstring).

    Args:
        model: the model, bare or wrapped.
        tokens_per_chunk: tokens per chunk, over all of a call's leading dimensions (batch x sequence). Calls with at
            most this many tokens run the MLP unchanged. A few thousand keeps the chunks' matrix products efficient;
            Arctic Long Sequence Training picks about the hidden size.
        layers: indices into the decoder layers (forward order; negative counts from the end); None for all.

    Returns:
        A `TiledMLPHandle` whose `remove()` undoes this call.

    Raises:
        ValueError: `tokens_per_chunk` is not a positive int; the model has no decoder layers; a layer index is out of
            range; a selected layer has no MLP child, has a mixture-of-experts block there, or is already tiled.

    Example:

    ```python
    handle = apply_tiled_mlp(model, tokens_per_chunk=4096)
    loss = model(**batch).loss  # each MLP holds one chunk of intermediates at a time
    loss.backward()
    handle.remove()  # the model computes exactly as before
    ```
    """
    tokens_per_chunk = check_tokens_per_chunk(tokens_per_chunk)
    return TiledMLPHandle.of(mlps_to_tile(model, layers), lambda mlp: _TiledForward(mlp, mlp.forward, tokens_per_chunk))


class TiledLayerHandle(ForwardsReplaced):
    """What `apply_tiled_layer` changed; `remove()` gives every tiled module its previous `forward` back."""


def apply_tiled_layer(model: nn.Module, tokens_per_chunk: int, layers: Iterable[int] | None = None, *,
                      call_op: Callable[..., Any] | None = None) -> TiledLayerHandle:  # fmt: skip
    """Run each decoder layer (or each of `layers`) over chunks of `tokens_per_chunk` tokens, attention on the whole
    sequence by head groups, in forward and backward.

    Each layer (found by `hf_offload.model.find_decoder_layers`) gets a tiled `forward` as an instance attribute; the
    model's code and weights are untouched, and `remove()` on the returned handle restores them exactly. Every check
    runs before anything is changed: a call that raises leaves the model as it was.

    Works for a model wrapped by PEFT, DDP, DeepSpeed or `torch.compile` (it is unwrapped first), for LoRA layers
    (only trainable weights get gradients), for bf16/fp16/fp32 and for autocast, with any attention implementation
    transformers looks up through `AttentionInterface` (eager, SDPA, FlashAttention, flex). Gradients agree with the
    untiled layer within rounding, not bitwise (see `layer_op`'s docstring). A tiled layer is its own checkpoint: its
    `gradient_checkpointing` is not used while it is tiled.

    Args:
        model: the model, bare or wrapped.
        tokens_per_chunk: tokens per chunk, over the batch: a chunk is `tokens_per_chunk // batch` positions (at
            least one) of every sequence. Calls with at most this many tokens run the layer unchanged.
        layers: indices into the decoder layers (forward order; negative counts from the end); None for all.
        call_op: how a tiled call runs the op, as `call_op(function, *args)` (a `_gradient_checkpointing_func`'s
            signature): the memory planner's layer actions pass one that runs it in a region of the offloading engine
            that keeps what it saves, the layer's input (`l`). None runs it as it is.

    Returns:
        A `TiledLayerHandle` whose `remove()` undoes this call.

    Raises:
        ValueError: `tokens_per_chunk` is not a positive int; the model has no decoder layers; a layer index is out of
            range; a selected layer has no module that calls transformers' attention interface, or more than one, or
            is already tiled.

    Example:

    ```python
    handle = apply_tiled_layer(model, tokens_per_chunk=4096)
    loss = model(**batch).loss  # each layer holds one chunk's activations at a time, attention one head group's
    loss.backward()
    handle.remove()  # the model computes exactly as before
    ```
    """
    tokens_per_chunk = check_tokens_per_chunk(tokens_per_chunk)
    return TiledLayerHandle.of(
        layers_to_tile(model, layers), lambda layer: _TiledLayerForward(layer, layer.forward, tokens_per_chunk, call_op)
    )
