"""Sequence-tiled decoder layer: everything in a layer that treats tokens one by one runs over chunks of the
sequence, and attention, which needs the whole sequence, runs on it one group of heads at a time.

What it does
------------
In a decoder layer only attention mixes tokens: the norms, the q/k/v/o projections (LoRA included), rotary embedding,
q/k norms, the MLP (dense or mixture of experts) and the residual adds treat each token on its own. transformers'
attention modules (5.x, every family whose modeling file calls `ALL_ATTENTION_FUNCTIONS.get_interface`) hand the
query, key and value, after projections, norms and rotary, to one attention function looked up at each call, and take
its output back before `o_proj`. That call is where the layer is cut, without code per family: while a chunk runs,
`get_interface` answers a function of ours (on this thread only; any other caller gets the real one), and the layer's
own forward runs on a chunk of tokens in one of two ways:

* a *harvest* records the chunk's query, key and value and stops the layer there (a private exception): nothing after
  attention is computed;
* an *answer* hands the layer the chunk's rows of an attention output computed beforehand, and the layer goes on
  through `o_proj`, the MLP and the residual adds for that chunk.

Between the two, the real attention function runs on the whole sequence with the mask and arguments the attention
module gave it, once per group of heads (at most `MAX_HEAD_GROUPS` groups of key/value heads, each with its query
heads: attention treats heads independently), so that one group's attention state is alive at a time.

Forward (no grad): harvest each chunk into q, k, v per head group; attention per group gives `a`; answer each chunk
into `y`. Saved for backward: the layer's input alone, as a checkpoint saves it (an offloading engine moves it alike).
Backward, in five phases, each freeing what the next does not need:

1. harvest each chunk, without grad: q, k, v per head group;
2. attention per group, without grad: `a` (each group's q, k, v freed after its call);
3. answer each chunk with grad, its rows of the input and of `a` as leaves, and backpropagate its rows of the output's
   gradient: the input's gradient except for the path through q, k, v (the residual, the MLP of a parallel block),
   `a`'s gradient (written over `a`'s rows, spent by then), and the gradients of `o_proj`, the norms and the MLP;
4. per head group: harvest each chunk keeping that group's q, k, v, run attention with grad, and backpropagate the
   group's part of `a`'s gradient: the group's dq, dk, dv;
5. harvest each chunk with grad and backpropagate its rows of dq, dk, dv: the rest of the input's gradient, and the
   gradients of the input norm and the q/k/v projections.

The op (`_TiledLayerFunction`) is kept apart from the model integration (`apply_tiled_layer`, which gives each chosen
decoder layer a tiled `forward` and takes it back on `remove()`), as in `tiled_mlp`.

Memory
------
Per token, with X the bytes of a hidden state (hidden size x dtype), Q of a query (query heads x head dim x dtype),
KV of a key and a value together, A of attention's output (Q in every family here) and G the head groups, the
sequence-long tensors alive in backward are the input, the output's gradient (autograd holds it for the whole call)
and, from phase 3 on, the input's gradient: 3X (2X in phases 1-2); and besides them:

* phases 1-2: q, k, v and `a`, traded group by group: at most Q + KV + A/G;
* phase 3: `a`, whose rows take their gradient in their place once spent: A;
* phase 4, at the last group: the other groups' dq, dk, dv, the last group's gradient of `a`, its q, k, v (saved by
  attention), its output, and its dq, dk, dv: (Q + KV)(G - 1)/G + A/G + 2(Q + KV)/G + A/G;
* phase 5: dq, dk, dv: Q + KV.

The peak is phase 4's (`backward_bytes_per_token` computes it for given heads):

    3X + (Q + KV)(1 + 1/G) + 2A/G  bytes per token,

plus what does not grow with the sequence: one chunk's working set (its MLP intermediates and their gradients), and
the fp32 sums of the trainable weights' gradients; and what the attention kernel keeps for one group besides its
output: its softmax statistics (4 bytes per query head), and in its backward a workspace that grows with the sequence
(FlashAttention-2, for one group of an 8B layer: an fp32 dq accumulator and, with grouped-query attention, dk and dv
expanded to the group's query heads, about 4 KiB per token). An attention function that returns a copy of its
kernel's output (eager's transpose) keeps A/G more.

For an 8B layer (hidden 4096, 32 query and 8 key/value heads of 128, bf16): X = Q = A = 8 KiB, KV = 4 KiB, G = 8: 24 +
13.5 + 2 = 39.5 KiB per token (phase 3: 32, phase 5: 36), about 43.5 with FlashAttention-2's workspace: under the 48 KiB
per token that the long-context runs on the H100 needed (`benchmarks/long_context.py`), where the same layer untiled,
under full checkpointing and with the tiled MLP, took about 127 KiB per token in its recompute and backward (434K tokens
on an H100, with Liger's norms). Measured on CPU, live tensor storages counted under a dispatch mode
(`benchmarks/tiled_layer_memory.py`): at the 8B shape in fp32 (320 tokens; this CPU's bf16 products are too slow),
80,912 bytes per token at the backward's peak, the count in fp32 (80,896) and one group's softmax statistics (16),
against 153 KiB untiled under checkpointing with the tiled MLP; at a sixteenth of the shape in bf16 likewise
(tests/memory_budget/test_tiled_layer.py).

Why phase 4 runs attention's forward again, and harvests per group: keeping attention's graph from phase 2 to
phase 4 would keep q, k, v and the output through phase 3, where the output could then not take its gradient in its
place: 3X + Q + KV + 2A, 52 KiB per token at the 8B shape. Re-running the harvest per group costs only the forward of
the projections before attention.

Time
----
With P the forward of the part before attention (input norm, q/k/v projections, rotary), O the forward of the rest
(`o_proj`, norms, MLP, residual adds), A_f attention's forward and A_b its backward, and a backward of P or O about
twice its forward:

    full checkpoint (the action it stands in for):  4P + 2 A_f + A_b + 4O
    tiled layer:                               (7 + G)P + 3 A_f + A_b + 4O

so one more attention forward and (3 + G)P: the forward harvests and answers (2P, as the answer re-runs the
projections before attention: one layer call computes both parts), backward's harvest (P), the answers' part before
attention (P), phase 4's harvest per group (G P), phase 5 (3P), against the checkpoint's 4P. At long context attention
dominates: for the 8B layer at 512K tokens A_f is about 2 x 10^15 FLOP, P about 3 x 10^13, so the extra attention
forward is about a fifth of the layer's attention time (A_b is about 2.5 A_f) and G P a few percent. At short context
the extra work and the chunks' smaller matrix products only cost: the memory planner should choose it only when no
exact plan fits.

Not exact
---------
As for the tiled MLP: a weight's gradient is a sum over the chunks (and over phases 3 and 5 for a weight used both
before and after attention) instead of one matrix product, summed in fp32 for bf16/fp16 weights; chunks and head
groups may pick other kernels than the whole sequence. Losses and gradients agree within a tolerance, not bitwise
(tests/memory_budget/test_tiled_layer.py states what was measured). With `tokens_per_chunk` at least the tokens of a
call, the layer is simply called: bitwise equal, no overhead.

Randomness
----------
A layer with dropout (a LoRA adapter's, attention's, a residual's) draws per chunk run and per head group's attention.
The forward records the random state before each harvest, each group's attention and each answer; backward replays
each state before the same run and leaves the generators as it found them. Dropout is then consistent between a
layer's forward and backward, but draws other masks than the untiled layer (as another seed would).

With hf-offload's layer actions
-------------------------------
A tiled layer is its own checkpoint: it saves only its input, and the layer's `gradient_checkpointing` is not used
while it is tiled (a checkpoint around it would run the tiled forward twice, and one inside a chunk's recompute would
recompute it again). A plan keeps its input (`c`-like) or offloads it through the engine (`C`-like). The tiled MLP may
be applied too: the MLP then sees one chunk of the layer at a time, and tiles it further if the chunk is longer than
its own.

What it does not do
-------------------
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
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from transformers.cache_utils import Cache
from transformers.modeling_utils import AttentionInterface
from transformers.utils.output_capturing import _active_collector

from ..engine import NoOpManager
from ..random_state import RandomState, random_state, random_state_untouched, set_random_state
from .tiling import (
    LOW_PRECISION,
    ForwardsReplaced,
    autocast_states,
    check_tokens_per_chunk,
    chunk_bounds,
    selected_decoder_layers,
)

__all__ = [
    "apply_tiled_layer",
    "TiledLayerHandle",
    "MAX_HEAD_GROUPS",
    "backward_bytes_per_token",
    "forward_bytes_per_token",
    "layer_bytes_per_token",
    "recorded_outputs",
    "tiled_forward",
]

# Attention runs on the whole sequence for at most this many groups of heads, one at a time. More groups make one
# group's attention state smaller (the peak's (Q + KV)/G + 2A/G) and cost one more harvest each (P per group).
MAX_HEAD_GROUPS = 8

# The decoder-layer arguments cut along the sequence, and the dimension of each tensor in them that is the sequence:
# (cos, sin) of shape (batch or 1, sequence, head dim), position ids (batch or 1, sequence), cache positions (sequence).
_PER_TOKEN: dict[str, int] = {"position_embeddings": -2, "position_ids": -1, "cache_position": -1}
# Passed whole to every chunk, and to the attention function: the attention module hands it on unchanged.
_MASK = "attention_mask"
# The names transformers has given a layer's cache argument (5.24 renamed `past_key_values` to `cache`).
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
# Output recorders that see the whole layer's call, not its chunks (hooks on the decoder layer itself).
_WHOLE_LAYER_RECORDS = frozenset({"hidden_states", "_hidden_states_layers"})


# --------------------------------------------------------------------------------------------------------------------
# The cut: the attention function replaced while a chunk runs
# --------------------------------------------------------------------------------------------------------------------


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


@dataclass
class _AttentionCall:
    """An attention call as the attention module made it: the real function, the module, the mask, the rest."""

    function: Callable[..., Any]
    module: nn.Module
    mask: Any
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


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


# --------------------------------------------------------------------------------------------------------------------
# Attention on the whole sequence, by head groups
# --------------------------------------------------------------------------------------------------------------------


def _group_edges(kv_heads: int) -> list[int]:
    """Where the head groups start and end, in key/value heads: at most `MAX_HEAD_GROUPS` groups, as even as can be."""
    count = min(kv_heads, MAX_HEAD_GROUPS)
    return [kv_heads * g // count for g in range(count + 1)]


@dataclass(frozen=True)
class _HeadGroups:
    """Attention's heads in groups that run one after another: consecutive key/value heads with the query heads that
    share them (grouped-query attention gives key/value head j to query heads j*r to (j+1)*r - 1)."""

    query: tuple[slice, ...]
    key_value: tuple[slice, ...]

    @classmethod
    def of(cls, layer: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> _HeadGroups:
        shapes = [tuple(t.shape) for t in (query, key, value)]
        if (
            any(len(shape) != 4 for shape in shapes)
            or len({(shape[0], shape[2]) for shape in shapes}) != 1
            or query.shape[1] % key.shape[1]
            or key.shape[1] != value.shape[1]
        ):
            raise RuntimeError(f"{type(layer).__name__} passed query, key and value of shapes {shapes} to its "
                               "attention function; a tiled layer expects (batch, heads, sequence, head dim), with "
                               "the query heads a multiple of the key/value heads")  # fmt: skip
        share = query.shape[1] // key.shape[1]
        edges = _group_edges(key.shape[1])
        return cls(query=tuple(slice(a * share, b * share) for a, b in zip(edges, edges[1:])),
                   key_value=tuple(slice(a, b) for a, b in zip(edges, edges[1:])))  # fmt: skip

    def __len__(self) -> int:
        return len(self.query)


class _SequenceQKV:
    """Query, key and value of the whole sequence, filled chunk by chunk, for the head groups in `keep`.

    Each group's tensors are kept as (batch, sequence, heads, head dim): the layout of a projection's output, which
    the attention function then gets as its (batch, heads, sequence, head dim) transpose, as from the untiled layer.
    Separate tensors per group, so that each group's are freed once its attention has run.
    """

    def __init__(self, groups: _HeadGroups, length: int, keep: Iterable[int]) -> None:
        self.groups, self.length, self.keep = groups, length, list(keep)
        self.buffers: dict[int, list[torch.Tensor]] = {}

    def put(self, start: int, end: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        for g in self.keep:
            kv = self.groups.key_value[g]
            parts = (query[:, self.groups.query[g]], key[:, kv], value[:, kv])
            if g not in self.buffers:
                self.buffers[g] = [p.new_empty((p.shape[0], self.length, p.shape[1], p.shape[3])) for p in parts]
            for buffer, part in zip(self.buffers[g], parts):
                buffer[:, start:end].copy_(part.transpose(1, 2))

    def take(self, g: int) -> list[torch.Tensor]:
        """Group `g`'s query, key and value, which this object then lets go of."""
        return self.buffers.pop(g)


