"""The scenarios: a model's shape and family (Llama unless it says otherwise), the tokens per step, and what else the
scenario turns on.

Besides run.py's scenarios (S1, S2, S3, M36 and the CPU smoke tests), the shape zoo of `benchmarks/zoo.py`: the
layer shape and vocabulary of real 1B-8B models, some with fewer layers than the real model so that a
step stays short. `run.py --scenarios` accepts them too."""

from __future__ import annotations

import dataclasses
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
    liger: bool  # Liger's kernels for the family, fused linear cross-entropy included
    force_ckpt: bool  # checkpointing on in every mode: only ckpt* modes run
    steps: int  # timed steps, unless --steps
    warmup: int  # warm-up steps, unless --warmup
    head_dim: int | None = None  # attention head size where it is not hidden / heads (Gemma's 256)
    model: str = ""  # the real model whose layer shape and vocabulary these are (the zoo's shapes)
    family: str = "llama"  # the transformers model class built (harness.model.FAMILIES)
    # Further fields of the family's config, as (name, value) pairs (frozen): a MoE's experts and router loss, a
    # sliding window.
    config: tuple[tuple[str, object], ...] = ()

    def describe(self) -> str:
        text = (
            f"hidden {self.hidden}, intermediate {self.intermediate}, {self.layers} layers, "
            f"{self.heads}/{self.kv_heads} heads{f' of {self.head_dim}' if self.head_dim else ''}, vocab {self.vocab}; "
            f"seq {self.seq}, batch {self.batch} "
            f"({self.seq * self.batch} tokens/step)"
        )
        extras = []
        if self.lora:
            extras.append("LoRA r=16 all-linear")
        if self.liger:
            extras.append("Liger (fused linear CE)")
        if self.force_ckpt:
            extras.append("checkpointing on in every mode")
        if self.family != "llama":
            extras.append(f"{self.family} model class")
        extras += [f"{name}={value}" for name, value in self.config]
        text += "; " + ", ".join(extras) if extras else ""
        return f"{self.model}: {text}" if self.model else text


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
    # the engine costs per layer shows. Full fine-tune.
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
        model="Qwen2.5-3B shape",
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


def _zoo_shape(model: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
               seq: int, batch: int, lora: bool = False, head_dim: int | None = None, family: str = "llama",
               **config: object) -> Scenario:  # fmt: skip
    """A zoo shape: a real model's layer shape and vocabulary (Llama layers unless ``family`` says otherwise;
    ``config``: further fields of its config), no Liger, 2 warm-up and 3 timed steps."""
    return Scenario(hidden=hidden, intermediate=intermediate, layers=layers, heads=heads, kv_heads=kv_heads,
                    vocab=vocab, seq=seq, batch=batch, lora=lora, liger=False, force_ckpt=False, steps=3, warmup=2,
                    head_dim=head_dim, model=model, family=family, config=tuple(sorted(config.items())))  # fmt: skip


# The shape zoo (benchmarks/zoo.py): 1B to 8B-class layer shapes and vocabularies, 8 to 36 layers, 1 x 2K to 8 x 4K
# tokens, full fine-tunes and LoRA r=16, each sized for a step of about 0.1-0.3 s on an H100 (fewer layers than the
# real model where the real number would make the step long). M36 (above) is the zoo's Qwen2.5-3B shape; it and
# mistral-7b-8l are the first two it sweeps.
# The config fields of the zoo's shapes of other families than Llama (below).
_QWEN3_30B_A3B_MOE: dict = {"head_dim": 128, "family": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
                            "moe_intermediate_size": 768, "norm_topk_prob": True,
                            "output_router_logits": True}  # fmt: skip
_GEMMA3_4B_TEXT: dict = {"head_dim": 256, "family": "gemma3_text", "sliding_window": 1024}

