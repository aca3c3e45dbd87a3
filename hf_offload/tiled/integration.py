"""The tiled ops in transformers' models: which modules are tiled, and the forwards that run the ops on them.

* The decoder layers a caller names by index (`selected_decoder_layers`), and the tokens per chunk a model's hidden
  size gives (`default_tokens_per_chunk`).
* The MLP: the child `mlp` of a decoder layer (a mixture-of-experts block there refused, `mlps_to_tile`) and its
  tiled forward (`_TiledForward`), which runs `mlp_op.tiled_mlp` over the call's tokens.
* The whole layer (`layers_to_tile`): the cut at the attention interface (transformers' `get_interface` answered, on
  the running thread only, by a harvest or an answer), one layer call cut along the sequence (`_LayerCall`: its
  per-token arguments, its checkpointing off, the whole sequence's attention call made from the chunks'), the tiled
  forward (`_TiledLayerForward`) that runs `layer_op`'s op on it, and what the planner reads of a layer
  (`layer_bytes_per_token`, `recorded_outputs`, `tiled_forward`).

A change to how a family's layers are found, cut or refused goes here; a change to what runs over the chunks, in
forward or in backward, goes in `mlp_op` or `layer_op`; the entry points and their handles are `apply`'s.

What a tiled layer does not do
------------------------------
* A layer must have exactly one module that calls the attention interface (checked at `apply_tiled_layer`); a call
  that does not call it, or calls it twice, is an error.
* The per-token arguments it knows how to cut are `position_embeddings` (cos, sin), `position_ids` and
  `cache_position`; the attention mask is passed whole. Another argument with a dimension as long as the sequence is
  an error, and so is an attention module that changes the mask or passes a learned tensor to the attention function
  (gpt-oss's sinks): a head group could not take its share of it.
* Output recorders that would see chunks (router logits for a mixture of experts' auxiliary loss, attention weights)
  are refused with an error: the router's logits recorded per chunk without grad would give the auxiliary loss no
  gradient.
* A KV cache is dropped in training with grad (as transformers' checkpointing does) and kept otherwise, where the
  layer then runs untiled.
* Calls that are not `(batch, sequence, hidden)` hidden states run untiled; torch.compile of a tiled layer is untried.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import numbers
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import AttentionInterface
from transformers.utils.output_capturing import _active_collector

from ..model import CACHE_ARGUMENTS, find_decoder_layers, is_cache, unwrap_model
from .chunks import chunk_bounds
from .layer_op import (
    _AttentionCall,
    _HeadGroups,
    _TiledLayerFunction,
    backward_bytes_per_token,
    forward_bytes_per_token,
)
from .mlp_op import tiled_mlp

__all__ = [
    "default_tokens_per_chunk",
    "layer_bytes_per_token",
    "layer_indices",
    "layers_to_tile",
    "mlps_to_tile",
    "recorded_outputs",
    "selected_decoder_layers",
    "tiled_forward",
]

# --------------------------------------------------------------------------------------------------------------------
# The decoder layers
# --------------------------------------------------------------------------------------------------------------------


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


def _refuse_tiled_again(name: str, module: nn.Module, tiled_forward_type: type) -> None:
    """A ValueError if the module's `forward` is a tiled one of this type that no `remove()` has switched off."""
    current = module.__dict__.get("forward")
    if isinstance(current, tiled_forward_type) and current.active:
        raise ValueError(f"{name} is already tiled: remove() the earlier handle first")


def default_tokens_per_chunk(model: nn.Module) -> int:
    """Tokens per chunk when the user names none: the model's hidden size (`config.hidden_size`; 4096 without one).

    The rule of Arctic Long Sequence Training: a chunk's matrix products are then at least hidden x hidden x
    intermediate, large enough to run at full speed, and its intermediates small (112 MiB per tokens x intermediate
    tensor for an 8B shape).
    """
    hidden = getattr(getattr(unwrap_model(model), "config", None), "hidden_size", None)
    return hidden if isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0 else 4096


