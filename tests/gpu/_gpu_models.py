"""Shared helpers of the GPU test suite: tiny models from configs, batches, one training step, comparison.

Everything here takes an explicit ``device`` so that a case body can also be run on CPU against the
engine's ``device_type="cpu"`` test mode while developing; the tests themselves always pass "cuda".
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ARCHS = ("llama", "qwen2", "gpt2", "t5", "bart")  # the full bitwise matrix
# Run in a smaller matrix: decoders that differ from Llama in structure (Mistral's and Gemma-2's sliding window,
# Gemma-2's soft-capping, extra norms and tied embeddings, Phi's parallel block and partial rotary), and two
# classifiers whose head is `classifier` on a pooled/CLS token instead of an LM head over every position.
MORE_ARCHS = ("mistral", "gemma2", "phi", "bert", "vit")
ENCODER_DECODER = ("t5", "bart")
CLASSIFIERS = ("bert", "vit")
# The families the memory budget must hold on besides dense decoders: vision-language models (a vision tower's
# layers and a language model's, each stack with its own arguments and tokens), mixtures of experts with the
# router's auxiliary loss on (`output_router_logits=True`), and hybrids of attention with Mamba or linear attention.
VLMS = ("qwen2_vl", "qwen2_5_vl", "llava", "gemma3", "idefics3")
MOES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v32")
HYBRIDS = ("jamba", "qwen3_next", "bamba", "falcon_h1")
CKPT_MODES = ("off", "nonreentrant", "reentrant")

VOCAB = 1000
TINY = dict(hidden=128, layers=3, seq=128, batch=2)
NUM_LABELS = 3
IMAGE = dict(size=32, patch=4, channels=3)  # 64 patches + CLS: 65 tokens per image
# The VLMs' images: 16 x 16 pixels in 4 x 4 patches (Qwen2-VL: 4 x 4 patches of 2 x 2 pixels, merged 2 x 2), and
# the language model's tokens that stand for each one (after LLaVA drops the CLS, Gemma 3 pools and Idefics3
# shuffles pixels, or Qwen2-VL merges patches).
VLM_IMAGE = dict(size=16, patch=4, channels=3)
IMAGE_TOKEN = 3  # text tokens are drawn above it
IMAGE_TOKENS = {"llava": 16, "gemma3": 4, "idefics3": 4, "qwen2_vl": 4, "qwen2_5_vl": 4}


# --------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------
def model_config(
    arch: str,
    *,
    hidden: int,
    layers: int,
    seq: int,
    vocab: int = VOCAB,
    attn: str = "eager",
    intermediate: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
):
    """A transformers config for a small random-weight model of ``arch`` (no download)."""
    import transformers as tf

    heads = heads or max(2, hidden // 32)
    kv_heads = kv_heads or max(1, heads // 2)
    inter = intermediate or 2 * hidden
    common = dict(vocab_size=vocab, attn_implementation=attn, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    # Decoder-only LMs share their config fields. Mistral and Gemma-2 get sliding windows shorter than the
    # sequence, so that the sliding-window masks are really used.
    decoder = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(seq, 256),
        **common,
    )
    sliding = dict(head_dim=hidden // heads, sliding_window=max(seq // 2, 1))
    decoders = {
        "llama": (tf.LlamaConfig, {}),
        "qwen2": (tf.Qwen2Config, {}),
        "mistral": (tf.MistralConfig, sliding),
        "gemma2": (tf.Gemma2Config, {**sliding, "query_pre_attn_scalar": hidden // heads}),
        "phi": (tf.PhiConfig, {}),
    }
    if arch in decoders:
        config_class, extra = decoders[arch]
        return config_class(**decoder, **extra)
    if arch == "gpt2":
        return tf.GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_inner=inter, n_positions=max(seq, 256), **common
        )
    if arch == "t5":
        return tf.T5Config(
            d_model=hidden,
            d_kv=hidden // heads,
            d_ff=inter,
            num_layers=max(1, layers - 1),
            num_decoder_layers=max(1, layers - 1),
            num_heads=heads,
            decoder_start_token_id=0,
            **common,
        )
    if arch == "bart":
        return tf.BartConfig(
            d_model=hidden,
            encoder_layers=max(1, layers - 1),
            decoder_layers=max(1, layers - 1),
            encoder_attention_heads=heads,
            decoder_attention_heads=heads,
            encoder_ffn_dim=inter,
            decoder_ffn_dim=inter,
            max_position_embeddings=max(seq, 256),
            decoder_start_token_id=2,
            forced_eos_token_id=None,
            **common,
        )
    if arch in VLMS + MOES + HYBRIDS:
        return _family_config(tf, arch, decoder, sliding, hidden, heads)
    if arch == "bert":
        return tf.BertConfig(
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=max(seq, 256),
            num_labels=NUM_LABELS,
            **common,
        )
    if arch == "vit":
        return tf.ViTConfig(
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            image_size=IMAGE["size"],
            patch_size=IMAGE["patch"],
            num_channels=IMAGE["channels"],
            num_labels=NUM_LABELS,
            attn_implementation=attn,
        )
    raise ValueError(f"unknown arch {arch!r}")


def _family_config(tf, arch: str, decoder: dict, sliding: dict, hidden: int, heads: int):
    """The config of a VLM, MoE or hybrid (see `model_config`): the text part from the decoders' fields."""
    moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
    if arch == "mixtral":
        return tf.MixtralConfig(**decoder, num_local_experts=4, **moe)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**decoder, num_experts=4, moe_intermediate_size=hidden, **moe)
    if arch == "gpt_oss":
        return tf.GptOssConfig(**decoder, **sliding, num_local_experts=4, **moe)
    if arch == "jamba":  # Mamba, then attention with experts, alternating
        return tf.JambaConfig(
            **decoder,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            **{**moe, "num_experts_per_tok": 1},
        )
    if arch == "qwen3_next":  # linear attention, then full attention, alternating; experts in every layer
        layer_types = ["linear_attention", "full_attention"] * (decoder["num_hidden_layers"] // 2)
        return tf.Qwen3NextConfig(
            **decoder,
            head_dim=hidden // heads,
            layer_types=layer_types,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=hidden // heads,
            linear_value_head_dim=hidden // heads,
            linear_num_key_heads=heads,
            linear_num_value_heads=heads,
            num_experts=4,
            moe_intermediate_size=hidden,
            shared_expert_intermediate_size=hidden,
            **moe,
        )
    if arch == "deepseek_v32":  # multi-head latent attention with the DSA indexer; experts after the first layer
        return tf.DeepseekV32Config(
            **{**decoder, "num_key_value_heads": heads},
            kv_lora_rank=hidden // 2,
            q_lora_rank=hidden // 2,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=hidden,
            first_k_dense_replace=1,
            index_topk=8,
            index_head_dim=16,
            index_n_heads=2,
            num_experts_per_tok=2,
        )
    mamba2 = dict(mamba_n_heads=heads * 2, mamba_d_head=hidden // heads, mamba_n_groups=1, mamba_d_state=8,
                  mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)  # fmt: skip
    if arch == "falcon_h1":  # attention and Mamba-2 side by side in every layer
        return tf.FalconH1Config(**decoder, **mamba2, mamba_d_ssm=2 * hidden)
    if arch == "bamba":  # Mamba-2, then attention
        return tf.BambaConfig(**decoder, **mamba2, attn_layer_indices=list(range(1, decoder["num_hidden_layers"], 2)))
    vision = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=decoder["num_hidden_layers"],
        num_attention_heads=heads,
        image_size=VLM_IMAGE["size"],
        patch_size=VLM_IMAGE["patch"],
    )
    image = dict(image_token_id=IMAGE_TOKEN)
    if arch == "llava":
        return tf.LlavaConfig(
            vision_config=tf.CLIPVisionConfig(**vision),
            text_config=tf.LlamaConfig(**decoder),
            image_token_index=IMAGE_TOKEN,
            vision_feature_layer=-1,
            image_seq_length=IMAGE_TOKENS[arch],
        )
    if arch == "gemma3":
        text = tf.Gemma3TextConfig(**decoder, **sliding, query_pre_attn_scalar=hidden // heads)
        return tf.Gemma3Config(
            text_config=text,
            vision_config=tf.SiglipVisionConfig(**vision),
            mm_tokens_per_image=IMAGE_TOKENS[arch],
            image_token_index=IMAGE_TOKEN,
            boi_token_index=IMAGE_TOKEN + 1,
            eoi_token_index=IMAGE_TOKEN + 2,
        )
    if arch == "idefics3":
        return tf.Idefics3Config(
            vision_config=tf.Idefics3VisionConfig(**vision),
            text_config=tf.LlamaConfig(**decoder),
            scale_factor=2,
            **image,
        )
    # Qwen2-VL and Qwen2.5-VL: multimodal rotary sections of a head of `hidden // heads`.
    half = hidden // heads // 2
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
    }
    qwen_vision = dict(
        depth=decoder["num_hidden_layers"],
        hidden_size=hidden,
        num_heads=heads,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if arch == "qwen2_vl":
        return tf.Qwen2VLConfig(
            text_config=tf.Qwen2VLTextConfig(**decoder, rope_parameters=rope).to_dict(),
            vision_config=dict(qwen_vision, embed_dim=hidden, in_chans=3),
            **image,
        )
    return tf.Qwen2_5_VLConfig(
        text_config=tf.Qwen2_5_VLTextConfig(**decoder, rope_parameters=rope).to_dict(),
        vision_config=dict(
            qwen_vision,
            out_hidden_size=hidden,
            intermediate_size=2 * hidden,
            in_channels=3,
            window_size=8,
            fullatt_block_indexes=[1],
        ),
        **image,
    )


def model_class(arch: str):
    import transformers as tf

    return {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
        "t5": tf.T5ForConditionalGeneration,
        "bart": tf.BartForConditionalGeneration,
        "mistral": tf.MistralForCausalLM,
        "gemma2": tf.Gemma2ForCausalLM,
        "phi": tf.PhiForCausalLM,
        "bert": tf.BertForSequenceClassification,
        "vit": tf.ViTForImageClassification,
        "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
        "llava": tf.LlavaForConditionalGeneration,
        "gemma3": tf.Gemma3ForConditionalGeneration,
        "idefics3": tf.Idefics3ForConditionalGeneration,
        "mixtral": tf.MixtralForCausalLM,
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "gpt_oss": tf.GptOssForCausalLM,
        "jamba": tf.JambaForCausalLM,
        "qwen3_next": tf.Qwen3NextForCausalLM,
        "bamba": tf.BambaForCausalLM,
        "deepseek_v32": tf.DeepseekV32ForCausalLM,
        "falcon_h1": tf.FalconH1ForCausalLM,
    }[arch]


def enable_checkpointing(model, mode: str) -> None:
    """mode in CKPT_MODES. Uses ``activation_checkpointing_enable`` (transformers >= 5.x) when it exists,
    else the older ``gradient_checkpointing_enable``."""
    if mode == "off":
        name = (
            "is_activation_checkpointing"
            if hasattr(type(model), "is_activation_checkpointing")
            else "is_gradient_checkpointing"
        )
        if getattr(model, name, False):
            _call_ckpt_api(model, enable=False)
        return
    if mode not in ("nonreentrant", "reentrant"):
        raise ValueError(f"unknown checkpointing mode {mode!r}")
    _call_ckpt_api(model, enable=True, kwargs={"use_reentrant": mode == "reentrant"})


def _call_ckpt_api(model, *, enable: bool, kwargs: dict | None = None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if enable:
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            if hasattr(model, "activation_checkpointing_disable"):
                model.activation_checkpointing_disable()
            else:
                model.gradient_checkpointing_disable()


def apply_lora(model, seed: int = 1):
    """PEFT LoRA r=8 on every linear layer but the head. ``init_lora_weights=False`` makes B random too, so
    that both A and B get non-zero gradients (with B=0, A's gradient is exactly zero and compares trivially)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    # PEFT refuses LoRA on Falcon-H1's Mamba output projection (a ValueError of its own for Mamba-based models).
    excluded = r".*\.mamba\.out_proj" if model.config.model_type == "falcon_h1" else None
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False,
                     exclude_modules=excluded)  # fmt: skip
    return get_peft_model(model, cfg)


def build_model(
    arch: str,
    *,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cuda",
    ckpt: str = "off",
    lora: bool = False,
    seed: int = 0,
    attn: str = "eager",
    **size,
) -> torch.nn.Module:
    """A deterministic random-weight model: the same arguments always give bitwise the same weights."""
    size = {**TINY, **size}
    cfg = model_config(
        arch,
        hidden=size["hidden"],
        layers=size["layers"],
        seq=size["seq"],
        attn=attn,
        vocab=size.get("vocab", VOCAB),
        intermediate=size.get("intermediate"),
        heads=size.get("heads"),
        kv_heads=size.get("kv_heads"),
    )
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(arch)(cfg)
    model.to(dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype)
    enable_checkpointing(model, ckpt)
    if lora:
        model = apply_lora(model, seed=seed + 1)
    model.to(device)
    model.train()
    return model


def make_batch(
    arch: str,
    *,
    batch: int = TINY["batch"],
    seq: int = TINY["seq"],
    vocab: int = VOCAB,
    device="cuda",
    seed: int = 1234,
) -> dict[str, torch.Tensor]:
    """Inputs with labels, so that the model computes its own loss: LM labels (shifted inside the model),
    seq2seq targets, or one class per sequence or image (pixels in fp32: ViT casts them to its dtype)."""
    g = torch.Generator().manual_seed(seed)
    if arch == "vit":
        out = {"pixel_values": torch.randn(batch, IMAGE["channels"], IMAGE["size"], IMAGE["size"], generator=g)}
    elif arch in VLMS:
        out = _vlm_inputs(arch, batch, seq, vocab, g)
    else:
        ids = torch.randint(3, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, :4] = -100  # some ignored positions, as with a prompt mask
        out = {"input_ids": ids, "labels": labels}
    if arch in ENCODER_DECODER:
        out["attention_mask"] = torch.ones_like(ids)
        out["labels"] = torch.randint(3, vocab, (batch, max(8, seq // 2)), generator=g)
    if arch in CLASSIFIERS:
        if arch == "bert":
            out["attention_mask"] = torch.ones_like(ids)
            out["attention_mask"][1:, -(seq // 4) :] = 0  # right padding in all but the first sequence
        out["labels"] = torch.randint(0, NUM_LABELS, (batch,), generator=g)
    return {k: v.to(device) for k, v in out.items()}


def _vlm_inputs(arch: str, batch: int, seq: int, vocab: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One image per sequence, its tokens after a 2-token prompt, the loss on the text after them."""
    ids = torch.randint(IMAGE_TOKEN + 3, vocab, (batch, seq), generator=g)  # above the image's special tokens
    image = slice(2, 2 + IMAGE_TOKENS[arch])
    ids[:, image] = IMAGE_TOKEN
    labels = ids.clone()
    labels[:, : image.stop] = -100
    size, channels = VLM_IMAGE["size"], VLM_IMAGE["channels"]
    out = {"input_ids": ids, "labels": labels}
    if arch in ("qwen2_vl", "qwen2_5_vl"):  # flattened patches of 2 x 2 pixels by 2 frames, 4 x 4 of them
        out["pixel_values"] = torch.randn(batch * 16, channels * 2 * 2 * 2, generator=g)
        out["image_grid_thw"] = torch.tensor([[1, 4, 4]] * batch)
        out["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
        return out
    pixels = torch.randn(batch, channels, size, size, generator=g)
    out["pixel_values"] = pixels.unsqueeze(1) if arch == "idefics3" else pixels  # Idefics3: images per sequence
    if arch == "gemma3":
        out["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    return out


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not bad, f"models built from the same seed differ in {bad[:5]}"


def mlp_saving_3_gib(device: str = "cuda") -> Callable[[Any], list[torch.Tensor]]:
    """Twelve layers of Linear(4096, 4096) + GELU on 8,192 rows, seeded: a step saves about 3 GiB, enough to pass
    any small pool, reserve or disk threshold a test sets. Returns ``grads(engine)``: one step, inside ``engine``
    when one is given (any context manager), and the gradients it left."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU())
                                  for _ in range(12)]).to(device)  # fmt: skip
    x = torch.randn(8192, 4096, device=device)

    def grads(engine) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with engine if engine is not None else contextlib.nullcontext():
            loss = model(x).square().mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    return grads


# --------------------------------------------------------------------------------------------------------------
# Context construction and auditing
# --------------------------------------------------------------------------------------------------------------
def make_ctx(model, **options):
    """The context under test, built through the public entry point."""
    import hf_offload

    return hf_offload.get_act_offloading_ctx_manager(model, **options)


def dispose(ctx) -> None:
    """Removes the context's module hooks and breaks the reference cycle through its hook attributes (bound
    methods of itself), so that its pinned pool returns to PyTorch's host allocator cache now rather than at
    the next full garbage collection (hundreds of cases each build a context)."""
    ctx.remove_hooks()
    ctx.pack_hook = ctx.unpack_hook = None


class HookAudit:
    """Wraps the pack/unpack hooks of a ``saved_tensors_hooks`` object to check, for every tensor the context
    packs, that unpack returns a tensor on the same device with the same dtype, shape and strides."""

    def __init__(self, ctx):
        self.packed = Counter()  # device -> count
        self.unpacked = Counter()
        self.errors: list[str] = []
        orig_pack, orig_unpack = ctx.pack_hook, ctx.unpack_hook

        def pack(t):
            meta = (t.device, t.dtype, tuple(t.shape), tuple(t.stride()) if t.layout == torch.strided else None)
            self.packed[str(t.device)] += 1
            return (meta, orig_pack(t))

        def unpack(p):
            meta, inner = p
            out = orig_unpack(inner)
            self.unpacked[str(out.device)] += 1
            got = (
                out.device,
                out.dtype,
                tuple(out.shape),
                tuple(out.stride()) if out.layout == torch.strided else None,
            )
            if got != meta and len(self.errors) < 20:
                self.errors.append(f"packed {meta} but unpacked {got}")
            return out

        ctx.pack_hook, ctx.unpack_hook = pack, unpack

    def check(self) -> None:
        assert sum(self.packed.values()) > 0, (
            "the audit saw no pack call: the context does not push ctx.pack_hook/unpack_hook in __enter__ "
            "(update HookAudit to the engine's hook attributes)"
        )
        assert not self.errors, "unpacked tensors differ from what was packed:\n" + "\n".join(self.errors)


# --------------------------------------------------------------------------------------------------------------
# Running steps
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunResult:
    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor | None]]
    final_params: dict[str, torch.Tensor]
    stats: list[dict[str, Any]]
    mem_after_step: list[int]


def _plan_in_force(ctx) -> tuple:
    """The plan in force after a step (code, whether a trial) and whether the engine stood aside."""
    plan = ctx.memory_plan
    return plan.code if plan else None, plan.trial if plan else None, ctx.standing_aside


def step_peaks(model, batch: dict | Callable[[int], dict], ctx, steps: int, seen: list | None = None,
               describe: Callable[[Any], Any] = _plan_in_force) -> tuple[list[int], list[torch.Tensor]]:  # fmt: skip
    """The peak allocated memory of each training step (forward, backward, optimizer), and the losses. `batch`: the
    inputs of every step, or a function of the step's index that gives them. With `seen`, after each step
    `describe(ctx)`: by default the plan in force (code, whether a trial) and whether the engine stood aside."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    peaks, losses = [], []
    for step in range(steps):
        inputs = batch(step) if callable(batch) else batch
        torch.manual_seed(100 + step)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if ctx is None:
            loss = model(**inputs).loss
        else:
            with ctx:
                loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        # On the host: a list of losses on the device grows the memory held between steps by a 512-byte block a
        # step, which a budget at exactly a measured peak does not have room for (H200: 2,560 bytes over by step 7).
        losses.append(loss.detach().cpu())
        if seen is not None:
            seen.append(describe(ctx))
    return peaks, losses


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def run_steps(
    model,
    batch: dict,
    *,
    steps: int = 2,
    ctx=None,
    span: str = "fwd",
    lr: float = 1e-3,
    seed: int = 4321,
    keep: bool = True,
    device="cuda",
    optimizer: str | torch.optim.Optimizer = "adamw",
) -> RunResult:
    """``steps`` training steps (zero_grad, forward, backward, optimizer step) on the same batch.

    span="fwd": only the forward runs inside ``with ctx`` (Trainer.compute_loss style); span="fwd_bwd": the
    backward too (training_step style). ``ctx=None`` is the reference run. Each step reseeds the RNG so that
    dropout draws the same masks in the reference and the offloaded run. ``optimizer``: "adamw", "sgd", or an
    optimizer object that lives on across calls (a long run sampled in windows)."""
    if span not in ("fwd", "fwd_bwd"):
        raise ValueError(span)
    params = [p for _, p in trainable(model)]
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    else:
        opt = torch.optim.AdamW(params, lr=lr) if optimizer == "adamw" else torch.optim.SGD(params, lr=lr)
    res = RunResult([], [], {}, [], [])
    for step in range(steps):
        torch.manual_seed(seed + step)
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(model, batch, ctx, span)
        _sync(device)
        if ctx is not None:
            res.stats.append(dict(ctx.get_stats()))
        if keep:
            res.losses.append(loss.detach().clone())
            res.grads.append({n: (None if p.grad is None else p.grad.detach().clone()) for n, p in trainable(model)})
        del loss
        opt.step()
        _sync(device)
        if torch.device(device).type == "cuda":
            res.mem_after_step.append(torch.cuda.memory_allocated(device))
    if keep:
        res.final_params = {n: p.detach().clone() for n, p in trainable(model)}
    opt.zero_grad(set_to_none=True)
    del opt
    return res


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    d = (a.float() - b.float()).abs()
    return f"max|diff|={d.max().item():.3e}, {int((d != 0).sum())}/{d.numel()} elements differ"


def assert_bitwise_equal(ref: RunResult, got: RunResult, what: str = "") -> None:
    """Per step: the loss, then every gradient (None in both runs counts as equal); then the parameters after
    the last optimizer step. Fails at the first step that differs, naming up to 10 tensors."""
    assert len(ref.losses) == len(got.losses) == len(ref.grads) == len(got.grads)
    n_with_grad = 0
    for step in range(len(ref.losses)):
        lr_, lg = ref.losses[step], got.losses[step]
        gr, gg = ref.grads[step], got.grads[step]
        bad = [] if torch.equal(lr_, lg) else [f"loss: {lr_.item()!r} != {lg.item()!r}"]
        assert gr.keys() == gg.keys()
        for name in gr:
            a, b = gr[name], gg[name]
            if a is None or b is None:
                if (a is None) != (b is None):
                    bad.append(f"{name}: grad None in one run only")
                continue
            n_with_grad += 1
            if not torch.equal(a, b):
                bad.append(f"{name}: {_diff(a, b)}")
        assert not bad, f"{what} step {step + 1}: {len(bad)} of loss+gradients differ:\n  " + "\n  ".join(bad[:10])
    assert n_with_grad > 0, f"{what}: no parameter received a gradient"
    bad = [
        f"{n}: {_diff(ref.final_params[n], got.final_params[n])}"
        for n in ref.final_params
        if not torch.equal(ref.final_params[n], got.final_params[n])
    ]
    assert not bad, f"{what}: parameters after the optimizer steps differ:\n  " + "\n  ".join(bad[:10])


def assert_offloaded(stats: Iterable[dict], what: str = "") -> None:
    for step, s in enumerate(stats):
        assert s.get("bytes_offloaded", 0) > 0 and s.get("tensors_offloaded", 0) > 0, (
            f"{what} step {step + 1}: nothing was offloaded, stats={_short(s)}"
        )


def _short(s: dict) -> dict:
    return {k: v for k, v in s.items() if v}


# --------------------------------------------------------------------------------------------------------------
# One comparison case: the body shared by the bitwise tests
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    arch: str
    dtype: str = "bf16"
    ckpt: str = "off"
    lora: bool = False
    use_streams: bool = True
    span: str = "fwd"
    steps: int = 2
    attn: str = "eager"
    options: tuple = ()  # extra engine options, as ((name, value), ...)

    @property
    def id(self) -> str:
        parts = [
            self.arch,
            self.dtype,
            f"ckpt-{self.ckpt}",
            "lora" if self.lora else "full",
            "streams" if self.use_streams else "nostreams",
            f"span-{self.span}",
        ]
        if self.attn != "eager":
            parts.append(self.attn)
        parts += [f"{k}={v}" for k, v in self.options]
        return "-".join(parts)


def run_case(case: Case, device="cuda", **ctx_overrides) -> dict:
    """Reference run vs offloaded run of ``case``; asserts bitwise equality, that real bytes were offloaded
    in every step, and that every unpacked tensor matches what was packed. Returns numbers to report."""
    kw = dict(dtype=case.dtype, device=device, ckpt=case.ckpt, lora=case.lora, attn=case.attn)
    ref_model = build_model(case.arch, **kw)
    off_model = build_model(case.arch, **kw)
    assert_same_weights(ref_model, off_model)
    batch = make_batch(case.arch, device=device)

    ref = run_steps(ref_model, batch, steps=case.steps, span=case.span, device=device)
    del ref_model

    options = dict(use_streams=case.use_streams, min_offload_size=1024, **dict(case.options), **ctx_overrides)
    ctx = make_ctx(off_model, **options)
    audit = HookAudit(ctx)
    got = run_steps(off_model, batch, steps=case.steps, ctx=ctx, span=case.span, device=device)
    try:
        assert_bitwise_equal(ref, got, case.id)
        assert_offloaded(got.stats, case.id)
        audit.check()
    finally:
        dispose(ctx)
    return {
        "bytes_offloaded": [s.get("bytes_offloaded", 0) for s in got.stats],
        "tensors_offloaded": [s.get("tensors_offloaded", 0) for s in got.stats],
        "bytes_kept_tail": [s.get("bytes_kept_tail", 0) for s in got.stats],
        "pinned_bytes": [s.get("pinned_bytes", 0) for s in got.stats],
        "packed_by_device": dict(audit.packed),
    }


def run_reload_case(arch: str, device="cuda", size: dict | None = None, prepare=lambda ctx: ctx, **ctx_options) -> dict:
    """Three steps of `arch` with non-reentrant checkpointing, with and without offloading; asserts bitwise equality
    and that the last step reloaded every copy ahead of need (no prefetch miss). `prepare` takes the context before its
    first step (the CPU suite gives it stand-in streams). Returns the last step's statistics."""
    size = size or {}
    batch = make_batch(arch, device=device, **{k: size[k] for k in ("seq", "vocab") if k in size})
    ref = run_steps(build_model(arch, device=device, ckpt="nonreentrant", **size), batch, steps=3, device=device)
    model = build_model(arch, device=device, ckpt="nonreentrant", **size)
    ctx = prepare(make_ctx(model, **ctx_options))
    try:
        got = run_steps(model, batch, steps=3, ctx=ctx, device=device)
    finally:
        dispose(ctx)
    last = got.stats[-1]
    assert_bitwise_equal(ref, got, arch)
    assert last["tensors_offloaded"] > 0 and last["prefetch_hits"] > 0 and last["prefetch_misses"] == 0, last
    return last


def reference_is_reproducible(case: Case, device="cuda") -> bool:
    """True when two reference runs of ``case`` are bitwise equal (used to skip kernels that are
    nondeterministic on this device, e.g. some SDPA backward kernels)."""
    kw = dict(dtype=case.dtype, device=device, ckpt=case.ckpt, lora=case.lora, attn=case.attn)
    batch = make_batch(case.arch, device=device)
    a = run_steps(build_model(case.arch, **kw), batch, steps=case.steps, span=case.span, device=device)
    b = run_steps(build_model(case.arch, **kw), batch, steps=case.steps, span=case.span, device=device)
    try:
        assert_bitwise_equal(a, b)
        return True
    except AssertionError:
        return False


def forward_backward(model, batch: dict, ctx=None, span: str = "fwd") -> torch.Tensor:
    """One forward and backward, the context (if any) around the forward only (``"fwd"``, Trainer.compute_loss)
    or around both (``"fwd_bwd"``, TRL's training_step). Returns the loss."""
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = model(**batch, use_cache=False).loss
        if span == "fwd_bwd":
            loss.backward()
    if span == "fwd":
        loss.backward()
    return loss


def peak_step_memory(model, batch, *, ctx=None, span="fwd", warmup: int = 2, device="cuda") -> dict:
    """Peak memory of one training step (forward + backward, no optimizer) after ``warmup`` steps.

    Two by default: a context's second step is the one its peak watch measures (`hf_offload.peak`), resetting the
    device's counter at each of the step's phases, so that the counter read after that step holds its last phase's
    peak only (with one warm-up step, a context's peak read 597 MiB where the step's was 1,447)."""

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        forward_backward(model, batch, ctx, span)

    for _ in range(warmup):
        step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    out = {"peak_bytes": peak, "resident_bytes": before, "step_peak_over_resident": peak - before}
    if ctx is not None:
        st = ctx.get_stats()
        out.update(
            {
                k: st.get(k)
                for k in ("bytes_offloaded", "tensors_offloaded", "bytes_kept_tail", "pinned_bytes", "compute_wait_s")
            }
        )
    model.zero_grad(set_to_none=True)
    return out


def move_to(obj, device):
    """Moves every tensor inside nested tuples/lists/dicts to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        t = [move_to(o, device) for o in obj]
        return type(obj)(t) if not hasattr(obj, "_fields") else type(obj)(*t)
    if isinstance(obj, dict):
        return {k: move_to(v, device) for k, v in obj.items()}
    return obj


def split_across_devices(model, devices: list[str]) -> None:
    """Splits a decoder-only HF model by hand: embeddings and the first half of the layers on devices[0], the
    rest of the layers, the final norm and the head on devices[1]. Forward pre-hooks move each moved
    module's inputs to its device (what accelerate's dispatch does for device_map='auto')."""
    base = model.model
    layers = base.layers
    half = len(layers) // 2
    second = [*layers[half:], base.norm, model.lm_head]
    model.to(devices[0])
    for m in second:
        m.to(devices[1])
        m.register_forward_pre_hook(
            lambda mod, args, kwargs, _d=devices[1]: (move_to(args, _d), move_to(kwargs, _d)), with_kwargs=True
        )
