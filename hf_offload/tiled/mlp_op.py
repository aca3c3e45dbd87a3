"""Sequence-tiled MLP: a decoder layer's MLP run over chunks of the tokens, in forward and in backward.

What it does
------------
A decoder layer's MLP is a position-wise function: token t's output depends only on token t's input. So the MLP can
run on a few thousand tokens at a time, and its intermediates (gate, up, act(gate), act(gate) * up: tokens x
intermediate each) then exist for one chunk at a time instead of for the whole sequence:

* forward: under `torch.no_grad()`, each chunk's output is written into one preallocated output tensor; the chunk's
  intermediates are freed before the next chunk starts. Only the MLP's input is saved for backward, the same tensor
  the untiled MLP's first projections save anyway.
* backward: each chunk is recomputed with grad enabled and backpropagated at once with its slice of the incoming
  gradient; its input-gradient slice goes into one preallocated tensor and its weight gradients are added up. Again
  one chunk's intermediates (and their gradients) at a time.

This module is the op (`tiled_mlp`, a `torch.autograd.Function`), kept apart from the model integration
(`integration`: which child of a decoder layer is its MLP, and its tiled forward; `apply.apply_tiled_mlp`, which swaps
the forward of each decoder layer's `mlp` for a tiled one and gives it back on `remove()`), as Liger-Kernel keeps its
kernels apart from its `apply_liger_kernel_to_*` functions. The idea is Arctic Long Sequence Training's TiledMLP;
the code is ours.

When it helps
-------------
At long context. For a Llama-3-8B shape (hidden 4096, intermediate 14336) at 1 x 262,144 tokens in bf16, one
tokens x intermediate tensor is 262144 x 14336 x 2 B = 7 GiB. The untiled MLP saves four of them for backward (the
gate projection for the activation, act(gate) and up for their product, the product for `down_proj`): 28 GiB per
layer, for every layer, without checkpointing. With activation checkpointing they are the recompute of the one layer
being backpropagated, and its backward adds gradients of the same size (the product's, then act(gate)'s and up's while
the saved ones are still held): six such tensors, about 42 GiB, at the MLP's backward, for a layer whose checkpointed
input is 2 GiB. Tiled by 4096 tokens the same tensors are 112 MiB each, six of them 672 MiB, for a chunk's forward
and backward. What tiling does not shrink: the hidden-size tensors (the MLP's input, its output and their gradients,
2 GiB each at this shape) and, when the MLP's weights are trained, an fp32 gradient accumulator per weight
(3 x 4096 x 14336 x 4 B = 672 MiB per layer, for one layer at a time; nothing to speak of for LoRA adapters).

At short context it only costs: the MLP's forward runs once more per layer (the recompute in backward; a third time
under full activation checkpointing, whose recompute runs the tiled forward again just to save its input), and the
chunks' smaller matrix products run less efficiently than one large product.

Not exact
---------
Every other action of hf-offload moves or recomputes bytes and keeps gradients bitwise equal. This one does not: a
weight's gradient is a sum over all tokens, which the untiled backward computes in one matrix product (one fp32
accumulation, rounded once) and the tiled one as a sum of per-chunk products (a different order, and each chunk's
product rounded to the weight's dtype before the sum). The chunks' products may also pick different kernels than the
whole-sequence product, so outputs and input gradients can differ in their last bits too. Losses and gradients agree
only within a tolerance (on CPU, relative to a tensor's largest element: at most 4.5e-7 in fp32 and 6.5e-3 in bf16
for six model families; tests/tiled/test_mlp_op.py). Keep it off unless the MLP's intermediates are what
stands between a run and the memory it has. With `tokens_per_chunk` at least the number of tokens of a call, the tiled
forward simply calls the MLP: bitwise equal, no overhead.

With hf-offload's layer actions
-------------------------------
Keep and offload (no checkpoint): the layer's MLP then saves only its input, so nothing of the MLP's is kept or
copied. Full checkpoint: the recompute holds one chunk at a time, at the cost of the third forward above; this is the
memory planner's tiled action (`T`, `t`), which it chooses only when no exact plan fits the budget, and the option
`tile_mlp=True` tiles every layer whatever the plan. Selective
checkpoint (`selective`, `selective_offload`): correct, but it saves nothing. Its policy caches the output of every
matrix product run in the checkpointed forward, grad or no grad, so the chunks' gate and up products all end up in
the checkpoint's cache (or go through the engine), as much as without tiling.

Randomness
----------
An MLP with dropout (GPT-2's, or a LoRA adapter's `lora_dropout`) draws random numbers per chunk, and the backward's
recompute must draw the same ones. The forward records the CPU and device RNG states before each chunk; the
backward restores each chunk's state before recomputing it and puts the RNG back as it found it afterwards (what
`torch.utils.checkpoint` does for a whole region). Dropout masks are then consistent between a chunk's forward and
backward, but they are other draws than the untiled MLP's: with dropout active, tiled and untiled runs differ by more
than any tolerance, as two seeds do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..engine import NoOpManager
from ..random_state import random_state, random_state_untouched, set_random_state
from .chunks import LOW_PRECISION, autocast_states, chunk_bounds

__all__ = ["tiled_mlp"]


class _TiledMLPFunction(torch.autograd.Function):
    """`forward(x)` over chunks of `x`'s tokens, in forward and backward; see the module docstring.

    Inputs: the MLP's forward (a callable of one tensor), the tokens per chunk, the input `x` of shape
    `(..., hidden)` (every leading dimension is tokens) and the trainable parameters the forward uses. The parameters
    are inputs so that autograd sees them: their gradients are returned by `backward` and then accumulated into
    `.grad` by autograd itself, exactly where the untiled backward would put them (gradient hooks and DDP's reducer,
    which fire on that accumulation, included).
    Frozen parameters (a LoRA layer's base weights) are not inputs and get no gradient.
    """

    @staticmethod
    def forward(ctx: Any, forward: Callable[[torch.Tensor], torch.Tensor], tokens_per_chunk: int, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:  # fmt: skip
        hidden = x.shape[-1]
        flat = x.reshape(-1, hidden)  # a view when x is contiguous, which it is in a decoder layer
        # Each chunk keeps x's number of dimensions, (1, ..., n, hidden): an MLP that unpacks a 3-d input still works.
        chunk_lead = (1,) * (x.dim() - 2)
        bounds = chunk_bounds(flat.shape[0], tokens_per_chunk)
        rng = []
        out = out_flat = None
        # Autograd runs a Function's forward without grad already; said again because it is the point: nothing a
        # chunk computes is recorded, so its intermediates die with the Python references to them, inside `forward`
        # (each chunk's output is a temporary that lives until it is copied out).
        with torch.no_grad():
            for start, end in bounds:
                rng.append(random_state(x.device))
                y = forward(flat[start:end].reshape(*chunk_lead, end - start, hidden))
                if not isinstance(y, torch.Tensor) or y.shape[:-1] != (*chunk_lead, end - start):
                    got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                    raise RuntimeError(
                        f"a tiled MLP must map (..., tokens, hidden) to (..., tokens, out): for a "
                        f"chunk of shape {(*chunk_lead, end - start, hidden)} it returned {got}"
                    )
                if out is None:
                    # Allocated once, from the first chunk's dtype and width: the only full-sequence tensor made here.
                    out = y.new_empty((*x.shape[:-1], y.shape[-1]))
                    out_flat = out.view(-1, y.shape[-1])
                out_flat[start:end].copy_(y.reshape(end - start, -1))
                del y
        ctx.forward = forward
        ctx.bounds = bounds
        ctx.chunk_lead = chunk_lead
        ctx.rng = rng
        ctx.autocast = autocast_states(x.device.type)
        # Saved: x, which the untiled MLP's first projections save as well (the same tensor, so an offloading engine
        # or a checkpoint sees the same bytes as without tiling), and the parameters, through `save_for_backward` so
        # that an in-place change to them before backward is caught by autograd's version check as it would be
        # untiled. Nothing chunk-sized is saved.
        ctx.save_for_backward(x, *params)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        need = ctx.needs_input_grad[3:]
        wanted = [p for p, n in zip(params, need) if n]
        if not need_x and not wanted:  # nothing upstream asked for a gradient: no need to recompute anything
            return (None,) * (3 + len(params))
        hidden = x.shape[-1]
        flat = x.reshape(-1, hidden)
        grad_flat = grad_out.reshape(flat.shape[0], -1)
        # One full-size tensor, filled slice by slice (contiguous, whatever x's strides, so that it views as x).
        grad_x = torch.empty(flat.shape, dtype=x.dtype, device=x.device) if need_x else None
        # Weight gradients are summed over the chunks in fp32 when the weights are bf16/fp16: the untiled backward
        # rounds each weight gradient once, at the end of one fp32-accumulating matrix product; summing the chunks'
        # (already rounded) products in bf16 would round once more per chunk, an error that grows with the number of
        # chunks (128 at 256K tokens in chunks of 2048). In fp32 the sum adds about one rounding of the result, at
        # the cost of one fp32 copy of this MLP's trainable weights for the duration of its backward (672 MiB for an
        # 8B-shape layer trained in full, a few KiB for LoRA adapters). fp32 and fp64 weights are summed in their own
        # dtype, which is already that accurate.
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        with random_state_untouched(x.device):  # the RNG continues as if this backward had drawn nothing
            for i, (start, end) in enumerate(ctx.bounds):
                # A detached slice: this chunk's recompute builds a small graph of its own, rooted here, that
                # `autograd.grad` below consumes and frees. Nothing links it to x's graph.
                chunk = flat[start:end].reshape(*ctx.chunk_lead, end - start, hidden).detach().requires_grad_(need_x)
                set_random_state(x.device, ctx.rng[i])  # the chunk's forward draws, if it has dropout
                with ExitStack() as stack:
                    stack.enter_context(torch.enable_grad())
                    for kind, enabled, dtype, cache in ctx.autocast:
                        stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
                    # The recompute's saved tensors stay where they are: an offloading context that spans backward
                    # (TRL's training_step) would otherwise copy each chunk's intermediates to the host and back.
                    stack.enter_context(NoOpManager())
                    y = ctx.forward(chunk)
                inputs = ([chunk] if need_x else []) + wanted
                grads = list(torch.autograd.grad(y, inputs, grad_flat[start:end].reshape(y.shape), allow_unused=True))
                # `autograd.grad` freed the chunk's graph (retain_graph=False); dropping `y` and `chunk` now, not at
                # the next iteration's assignment, keeps the next chunk from ever overlapping this one.
                del y, chunk
                if need_x:
                    g = grads.pop(0)
                    if g is None:  # the forward did not use its input; then its gradient is zero
                        grad_x[start:end].zero_()
                    else:
                        grad_x[start:end].copy_(g.reshape(end - start, hidden))
                for j, (p, g) in enumerate(zip(wanted, grads)):
                    if g is None:  # a parameter this chunk did not reach
                        continue
                    if sums[j] is None:
                        # A copy, never `g` itself: autograd may hand back a tensor it also holds elsewhere.
                        sums[j] = g.to(torch.float32 if p.dtype in LOW_PRECISION else p.dtype, copy=True)
                    else:
                        sums[j].add_(g)
                del grads
        param_grads: list[torch.Tensor | None] = []
        sums_iter = iter(sums)
        for p, n in zip(params, need):
            total = next(sums_iter) if n else None
            param_grads.append(None if total is None else total.to(p.dtype))
        input_grad = None if grad_x is None else grad_x.view(x.shape)
        return None, None, input_grad, *param_grads


def tiled_mlp(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tokens_per_chunk: int,
              params: Iterable[torch.Tensor] = ()) -> torch.Tensor:  # fmt: skip
    """Apply the position-wise `forward` to `x` in chunks of `tokens_per_chunk` tokens, in forward and backward.

    Args:
        forward: the MLP's forward, a function of one tensor `(..., n, hidden) -> (..., n, out)` that treats every
            token on its own (not the module itself when its `forward` is the tiled one: that would recurse).
        x: the input, `(..., hidden)`; all leading dimensions are flattened into tokens.
        tokens_per_chunk: tokens per chunk; the last chunk takes the rest.
        params: the trainable parameters `forward` uses; they receive gradients. Frozen ones are left out.

    Returns:
        `forward(x)`, computed chunk by chunk (equal within rounding, not bitwise; see the module docstring). When
        `x` has at most `tokens_per_chunk` tokens, exactly `forward(x)`.
    """
    if x.numel() // max(x.shape[-1], 1) <= tokens_per_chunk:
        return forward(x)
    return _TiledMLPFunction.apply(forward, tokens_per_chunk, x, *params)