# --------------------------------------------------------------------------------------------------------------------
# The MLP
# --------------------------------------------------------------------------------------------------------------------


# The child of a decoder layer that holds its MLP: `mlp` for Llama, Qwen2, Qwen3, Mistral, Gemma (1-3), Phi3,
# GPT-2, Phi, Falcon and OLMo (checked in transformers 5.23's modeling files).
_MLP_NAMES: tuple[str, ...] = ("mlp",)

# A mixture-of-experts block under `mlp` (Mixtral, Qwen3-MoE) routes each token on its own, but transformers records
# its router logits with forward hooks on the router, for the load-balancing loss: per chunk, those would keep only
# the last chunk's logits. Recognised by a descendant called `experts`, and refused.
_EXPERTS_NAME = "experts"


class _TiledForward:
    """The `forward` installed on one tiled MLP (an instance attribute, which `nn.Module.__call__` finds first).

    Hooks on the MLP itself keep running once per call, around the whole tiled forward; hooks inside it (on
    `up_proj`, a LoRA layer's) run once per chunk, in forward and again in backward. Calls the tiling is not
    meant for (keyword arguments, more than one argument, a non-tensor, fewer than two dimensions) and calls of
    at most `tokens_per_chunk` tokens go to the previous forward unchanged.

    The module is held strongly (its previous, bound `forward` holds it anyway): `copy.deepcopy` of a tiled model
    then maps both to the copy, and the copy tiles its own MLP.
    """

    def __init__(self, module: nn.Module, previous: Callable[..., Any], tokens_per_chunk: int) -> None:
        self.module = module
        self.previous = previous
        self.tokens_per_chunk = tokens_per_chunk
        self.active = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            return self.previous(*args, **kwargs)
        # The trainable parameters are looked up per call: a LoRA adapter added, or a weight frozen, after
        # `apply_tiled_mlp` is seen. `parameters()` yields each shared parameter once.
        params = [p for p in self.module.parameters() if p.requires_grad]
        return tiled_mlp(self.previous, args[0], self.tokens_per_chunk, params)


def _recorded_module_types(model: nn.Module) -> tuple[tuple[type, ...], tuple[str, ...]]:
    """The classes, and class names (or their ends), of the modules whose outputs transformers' output recorders
    collect inside the decoder layers: each pretrained model's `_can_record_outputs` in `model` (router logits,
    attention weights), the hidden states aside, which are recorded around whole decoder layers."""
    classes, names = [], []
    for module in model.modules():
        for key, recorders in (getattr(module, "_can_record_outputs", None) or {}).items():
            if key in _WHOLE_LAYER_RECORDS:
                continue
            # One recorder, or several for one output (transformers 5.17: JetMoE's attention and its MLP's router).
            for recorder in recorders if isinstance(recorders, (list, tuple)) else [recorders]:
                target = getattr(recorder, "target_class", recorder)
                if isinstance(target, type):
                    classes.append(target)
                if getattr(recorder, "class_name", None):
                    names.append(recorder.class_name)
    return tuple(classes), tuple(names)