@dataclass
class _Attention:
    """The layer's attention call on the whole sequence, run one head group at a time."""

    call: _AttentionCall
    groups: _HeadGroups

    def __call__(self, g: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attention's output for head group `g` from its (batch, sequence, heads, head dim) query, key and value:
        (batch, sequence, query heads, value head dim), as transformers' attention functions return it."""
        c = self.call
        out = c.function(c.module, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), c.mask, *c.args,
                         **c.kwargs)[0]  # fmt: skip
        expected = (*query.shape[:3], value.shape[-1])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise RuntimeError(f"the attention function of {type(c.module).__name__} returned {got}; a tiled layer "
                               f"expects (batch, sequence, heads, head dim) = {expected}")  # fmt: skip
        return out

    def rows(self, outputs: list[torch.Tensor], start: int, end: int) -> torch.Tensor:
        """Rows `start:end` of attention's output, all heads, from the groups' `outputs`."""
        if len(outputs) == 1:
            return outputs[0][:, start:end]
        return torch.cat([out[:, start:end] for out in outputs], dim=2)


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


# --------------------------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------------------------


class _GradientSums:
    """The trainable parameters' gradients summed over chunks and phases: in fp32 for bf16/fp16 weights (each
    chunk's product is rounded to the weight's dtype; summing those in bf16 would round once more per chunk)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.sums: list[torch.Tensor | None] = [None] * len(params)

    def add(self, grads: list[torch.Tensor | None]) -> None:
        for j, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:  # a parameter this run did not reach
                continue
            if self.sums[j] is None:
                # A copy, never `g` itself: autograd may hand back a tensor it also holds elsewhere.
                self.sums[j] = g.to(torch.float32 if p.dtype in LOW_PRECISION else p.dtype, copy=True)
            else:
                self.sums[j].add_(g)

    def gradients(self) -> list[torch.Tensor | None]:
        return [None if s is None else s.to(p.dtype) for p, s in zip(self.params, self.sums)]


def _harvest_all(call: _LayerCall, x: torch.Tensor, states: list[RandomState], qkv: _SequenceQKV) -> _SequenceQKV:
    """Backward's harvests without grad: every chunk, each from the random state its forward harvest started with."""
    with torch.no_grad():
        for i, state in enumerate(states):
            set_random_state(x.device, state)
            (query, key, value), _, _ = call.harvest(i, call.chunk(x, i))
            qkv.put(*call.bounds[i], query, key, value)
    return qkv