ZOO_SCENARIOS: dict[str, Scenario] = {
    "mistral-7b-8l": _zoo_shape("Mistral-7B, 8 of 32 layers", 4096, 14336, 8, 32, 8, 32000, 4096, 2),
    "llama3.2-1b": _zoo_shape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, 4096, 2),
    "qwen2.5-1.5b-lora": _zoo_shape("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, 4096, 1, lora=True),
    "gemma2-2b-2k": _zoo_shape("Gemma-2-2B, Llama layers", 2304, 9216, 26, 8, 4, 256000, 2048, 1, head_dim=256),
    "llama3.2-3b-14l-lora": _zoo_shape(
        "Llama-3.2-3B, 14 of 28 layers", 3072, 8192, 14, 24, 8, 128256, 4096, 2, lora=True
    ),
    "qwen2.5-7b-8l": _zoo_shape("Qwen2.5-7B, 8 of 28 layers", 3584, 18944, 8, 28, 4, 152064, 4096, 1),
    "tinyllama-8l-8x4k-lora": _zoo_shape(
        "TinyLlama-1.1B, 8 of 22 layers", 2048, 5632, 8, 32, 4, 32000, 4096, 8, lora=True
    ),
    # Not in the default sweep (time): run them with --shapes.
    "llama3.1-8b-8l-4x4k-lora": _zoo_shape(
        "Llama-3.1-8B, 8 of 32 layers", 4096, 14336, 8, 32, 8, 128256, 4096, 4, lora=True
    ),
    "phi3-mini-2k": _zoo_shape("Phi-3-mini, Llama layers", 3072, 8192, 32, 32, 32, 32064, 2048, 1),
    # Other families' own layers (not Llama's), not in the default sweep either. Qwen3-30B-A3B: 128 experts of 768, 8
    # per token, with the router's auxiliary loss on (as fine-tuning scripts set it), LoRA (the experts' 3-D weights
    # stay frozen: fully fine-tuned, their optimizer state would leave activations a few percent of the memory).
    # Gemma-3-4B's text model: sliding-window layers (1024 tokens) five in six, so the model hands its layers a
    # materialised mask.
    "qwen3-moe-30b-a3b-16l-lora": _zoo_shape(
        "Qwen3-30B-A3B, 16 of 48 layers", 2048, 6144, 16, 32, 4, 151936, 4096, 2, lora=True, **_QWEN3_30B_A3B_MOE
    ),
    "gemma3-4b-12l": _zoo_shape(
        "Gemma-3-4B, text, 12 of 34 layers", 2560, 10240, 12, 8, 4, 262208, 4096, 1, **_GEMMA3_4B_TEXT
    ),
    # Added after the planner's last change, as shapes it was never tuned on: Qwen3's own layers (q/k
    # norms) at 2 x 4K, a LoRA at 8K tokens on a 49K vocabulary, and a wide full fine-tune at 4 x 2K on a 64K one.
    "qwen3-4b-12l-2x4k": _zoo_shape(
        "Qwen3-4B, 12 of 36 layers", 2560, 9728, 12, 32, 8, 151936, 4096, 2, head_dim=128, family="qwen3"
    ),
    "smollm2-1.7b-8k-lora": _zoo_shape("SmolLM2-1.7B", 2048, 8192, 24, 32, 32, 49152, 8192, 1, lora=True),
    "yi1.5-6b-10l-4x2k": _zoo_shape("Yi-1.5-6B, 10 of 32 layers", 4096, 11008, 10, 32, 4, 64000, 2048, 4),
}
SCENARIOS.update(ZOO_SCENARIOS)
# M36 at 4 x 4096 tokens, where per-layer compute is four times as long as M36's.
SCENARIOS["M36-4x4k"] = dataclasses.replace(SCENARIOS["M36"], batch=4)
# The zoo's CPU smoke test of a LoRA shape: tiny-lora without Liger and without forced checkpointing, so that every
# mode of the sweep runs.
SCENARIOS["tiny-lora-plain"] = dataclasses.replace(SCENARIOS["tiny-lora"], liger=False, force_ckpt=False)
# The zoo's sweep, in the order it runs: M36 and mistral-7b-8l first. --shapes all adds the others.
ZOO_DEFAULT = ["M36", "mistral-7b-8l", "llama3.2-1b", "qwen2.5-1.5b-lora", "gemma2-2b-2k", "llama3.2-3b-14l-lora",
               "qwen2.5-7b-8l", "tinyllama-8l-8x4k-lora"]  # fmt: skip
ZOO_ALL = ZOO_DEFAULT + [name for name in ZOO_SCENARIOS if name not in ZOO_DEFAULT]
# --device cpu: the zoo's CPU smoke run (hf-offload in its CPU test mode, no peaks measured).
ZOO_CPU = ["tiny", "tiny-lora-plain"]