def mlps_to_tile(model: nn.Module, layers: Iterable[int] | None) -> list[tuple[str, nn.Module]]:
    """The MLPs `apply_tiled_mlp` tiles, `(name, mlp)`, each checked before any is changed.

    Raises:
        ValueError: the model has no decoder layers; a layer index is out of range; a selected layer has no MLP
            child, has a mixture-of-experts block there, or is already tiled.
    """
    chosen: list[tuple[str, nn.Module]] = []
    recorded_classes, recorded_names = _recorded_module_types(model)
    for index, layer_name, layer in selected_decoder_layers(model, layers, "apply_tiled_mlp finds the MLPs in "
                                                            "transformers' decoder layers"):  # fmt: skip
        found = [(attr, layer._modules[attr]) for attr in _MLP_NAMES if layer._modules.get(attr) is not None]
        if not found:
            raise ValueError(f"decoder layer {index} ({layer_name!r}, {type(layer).__name__}) has no MLP: looked for "
                             f"a child module named {' or '.join(map(repr, _MLP_NAMES))}")  # fmt: skip
        attr, mlp = found[0]
        name = f"{layer_name}.{attr}"
        recorded = [type(sub).__name__ for sub in mlp.modules()
                    if isinstance(sub, recorded_classes) or type(sub).__name__.endswith(recorded_names)]  # fmt: skip
        if recorded or any(sub.rsplit(".", 1)[-1] == _EXPERTS_NAME for sub, _ in mlp.named_modules()):
            # Tiled, the router would run once per chunk, and an auxiliary loss read from its recorded outputs would
            # see each chunk as a layer of its own (JetMoE, whose experts are `input_linear` and `output_linear`).
            raise ValueError(f"{name} ({type(mlp).__name__}) is a mixture-of-experts block: its router's outputs are "
                             f"recorded per call{f' ({recorded[0]})' if recorded else ''}, so it cannot be "
                             "tiled")  # fmt: skip
        _refuse_tiled_again(name, mlp, _TiledForward)
        chosen.append((name, mlp))
    return chosen


# --------------------------------------------------------------------------------------------------------------------
# The whole layer: the attention function replaced while a chunk runs
# --------------------------------------------------------------------------------------------------------------------


# The decoder-layer arguments cut along the sequence, and the dimension of each tensor in them that is the sequence:
# (cos, sin) of shape (batch or 1, sequence, head dim), position ids (batch or 1, sequence), cache positions (sequence).
_PER_TOKEN: dict[str, int] = {"position_embeddings": -2, "position_ids": -1, "cache_position": -1}
# Passed whole to every chunk, and to the attention function: the attention module hands it on unchanged.
_MASK = "attention_mask"
# Output recorders that see the whole layer's call, not its chunks (hooks on the decoder layer itself).
_WHOLE_LAYER_RECORDS = frozenset({"hidden_states", "_hidden_states_layers"})


class _Stop(BaseException):
    """Raised by a harvest to end the layer's forward at its attention call. A BaseException, so that no
    `except Exception` of the model's code or of a hook between the attention call and the op catches it."""


_local = threading.local()  # .handler: the attention handler of the chunk run in progress on this thread
_patch_lock = threading.Lock()
_patch_users = 0
_real_get_interface: Callable[..., Callable[..., Any]] | None = None


def _get_interface(self: AttentionInterface, attn_implementation: str, default: Callable[..., Any]) -> Callable:
    """`AttentionInterface.get_interface` while a chunk runs: the real function, or, on the thread running the chunk,
    the chunk's handler with the real function as its first argument."""
    function = _real_get_interface(self, attn_implementation, default)
    handler = getattr(_local, "handler", None)
    return function if handler is None else functools.partial(handler, function)


@contextlib.contextmanager
def _intercepting(handler: Callable[..., Any]) -> Iterator[None]:
    """Run a region in which this thread's attention calls go to `handler(real_function, module, query, ...)`.

    `get_interface` is replaced on the class only while some thread runs such a region (counted, so that overlapping
    regions of several threads share one replacement), and put back after the last, unless someone replaced it since.
    """
    global _patch_users, _real_get_interface
    with _patch_lock:
        if _patch_users == 0:
            _real_get_interface = AttentionInterface.get_interface
            AttentionInterface.get_interface = _get_interface
        _patch_users += 1
    previous, _local.handler = getattr(_local, "handler", None), handler
    try:
        yield
    finally:
        _local.handler = previous
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0 and AttentionInterface.__dict__.get("get_interface") is _get_interface:
                AttentionInterface.get_interface = _real_get_interface


class _Harvest:
    """The attention handler of a harvest: records the call and the chunk's query, key and value (with their graph
    when grad is on), and stops the layer."""

    def __init__(self) -> None:
        self.call: _AttentionCall | None = None
        self.qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, function: Callable[..., Any], module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any = None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        self.call = _AttentionCall(function, module, attention_mask, args, kwargs)
        self.qkv = (query, key, value)
        raise _Stop


