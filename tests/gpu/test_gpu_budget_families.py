"""The memory budget on the GPU for a vision-language model, mixtures of experts with the router's auxiliary loss,
a hybrid and the encoder-decoders: a budget halfway between the lowest plan's predicted peak and keeping
everything trains under a plan that acts on some layers, with losses, gradients and weights bitwise equal to training
without offloading. The CPU test mode runs every family (tests/memory_budget/test_controller_families.py); here the
probes, the measured profile and the plans run on CUDA."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from _gpu_models import assert_bitwise_equal, build_model, dispose, make_batch, make_ctx, move_to, run_steps

from hf_offload import InfeasibleBudgetError
from hf_offload.memory_budget.search import choose_plan
from hf_offload.model import find_decoder_layers, unwrap_model

SIZE = dict(hidden=512, layers=2, vocab=128)
SEQ = 1024  # the layers' activations (tens of MB) must dwarf what differs between two runs in one process (MBs)
STEPS = 6  # two profiled under the safe plan, three of the closed loop's trial where it runs, then the budget's plan
ROOMY = 60 * 2**30
ARCHS = ("qwen2_vl", "llava", "mixtral", "qwen3_moe", "jamba", "t5", "bart")


def on_host(result):
    """A run's losses, gradients and weights moved to the host: kept on the GPU, a reference run's tensors would count
    as static memory in the runs after it, which the budget (derived from an earlier run's profile) must then cover."""
    return dataclasses.replace(
        result,
        losses=move_to(result.losses, "cpu"),
        grads=move_to(result.grads, "cpu"),
        final_params=move_to(result.final_params, "cpu"),
    )


def train(arch: str, budget: int | None = None):
    """`STEPS` steps under `budget`; every run starts from the same device memory (an earlier run's model and
    optimizer, held in reference cycles until a collection, would count as static memory)."""
    gc.collect()
    torch.cuda.empty_cache()
    model = build_model(arch, device="cuda", seq=SEQ, **SIZE)
    batch = make_batch(arch, device="cuda", seq=SEQ, vocab=SIZE["vocab"])
    context = None if budget is None else make_ctx(model, memory_budget=budget)
    try:
        return run_steps(model, batch, steps=STEPS, ctx=context, device="cuda"), context, model
    finally:
        if context is not None:
            dispose(context)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_budget_between_the_lowest_plan_and_keeping_everything_is_met_exactly(arch, record):
    baseline = on_host(train(arch)[0])
    assert_bitwise_equal(baseline, on_host(train(arch)[0]), f"{arch}: baseline against itself")
    roomy, model = train(arch, ROOMY)[1:]
    keep_all = roomy.memory_plan
    assert keep_all.code == "K" * len(find_decoder_layers(unwrap_model(model)))
    with pytest.raises(InfeasibleBudgetError) as refused:
        choose_plan(roomy.budget_controller.profile, 1)
    lowest = refused.value.lowest_plan.predicted.peak_bytes
    budget = (lowest + keep_all.predicted.peak_bytes) // 2
    del roomy, model, refused  # the budgeted run starts from the memory the roomy one started from
    planned, context, _ = train(arch, budget)
    planned = on_host(planned)
    chosen = context.memory_plan
    record("", {"plan": chosen.code, "budget": budget, "predicted_peak": chosen.predicted.peak_bytes,
                "keep_all_peak": keep_all.predicted.peak_bytes, "lowest_peak": lowest}, show=True)  # fmt: skip
    assert chosen.predicted.peak_bytes <= budget and chosen.code != keep_all.code
    assert_bitwise_equal(baseline, planned, f"{arch} under {chosen.code}")