class _TiledLayerFunction(torch.autograd.Function):
    """A decoder layer's call over chunks of the sequence, with attention on the whole of it; see the module docstring.

    Inputs: the layer call (`_LayerCall`), the hidden states `x` (batch, sequence, hidden) and the layer's trainable
    parameters, inputs so that autograd accumulates the gradients `backward` returns where the untiled backward would
    (gradient hooks and DDP's reducer included). Only `x` gets a gradient among the layer's arguments.
    """

    @staticmethod
    def forward(ctx: Any, call: _LayerCall, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        # Autograd runs a Function's forward without grad: nothing below is recorded, and each chunk's intermediates
        # die with it.
        device = x.device
        rng_harvest: list[RandomState] = []
        rng_attention: list[RandomState] = []
        rng_answer: list[RandomState] = []
        harvests = []
        qkv = groups = None
        with call.checkpointing_off():
            for i, (start, end) in enumerate(call.bounds):
                rng_harvest.append(random_state(device))
                (query, key, value), attention_call, cut = call.harvest(i, call.chunk(x, i))
                if qkv is None:
                    groups = _HeadGroups.of(call.layer, query, key, value)
                    qkv = _SequenceQKV(groups, call.length, range(len(groups)))
                qkv.put(start, end, query, key, value)
                harvests.append((attention_call, cut))
                del query, key, value
            attention = _Attention(_whole_sequence_call(call.layer, call.mask, groups, harvests), groups)
            del harvests
            outputs = []
            for g in range(len(groups)):
                rng_attention.append(random_state(device))
                outputs.append(attention(g, *qkv.take(g)))
            y = None
            for i, (start, end) in enumerate(call.bounds):
                rng_answer.append(random_state(device))
                out = call.answer(i, call.chunk(x, i), attention.call.module, attention.rows(outputs, start, end))
                if y is None:  # the only sequence-long tensor this forward returns
                    y = out.new_empty((*x.shape[:2], *out.shape[2:]))
                y[:, start:end].copy_(out)
                del out
        ctx.call, ctx.attention = call, attention
        ctx.rng = (rng_harvest, rng_attention, rng_answer)
        ctx.autocast = autocast_states(device.type)
        # Saved: x, as a checkpoint saves its input (an offloading engine sees the same bytes), and the parameters,
        # through `save_for_backward`, so that an in-place change to one before backward is caught as untiled.
        ctx.save_for_backward(x, *params)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.call is None:
            raise RuntimeError("a tiled layer's backward ran a second time through one graph (retain_graph=True): "
                               "its first released the layer's call, whose mask and rotary tables would otherwise "
                               "live as long as the loss. Tiled layers (tile_layer) allow one backward per "
                               "forward.")  # fmt: skip
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[1]
        need = ctx.needs_input_grad[2:]
        wanted = [p for p, n in zip(params, need) if n]
        if not need_x and not wanted:  # nothing upstream asked for a gradient: nothing to recompute
            return (None,) * (2 + len(params))
        call: _LayerCall = ctx.call
        attention: _Attention = ctx.attention
        rng_harvest, rng_attention, rng_answer = ctx.rng
        groups, device = attention.groups, x.device
        sums = _GradientSums(wanted)
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=device) if need_x else None  # filled chunk by chunk
        with contextlib.ExitStack() as stack:
            stack.enter_context(random_state_untouched(device))  # the RNG goes on as if backward drew nothing
            # The recompute's saved tensors are no offloader's business: one whose context spans backward (TRL's
            # training_step) would otherwise see each of them (hf-offload's engine keeps what backward saves, but
            # runs its pack hook on each).
            stack.enter_context(NoOpManager())
            for kind, enabled, dtype, cache in ctx.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
            stack.enter_context(call.checkpointing_off())

            # 1-2. Attention's output, without grad: q, k, v of every chunk, then attention group by group, each
            # group's q, k, v freed once its attention has run.
            qkv = _harvest_all(call, x, rng_harvest, _SequenceQKV(groups, call.length, range(len(groups))))
            outputs = []
            for g in range(len(groups)):
                set_random_state(device, rng_attention[g])
                outputs.append(attention(g, *qkv.take(g)))
            del qkv

            # 3. The layer after attention, chunk by chunk, with the chunk's rows of x and of attention's output as
            # leaves. Each chunk's gradient of attention's output goes where that output's rows were: they are spent.
            for i, (start, end) in enumerate(call.bounds):
                set_random_state(device, rng_answer[i])
                hidden = call.chunk(x, i).detach().requires_grad_(need_x)
                rows = attention.rows(outputs, start, end).detach().requires_grad_()
                with torch.enable_grad():
                    out = call.answer(i, hidden, attention.call.module, rows)
                inputs = ([hidden] if need_x else []) + [rows] + wanted
                grads = list(torch.autograd.grad(out, inputs, grad_y[:, start:end], allow_unused=True))
                del out, hidden
                if need_x:
                    _set_rows(grad_x, start, end, grads.pop(0))
                grad_rows = grads.pop(0)
                for g, heads in enumerate(groups.query):
                    _set_rows(outputs[g], start, end, None if grad_rows is None else grad_rows[:, :, heads])
                sums.add(grads)
                del grads, grad_rows, rows
            grad_attention, outputs = outputs, None

            # 4. Attention's backward, group by group: the group's q, k, v harvested again, attention run again with
            # grad (its graph was not kept: see the module docstring), and backpropagated.
            grad_qkv: list[tuple[torch.Tensor, ...]] = []
            for g in range(len(groups)):
                group = _harvest_all(call, x, rng_harvest, _SequenceQKV(groups, call.length, [g]))
                leaves = [t.requires_grad_() for t in group.take(g)]
                set_random_state(device, rng_attention[g])
                with torch.enable_grad():
                    out = attention(g, *leaves)
                grad_qkv.append(torch.autograd.grad(out, leaves, grad_attention[g]))
                grad_attention[g] = None
                del out, leaves, group

            # 5. The layer before attention, chunk by chunk, with grad: backpropagate the chunk's rows of dq, dk, dv.
            for i, (start, end) in enumerate(call.bounds):
                set_random_state(device, rng_harvest[i])
                hidden = call.chunk(x, i).detach().requires_grad_(need_x)
                with torch.enable_grad():
                    qkv_rows, _, _ = call.harvest(i, hidden)
                pairs = [(t, attention.rows([grads[which] for grads in grad_qkv], start, end).transpose(1, 2))
                         for which, t in enumerate(qkv_rows) if t.requires_grad]  # fmt: skip
                if pairs:  # none when nothing before attention is trained and x needs no gradient
                    inputs = ([hidden] if need_x else []) + wanted
                    grads = list(torch.autograd.grad([t for t, _ in pairs], inputs, [g for _, g in pairs],
                                                     allow_unused=True))  # fmt: skip
                    if need_x:
                        g = grads.pop(0)
                        if g is not None:
                            grad_x[:, start:end] += g
                    sums.add(grads)
                del hidden, qkv_rows, pairs
        # The node lives as long as the loss that made it, and a loop's `loss` lives through the next step's forward:
        # the call's mask and rotary tables, held here, would be memory held between steps.
        ctx.call = ctx.attention = ctx.rng = None
        summed = iter(sums.gradients())
        return None, grad_x, *(next(summed) if n else None for n in need)


