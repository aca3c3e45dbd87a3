"""Several devices. A model split by hand across two GPUs (first half of the layers on cuda:0, the rest and the head
on cuda:1): gradients bitwise equal with offloading on and off, tensors offloaded from both devices, and every tensor
comes back on the device it left (checked per tensor by HookAudit). And a memory budget on two ranks whose steps have
different lengths: one plan, every rank's peak under the budget."""

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_budget_on_two_ranks_runs_one_plan_and_every_ranks_peak_stays_under_it(record):
    """Two ranks (each on its own GPU over NCCL where there are two, else sharing one over gloo, each process counting
    its own peak) whose steps have different lengths (padding-free packing): rank 1's step is the longer at the 4th and
    9th steps, rank 0's at the 6th and 10th. Under a budget of 60% of the largest peak without offloading, every rank
    runs the same plan at every step, made for the longest rank's step, and every rank's peak stays under the budget
    on every step; the losses are those without offloading, bitwise."""
    import multiprocessing
    import socket

    from _gpu_ranks import budget_on_rank

    lengths = ((2048, 2048, 2048, 2048, 2048, 3072, 2048, 2048, 2048, 4096),
               (2048, 2048, 2048, 3072, 2048, 2048, 2048, 2048, 4096, 2048))  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=budget_on_rank, args=(rank, port, results, lengths, 0.6)) for rank in (0, 1)]
    try:
        for process in processes:
            process.start()
        outcomes = dict(results.get(timeout=240) for _ in processes)  # a rank left in a collective fails here
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    record("budget_two_ranks", outcomes, show=True)
    for rank in (0, 1):
        assert "error" not in outcomes[rank], outcomes[rank]["error"]
    first, second = outcomes[0], outcomes[1]
    assert first["budget"] == second["budget"]
    assert first["plans"] == second["plans"]
    for step, plan in enumerate(first["plans"][2:], start=2):
        assert plan[1] >= max(lengths[0][step], lengths[1][step]), f"step {step}: plan {plan} for fewer tokens"
    for rank, outcome in outcomes.items():
        assert max(outcome["peaks"]) <= outcome["budget"], f"rank {rank}: peaks {outcome['peaks']}"
        assert outcome["exact"], f"rank {rank}: losses differ from those without offloading"
    assert any(plan[0] != "K" * 6 for plan in first["plans"][2:]), "the budget never needed a plan"
