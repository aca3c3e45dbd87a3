"""QLoRA on CUDA: a 4-bit model (bitsandbytes NF4, bf16 compute, LoRA r=16 on every linear layer) under offloading,
checkpointing and the memory budget. The gradients are bitwise those without offloading, and a budget is never
exceeded. tests/test_qlora.py is the same in the CPU test mode; `qlora_models` loads the model as users do."""

from __future__ import annotations

import pytest
from _gpu_models import dispose
from qlora_models import assert_bitwise_equal, load_qlora, max_relative_difference, save_random_llama, train

from hf_offload import apply_tiled_mlp, get_act_offloading_ctx_manager

bitsandbytes = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (carry its wheel in .whl/)")

# Large enough for the activations to dominate the peak (8 layers of 4 x 1024 tokens), small enough for seconds.
VOCAB, LAYERS = 1000, 8
SHAPE = (4, 1024)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("llama")), vocab=VOCAB, hidden=1024, intermediate=2816,
                             layers=LAYERS, heads=16, kv_heads=8)  # fmt: skip


def qlora(path: str, checkpointing: bool):
    return load_qlora(path, "cuda", checkpointing)


def run(model, context=None, steps: int = 3, peaks: list[int] | None = None):
    return train(model, context, steps=steps, shape=SHAPE, vocab=VOCAB, peaks=peaks)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_offloading_a_qlora_model_is_bitwise_exact(saved_model, checkpointing, record):
    reference = run(qlora(saved_model, checkpointing))
    assert_bitwise_equal(reference, run(qlora(saved_model, checkpointing)))  # it repeats: the comparison means it
    model = qlora(saved_model, checkpointing)
    linear = model.base_model.model.model.layers[0].mlp.up_proj.base_layer
    assert isinstance(linear, bitsandbytes.nn.Linear4bit) and linear.weight.device.type == "cuda"
    context = get_act_offloading_ctx_manager(model)
    assert_bitwise_equal(reference, run(model, context))
    stats = context.get_stats()
    record(f"checkpointing_{checkpointing}", {key: stats[key] for key in ("bytes_offloaded", "prefetch_misses")},
           show=True)  # fmt: skip
    assert stats["bytes_offloaded"] > 0
    dispose(context)


def test_a_qlora_budget_is_never_exceeded_and_stays_exact(saved_model, record):
    from hf_offload.memory_budget.simulate import simulate

    steps = 5  # two profiled, then three planned
    reference = run(qlora(saved_model, checkpointing=False), steps=steps)
    roomy_model = qlora(saved_model, checkpointing=False)
    roomy = get_act_offloading_ctx_manager(roomy_model, memory_budget=2**40)
    run(roomy_model, roomy, steps=3)
    keep_all = roomy.memory_plan.predicted.peak_bytes
    lowest = simulate(roomy.budget_controller.profile, "C" * LAYERS).peak_bytes
    dispose(roomy)
    del roomy_model
    budget = (keep_all + lowest) // 2
    model = qlora(saved_model, checkpointing=False)
    context = get_act_offloading_ctx_manager(model, memory_budget=budget)
    peaks: list[int] = []
    results = run(model, context, steps=steps, peaks=peaks)
    plan = context.memory_plan
    record("budget", {"budget": budget, "keep_all_predicted": keep_all, "lowest_predicted": lowest,
                      "plan": plan.code, "predicted_peak": plan.predicted.peak_bytes, "step_peaks": peaks},
           show=True)  # fmt: skip
    assert set(plan.code) - {"K"} and not set(plan.code) & set("Tt"), plan.code
    assert max(peaks) <= budget, f"plan {plan.code}: step peaks {peaks} over the budget {budget}"
    assert_bitwise_equal(results, reference)
    dispose(context)


def test_a_tiled_qlora_mlp_is_close(saved_model, record):
    reference = run(qlora(saved_model, checkpointing=True), steps=1)
    model = qlora(saved_model, checkpointing=True)
    with apply_tiled_mlp(model, tokens_per_chunk=512) as handle:  # 4096 tokens per call: eight chunks
        assert len(handle) == LAYERS
        context = get_act_offloading_ctx_manager(model)
        tiled = run(model, context, steps=1)
    difference = max_relative_difference(tiled, reference)
    record("tiled_max_relative_difference", difference, show=True)
    assert difference < 2e-2  # bf16 compute, weight gradients summed per chunk
    dispose(context)