class _Answer:
    """The attention handler of an answer: gives the attention module the chunk's rows of attention's output, once."""

    def __init__(self, module: nn.Module, output: torch.Tensor) -> None:
        self.module = module
        self.output: torch.Tensor | None = output

    def __call__(self, function: Callable[..., Any], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if module is not self.module or self.output is None:
            raise RuntimeError(f"a tiled layer answers one attention call per chunk, from the module its harvest "
                               f"recorded ({type(self.module).__name__}); this one came from {type(module).__name__}"
                               f"{' again' if module is self.module else ''}")  # fmt: skip
        output, self.output = self.output, None
        return output, None  # (output, attention weights): none, as SDPA and FlashAttention give none


def _same(a: Any, b: Any) -> bool:
    """Whether two arguments of attention calls are the same: tensors by identity, plain values by equality."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    return bool(a == b)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an argument (itself, or inside tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _whole_sequence_call(layer: nn.Module, mask: Any, groups: _HeadGroups,
                         harvests: list[tuple[_AttentionCall, dict[int, Any]]]) -> _AttentionCall:  # fmt: skip
    """The attention call for the whole sequence, from the calls the attention module made for each chunk.

    An argument the module passed on from the layer's per-token arguments cut for the chunk (position ids, which
    FlashAttention reads to find packed sequences) is given whole; anything else must be the same for every chunk and
    is passed as it is. The mask must be the layer's own, unchanged: the chunks' runs were given all of it.
    """
    name = type(layer).__name__

    def whole(value: Any, cut: dict[int, Any]) -> Any:
        entry = cut.get(id(value)) if isinstance(value, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is value else value

    calls = [(call, [whole(v, cut) for v in call.args], {k: whole(v, cut) for k, v in call.kwargs.items()})
             for call, cut in harvests]  # fmt: skip
    first, args, kwargs = calls[0]
    for call, other_args, other_kwargs in calls:
        if call.module is not first.module or call.function is not first.function:
            raise RuntimeError(f"{name} called another attention module or function for another chunk")
        if call.mask is not mask:
            raise ValueError(f"{type(call.module).__name__} passes its attention function another mask than the "
                             f"{_MASK} {name} got: a tiled layer runs attention with the layer's mask")  # fmt: skip
        if len(other_args) != len(args) or other_kwargs.keys() != kwargs.keys():
            raise RuntimeError(f"{type(call.module).__name__} called its attention function with other arguments "
                               "for another chunk")  # fmt: skip
        for key, a, b in [*zip(range(len(args)), args, other_args), *((k, kwargs[k], other_kwargs[k]) for k in kwargs)]:
            if not _same(a, b):
                raise ValueError(f"{type(call.module).__name__} passes its attention function an argument ({key!r}) "
                                 "computed per chunk: a tiled layer cannot give it for the whole sequence")  # fmt: skip
    for key, value in [*enumerate(args), *kwargs.items()]:
        if any(t.requires_grad for t in _tensors(value)):
            raise ValueError(f"{type(first.module).__name__} passes a learned tensor ({key!r}) to its attention "
                             "function: a tiled layer cannot split it between head groups")  # fmt: skip
    if len(groups) > 1 and isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] != 1:
        raise ValueError(f"{name}'s {_MASK} has a mask per head {tuple(mask.shape)}: a tiled layer runs attention by "
                         "head groups and passes the mask whole")  # fmt: skip
    return _AttentionCall(first.function, first.module, mask, tuple(args), kwargs)


# --------------------------------------------------------------------------------------------------------------------
# One layer call, cut along the sequence
# --------------------------------------------------------------------------------------------------------------------


class _LayerCall:
    """One call of a decoder layer cut along the sequence: the layer's own forward, run on one chunk at a time,
    harvesting at its attention call or answering it.

    A chunk is `positions` consecutive positions of every sequence of the batch: (batch, positions, hidden).
    """

    def __init__(self, layer: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                 positions: int) -> None:  # fmt: skip
        self.layer, self.forward = layer, forward
        self.hidden_positional = bool(args)
        self.length = (args[0] if args else kwargs["hidden_states"]).shape[1]
        self.bounds = chunk_bounds(self.length, positions)
        self.args = args[1:]
        self.kwargs = {name: value for name, value in kwargs.items() if name != "hidden_states"}
        self.mask = self.kwargs.get(_MASK)
        named = [(f"positional argument {i + 1}", value) for i, value in enumerate(self.args)]
        named += [(name, value) for name, value in self.kwargs.items() if name not in _PER_TOKEN and name != _MASK]
        for name, value in named:
            for tensor in _tensors(value):
                if self.length in tensor.shape:
                    raise ValueError(
                        f"{type(layer).__name__} got {name} of shape {tuple(tensor.shape)}, a dimension as long as "
                        f"the sequence ({self.length}): a tiled layer cuts {', '.join(_PER_TOKEN)} along the "
                        f"sequence, passes {_MASK} whole, and knows no other per-token argument"
                    )

    def chunk(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk `i`'s rows of a (batch, sequence, ...) tensor, contiguous as a layer's hidden states are."""
        start, end = self.bounds[i]
        return tensor[:, start:end].contiguous()

    @contextlib.contextmanager
    def checkpointing_off(self) -> Iterator[None]:
        """The layer's own checkpointing off while its chunks run (transformers' `GradientCheckpointingLayer` reads
        `gradient_checkpointing` at each call): the op is the layer's checkpoint, and a checkpoint around a chunk's
        recompute in backward would only recompute it once more."""
        had = "gradient_checkpointing" in self.layer.__dict__
        previous = self.layer.__dict__.get("gradient_checkpointing")
        self.layer.gradient_checkpointing = False
        try:
            yield
        finally:
            if had:
                self.layer.gradient_checkpointing = previous
            else:
                del self.layer.gradient_checkpointing

    def _arguments(self, i: int, hidden: torch.Tensor) -> tuple[tuple, dict[str, Any], dict[int, Any]]:
        """The layer's arguments for chunk `i` (`hidden` being its rows of the hidden states), and
        `{id(cut argument): (cut argument, whole argument)}` for the per-token arguments cut for it."""
        start, end = self.bounds[i]
        cut: dict[int, Any] = {}

        def part(value: Any, dim: int) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            piece = value.narrow(dim, start, end - start)
            cut[id(piece)] = (piece, value)
            return piece

        kwargs = dict(self.kwargs)
        for name, dim in _PER_TOKEN.items():
            value = kwargs.get(name)
            if isinstance(value, (tuple, list)):
                kwargs[name] = type(value)(part(v, dim) for v in value)
            elif value is not None:
                kwargs[name] = part(value, dim)
        if self.hidden_positional:
            return (hidden, *self.args), kwargs, cut
        return self.args, {**kwargs, "hidden_states": hidden}, cut

    def harvest(self, i: int, hidden: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], _AttentionCall, dict[int, Any]]:
        """Chunk `i`'s query, key and value (with their graph if grad is on), the attention call they were recorded
        at, and the per-token arguments cut for the chunk."""
        args, kwargs, cut = self._arguments(i, hidden)
        handler = _Harvest()
        try:
            with _intercepting(handler):
                self.forward(*args, **kwargs)
        except _Stop:
            return handler.qkv, handler.call, cut  # type: ignore[return-value]
        raise RuntimeError(f"{type(self.layer).__name__} returned without calling its attention function through "
                           "transformers' AttentionInterface: it cannot be tiled")  # fmt: skip

    def answer(self, i: int, hidden: torch.Tensor, module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """The layer's output for chunk `i`, given `rows`, the chunk's rows of attention's output."""
        args, kwargs, _ = self._arguments(i, hidden)
        handler = _Answer(module, rows)
        with _intercepting(handler):
            out = self.forward(*args, **kwargs)
        if handler.output is not None:
            raise RuntimeError(f"{type(self.layer).__name__} did not call its attention function for chunk {i}")
        if not isinstance(out, torch.Tensor) or out.shape[:2] != hidden.shape[:2]:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise RuntimeError(f"a tiled layer must return its hidden states, (batch, sequence, hidden): "
                               f"{type(self.layer).__name__} returned {got} for {tuple(hidden.shape)}")  # fmt: skip
        return out

    def whole_sequence(self, groups: _HeadGroups,
                       harvests: list[tuple[_AttentionCall, dict[int, Any]]]) -> _AttentionCall:  # fmt: skip
        """The attention call for the whole sequence, from the calls each chunk's harvest recorded
        (`_whole_sequence_call`, with the layer's own mask)."""
        return _whole_sequence_call(self.layer, self.mask, groups, harvests)


# --------------------------------------------------------------------------------------------------------------------
# The tiled layer's forward
# --------------------------------------------------------------------------------------------------------------------


def layer_bytes_per_token(layer: nn.Module, element_size: int) -> tuple[int, int] | None:
    """`(forward_bytes_per_token, backward_bytes_per_token)` of a decoder layer, its attention's shape read from the
    config of the module that calls the attention interface (`hidden_size`, `num_attention_heads`,
    `num_key_value_heads`, `head_dim`); None where that config does not say. For the planner where nothing measures
    memory (the CPU test mode)."""
    callers = [module for module in layer.modules() if _calls_attention_interface(module)]
    config = getattr(callers[0], "config", None) if len(callers) == 1 else None
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    shape = (hidden, heads, kv_heads, head_dim, element_size)
    return forward_bytes_per_token(*shape), backward_bytes_per_token(*shape)


def recorded_outputs() -> list[str]:
    """What transformers' output recorders collect in this forward inside the layers (router logits, attention
    weights); hidden states are recorded around the whole decoder layer and see its call once. A tiled layer refuses
    to run where this is not empty."""
    collected = _active_collector.get() or {}
    return sorted(key for key in collected if key not in _WHOLE_LAYER_RECORDS)


def _calls_attention_interface(module: nn.Module) -> bool:
    """Whether the module's forward looks its attention function up in transformers' AttentionInterface (the name
    `get_interface` in its code, beneath decorators): the call a tiled layer cuts the layer at."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return code is not None and "get_interface" in code.co_names


class _TiledLayerForward:
    """The `forward` installed on one tiled decoder layer (an instance attribute, which `nn.Module.__call__` finds
    first, before the class's forward and the checkpointing transformers wraps it in).

    Hooks on the layer itself run once per call, around the whole tiled forward; hooks inside it run per chunk, in
    forward and again in backward. Calls the tiling is not for (hidden states that are not (batch, sequence, hidden),
    or at most `tokens_per_chunk` tokens, or a KV cache outside training) go to the previous forward unchanged.

    The layer is held strongly (its previous, bound `forward` holds it anyway): `copy.deepcopy` of a tiled model then
    maps both to the copy, and the copy tiles its own layer.
    """

    def __init__(self, layer: nn.Module, previous: Callable[..., Any], tokens_per_chunk: int,
                 call_op: Callable[..., Any] | None = None) -> None:  # fmt: skip
        self.layer = layer
        self.previous = previous
        self.tokens_per_chunk = tokens_per_chunk
        self.call_op = call_op
        self.active = True

    def tiles(self, *args: Any, **kwargs: Any) -> bool:
        """Whether a call with these arguments runs tiled; the others go to the previous forward unchanged."""
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not self.active or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            return False
        if hidden.shape[1] <= self._positions(hidden):  # one chunk: the layer as it is, bitwise
            return False
        # Generation: the cache is the point.
        return not _caches(args, kwargs) or (self.layer.training and torch.is_grad_enabled())

    def _positions(self, hidden: torch.Tensor) -> int:
        """The positions of every sequence in one chunk."""
        return max(1, self.tokens_per_chunk // hidden.shape[0])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.tiles(*args, **kwargs):
            return self.previous(*args, **kwargs)
        hidden = args[0] if args else kwargs["hidden_states"]
        positions = self._positions(hidden)
        caches = _caches(args, kwargs)
        if caches:
            # Training makes a cache nobody reads (transformers 5.x, use_cache defaulting to True); chunks would fill
            # it piece by piece, once per run, and a later chunk's keys would hold the earlier ones too. Dropped, as
            # transformers' own checkpointing does; by position too (GPT-2 passes it as the second argument).
            warnings.warn(f"{type(self.layer).__name__}: a tiled layer does not fill a KV cache; setting "
                          f"{', '.join(caches)} to None", stacklevel=2)  # fmt: skip
            args = tuple(None if is_cache(value) else value for value in args)
            kwargs = {name: None if name in caches else value for name, value in kwargs.items()}
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
        recorded = recorded_outputs()
        if recorded:
            raise ValueError(f"{type(self.layer).__name__} is tiled, and this forward records {', '.join(recorded)} "
                             "inside its layers: recorders would see each chunk's runs, without grad in the forward "
                             "(an auxiliary loss on router logits would get no gradient). Turn the recording off "
                             "(output_router_logits=False, output_attentions=False) or the tiling.")  # fmt: skip
        call = _LayerCall(self.layer, self.previous, args, kwargs, positions)
        # The trainable parameters are looked up per call: a LoRA adapter added, or a weight frozen, after
        # `apply_tiled_layer` is seen. `parameters()` yields each shared parameter once.
        params = [p for p in self.layer.parameters() if p.requires_grad]
        if self.call_op is not None:
            return self.call_op(_TiledLayerFunction.apply, call, hidden, *params)
        return _TiledLayerFunction.apply(call, hidden, *params)


def _caches(args: tuple, kwargs: dict[str, Any]) -> list[str]:
    """The names of a call's KV cache arguments that hold one (`argument N` for one passed by position)."""
    return [f"argument {i}" for i, value in enumerate(args) if is_cache(value)] + [
        name for name, value in kwargs.items()
        if value is not None and (name in CACHE_ARGUMENTS or is_cache(value))
    ]  # fmt: skip


def tiled_forward(layer: nn.Module) -> Callable[..., Any] | None:
    """The layer's tiled `forward` (what `apply_tiled_layer` installed, and not removed since); None if untiled."""
    forward = layer.__dict__.get("forward")
    return forward if isinstance(forward, _TiledLayerForward) and forward.active else None


def layers_to_tile(model: nn.Module, layers: Iterable[int] | None) -> list[tuple[str, nn.Module]]:
    """The decoder layers `apply_tiled_layer` tiles, `(name, layer)`, each checked before any is changed.

    Raises:
        ValueError: the model has no decoder layers; a layer index is out of range; a selected layer has no module
            that calls transformers' attention interface, or more than one, or is already tiled.
    """
    chosen: list[tuple[str, nn.Module]] = []
    for index, name, layer in selected_decoder_layers(model, layers, "apply_tiled_layer tiles transformers' decoder "
                                                      "layers"):  # fmt: skip
        callers = [sub for sub, module in layer.named_modules() if _calls_attention_interface(module)]
        if len(callers) != 1:
            found = f"{len(callers)} ({', '.join(callers)})" if callers else "no module"
            raise ValueError(f"decoder layer {index} ({name!r}, {type(layer).__name__}) has {found} that looks its "
                             "attention function up in transformers' AttentionInterface (ALL_ATTENTION_FUNCTIONS."
                             "get_interface): a tiled layer runs that one call on the whole sequence and the rest of "
                             "the layer by chunks, so it needs exactly one")  # fmt: skip
        _refuse_tiled_again(name, layer, _TiledLayerForward)
        chosen.append((name, layer))
    return chosen
