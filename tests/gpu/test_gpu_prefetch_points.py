"""With checkpointing, reloads start from the middle of each block's backward (the attention's gradient), not from
the block's first unpack: the next block's input is then allocated after the recomputed activations' peak. And on
every family, from the second step on, no reload waits on demand (the CPU suite checks the same on stand-in
streams: `tests/test_architectures.py`)."""

from __future__ import annotations

import pytest
from _gpu_models import (
    ARCHS,
    HYBRIDS,
    MOES,
    MORE_ARCHS,
    VLMS,
    build_model,
    dispose,
    make_batch,
    make_ctx,
    peak_step_memory,
    run_reload_case,
)

import hf_offload.context as hf_context

MiB = 1 << 20
# Activations dominate (small vocabulary; LoRA, so no full-size gradients pile up towards the end of backward);
# each layer's input is 2 B x 4096 tokens x 2048 = 16 MiB, and the recomputed MLP activations (intermediate 8192)
# are several times that, so the step's peak is inside a block's backward.
SIZE = dict(hidden=2048, intermediate=8192, layers=4, seq=4096, heads=16, kv_heads=8, vocab=1000)


@pytest.mark.parametrize("ckpt", ["nonreentrant", "reentrant"])
def test_checkpointed_reload_is_not_on_top_of_the_block_peak(ckpt, device, record, nondeterministic, monkeypatch):
    model = build_model("llama", dtype="bf16", device=device, ckpt=ckpt, lora=True, attn="sdpa", **SIZE)
    batch = make_batch("llama", device=device, batch=1, seq=SIZE["seq"], vocab=SIZE["vocab"])
    layer_input_bytes = 2 * SIZE["seq"] * SIZE["hidden"]

    # The peak is the recomputed MLP's, which offloading cannot lower by the default share: kept on, to time reloads.
    ctx = make_ctx(model, min_peak_reduction=None)
    try:
        points = peak_step_memory(model, batch, ctx=ctx, device=device)
        stats = ctx.get_stats()
        assert not ctx.prefetch_on_unpack
    finally:
        dispose(ctx)

    monkeypatch.setattr(hf_context, "install_prefetch_points", lambda *args: None)  # reload from each unpack
    ctx = make_ctx(model, min_peak_reduction=None)
    try:
        on_unpack = peak_step_memory(model, batch, ctx=ctx, device=device)
        assert ctx.prefetch_on_unpack
    finally:
        dispose(ctx)

    record(
        "",
        {
            "peak_MiB_points": points["peak_bytes"] / MiB,
            "peak_MiB_on_unpack": on_unpack["peak_bytes"] / MiB,
            "prefetch_hits": stats["prefetch_hits"],
            "prefetch_misses": stats["prefetch_misses"],
            "compute_wait_s": stats["compute_wait_s"],
        },
        show=True,
    )
    assert stats["tensors_offloaded"] >= SIZE["layers"] - 1
    assert stats["prefetch_misses"] == 0, stats  # every reload was started ahead of its use
    assert points["peak_bytes"] <= on_unpack["peak_bytes"] - 0.9 * layer_input_bytes, (points, on_unpack)


@pytest.mark.parametrize("arch", ARCHS + MORE_ARCHS + VLMS + MOES + HYBRIDS)
def test_from_the_second_step_every_reload_is_started_ahead(arch, device, record):
    # Two layers: Qwen3-Next's layer types come in pairs.
    last = run_reload_case(arch, device=device, size=dict(hidden=256, layers=2, vocab=1000, seq=256))
    record("", {k: last[k] for k in ("tensors_offloaded", "prefetch_hits", "prefetch_misses", "inflight_hits")})
