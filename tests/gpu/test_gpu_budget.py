"""Per-layer plans and the memory budget on a GPU: every action is exact, and a budget is never exceeded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _gpu_models import assert_bitwise_equal, build_model, dispose, make_batch, make_ctx, run_steps

from hf_offload.layer_plan import apply_layer_plan

CODES = {"K": ("keep", False), "O": ("offload", True), "S": ("selective", True), "s": ("selective", False),
         "C": ("full", True), "c": ("full", False)}  # fmt: skip
SMALL = dict(hidden=256, layers=4, seq=256, batch=2)
# Large enough for activations to dominate the peak, small enough for a few steps per budget in seconds.
MEDIUM = dict(hidden=1024, layers=8, seq=2048, batch=4, heads=16, kv_heads=8, intermediate=2816)


def actions(code: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(action=CODES[c][0], offload_input=CODES[c][1]) for c in code]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("code", ["KKKK", "OOOO", "SSSS", "ssss", "CCCC", "cccc", "CSOK", "KOcC"])
def test_every_layer_action_is_bitwise_equal_to_no_offloading(code, lora):
    size = {key: SMALL[key] for key in ("hidden", "layers", "seq")}
    batch = make_batch("llama", batch=SMALL["batch"], seq=SMALL["seq"])
    reference = run_steps(build_model("llama", dtype="bf16", lora=lora, **size), batch, steps=3)
    assert_bitwise_equal(reference, run_steps(build_model("llama", dtype="bf16", lora=lora, **size), batch, steps=3))
    model = build_model("llama", dtype="bf16", lora=lora, **size)
    ctx = make_ctx(model)
    applied = apply_layer_plan(model, ctx, actions(code))
    got = run_steps(model, batch, steps=3, ctx=ctx)
    assert_bitwise_equal(reference, got, code)
    if "O" in code or "C" in code or "S" in code:
        assert all(stats["bytes_offloaded"] > 0 for stats in got.stats)
    applied.remove()
    dispose(ctx)


def step_peaks(model, batch, ctx, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """The peak allocated memory of each training step (forward, backward, optimizer), and the losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    peaks, losses = [], []
    for step in range(steps):
        torch.manual_seed(100 + step)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if ctx is None:
            loss = model(**batch).loss
        else:
            with ctx:
                loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        losses.append(loss.detach())
    return peaks, losses


def medium_model():
    size = {key: MEDIUM[key] for key in ("hidden", "layers", "seq", "heads", "kv_heads", "intermediate")}
    return build_model("llama", dtype="bf16", **size)


@pytest.mark.parametrize("share", [0.45, 0.6, 0.75, 0.9, 1.2])
def test_a_budget_is_never_exceeded_and_changes_no_arithmetic(share, record):
    batch = make_batch("llama", batch=MEDIUM["batch"], seq=MEDIUM["seq"])
    steps = 6  # two profiled, then four planned (the first of them plans)
    none_peaks, reference = step_peaks(medium_model(), batch, None, steps)
    assert torch.equal(torch.stack(reference), torch.stack(step_peaks(medium_model(), batch, None, steps)[1]))
    budget = int(share * max(none_peaks))
    model = medium_model()
    ctx = make_ctx(model, memory_budget=budget)
    try:
        peaks, losses = step_peaks(model, batch, ctx, steps)
    except ValueError as error:  # below every plan's peak: the clear error, before the planned step runs
        assert "below the smallest peak" in str(error)
        record(f"budget_{share}", {"budget": budget, "none_peak": max(none_peaks), "infeasible": str(error)[:300]})
        dispose(ctx)
        return
    plan = ctx.budget.plan
    record(f"budget_{share}", {
        "budget": budget, "none_peak": max(none_peaks), "step_peaks": peaks, "plan": plan.code,
        "predicted_peak": plan.predicted.peak_bytes, "predicted_step_s": plan.predicted.step_s,
    }, show=True)  # fmt: skip
    assert max(peaks) <= budget, f"plan {plan.code}: step peaks {peaks} over the budget {budget}"
    assert torch.equal(torch.stack(losses), torch.stack(reference))
    if share >= 1.0:
        assert plan.code == "K" * MEDIUM["layers"]
    dispose(ctx)
