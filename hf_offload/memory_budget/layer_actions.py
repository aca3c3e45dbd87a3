"""Applying a per-layer plan to decoder layers: keep, offload, selective (kept or offloaded) or full checkpoint.

transformers' decoder layers (`GradientCheckpointingLayer`) each read their own `gradient_checkpointing` flag and
`_gradient_checkpointing_func` at every forward, so a plan can be applied layer by layer without touching the
model's code. For each layer, with the engine's offloading context around the model's forward:

* keep: no checkpoint; the layer runs inside a region that keeps its saved tensors where they are (counted
  "planned");
* offload: no checkpoint; every tensor the layer saves goes through the engine;
* selective: a non-reentrant checkpoint whose policy saves the outputs of matrix products and attention and
  recomputes the rest (`torch.utils.checkpoint.create_selective_checkpoint_contexts`). The saved outputs stay in
  the checkpoint's own cache on the GPU: saved-tensor hooks never see them;
* selective offload: the same checkpoint and policy, but the saved outputs go through the engine (its pinned pool,
  streams, windows and prefetch) instead of that cache, so the layer holds nothing on the GPU between its forward
  and backward, and backward reloads the outputs and recomputes only the cheap ops (`_SelectiveOffload`);
* full: a non-reentrant checkpoint, which saves only the layer's input;
* full with the MLP tiled: the same checkpoint, and the layer's MLP runs over chunks of tokens
  (`hf_offload.tiled.mlp_op`), so that its intermediates exist one chunk at a time in the recompute and backward;
* tiled layer: the whole layer runs over chunks of tokens, attention on the whole sequence by head groups
  (`hf_offload.tiled.layer_op`). It is its own checkpoint (it saves only its input, through the hooks, and recomputes
  the layer in backward), set on the layer's `forward`; the layer's checkpointing attributes are those of a full
  checkpoint, for the calls it runs untiled (at most one chunk of tokens).

A checkpointed layer's input is saved by the checkpoint itself, before its own hooks take over, so the engine sees
it: it is offloaded unless the plan keeps it (`offload_input=False`), in which case the checkpoint call runs inside
a region that keeps it.

Every action is set through the two attributes alone, never through module hooks: a kept layer gets a "checkpoint
function" that runs it unchanged inside the keeping region. A plan may then be replaced at any point, even from a
hook of the first layer while its call is being dispatched (the controller re-plans there), since the attributes are
read only inside the layer's forward.

Every action but the tiled ones only decides where bytes live and what is recomputed: the arithmetic is the same, so
losses and gradients are bitwise equal under any plan without tiling (with deterministic kernels). A tiled MLP or
layer sums its weight gradients chunk by chunk: equal within rounding.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from ..engine import OffloadActivations
from ..model import find_decoder_layers, find_liger_functions, is_cache
from ..random_state import RandomState, random_state, set_random_state
from ..tiled.apply import ForwardsReplaced, apply_tiled_layer, apply_tiled_mlp
from ..tiled.integration import tiled_forward
from .actions import ACTIONS, FULL, FULL_TILED, KEEP, OFFLOAD, SELECTIVE, SELECTIVE_OFFLOAD, TILED_LAYER

__all__ = [
    "LayerActionLike",
    "AppliedActions",
    "StorageSet",
    "apply_layer_actions",
    "checkpointing_as",
    "saved_by_selective_checkpoint",
    "selective_checkpoint_function",
    "whole_call_layer",
    "written_tensors",
]

# The actions' names (`actions.ACTIONS`, where each is also offered with its input kept or offloaded).
_NAMES = tuple(dict.fromkeys(action.action for action in ACTIONS.values()))

# What a selective checkpoint saves: the outputs of the ops that cost the most to recompute per byte they occupy.
# Everything else (norms, activations, rotary embeddings, residual adds) is recomputed.
_SAVED_OP_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                   "_scaled_dot_product_flash_attention_for_cpu",
                   "_flash_attention_forward", "_efficient_attention_forward")  # fmt: skip
_SAVED_BY_SELECTIVE_CHECKPOINT = frozenset(
    op for op in (getattr(torch.ops.aten, name, None) for name in _SAVED_OP_NAMES) if op is not None
)


class LayerActionLike(Protocol):
    """What a plan says about one layer: an `actions.LayerAction`, or the planner's `PlannedLayer`."""

    action: str
    offload_input: bool


