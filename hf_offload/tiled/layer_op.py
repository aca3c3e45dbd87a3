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

This module is the op (`_TiledLayerFunction`): it runs a layer call it is given (`LayerCallLike`: harvests, answers,
the whole sequence's attention call) over the chunks and head groups. Making that call of a transformers decoder layer
(the cut at the attention interface, the per-token arguments, what the attention module may pass) is the model
integration's (`integration`, whose docstring says what a tiled layer does not do), and `apply.apply_tiled_layer` gives
each chosen decoder layer a tiled `forward` and takes it back on `remove()`, as for the tiled MLP (`mlp_op`).

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
(tests/tiled/test_layer_op.py).

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
(tests/tiled/test_layer_op.py states what was measured). With `tokens_per_chunk` at least the tokens of a call, the
layer is simply called: bitwise equal, no overhead.

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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..engine import NoOpManager
from ..random_state import RandomState, random_state, random_state_untouched, set_random_state
from .chunks import LOW_PRECISION, autocast_states

__all__ = ["LayerCallLike", "MAX_HEAD_GROUPS", "backward_bytes_per_token", "forward_bytes_per_token"]

# Attention runs on the whole sequence for at most this many groups of heads, one at a time. More groups make one
# group's attention state smaller (the peak's (Q + KV)/G + 2A/G) and cost one more harvest each (P per group).
MAX_HEAD_GROUPS = 8


@dataclass
class _AttentionCall:
    """An attention call as the attention module made it: the real function, the module, the mask, the rest."""

    function: Callable[..., Any]
    module: nn.Module
    mask: Any
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


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


# --------------------------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------------------------


class LayerCallLike(Protocol):
    """What the op needs of one decoder layer call cut along the sequence (`integration._LayerCall`): its chunks, and
    the layer's own forward run on one chunk, harvesting at its attention call or answering it."""

    layer: nn.Module
    length: int
    bounds: list[tuple[int, int]]

    def chunk(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk `i`'s rows of a (batch, sequence, ...) tensor."""

    def checkpointing_off(self) -> contextlib.AbstractContextManager[None]:
        """The layer's own checkpointing off while its chunks run."""

    def harvest(self, i: int, hidden: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], _AttentionCall, dict[int, Any]]:
        """Chunk `i`'s query, key and value, the attention call they were recorded at, and the arguments cut for it."""

    def answer(self, i: int, hidden: torch.Tensor, module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """The layer's output for chunk `i`, given its rows of attention's output."""

    def whole_sequence(self, groups: _HeadGroups,
                       harvests: list[tuple[_AttentionCall, dict[int, Any]]]) -> _AttentionCall:  # fmt: skip
        """The attention call for the whole sequence, from the calls recorded by each chunk's harvest."""


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


def _harvest_all(call: LayerCallLike, x: torch.Tensor, states: list[RandomState], qkv: _SequenceQKV) -> _SequenceQKV:
    """Backward's harvests without grad: every chunk, each from the random state its forward harvest started with."""
    with torch.no_grad():
        for i, state in enumerate(states):
            set_random_state(x.device, state)
            (query, key, value), _, _ = call.harvest(i, call.chunk(x, i))
            qkv.put(*call.bounds[i], query, key, value)
    return qkv


class _TiledLayerFunction(torch.autograd.Function):
    """A decoder layer's call over chunks of the sequence, with attention on the whole of it; see the module docstring.

    Inputs: the layer call (`LayerCallLike`), the hidden states `x` (batch, sequence, hidden) and the layer's trainable
    parameters, inputs so that autograd accumulates the gradients `backward` returns where the untiled backward would
    (gradient hooks and DDP's reducer included). Only `x` gets a gradient among the layer's arguments.
    """

    @staticmethod
    def forward(ctx: Any, call: LayerCallLike, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
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
            attention = _Attention(call.whole_sequence(groups, harvests), groups)
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
        call: LayerCallLike = ctx.call
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
