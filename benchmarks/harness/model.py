"""What a scenario trains: a model of its family (Llama, Qwen3, Qwen3-MoE, Gemma 3) from its config (random bf16
weights), Liger and LoRA where it asks for them, the optimizer, and the batch (labels = input_ids). The same seed
gives every mode the same weights and data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from .scenarios import Scenario


@dataclass(frozen=True)
class Family:
    config: type[PretrainedConfig]
    model: type[PreTrainedModel]
    liger_patch: str  # liger_kernel.transformers' class-level patch of this family


# Scenario.family -> what is built. Qwen3's layers differ from Llama's by their q/k RMSNorm; Qwen3-MoE's MLP is a
# router over experts held as 3-D parameters (transformers' experts implementation); Gemma 3's layers have four norms
# and q/k norms, and most of them attend within a sliding window, so the model hands its layers two masks.
FAMILIES: dict[str, Family] = {
    "llama": Family(LlamaConfig, LlamaForCausalLM, "apply_liger_kernel_to_llama"),
    "qwen3": Family(Qwen3Config, Qwen3ForCausalLM, "apply_liger_kernel_to_qwen3"),
    "qwen3_moe": Family(Qwen3MoeConfig, Qwen3MoeForCausalLM, "apply_liger_kernel_to_qwen3_moe"),
    "gemma3_text": Family(Gemma3TextConfig, Gemma3ForCausalLM, "apply_liger_kernel_to_gemma3_text"),
}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r}: the harness builds {', '.join(FAMILIES)}")
    return FAMILIES[name]


def liger_call(family_name: str = "llama") -> str:
    """How Liger is applied, for the results."""
    return (
        f"{family(family_name).liger_patch}(fused_linear_cross_entropy=True) before building the model (rope, "
        "rms_norm, swiglu on: the defaults)"
    )


def apply_liger(device: torch.device, notes: list[str], family_name: str) -> bool:
    """Liger's class-level patch of the family; it must come before the model is built. Returns whether it was
    applied (why not goes to ``notes``: the mode then runs without)."""
    patch = family(family_name).liger_patch  # an unknown family is the caller's error, not a missing Liger
    if device.type != "cuda":
        notes.append("liger skipped: needs an accelerator (ran without)")
        return False
    try:
        import liger_kernel.transformers

        getattr(liger_kernel.transformers, patch)(fused_linear_cross_entropy=True)
        return True
    except Exception as e:
        notes.append(f"liger not applied ({type(e).__name__}: {str(e)[:120]}); ran without")
        return False


def build_model(scenario: Scenario, seed: int, device: torch.device, **config_overrides: Any) -> PreTrainedModel:
    """The scenario's family's model, random bf16 weights drawn on ``device`` from ``seed``, sdpa attention.
    ``config_overrides`` are further config fields that the scenario does not set (e.g. ``rope_parameters``)."""
    built = family(scenario.family)
    config = built.config(
        hidden_size=scenario.hidden,
        intermediate_size=scenario.intermediate,
        num_hidden_layers=scenario.layers,
        num_attention_heads=scenario.heads,
        num_key_value_heads=scenario.kv_heads,
        vocab_size=scenario.vocab,
        max_position_embeddings=max(scenario.seq, 4096),
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        # Given always: Qwen3Config's default is 128 whatever the hidden size (Llama's is hidden / heads).
        head_dim=scenario.head_dim or scenario.hidden // scenario.heads,
        **dict(scenario.config),
        **config_overrides,
    )
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return built.model(config)
    finally:
        torch.set_default_dtype(prev_dtype)


def apply_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    )


def make_optimizer(params: list[torch.nn.Parameter], notes: list[str]) -> tuple[torch.optim.Optimizer, str]:
    """Fused AdamW, or foreach where this device has no fused kernel. Returns it and its description."""
    try:
        return torch.optim.AdamW(params, lr=1e-5, fused=True), "AdamW(fused=True)"
    except Exception as e:
        optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=True)
        notes.append(f"fused AdamW unavailable: {e}")
        return optimizer, "AdamW(foreach=True)"


def make_input_ids(scenario: Scenario, seed: int, device: torch.device) -> torch.Tensor:
    """Random token ids, batch x seq, from their own generator (the model's draws do not shift them)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, scenario.vocab, (scenario.batch, scenario.seq), generator=gen).to(device)
