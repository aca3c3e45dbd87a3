"""The sequence-tiled decoder layer on CUDA: the bytes per token alive at the peak of one 8B layer's backward (at most
48 KiB, against about 127 KiB with the MLP tiled alone: docs/DESIGN.md, Long context), bf16 gradients within a stated
tolerance of the untiled model with SDPA and, where flash-attn is installed, FlashAttention-2, and hf-offload's engine
on top of it.

This file was written without a GPU run: the CPU measurements it rests on are in
tests/tiled/test_layer_op.py (tolerances) and benchmarks/tiled_layer_memory.py (bytes per token: the
module's count, 39.5 KiB at the 8B shape, matched on CPU to within the softmax statistics). On CUDA the attention
kernel's backward adds a workspace of its own for one head group (FlashAttention-2 with grouped-query attention:
about 4 KiB per token at this shape), so about 43.5 KiB is expected; its first run's recorded numbers are the
measurements.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from _gpu_models import (
    assert_bitwise_equal,
    assert_offloaded,
    build_model,
    dispose,
    forward_backward,
    make_batch,
    make_ctx,
    run_steps,
)

from hf_offload.tiled.apply import apply_tiled_layer
from hf_offload.tiled.layer_op import backward_bytes_per_token

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import tiled_layer_memory  # noqa: E402

KiB = 1024
MiB = 1 << 20
TARGET_BYTES_PER_TOKEN = 48 * KiB  # for an 8B layer's recompute and backward

# bf16 tolerance, as max |tiled - untiled| / max |untiled| per tensor (loss, every parameter gradient): on CPU, 74
# tokens in 5 chunks, seven families measured 5.8e-3 to 7.6e-3 (tests/tiled/test_layer_op.py), under one
# bf16 epsilon (7.8e-3). Asserted here as for the tiled MLP: 3e-2; and against an fp32 run of the same weights, the
# tiled step's error at most 1.5x the untiled one's.
BF16_TOLERANCE = 3e-2
TILED_ERROR_RATIO = 1.5


@pytest.fixture(scope="module")
def layer_8b():
    model = tiled_layer_memory.build_model("8b", "cuda")
    yield model
    del model
    torch.cuda.empty_cache()


def test_tiled_layer_bytes_per_token_8b(layer_8b, record, nondeterministic):
    """One Llama-3-8B layer (bf16, SDPA, weights frozen as under LoRA, batch 1): max_memory_allocated over its
    backward at 16K and 32K tokens, in chunks of 2048; the difference per token is what grows with the context."""
    tokens, chunk = [16384, 32768], 2048
    figures = {}
    for mode in tiled_layer_memory.MODES:
        results = [tiled_layer_memory.measure(layer_8b, mode, n, chunk) for n in tokens]
        figures[mode] = tiled_layer_memory.per_token(results)
        record(mode, {**{f"{r['tokens']}": r for r in results}, "bytes_per_token": figures[mode]}, show=True)
    s = tiled_layer_memory.SHAPES["8b"]
    count = backward_bytes_per_token(s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], 2)
    record("summary", {"tiled_KiB_per_token": round(figures["tiled"] / KiB, 2),
                       "untiled_ckpt_tiled_mlp_KiB_per_token": round(figures["checkpoint+tiled-mlp"] / KiB, 2),
                       "count_KiB_per_token": count / KiB,
                       "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled()}, show=True)  # fmt: skip
    assert figures["tiled"] <= TARGET_BYTES_PER_TOKEN, (
        f"the tiled layer's backward holds {figures['tiled'] / KiB:.1f} KiB per token, over the target "
        f"{TARGET_BYTES_PER_TOKEN / KiB:.0f} (count without the kernel's workspace: {count / KiB:.1f})"
    )
    # The count is what the CPU's kernels hold, to the byte (tests/tiled/test_layer_op.py). On the H100
    # (flash attention, torch 2.11) the backward held 32.5 KiB per token, 7 less than the count: the CUDA kernels
    # allocate less than the CPU's around attention. So the count is recorded beside the measurement, not asserted.
    assert 2 * figures["tiled"] <= figures["checkpoint+tiled-mlp"]


def _step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = forward_backward(model, batch)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _max_difference(got, ref) -> tuple[float, str]:
    assert got[1].keys() == ref[1].keys()
    pairs = {"loss": (got[0], ref[0]), **{n: (got[1][n].to(ref[1][n].dtype), ref[1][n]) for n in ref[1]}}
    worst = max(pairs, key=lambda n: _relative(*pairs[n]))
    return _relative(*pairs[worst]), worst


ATTENTION = [
    "sdpa",
    pytest.param("flash_attention_2", marks=pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                                                               reason="flash-attn is not installed")),
]  # fmt: skip
SHAPE = dict(hidden=2048, intermediate=7168, heads=16, kv_heads=4, layers=2, vocab=1000)
SEQ, CHUNK = 8192, 2048


@pytest.mark.parametrize("attn", ATTENTION)
def test_tiled_layer_gradients_bf16(attn, record, nondeterministic):
    """bf16 loss and gradients of a tiled 2-layer model (hidden 2048, 16 query and 4 key/value heads of 128) against
    the untiled one, and both against an fp32 copy of the same weights (SDPA): tiling must not move the gradients
    further from fp32 than bf16 itself does."""
    model = build_model("llama", dtype="bf16", device="cuda", attn=attn, seq=SEQ, **SHAPE)
    batch = make_batch("llama", device="cuda", batch=1, seq=SEQ, vocab=SHAPE["vocab"])
    ref = _step(model, batch)
    noise = _max_difference(_step(model, batch), ref)  # attention's backward need not repeat itself bitwise
    with apply_tiled_layer(model, tokens_per_chunk=CHUNK):
        got = _step(model, batch)
    exact_model = copy.deepcopy(model).float()
    exact_model.config._attn_implementation = "sdpa"  # FlashAttention has no fp32
    exact = _step(exact_model, batch)
    del exact_model
    difference, where = _max_difference(got, ref)
    untiled_error, untiled_where = _max_difference(ref, exact)
    tiled_error, tiled_where = _max_difference(got, exact)
    record("bf16", {"attn": attn, "max_rel_diff_tiled_vs_untiled": difference, "where": where,
                    "untiled_repeat_max_rel_diff": noise[0], "untiled_vs_fp32": untiled_error,
                    "untiled_vs_fp32_where": untiled_where, "tiled_vs_fp32": tiled_error,
                    "tiled_vs_fp32_where": tiled_where}, show=True)  # fmt: skip
    assert noise[0] <= BF16_TOLERANCE / 4, f"the untiled step does not repeat itself: {noise}"
    assert difference <= BF16_TOLERANCE, f"{where} differs by {difference:.3g}"
    assert tiled_error <= TILED_ERROR_RATIO * untiled_error, (
        f"tiling moves the gradients further from fp32 ({tiled_error:.3g}, {tiled_where}) than bf16 does "
        f"({untiled_error:.3g}, {untiled_where})"
    )


# Eager attention, whose backward is deterministic: the tiled step must repeat itself bitwise for the engine's
# bitwise comparison to mean something. 4096 tokens keep its attention matrices small.
ENGINE_SEQ, ENGINE_CHUNK = 4096, 512


@pytest.mark.parametrize("span", ["fwd", "fwd_bwd"])
def test_tiled_layer_with_offloading(span, record):
    """hf-offload's engine on a tiled model (the model's checkpointing on, which a tiled layer does not use: the op
    saves only the layer's input): bitwise equal to the same tiled model without the engine, and offloading. With span
    fwd_bwd the tiled backward's recompute runs inside the offloading context (its tensors stay put)."""
    shape = {**SHAPE, "hidden": 1024, "intermediate": 4096}
    kw = dict(dtype="bf16", device="cuda", ckpt="nonreentrant", seq=ENGINE_SEQ, **shape)
    batch = make_batch("llama", device="cuda", batch=1, seq=ENGINE_SEQ, vocab=SHAPE["vocab"])

    def tiled_run(ctx=None):
        model = build_model("llama", **kw)
        with apply_tiled_layer(model, tokens_per_chunk=ENGINE_CHUNK):
            return run_steps(model, batch, steps=2, ctx=ctx, span=span, device="cuda")

    ref = tiled_run()
    again = tiled_run()
    assert all(torch.equal(a, b) for a, b in zip(ref.losses, again.losses)), "the tiled step does not repeat itself"
    model = build_model("llama", **kw)
    ctx = make_ctx(model, min_offload_size=1024, keep_tail=False)
    try:
        with apply_tiled_layer(model, tokens_per_chunk=ENGINE_CHUNK):
            got = run_steps(model, batch, steps=2, ctx=ctx, span=span, device="cuda")
    finally:
        dispose(ctx)
    assert_offloaded(got.stats, f"tiled layer, span={span}")
    assert_bitwise_equal(ref, got, f"tiled layer with the engine, span={span}")
    record("", {"span": span, "bytes_offloaded": [s.get("bytes_offloaded") for s in got.stats],
                "peak_MiB": round(torch.cuda.max_memory_allocated() / MiB, 1)}, show=span == "fwd")  # fmt: skip
