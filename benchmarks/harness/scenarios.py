"""The scenarios: a Llama-style model's shape, the tokens per step, and what else the scenario turns on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    batch: int
    lora: bool  # LoRA r=16 on all linear layers (peft)
    liger: bool  # Liger's Llama kernels, fused linear cross-entropy included
    force_ckpt: bool  # checkpointing on in every mode: only ckpt* modes run
    steps: int  # timed steps, unless --steps
    warmup: int  # warm-up steps, unless --warmup

    def describe(self) -> str:
        text = (
            f"hidden {self.hidden}, intermediate {self.intermediate}, {self.layers} layers, "
            f"{self.heads}/{self.kv_heads} heads, vocab {self.vocab}; seq {self.seq}, batch {self.batch} "
            f"({self.seq * self.batch} tokens/step)"
        )
        extras = []
        if self.lora:
            extras.append("LoRA r=16 all-linear")
        if self.liger:
            extras.append("Liger (fused linear CE)")
        if self.force_ckpt:
            extras.append("checkpointing on in every mode")
        return text + ("; " + ", ".join(extras) if extras else "")


SCENARIOS: dict[str, Scenario] = {
    "S1": Scenario(
        hidden=2048,
        intermediate=8192,
        layers=16,
        heads=32,
        kv_heads=8,
        vocab=32000,
        seq=4096,
        batch=4,
        lora=False,
        liger=False,
        force_ckpt=False,
        steps=10,
        warmup=3,
    ),
    "S2": Scenario(
        hidden=4096,
        intermediate=14336,
        layers=8,
        heads=32,
        kv_heads=8,
        vocab=128256,
        seq=4096,
        batch=2,
        lora=False,
        liger=False,
        force_ckpt=False,
        steps=10,
        warmup=3,
    ),
    # Same shape as S2, 32 layers, LoRA r=16 on all linear layers, Liger fused linear cross-entropy, checkpointing on.
    "S3": Scenario(
        hidden=4096,
        intermediate=14336,
        layers=32,
        heads=32,
        kv_heads=8,
        vocab=128256,
        seq=32768,
        batch=1,
        lora=True,
        liger=True,
        force_ckpt=True,
        steps=5,
        warmup=2,
    ),
    # Short steps on many layers (Qwen2.5-3B-class shape, Llama-style layers): per-layer compute is short, so what
    # the engine costs per layer shows (issue 21). Full fine-tune.
    "M36": Scenario(
        hidden=2048,
        intermediate=11008,
        layers=36,
        heads=16,
        kv_heads=2,
        vocab=151936,
        seq=4096,
        batch=1,
        lora=False,
        liger=False,
        force_ckpt=False,
        steps=10,
        warmup=3,
    ),
    # CPU smoke tests of the harness itself.
    "tiny": Scenario(
        hidden=64,
        intermediate=256,
        layers=2,
        heads=4,
        kv_heads=2,
        vocab=512,
        seq=64,
        batch=2,
        lora=False,
        liger=False,
        force_ckpt=False,
        steps=4,
        warmup=2,
    ),
    "tiny-lora": Scenario(
        hidden=64,
        intermediate=256,
        layers=2,
        heads=4,
        kv_heads=2,
        vocab=512,
        seq=64,
        batch=2,
        lora=True,
        liger=True,
        force_ckpt=True,
        steps=4,
        warmup=2,
    ),
}