def _set_rows(target: torch.Tensor, start: int, end: int, value: torch.Tensor | None) -> None:
    """`target[:, start:end] = value`, zeros for a gradient autograd left out (an input the run did not use)."""
    if value is None:
        target[:, start:end].zero_()
    else:
        target[:, start:end].copy_(value)


def _bytes_per_group(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     element_size: int) -> tuple[int, list[int], list[int]]:  # fmt: skip
    """Per token: a hidden state's bytes, and per head group (as `_HeadGroups` makes them) its query's (attention's
    output per group has this size too) and its key's and value's together."""
    share = num_heads // num_kv_heads
    edges = _group_edges(num_kv_heads)
    kv_sizes = [b - a for a, b in zip(edges, edges[1:])]
    query = [n * share * head_dim * element_size for n in kv_sizes]
    kv = [2 * n * head_dim * element_size for n in kv_sizes]
    return hidden_size * element_size, query, kv


def forward_bytes_per_token(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                            element_size: int) -> int:  # fmt: skip
    """The bytes per token of sequence-long tensors a tiled layer's forward holds at once besides its input: every
    group's query, key and value while the first group's attention runs (Q + KV + A/G), or, later, attention's output
    and the layer's output (A + X). As `backward_bytes_per_token`, without what does not grow with the sequence.

    Args: as `backward_bytes_per_token`.
    """
    hidden, query, kv = _bytes_per_group(hidden_size, num_heads, num_kv_heads, head_dim, element_size)
    # At group g: the outputs of groups ..g, the query, key and value of groups g.. (group g's are its arguments).
    attention = max(sum(query[: g + 1]) + sum(query[j] + kv[j] for j in range(g, len(kv))) for g in range(len(kv)))
    return max(attention, sum(query) + hidden)


