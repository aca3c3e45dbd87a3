"""A model split by hand across two GPUs (first half of the layers on cuda:0, the rest and the head on
cuda:1): gradients bitwise equal with offloading on and off, tensors offloaded from both devices, and every
tensor comes back on the device it left (checked per tensor by HookAudit)."""

from __future__ import annotations

import pytest
import torch
from _gpu_models import (
    HookAudit,
    assert_bitwise_equal,
    assert_offloaded,
    assert_same_weights,
    build_model,
    dispose,
    make_batch,
    make_ctx,
    run_steps,
    split_across_devices,
)

needs_two = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs at least 2 CUDA devices"
)


@needs_two
@pytest.mark.parametrize("ckpt", ["off", "nonreentrant"])
@pytest.mark.parametrize("span", ["fwd", "fwd_bwd"])
def test_split_model_two_devices(ckpt, span, record):
    devices = ["cuda:0", "cuda:1"]

    def build():
        m = build_model("llama", dtype="bf16", device="cpu", ckpt=ckpt, layers=4)
        split_across_devices(m, devices)
        return m

    ref_model, off_model = build(), build()
    assert_same_weights(ref_model, off_model)
    batch = make_batch("llama", device=devices[0])

    ref = run_steps(ref_model, batch, steps=2, span=span, device=devices[1])
    ctx = make_ctx(off_model, min_offload_size=1024)
    audit = HookAudit(ctx)
    try:
        got = run_steps(off_model, batch, steps=2, ctx=ctx, span=span, device=devices[1])
        torch.cuda.synchronize(devices[0])
    finally:
        dispose(ctx)
    record(
        "",
        {
            "packed_by_device": dict(audit.packed),
            "unpacked_by_device": dict(audit.unpacked),
            "bytes_offloaded": [s.get("bytes_offloaded") for s in got.stats],
        },
        show=True,
    )
    assert_bitwise_equal(ref, got, f"split ckpt={ckpt} span={span}")
    assert_offloaded(got.stats, "split")
    audit.check()
    assert set(audit.packed) >= set(devices), f"expected saved tensors on both devices, saw {dict(audit.packed)}"
    # parameters stayed where they were put
    assert {str(p.device) for p in off_model.model.layers[0].parameters()} == {devices[0]}
    assert {str(p.device) for p in off_model.lm_head.parameters()} == {devices[1]}
