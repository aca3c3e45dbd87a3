"""QLoRA: a 4-bit model (bitsandbytes NF4, bf16 compute) with LoRA adapters, under offloading and the memory budget,
in the CPU test mode. The 4-bit weights are loaded the way users load them (`from_pretrained` with a
`BitsAndBytesConfig`), here from a tiny random Llama saved to a temporary directory.

bitsandbytes' 4-bit matmul keeps its packed weight on the autograd context itself, not through `save_for_backward`,
so saved-tensor hooks never see it: what the engine moves is the activations, and the gradients must be bitwise those
of the same model without offloading. The GPU proof is tests/gpu (not yet run for QLoRA).
"""

import pytest
import torch
import transformers

from hf_offload import apply_tiled_mlp, get_act_offloading_ctx_manager

bitsandbytes = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (the dev extra installs it)")

VOCAB, LAYERS = 128, 4


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      attn_implementation="eager")  # fmt: skip
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def qlora(path: str, checkpointing: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16,
                                                   bnb_4bit_use_double_quant=True)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization,
                                                              device_map="cpu")  # fmt: skip
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    return model.train()


def train(model, context=None, steps: int = 3) -> list[torch.Tensor]:
    """Each step's loss and every LoRA gradient, over a few AdamW steps."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    torch.manual_seed(2)
    results = []
    for _ in range(steps):
        ids = torch.randint(VOCAB, (2, 48))
        with context if context is not None else torch.enable_grad():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results += [loss.detach(), *(p.grad.clone() for p in trainable)]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return results


def assert_bitwise_equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_offloading_a_qlora_model_is_bitwise_exact(saved_model, checkpointing):
    reference = train(qlora(saved_model, checkpointing))
    assert_bitwise_equal(reference, train(qlora(saved_model, checkpointing)))  # it repeats: the comparison means it
    model = qlora(saved_model, checkpointing)
    assert isinstance(model.base_model.model.model.layers[0].mlp.up_proj.base_layer, bitsandbytes.nn.Linear4bit)
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    assert_bitwise_equal(reference, train(model, context))
    assert context.get_stats()["bytes_offloaded"] > 0


def test_a_qlora_model_under_a_budget_gets_a_mixed_plan_and_stays_exact(saved_model):
    reference = train(qlora(saved_model, checkpointing=False), steps=4)
    roomy_model = qlora(saved_model, checkpointing=False)
    roomy = get_act_offloading_ctx_manager(roomy_model, device_type="cpu", memory_budget=2**40)
    train(roomy_model, roomy, steps=4)
    keep_all = roomy.budget.plan.predicted.peak_bytes
    from hf_offload.planner import simulate

    lowest = simulate(roomy.budget.profile, "C" * LAYERS).peak_bytes
    budget = (keep_all + lowest) // 2
    model = qlora(saved_model, checkpointing=False)
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
    results = train(model, context, steps=4)
    plan = context.budget.plan
    assert plan.predicted.peak_bytes <= budget and set(plan.code) - {"K"} and not set(plan.code) & set("Tt")
    assert_bitwise_equal(results, reference)


def test_a_tiled_qlora_mlp_is_close(saved_model):
    reference = train(qlora(saved_model, checkpointing=True), steps=1)
    model = qlora(saved_model, checkpointing=True)
    with apply_tiled_mlp(model, tokens_per_chunk=24) as handle:  # 96 tokens per call: four chunks
        assert len(handle) == LAYERS
        tiled = train(model, get_act_offloading_ctx_manager(model, device_type="cpu"), steps=1)
    for a, b in zip(tiled, reference):  # bf16 compute, weight gradients summed per chunk
        assert ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item() < 2e-2