def backward_bytes_per_token(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                             element_size: int) -> int:  # fmt: skip
    """The bytes per token of sequence-long tensors alive at the peak of a tiled layer's backward, for the planner.

    The module docstring's count, phase by phase, with the head groups `_HeadGroups` makes; the peak is phase 4's,
    3X + (Q + KV)(1 + 1/G) + 2A/G for groups of equal size. Not included: what does not grow with the sequence (one
    chunk's working set, the gradient sums) and what the attention kernel keeps for one head group besides its
    output (softmax statistics, its backward's workspace).

    Args:
        hidden_size: the hidden states' width.
        num_heads, num_kv_heads, head_dim: attention's query heads, key/value heads and head dimension.
        element_size: bytes per element of the activations (2 for bf16).
    """
    hidden, query, kv = _bytes_per_group(hidden_size, num_heads, num_kv_heads, head_dim, element_size)
    phase_3 = 3 * hidden + sum(query)
    # At group g: the gradient of `a` for groups g.., dq, dk, dv of groups before g, and the group's q, k, v, output and
    # dq, dk, dv.
    phase_4 = max(3 * hidden + sum(query[g:]) + sum(query[j] + kv[j] for j in range(g)) + 2 * (query[g] + kv[g])
                  + query[g] for g in range(len(kv)))  # fmt: skip
    phase_5 = 3 * hidden + sum(query) + sum(kv)
    return max(phase_3, phase_4, phase_5)


