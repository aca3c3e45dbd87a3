"""Applying a per-layer plan to a model's decoder layers: keep, offload, selective or full checkpoint.

transformers' decoder layers (`GradientCheckpointingLayer`) each read their own `gradient_checkpointing` flag and
`_gradient_checkpointing_func` at every forward, so a plan can be applied layer by layer without touching the
model's code. For each layer, with the engine's offloading context around the model's forward:

* keep: no checkpoint; the layer runs inside a region that keeps its saved tensors where they are (counted
  "planned");
* offload: no checkpoint; every tensor the layer saves goes through the engine;
* selective: a non-reentrant checkpoint whose policy saves the outputs of matrix products and attention and
  recomputes the rest (`torch.utils.checkpoint.create_selective_checkpoint_contexts`). The saved outputs stay in
  the checkpoint's own cache on the GPU: saved-tensor hooks never see them;
* full: a non-reentrant checkpoint, which saves only the layer's input.

A checkpointed layer's input is saved by the checkpoint itself, before its own hooks take over, so the engine sees
it: it is offloaded unless the plan keeps it (`offload_input=False`), in which case the checkpoint call runs inside
a region that keeps it.

Every action is set through the two attributes alone, never through module hooks: a kept layer gets a "checkpoint
function" that runs it unchanged inside the keeping region. A plan may then be replaced at any point, even from a
hook of the first layer while its call is being dispatched (the budget re-plans there), since the attributes are
read only inside the layer's forward.

Every action only decides where bytes live and what is recomputed: the arithmetic is the same, so losses and
gradients are bitwise equal under any plan (with deterministic kernels).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .engine import OffloadActivations
from .model import find_decoder_layers
from .planner import FULL, KEEP, OFFLOAD, SELECTIVE

ACTIONS = (KEEP, OFFLOAD, SELECTIVE, FULL)

# What a selective checkpoint saves: the outputs of the ops that cost the most to recompute per byte they occupy.
# Everything else (norms, activations, rotary embeddings, residual adds) is recomputed.
_SAVED_BY_SELECTIVE_CHECKPOINT = frozenset(
    op
    for op in (
        getattr(torch.ops.aten, name, None)
        for name in ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_flash_attention_for_cpu",
                     "_flash_attention_forward", "_efficient_attention_forward")  # fmt: skip
    )
    if op is not None
)


class LayerAction(Protocol):
    """What a plan says about one layer (the planner's `LayerPlan` is one)."""

    action: str
    offload_input: bool


def saved_by_selective_checkpoint(op: Any) -> bool:
    """Whether a selective checkpoint saves the output of `op` (an `OpOverload`, as dispatch sees it)."""
    return getattr(op, "overloadpacket", op) in _SAVED_BY_SELECTIVE_CHECKPOINT


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if saved_by_selective_checkpoint(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def selective_checkpoint_function() -> Callable[..., Any]:
    """A `_gradient_checkpointing_func` that checkpoints selectively (its input saved wherever hooks put it)."""
    return functools.partial(checkpoint, use_reentrant=False, context_fn=_selective_contexts)


def _run_as_is(function: Callable[..., Any], *args: Any) -> Any:
    """The "checkpoint function" of a kept layer: no checkpoint at all."""
    return function(*args)


def _layer_function(action: str, offload_input: bool, engine: OffloadActivations) -> Callable[..., Any]:
    """The `_gradient_checkpointing_func` of a kept or checkpointed layer."""
    function = {KEEP: _run_as_is, SELECTIVE: selective_checkpoint_function(),
                FULL: functools.partial(checkpoint, use_reentrant=False)}[action]  # fmt: skip
    return _InKeepingRegion(function, engine) if action == KEEP or not offload_input else function


class _InKeepingRegion:
    """Runs a layer's function inside a region of the engine that keeps what is saved there.

    For a kept layer that is everything it saves. For a checkpoint it is only the input: non-reentrant
    checkpointing saves its input before it pushes its own saved-tensor hooks, and everything the layer saves
    inside goes to the checkpoint's hooks, which sit on top.
    """

    def __init__(self, function: Callable[..., Any], engine: OffloadActivations) -> None:
        self.function = function
        self._engine = weakref.ref(engine)  # a model that outlives the engine must not keep it alive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._engine()
        if engine is None:
            return self.function(*args, **kwargs)
        with engine.exempt(reason="planned"):
            return self.function(*args, **kwargs)


_ABSENT = object()
_PLAN_ATTRIBUTES = ("gradient_checkpointing", "_gradient_checkpointing_func")


def _layer_attributes(layer: nn.Module) -> dict[str, Any]:
    """The layer's own checkpointing attributes (absent ones too: the class default then applies)."""
    return {name: layer.__dict__.get(name, _ABSENT) for name in _PLAN_ATTRIBUTES}


def _restore_layer(layer: nn.Module, attributes: dict[str, Any]) -> None:
    for name, value in attributes.items():
        if value is _ABSENT:
            layer.__dict__.pop(name, None)
        else:
            setattr(layer, name, value)


@contextlib.contextmanager
def checkpointing_as(layer: nn.Module, function: Callable[..., Any] | None) -> Iterator[None]:
    """Runs `layer` with `function` as its checkpoint function (None: not checkpointed), then restores its own.

    Args:
        layer: a decoder layer (`find_decoder_layers`).
        function: a `_gradient_checkpointing_func`, or None to run the layer without checkpointing.
    """
    saved = _layer_attributes(layer)
    layer.gradient_checkpointing = function is not None
    if function is not None:
        layer._gradient_checkpointing_func = function
    try:
        yield
    finally:
        _restore_layer(layer, saved)


class AppliedPlan:
    """What `apply_layer_plan` changed, so that `remove()` can restore the layers exactly."""

    def __init__(self) -> None:
        self._restore: list[tuple[nn.Module, dict[str, Any]]] = []

    def remove(self) -> None:
        """Restore each layer's `gradient_checkpointing` and `_gradient_checkpointing_func`; idempotent."""
        for layer, attributes in reversed(self._restore):
            _restore_layer(layer, attributes)
        self._restore.clear()


def apply_layer_plan(
    model: nn.Module, engine: OffloadActivations, actions: Sequence[LayerAction]
) -> AppliedPlan:
    """Set each decoder layer of `model` to its action in `actions` (one per layer, in forward order).

    Args:
        model: the (unwrapped) model whose decoder layers `find_decoder_layers` finds.
        engine: the offloading context the model's forward runs under.
        actions: one entry per decoder layer, each with `action` (one of `ACTIONS`) and `offload_input` (for the
            checkpointing actions: whether the checkpoint's input goes to the host).

    Returns:
        An `AppliedPlan` whose `remove()` restores the layers' checkpointing.

    Raises:
        ValueError: the number of actions differs from the number of decoder layers, or an action is unknown.
    """
    layers = [module for _, module in find_decoder_layers(model)]
    if len(actions) != len(layers):
        raise ValueError(f"the plan has {len(actions)} layer actions but {type(model).__name__} has {len(layers)} "
                         "decoder layers")  # fmt: skip
    unknown = sorted({entry.action for entry in actions} - set(ACTIONS))
    if unknown:
        raise ValueError(f"unknown layer actions {unknown}: a layer's action is one of {list(ACTIONS)}")
    applied = AppliedPlan()
    for layer, entry in zip(layers, actions):
        applied._restore.append((layer, _layer_attributes(layer)))
        layer.gradient_checkpointing = entry.action != OFFLOAD
        if entry.action != OFFLOAD:
            layer._gradient_checkpointing_func = _layer_function(entry.action, entry.offload_input, engine)
    return applied
