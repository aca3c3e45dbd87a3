"""What the QLoRA tests share, on the CPU (tests/test_qlora.py) and on the GPU (tests/gpu/test_gpu_qlora.py): a random
Llama saved to a folder, loaded back in 4 bits the way users load a QLoRA model, a few training steps, and the
comparisons.

The 4-bit weights come from `from_pretrained` with a `BitsAndBytesConfig` (NF4, bf16 compute, double quantization)
and LoRA r=16 goes on every linear layer, as in the usual QLoRA recipe.
"""

from __future__ import annotations

import torch
import transformers


def save_random_llama(path: str, *, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
                      kv_heads: int) -> str:  # fmt: skip
    """A random bf16 Llama saved to ``path`` (eager attention: deterministic backward on every device)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, attn_implementation="eager")  # fmt: skip
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def load_qlora(path: str, device: str, checkpointing: bool) -> torch.nn.Module:
    """The saved model in 4 bits on ``device``, with LoRA adapters, in training mode."""
    from peft import LoraConfig, get_peft_model

    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16,
                                                   bnb_4bit_use_double_quant=True)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization,
                                                              device_map=device)  # fmt: skip
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    return model.train()


def train(model, context=None, *, steps: int, shape: tuple[int, int], vocab: int,
          peaks: list[int] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Each step's loss and every LoRA gradient, over a few AdamW steps on random tokens of ``shape``. On CUDA, each
    step's peak allocated bytes go to ``peaks`` when it is given."""
    device = next(model.parameters()).device
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    generator = torch.Generator().manual_seed(2)
    results = []
    for _ in range(steps):
        ids = torch.randint(vocab, shape, generator=generator).to(device)
        if peaks is not None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with context if context is not None else torch.enable_grad():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results += [loss.detach(), *(p.grad.clone() for p in trainable)]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if peaks is not None:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
    return results


def assert_bitwise_equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    assert len(first) == len(second)
    for index, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"result {index} differs"


def max_relative_difference(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    """The largest difference of any result, relative to that result's largest magnitude."""
    return max(((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(first, second))  # fmt: skip