# --------------------------------------------------------------------------------------------------------------------
# Model integration
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
        return not _caches(kwargs) or (self.layer.training and torch.is_grad_enabled())

    def _positions(self, hidden: torch.Tensor) -> int:
        """The positions of every sequence in one chunk."""
        return max(1, self.tokens_per_chunk // hidden.shape[0])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.tiles(*args, **kwargs):
            return self.previous(*args, **kwargs)
        hidden = args[0] if args else kwargs["hidden_states"]
        positions = self._positions(hidden)
        caches = _caches(kwargs)
        if caches:
            # Training makes a cache nobody reads (transformers 5.x, use_cache defaulting to True); chunks would fill
            # it piece by piece, once per run. Dropped, as transformers' own checkpointing does.
            warnings.warn(f"{type(self.layer).__name__}: a tiled layer does not fill a KV cache; setting "
                          f"{', '.join(caches)} to None", stacklevel=2)  # fmt: skip
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


def _caches(kwargs: dict[str, Any]) -> list[str]:
    """The names of a call's KV cache arguments that hold one."""
    return [name for name, value in kwargs.items()
            if value is not None and (name in _CACHE_ARGUMENTS or isinstance(value, Cache))]  # fmt: skip


def tiled_forward(layer: nn.Module) -> Callable[..., Any] | None:
    """The layer's tiled `forward` (what `apply_tiled_layer` installed, and not removed since); None if untiled."""
    forward = layer.__dict__.get("forward")
    return forward if isinstance(forward, _TiledLayerForward) and forward.active else None


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
    untiled layer within rounding, not bitwise (see the module docstring). A tiled layer is its own checkpoint: its
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
        current = layer.__dict__.get("forward")
        if isinstance(current, _TiledLayerForward) and current.active:
            raise ValueError(f"{name} is already tiled: remove() the earlier handle first")
        chosen.append((name, layer))
    handle = TiledLayerHandle()
    for name, layer in chosen:
        handle.replace(name, layer, _TiledLayerForward(layer, layer.forward, tokens_per_chunk, call_op))
    return handle
