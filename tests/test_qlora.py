"""QLoRA: a 4-bit model (bitsandbytes NF4, bf16 compute) with LoRA adapters, under offloading and the memory budget,
in the CPU test mode. The model is loaded the way users load it (`qlora_models`).

bitsandbytes' 4-bit matmul keeps its packed weight on the autograd context itself, not through `save_for_backward`,
so saved-tensor hooks never see it: what the engine moves is the activations, and the gradients must be bitwise those
of the same model without offloading. tests/gpu/test_gpu_qlora.py is the same on CUDA.
"""

import pytest
from qlora_models import assert_bitwise_equal, load_qlora, max_relative_difference, save_random_llama, train

from hf_offload import apply_tiled_mlp, get_act_offloading_ctx_manager

bitsandbytes = pytest.importorskip("bitsandbytes", reason='QLoRA needs bitsandbytes: pip install -e ".[qlora]"')

VOCAB, LAYERS = 128, 4
SHAPE = (2, 48)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("tiny-llama")), vocab=VOCAB, hidden=64, intermediate=128,
                             layers=LAYERS, heads=4, kv_heads=2)  # fmt: skip


def qlora(path: str, checkpointing: bool):
    return load_qlora(path, "cpu", checkpointing)


def run(model, context=None, steps: int = 3):
    return train(model, context, steps=steps, shape=SHAPE, vocab=VOCAB)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_offloading_a_qlora_model_is_bitwise_exact(saved_model, checkpointing):
    reference = run(qlora(saved_model, checkpointing))
    assert_bitwise_equal(reference, run(qlora(saved_model, checkpointing)))  # it repeats: the comparison means it
    model = qlora(saved_model, checkpointing)
    assert isinstance(model.base_model.model.model.layers[0].mlp.up_proj.base_layer, bitsandbytes.nn.Linear4bit)
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    assert_bitwise_equal(reference, run(model, context))
    assert context.get_stats()["bytes_offloaded"] > 0


def test_a_qlora_model_under_a_budget_gets_a_mixed_plan_and_stays_exact(saved_model):
    from hf_offload.memory_budget.simulate import simulate

    reference = run(qlora(saved_model, checkpointing=False), steps=4)
    roomy_model = qlora(saved_model, checkpointing=False)
    roomy = get_act_offloading_ctx_manager(roomy_model, device_type="cpu", memory_budget=2**40)
    run(roomy_model, roomy, steps=4)
    keep_all = roomy.memory_plan.predicted.peak_bytes
    lowest = simulate(roomy.budget_controller.profile, "C" * LAYERS).peak_bytes
    budget = (keep_all + lowest) // 2
    model = qlora(saved_model, checkpointing=False)
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
    results = run(model, context, steps=4)
    plan = context.memory_plan
    assert plan.predicted.peak_bytes <= budget and set(plan.code) - {"K"} and not set(plan.code) & set("Tt")
    assert_bitwise_equal(results, reference)


def test_a_tiled_qlora_mlp_is_close(saved_model):
    reference = run(qlora(saved_model, checkpointing=True), steps=1)
    model = qlora(saved_model, checkpointing=True)
    with apply_tiled_mlp(model, tokens_per_chunk=24) as handle:  # 96 tokens per call: four chunks
        assert len(handle) == LAYERS
        tiled = run(model, get_act_offloading_ctx_manager(model, device_type="cpu"), steps=1)
    assert max_relative_difference(tiled, reference) < 2e-2  # bf16 compute, weight gradients summed per chunk