def saved_by_selective_checkpoint(op: Any) -> bool:
    """Whether a selective checkpoint saves the output of `op` (an `OpOverload`, as dispatch sees it)."""
    return getattr(op, "overloadpacket", op) in _SAVED_BY_SELECTIVE_CHECKPOINT


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if saved_by_selective_checkpoint(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def recomputed(function: Callable[..., Any], *args: Any, **checkpoint_options: Any) -> Any:
    """torch's non-reentrant checkpoint of a layer's call, without the step's KV cache among its arguments.

    The recomputation in backward would write the layer's keys and values into the cache a second time, and a later
    layer's attention would read both. transformers' checkpointing leaves out a cache passed by name, and models
    leave theirs out under model-wide checkpointing; a plan checkpoints layer by layer, and RemBERT passes its cache by
    position: its backward raised on the doubled keys' shapes. Training reads no cache.
    """
    args = tuple(None if is_cache(value) else value for value in args)
    return checkpoint(function, *args, use_reentrant=False, **checkpoint_options)


def selective_checkpoint_function() -> Callable[..., Any]:
    """A `_gradient_checkpointing_func` that checkpoints selectively (its input saved wherever hooks put it)."""
    return functools.partial(recomputed, context_fn=_selective_contexts)


def _run_as_is(function: Callable[..., Any], *args: Any) -> Any:
    """The "checkpoint function" of a kept layer: no checkpoint at all."""
    return function(*args)


def _layer_function(action: str, offload_input: bool, engine: OffloadActivations) -> Callable[..., Any]:
    """The `_gradient_checkpointing_func` of a kept or checkpointed layer."""
    if action == SELECTIVE_OFFLOAD:  # it keeps its input itself: a keeping region around it would hide the engine
        return _SelectiveOffload(engine, offload_input)
    # The MLP's tiling is set on the MLP itself, the layer's on the layer's `forward`: a checkpoint for what it runs
    # untiled.
    function = {KEEP: _run_as_is, SELECTIVE: selective_checkpoint_function(), FULL: recomputed, FULL_TILED: recomputed,
                TILED_LAYER: recomputed}[action]  # fmt: skip
    return _InKeepingRegion(function, engine) if action == KEEP or not offload_input else function


class _TiledLayerCheckpoint:
    """The `_gradient_checkpointing_func` of a layer tiled whole.

    The tiled forward is the layer's `forward` and its own checkpoint: transformers 5.24 on, which checkpoints a
    layer's `forward`, handing this function `partial(forward, layer, **kwargs)`, calls this function only where the
    tiled forward runs the layer untiled (a call of at most one chunk), and where the call looked the layer's forward
    up before the plan tiled it: the controller applies the profiled steps' plan from the pre-hook of the first
    layer called, which then runs this call under its class's forward. The first is checkpointed (`function`, as a
    full checkpoint, its input kept for `l`); the second goes to the tiled forward, so that no layer runs its long
    first step untiled (at long context that alone would not fit).

    Earlier transformers (5.17) checkpoint the layer's whole call, handing this function `partial(layer.__call__ of
    nn.Module, **kwargs)` at every call: a call the tiled forward tiles runs as it is (the tiled op is the checkpoint;
    one around it would run the layer's forward a third time), one it does not is checkpointed.
    """

    def __init__(self, layer: nn.Module, function: Callable[..., Any]) -> None:
        self._layer = weakref.ref(layer)
        self.function = function
        self._redirected = threading.local()

    def __call__(self, function: Callable[..., Any], *args: Any) -> Any:
        layer = self._layer()
        tiled = tiled_forward(layer) if layer is not None else None
        if tiled is not None and whole_call_layer(function) is layer:
            return function(*args) if tiled.tiles(*args, **function.keywords) else self.function(function, *args)
        bound = isinstance(function, functools.partial) and len(function.args) == 1 and function.args[0] is layer
        if tiled is None or not bound or getattr(self._redirected, "active", False):
            return self.function(function, *args)
        self._redirected.active = True  # the tiled forward's own untiled calls come back here: checkpointed
        try:
            return tiled(*args, **function.keywords)
        finally:
            self._redirected.active = False


def whole_call_layer(function: Callable[..., Any]) -> nn.Module | None:
    """The layer whose whole call, hooks and all, a checkpoint function was handed as `function` (transformers 5.17's
    `partial(super().__call__, **kwargs)`); None for anything else (5.24's `partial(forward, layer, **kwargs)`)."""
    if not isinstance(function, functools.partial) or function.args:
        return None
    layer = getattr(function.func, "__self__", None)
    return layer if isinstance(layer, nn.Module) else None


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
        if engine is None or engine.standing_aside is not None:  # standing aside, the engine keeps everything itself
            return self.function(*args, **kwargs)
        with engine.exempt(reason="planned"):
            return self.function(*args, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# Selective offload
# --------------------------------------------------------------------------------------------------------------------

# Without early stop, a recomputation runs to the end of the layer and so takes every output the forward stashed,
# the layer's last matrix product included (only the ops after the last tensor autograd saves read it). With early
# stop that output's copy would never be unpacked, yet the engine prefetches it like any other and counts it against
# the prefetch window until it is unpacked: a few layers later the window would stay full. torch takes the keyword
# from 2.9 on; before, the global switch does the same (it is read once, when `checkpoint` makes its frame).
_EARLY_STOP_KEYWORD = "early_stop" in inspect.signature(checkpoint).parameters


def _without_early_stop() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if _EARLY_STOP_KEYWORD else set_checkpoint_early_stop(False)


def _stashed(op: Any) -> bool:
    """Whether a selective offload sends `op`'s outputs through the engine: those a selective checkpoint saves,
    unless an output aliases an input (an `out=` variant), whose memory belongs to the caller."""
    return saved_by_selective_checkpoint(op) and not any(ret.alias_info is not None for ret in op._schema.returns)


@functools.cache
def _written_arguments(op: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument `op` writes into (in-place and `out=` variants)."""
    schema = getattr(op, "_schema", None)  # higher-order operators have none
    arguments = schema.arguments if schema is not None else ()
    return tuple((i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write)


def written_tensors(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The plain tensors a call of `op` with `args` and `kwargs` writes into (in-place and `out=` variants)."""
    tensors = []
    for position, name in _written_arguments(op):
        value = args[position] if position < len(args) else kwargs.get(name)
        tensors.extend(t for t in (value if isinstance(value, (list, tuple)) else (value,)) if type(t) is torch.Tensor)
    return tensors


class StorageSet:
    """Tensors' storages, each held by a weak reference: a storage freed and its address reused by a new one is not
    taken for it. Views of any kind share their base's storage, so a write through one is seen."""

    def __init__(self) -> None:
        self._storages: dict[int, weakref.ref] = {}

    def add(self, tensor: torch.Tensor) -> None:
        if _has_one_storage(tensor) and tensor.untyped_storage().nbytes():
            storage = tensor.untyped_storage()
            self._storages[storage.data_ptr()] = weakref.ref(storage)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        if not _has_one_storage(tensor):
            return False
        storage = tensor.untyped_storage()
        known = self._storages.get(storage.data_ptr())
        return known is not None and known() is storage

    def __bool__(self) -> bool:
        return bool(self._storages)


def _has_one_storage(tensor: torch.Tensor) -> bool:
    """A plain strided tensor: a sparse one, or a tensor subclass, has no one storage to compare."""
    return type(tensor) is torch.Tensor and tensor.layout == torch.strided


class _Packed:
    """A tensor output, as the engine's pack hook returned it (the handle of its host copy, or the tensor kept)."""

    __slots__ = ("saved",)

    def __init__(self, saved: Any) -> None:
        self.saved = saved


class _Call:
    """One call of a stashed op: its outputs (tensors packed, the rest as they are) and, for an op that may draw
    random numbers (attention with dropout), the device and generator state it left behind."""

    __slots__ = ("outputs", "rng")

    def __init__(self, outputs: Any, rng: tuple[torch.device, RandomState] | None) -> None:
        self.outputs = outputs
        self.rng = rng


class _Stash:
    """What one selective offload's forward stashed, per op, in call order: shared by its two dispatch modes.

    Held by the recompute mode, which the checkpoint's frame holds (in its recompute function), which autograd's
    graph holds: once backward has run or the graph is dropped, the stash and every handle still in it go, and with
    them their host copies. A recomputation takes each call's entry by its index (as torch 2.13's own cache does, not
    its 2.11 FIFO): a second backward (`retain_graph`) recomputes from the start again and must not be handed the
    outputs of later calls, and an entry taken once is empty, so that call runs again instead.
    """

    __slots__ = ("calls", "__weakref__")

    def __init__(self) -> None:
        self.calls: defaultdict[Any, list[_Call | None]] = defaultdict(list)

    def take(self, op: Any, index: int) -> _Call | None:
        calls = self.calls.get(op)
        if calls is None or index >= len(calls):
            return None
        call, calls[index] = calls[index], None
        return call

    def __len__(self) -> int:
        """The calls stashed and not taken yet."""
        return sum(call is not None for calls in self.calls.values() for call in calls)


class _StashingMode(TorchDispatchMode):
    """The forward of a selective offload: runs every op, and hands the outputs of those a selective checkpoint saves
    to the engine's pack hook, as if autograd had saved them, keeping only what the hook returns."""

    def __init__(self, stash: _Stash, pack: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self._stash = stash
        self._pack = pack
        # The storages of the stashed outputs, to refuse an in-place write into one: its copy may still be reading
        # it on the side stream, and backward would be handed the value from before the write.
        self._storages = StorageSet()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._storages:
            self._refuse_writes(func, args, kwargs)
        out = func(*args, **kwargs)
        if _stashed(func):
            rng = None
            if torch.Tag.nondeterministic_seeded in func.tags:
                device = next((a.device for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)), None)
                rng = (device, random_state(device)) if device is not None else None
            self._stash.calls[func].append(_Call(tree_map(self._packed, out), rng))
        return out

    def _packed(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        self._storages.add(value)
        return _Packed(self._pack(value.detach()))

    def _refuse_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        for tensor in written_tensors(func, args, kwargs):
            if tensor in self._storages:
                raise RuntimeError(
                    f"{func} writes in place into the output of a matrix product or attention that a "
                    f"'{SELECTIVE_OFFLOAD}' checkpoint has handed to the offloading engine: its copy would not "
                    "see the write (and a selective checkpoint's recomputation would apply it twice). Give this "
                    "layer another action."
                )


class _UnstashingMode(TorchDispatchMode):
    """The recomputation of a selective offload: the stashed ops do not run, their outputs come back from the engine
    (through its unpack hook, as autograd's saved tensors do); every other op runs again."""

    def __init__(self, stash: _Stash, unpack: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self._stash = stash
        self._unpack = unpack  # needs no engine: each handle holds its own
        self._calls: defaultdict[Any, int] = defaultdict(int)

    def __enter__(self) -> _UnstashingMode:
        self._calls.clear()  # each recomputation (one per backward) starts from the region's first call
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _stashed(func):
            index = self._calls[func]
            self._calls[func] = index + 1
            call = self._stash.take(func, index)
            if call is not None:
                outputs = tree_map(lambda leaf: self._unpack(leaf.saved) if isinstance(leaf, _Packed) else leaf,
                                   call.outputs)  # fmt: skip
                # The op does not run, so it draws no random numbers: the ops after it must find the generator
                # where the forward left it (the checkpoint restores it only at the region's start).
                if call.rng is not None:
                    set_random_state(*call.rng)
                return outputs
        return func(*args, **(kwargs or {}))


def _stash_contexts(pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> Any:
    """A `context_fn` for `checkpoint`: a new stash, and the forward and recompute modes that share it."""
    stash = _Stash()
    return _StashingMode(stash, pack), _UnstashingMode(stash, unpack)


class _SelectiveOffload:
    """The `_gradient_checkpointing_func` of a layer under "selective_offload".

    A non-reentrant checkpoint with the selective policy whose `context_fn` gives each call its own pair of dispatch
    modes sharing one stash: the forward one hands each saved output to the engine's pack hook, the recompute one
    gives back what the unpack hook returns and runs the other ops. The engine then treats those outputs as any saved
    tensor: copied out through its forward window, reloaded ahead of need, kept where its rules keep tensors (the
    tail, small tensors, the host pool's cap).

    The outputs go to the engine only when its hooks are the innermost ones, where the layer's other saved tensors
    would go: under a region that keeps tensors (`set_aside`, `exempt`), outside the engine's context, with the
    engine gone, or while compiling, the layer is checkpointed as under "selective" (torch's own cache).

    Attributes:
        offloads_saved_tensors: True. Tells other modules (`hf_offload.model_hooks`' prefetch points), without importing
            this one, that this checkpoint sends the engine many tensors per layer, each needing its reload ahead,
            rather than its input alone.
    """

    offloads_saved_tensors = True

    def __init__(self, engine: OffloadActivations, offload_input: bool = True) -> None:
        self._engine = weakref.ref(engine)  # a model that outlives the engine must not keep it alive
        self.offload_input = offload_input

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        engine = self._engine()
        if engine is None or not engine.is_innermost() or torch.compiler.is_compiling():
            return recomputed(function, *args, context_fn=_selective_contexts, **kwargs)
        context_fn = functools.partial(_stash_contexts, engine.pack_hook, engine.unpack_hook)
        early_stop = {"early_stop": False} if _EARLY_STOP_KEYWORD else {}
        # The checkpoint saves its input through the hooks in place when it is called; its modes go to the engine
        # directly, so a keeping region for the input changes nothing else.
        keep_input = engine.exempt(reason="planned") if not self.offload_input else contextlib.nullcontext()
        with keep_input, _without_early_stop():
            return recomputed(function, *args, context_fn=context_fn, **early_stop, **kwargs)


_ABSENT = object()
_CHECKPOINT_ATTRIBUTES = ("gradient_checkpointing", "_gradient_checkpointing_func")


def _layer_attributes(layer: nn.Module) -> dict[str, Any]:
    """The layer's own checkpointing attributes (absent ones too: the class default then applies)."""
    return {name: layer.__dict__.get(name, _ABSENT) for name in _CHECKPOINT_ATTRIBUTES}


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


class AppliedActions:
    """What `apply_layer_actions` changed, so that `remove()` can restore the layers exactly."""

    def __init__(self) -> None:
        self._restore: list[tuple[nn.Module, dict[str, Any]]] = []
        self._tiled: list[ForwardsReplaced] = []

    def remove(self) -> None:
        """Restore each layer's `gradient_checkpointing` and `_gradient_checkpointing_func`, and untile the MLPs and
        layers the plan tiled; idempotent."""
        for layer, attributes in reversed(self._restore):
            _restore_layer(layer, attributes)
        self._restore.clear()
        for handle in reversed(self._tiled):
            handle.remove()
        self._tiled.clear()


def apply_layer_actions(model: nn.Module, engine: OffloadActivations, actions: Sequence[LayerActionLike],
                        tile_tokens: int = 0, layer_tile_tokens: int = 0) -> AppliedActions:  # fmt: skip
    """Set each decoder layer of `model` to its action in `actions` (one per layer, in forward order).

    Args:
        model: the (unwrapped) model whose decoder layers `find_decoder_layers` finds.
        engine: the offloading context the model's forward runs under.
        actions: one entry per decoder layer, each with `action` (an `actions.ACTIONS` name) and `offload_input`
            (for the checkpointing actions: whether the checkpoint's input goes to the host).
        tile_tokens: tokens per chunk of the MLPs of the `FULL_TILED` layers (the plan's `tile_tokens`).
        layer_tile_tokens: tokens per chunk of the `TILED_LAYER` layers (the plan's `layer_tile_tokens`).

    Returns:
        An `AppliedActions` whose `remove()` restores the layers' checkpointing, MLPs and forwards.

    Raises:
        ValueError: the number of actions differs from the number of decoder layers, an action is unknown, a
            selective checkpoint is asked of a model whose code runs Liger's in-place kernels (`find_liger_functions`:
            its gradients would differ), or a layer's MLP or the layer itself cannot be tiled (see `apply_tiled_mlp`,
            `apply_tiled_layer`). Nothing is changed then.
    """
    layers = [module for _, module in find_decoder_layers(model)]
    if len(actions) != len(layers):
        raise ValueError(f"the plan has {len(actions)} layer actions but {type(model).__name__} has {len(layers)} "
                         "decoder layers")  # fmt: skip
    unknown = sorted({entry.action for entry in actions} - set(_NAMES))
    if unknown:
        raise ValueError(f"unknown layer actions {unknown}: a layer's action is one of {list(_NAMES)}")
    selective = sorted({entry.action for entry in actions} & {SELECTIVE, SELECTIVE_OFFLOAD})
    in_place = find_liger_functions(model) if selective else []
    if in_place:
        raise ValueError(f"the plan checkpoints layers selectively ({', '.join(selective)}), but Liger's functions in "
                         f"the model's code ({', '.join(in_place)}) write into the outputs of matrix products in "
                         "place, unseen by autograd: a selective checkpoint keeps those outputs for its "
                         "recomputation, which would see them already written, and the gradients would differ. Give "
                         "those layers another action.")  # fmt: skip
    applied = AppliedActions()
    # First, as each apply_tiled_* checks every layer it tiles before it changes any: one that raises undoes the others.
    tiled_mlps = [i for i, entry in enumerate(actions) if entry.action == FULL_TILED]
    kept_input = _InKeepingRegion(_run_as_is, engine)  # a tiled layer's op is its checkpoint: its input kept there
    try:
        if tiled_mlps:
            applied._tiled.append(apply_tiled_mlp(model, tile_tokens, layers=tiled_mlps))
        for offload_input in (True, False):
            tiled_layers = [i for i, entry in enumerate(actions)
                            if entry.action == TILED_LAYER and entry.offload_input == offload_input]  # fmt: skip
            if tiled_layers:
                applied._tiled.append(apply_tiled_layer(model, layer_tile_tokens, layers=tiled_layers,
                                                        call_op=None if offload_input else kept_input))  # fmt: skip
    except ValueError:
        applied.remove()
        raise
    for layer, entry in zip(layers, actions):
        applied._restore.append((layer, _layer_attributes(layer)))
        layer.gradient_checkpointing = entry.action != OFFLOAD
        if entry.action != OFFLOAD:
            function = _layer_function(entry.action, entry.offload_input, engine)
            layer._gradient_checkpointing_func = (_TiledLayerCheckpoint(layer, function)
                                                  if entry.action == TILED_LAYER else function)  # fmt: skip
    engine.refresh_prefetch_on_unpack()  # applied at a forward's start, after the model's hooks decided it
    return applied
