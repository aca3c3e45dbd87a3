"""The sequence-tiled decoder layer on CPU: losses and gradients within a measured tolerance of the untiled model for
seven families (eager and SDPA), LoRA on every linear layer, head groups, batches, bitwise equal when nothing is
tiled, dropout replayed, autocast, the offloading engine with and without checkpointing, errors, and the bytes per
token alive at the backward's peak.

Tolerances, as the largest |tiled - untiled| over the largest |untiled| of each tensor (loss, input gradient, every
parameter gradient), 2 x 37 tokens in chunks of 8 positions of both sequences (a ragged last chunk of 5), 2 layers,
measured with torch 2.13 and transformers 5.24 on CPU:

* fp32: 3.5e-7 to 6.0e-7 over llama, mistral, qwen2, qwen3, gemma2, phi3 and qwen3_moe with eager and SDPA
  attention, a few fp32 epsilons (1.2e-7): the order of a sum over 74 tokens; with LoRA on every linear layer (llama,
  gemma2, phi3) at most 7.6e-7. Asserted: 1e-5, as for the tiled MLP, over 10x the measurement and still 10^3-10^4
  below what a bug gives (a chunk lost or counted twice moves a weight gradient by about a fifth of itself here).
* bf16: 5.8e-3 to 7.6e-3, under one bf16 epsilon (7.8e-3): each chunk's weight gradient is rounded to bf16 before
  the fp32 sum. Asserted: 2e-2.
* fp32 weights under bf16 autocast: 3.8e-3, where autocast itself moves the untiled step by 1.9e-2. Asserted: at most
  twice autocast's own change.

The bytes per token alive at the peak of one layer's backward, sequence-long tensors counted under a dispatch mode
(benchmarks/tiled_layer_memory.py): at the 8B layer's shape divided by 16 in every width, bf16, 300 tokens, 2,544
tiled (the module's count, 2,528, and one head group's softmax statistics, 16) against 9,636 untiled under full
checkpointing with the tiled MLP. At the 8B shape itself, in fp32 (this CPU's bf16 matrix products are 300x slower),
320 tokens: 80,912 tiled, the count (79 KiB) and the statistics again, so 39.5 KiB in bf16; 153 KiB untiled.
"""

from __future__ import annotations

import copy
import sys
import threading
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import transformers
from step_comparisons import assert_bitwise, max_difference, relative_difference, step
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from hf_offload import get_act_offloading_ctx_manager
from hf_offload.model import find_decoder_layers
from hf_offload.tiled.apply import TiledLayerHandle, apply_tiled_layer
from hf_offload.tiled.integration import layer_bytes_per_token
from hf_offload.tiled.layer_op import MAX_HEAD_GROUPS, backward_bytes_per_token, forward_bytes_per_token

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import tiled_layer_memory  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE, LAYERS = 128, 64, 96, 2
BATCH, SEQ = 2, 37
TOKENS_PER_CHUNK = 16  # 8 positions of each of the 2 sequences
CHUNKS = [16, 16, 16, 16, 10]  # tokens per chunk: 4 x 8 positions, then 5, of both sequences
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 16}),  # a window shorter than the sequence
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),  # q/k norms; its default head_dim is 128
    # Soft-capped attention and logits, four norms per layer, a sliding window on every other layer; no SDPA.
    "gemma2": (transformers.Gemma2Config, {"head_dim": 16, "sliding_window": 16}),
    "phi3": (transformers.Phi3Config, {}),  # one fused qkv_proj
    # A mixture of experts for the MLP (still per token), with q/k norms.
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    ),
}
CASES = [(family, attn) for family in FAMILIES for attn in ("eager", "sdpa") if (family, attn) != ("gemma2", "sdpa")]


def tiny(family: str, dtype: torch.dtype = torch.float32, attn: str = "eager", **extra) -> transformers.PreTrainedModel:
    """A random-weight causal LM of `family`; the same weights at every call."""
    config_class, family_extra = FAMILIES[family]
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  attn_implementation=attn, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    config = config_class(**{**fields, **family_extra, **extra})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).train()


def batch(model: nn.Module, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Input embeddings (a leaf, so the step has an input gradient) and labels."""
    ids = torch.randint(3, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(1))
    return model.get_input_embeddings()(ids).detach(), ids


def assert_baseline_repeats(model, embeds, labels, **kwargs):
    """A comparison is evidence only when the untiled step repeats itself bitwise."""
    ref = step(model, embeds, labels, **kwargs)
    assert_bitwise(step(model, embeds, labels, **kwargs), ref)
    return ref


def layers_of(model: nn.Module) -> list[nn.Module]:
    return [layer for _, layer in find_decoder_layers(model)]


class CallLog:
    """Per decoder layer, the calls of its attention module (a harvest or an answer each, when tiled) and of its
    `o_proj` (answers only): the tokens each got, and whether grad was on (forward: off when tiled; backward: on)."""

    def __init__(self, model: nn.Module) -> None:
        self.attention: list[tuple[int, int, bool]] = []
        self.o_proj: list[tuple[int, int, bool, torch.dtype]] = []
        self._handles = []
        for i, layer in enumerate(layers_of(model)):
            self._handles.append(layer.self_attn.register_forward_pre_hook(self._attention_hook(i), with_kwargs=True))
            self._handles.append(layer.self_attn.o_proj.register_forward_pre_hook(self._o_proj_hook(i)))

    def _attention_hook(self, layer: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.attention.append((layer, hidden.shape[:-1].numel(), torch.is_grad_enabled()))

        return hook

    def _o_proj_hook(self, layer: int):
        def hook(module, args):
            x = args[0]
            self.o_proj.append((layer, x.shape[:-1].numel(), torch.is_grad_enabled(), x.dtype))

        return hook

    def answers(self, layer: int, grad: bool) -> list[int]:
        return [n for i, n, g, _ in self.o_proj if i == layer and g == grad]

    def attention_calls(self, layer: int) -> int:
        return sum(1 for i, _, _ in self.attention if i == layer)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def tiled_step(model, embeds, labels, tokens_per_chunk: int = TOKENS_PER_CHUNK, **kwargs):
    """One step with every layer tiled, and the calls it made."""
    with apply_tiled_layer(model, tokens_per_chunk):
        log = CallLog(model)
        try:
            return step(model, embeds, labels, **kwargs), log
        finally:
            log.remove()


# --------------------------------------------------------------------------------------------------------------------
# Gradients against the untiled model
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family,attn", CASES)
def test_tiled_gradients_match_untiled(family, attn, dtype):
    model = tiny(family, dtype, attn)
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    got, log = tiled_step(model, embeds, labels)
    difference, where = max_difference(got, ref)
    print(f"[tiled layer] {family} {attn} {dtype}: max relative difference {difference:.3g} ({where})")
    # Really tiled: each layer's part after attention ran chunk by chunk without grad in forward, and with grad in
    # backward; attention's module ran a harvest and an answer per chunk in forward, and in backward a harvest
    # (phase 1), an answer (3), a harvest per head group (4, two groups of one key/value head here) and a harvest (5).
    for layer in range(LAYERS):
        assert log.answers(layer, grad=False) == CHUNKS
        assert log.answers(layer, grad=True) == CHUNKS
        assert log.attention_calls(layer) == (2 + 3 + 2) * len(CHUNKS)
    # Every parameter was compared (the input embeddings get none from inputs_embeds, unless tied to the head).
    assert {name for name, p in model.named_parameters() if "embed_tokens" not in name} <= set(ref[2])
    assert difference <= TOLERANCE[dtype], f"{family} {attn} {dtype}: {where} differs by {difference:.3g}"


def test_attention_interface_is_ours_only_during_chunk_runs_and_on_their_thread():
    """transformers' `AttentionInterface.get_interface` is replaced only while a chunk runs, and answers the real
    function to any other thread meanwhile."""
    real = AttentionInterface.__dict__["get_interface"]
    model = tiny("llama", attn="sdpa")
    seen = []

    def other_thread_looks_up(module, args):
        if not seen:
            assert AttentionInterface.__dict__["get_interface"] is not real  # a chunk is running
            lookup = threading.Thread(target=lambda: seen.append(ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)))
            lookup.start()
            lookup.join()

    hook = layers_of(model)[0].self_attn.q_proj.register_forward_pre_hook(other_thread_looks_up)
    tiled_step(model, *batch(model))
    hook.remove()
    assert seen == [sdpa_attention_forward]
    assert AttentionInterface.__dict__["get_interface"] is real


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 4), (6, 3), (10, 10)], ids=["mqa", "mha", "gqa", "mha-10"])
def test_head_groups(heads, kv_heads):
    """Attention runs by groups of key/value heads with their query heads: one group per key/value head up to
    MAX_HEAD_GROUPS, then groups of unequal size (10 heads in 8 groups); one group, whose output's chunk rows are views
    of it, for multi-query attention."""
    model = tiny("llama", attn="sdpa", hidden_size=16 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads)
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    got, log = tiled_step(model, embeds, labels)
    groups = min(kv_heads, MAX_HEAD_GROUPS)
    assert log.attention_calls(0) == (2 + 3 + groups) * len(CHUNKS)
    difference, where = max_difference(got, ref)
    assert difference <= TOLERANCE[torch.float32], f"{where} differs by {difference:.3g}"


@pytest.mark.parametrize("size,tokens_per_chunk", [(1, 20), (3, 20)], ids=["batch-1", "batch-3"])
def test_batch_sizes(size, tokens_per_chunk):
    """A chunk is tokens_per_chunk // batch positions of every sequence: 20 of one sequence, 6 of three."""
    model = tiny("qwen2", attn="sdpa")
    embeds, labels = batch(model, size)
    ref = assert_baseline_repeats(model, embeds, labels)
    got, log = tiled_step(model, embeds, labels, tokens_per_chunk)
    positions = tokens_per_chunk // size
    expected = [size * min(positions, SEQ - start) for start in range(0, SEQ, positions)]
    assert log.answers(0, grad=True) == expected
    difference, where = max_difference(got, ref)
    assert difference <= TOLERANCE[torch.float32], f"{where} differs by {difference:.3g}"


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
@pytest.mark.parametrize("tokens_per_chunk", [BATCH * SEQ, 1000])
def test_chunk_at_least_the_tokens_is_bitwise_untiled(family, tokens_per_chunk):
    model = tiny(family)
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    got, log = tiled_step(model, embeds, labels, tokens_per_chunk)
    assert_bitwise(got, ref)
    # The layer was simply called: once per layer, on all tokens, with grad, and no recompute in backward.
    assert [n for _, n, _, _ in log.o_proj] == [BATCH * SEQ] * LAYERS
    assert all(grad for _, _, grad, _ in log.o_proj)


# --------------------------------------------------------------------------------------------------------------------
# LoRA, dropout, autocast, caches
# --------------------------------------------------------------------------------------------------------------------


def lora(model: nn.Module, dropout: float = 0.0) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    # init_lora_weights=False: B random too, so that A's gradient is not zero (it compares trivially when B = 0).
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", init_lora_weights=False)
    with warnings.catch_warnings():  # peft reads `is_gradient_checkpointing`, deprecated by transformers 5.2x
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, config)


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_lora_on_every_linear_layer(family):
    from peft.tuners.lora import LoraLayer

    model = lora(tiny(family, attn="eager"))
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    attention = layers_of(model)[0].self_attn
    projections = ["qkv_proj", "o_proj"] if family == "phi3" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert all(isinstance(getattr(attention, name), LoraLayer) for name in projections)
    got, log = tiled_step(model, embeds, labels)  # the PeftModel: unwrapped to find the layers
    assert log.answers(0, grad=False) == CHUNKS
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert set(got[2]) == trainable  # only adapters got gradients, all of them, before and after attention
    assert all(got[2][name].abs().sum() > 0 for name in trainable)
    difference, where = max_difference(got, ref)
    print(f"[tiled layer] {family} + LoRA fp32: max relative difference {difference:.3g} ({where})")
    assert difference <= TOLERANCE[torch.float32], f"{where} differs by {difference:.3g}"


def test_dropout_is_replayed_in_backward():
    """Attention dropout and LoRA dropout on every linear layer: each chunk run and each head group's attention in
    backward must draw what the forward drew. With the random state fixed before each forward, the layer is a
    function of its input alone, and the tiled backward must give that function's derivative: checked in fp64 along
    random directions against central differences. Measured: within 7.4e-5 (the untiled layer: 2.1e-5; the
    differences are rounded in fp32 by Llama's norms, which compute in fp32); without the replay, 0.07 to 1.2."""
    model = lora(tiny("llama", attn="sdpa", hidden_size=16, intermediate_size=24, head_dim=4, num_hidden_layers=1,
                      attention_dropout=0.3), dropout=0.3).double()  # fmt: skip
    layer = layers_of(model)[0]
    x = torch.randn(1, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(12)[None]
    rotary = model.get_base_model().model.rotary_emb(x, positions)

    def seeded_layer(hidden: torch.Tensor, seed: int = 5) -> torch.Tensor:
        torch.manual_seed(seed)
        return layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions)

    directions = torch.Generator().manual_seed(7)
    with apply_tiled_layer(model, 4):  # 3 chunks
        log = CallLog(model)
        assert torch.equal(seeded_layer(x), seeded_layer(x))  # the same draws for the same seed...
        assert not torch.equal(seeded_layer(x, seed=6), seeded_layer(x))  # ... and others for another
        for _ in range(3):
            v, w = (torch.randn(x.shape, generator=directions, dtype=torch.float64) for _ in range(2))
            leaf = x.clone().requires_grad_()
            (gradient,) = torch.autograd.grad((seeded_layer(leaf) * w).sum(), leaf)
            eps = 1e-3
            difference = ((seeded_layer(x + eps * v) - seeded_layer(x - eps * v)) * w).sum() / (2 * eps)
            error = ((gradient * v).sum() - difference).abs() / difference.abs()
            assert error <= 1e-3, f"the tiled backward is not the forward's derivative: {error:.3g}"
        log.remove()
    assert log.answers(0, grad=True) == [4, 4, 4] * 3


def test_autocast_is_replayed_in_the_recompute():
    """Under bf16 autocast the forward computes in bf16; backward's recompute, outside the user's autocast block,
    must too (or it would compute other numbers, in fp32, with twice the memory)."""
    model = tiny("qwen3", attn="sdpa")
    embeds, labels = batch(model)

    def autocast_step(enabled: bool = True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            model.zero_grad(set_to_none=True)
            x = embeds.clone().requires_grad_()
            loss = model(inputs_embeds=x, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = autocast_step()
    rounding = max_difference(ref, autocast_step(enabled=False))[0]  # what bf16 autocast itself changes
    with apply_tiled_layer(model, TOKENS_PER_CHUNK):
        log = CallLog(model)
        got = autocast_step()
        log.remove()
    assert log.answers(0, grad=True) == CHUNKS
    assert {dtype for _, _, grad, dtype in log.o_proj if grad} == {torch.bfloat16}
    difference, where = max_difference(got, ref)
    print(f"[tiled layer] qwen3 fp32 + bf16 autocast: {difference:.3g} ({where}); autocast itself: {rounding:.3g}")
    assert difference <= 2 * rounding, f"{where} differs by {difference:.3g}"


def test_training_drops_the_cache_and_generation_keeps_it_untiled():
    model = tiny("llama", attn="sdpa")
    embeds, labels = batch(model)
    ref = step(model, embeds, labels)
    # Training with transformers' default use_cache=True: a cache nobody reads, dropped with a warning, as
    # checkpointing drops it; the step is tiled.
    with pytest.warns(UserWarning, match="a tiled layer does not fill a KV cache"):
        got, log = tiled_step(model, embeds, labels, use_cache=True)
    assert log.answers(0, grad=True) == CHUNKS
    assert max_difference(got, ref)[0] <= TOLERANCE[torch.float32]
    # Generation (eval, no grad) fills its cache: the layers then run untiled, bitwise.
    model.eval()
    with torch.no_grad():
        untiled = model(inputs_embeds=embeds, use_cache=True)
        with apply_tiled_layer(model, TOKENS_PER_CHUNK):
            log = CallLog(model)
            tiled = model(inputs_embeds=embeds, use_cache=True)
            log.remove()
    assert torch.equal(tiled.logits, untiled.logits)
    cache = getattr(tiled, "cache", None) or tiled.past_key_values  # transformers 5.24 renamed it
    assert cache.get_seq_length() == SEQ
    assert [n for _, n, _, _ in log.o_proj] == [BATCH * SEQ] * LAYERS


def test_a_cache_passed_by_position_is_dropped_too():
    """GPT-2 passes its cache to each block as the second argument, by position: a tiled layer drops it as it drops
    one passed by name, or each chunk's keys would hold the earlier chunks' too (the step raised on their shapes)."""
    dropout_off = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # tiling draws dropout masks per chunk
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=128,
                                     attn_implementation="sdpa", **dropout_off)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    embeds, labels = batch(model)
    ref = step(model, embeds, labels)
    with apply_tiled_layer(model, TOKENS_PER_CHUNK):
        with pytest.warns(UserWarning, match="a tiled layer does not fill a KV cache; setting argument 1 to None"):
            got = step(model, embeds, labels, use_cache=True)
    assert max_difference(got, ref)[0] <= TOLERANCE[torch.float32]


def test_no_grad_forward_is_tiled_and_close():
    model = tiny("phi3", attn="sdpa")
    embeds, labels = batch(model)
    with torch.no_grad():
        ref = model(inputs_embeds=embeds, labels=labels, use_cache=False).loss
        with apply_tiled_layer(model, TOKENS_PER_CHUNK):
            log = CallLog(model)
            got = model(inputs_embeds=embeds, labels=labels, use_cache=False).loss
            log.remove()
    assert log.answers(0, grad=False) == CHUNKS
    assert relative_difference(got, ref) <= 1e-6


# --------------------------------------------------------------------------------------------------------------------
# The offloading engine
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [True, False], ids=["nonreentrant", "no-checkpointing"])
@pytest.mark.parametrize("span", ["fwd", "fwd_bwd"])
def test_with_the_offloading_engine(span, checkpointing):
    """Tiled layers with hf-offload's engine (CPU test mode), the model's checkpointing on or off: bitwise equal to
    the same tiled model without the engine, which copies bytes only. A tiled layer is its own checkpoint (the layer's
    checkpointing is not used): the engine sees what the op saves, each layer's input, and offloads it. With the
    context spanning backward, the op's recompute runs inside it (its tensors stay put)."""
    model = tiny("llama", attn="sdpa")
    if checkpointing:
        with warnings.catch_warnings():  # transformers 5.2x renamed gradient_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert all(layer.gradient_checkpointing for layer in layers_of(model))
    embeds, labels = batch(model)
    untiled = step(model, embeds, labels)
    handle = apply_tiled_layer(model, TOKENS_PER_CHUNK)
    ref = assert_baseline_repeats(model, embeds, labels)
    assert max_difference(ref, untiled)[0] <= TOLERANCE[torch.float32]
    context = get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0, keep_tail=False)
    log = CallLog(model)
    try:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(2)
            x = embeds.clone().requires_grad_()
            with context:
                loss = model(inputs_embeds=x, labels=labels, use_cache=False).loss
                if span == "fwd_bwd":
                    loss.backward()
            if span == "fwd":
                loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            assert_bitwise((loss.detach(), x.grad, grads), ref)
            stats = context.get_stats()
            assert stats.get("bytes_offloaded", 0) > 0
            # The op's recompute runs under NoOpManager: the engine's pack hook sees none of its saved tensors.
            assert stats.get("tensors_kept_in_backward", 0) == 0
    finally:
        log.remove()
        context.remove_hooks()
        handle.remove()
    # No checkpoint around the tiled layer or inside its chunks' recompute: each chunk ran once in backward.
    assert log.answers(0, grad=True) == CHUNKS * 2
    assert all(layer.gradient_checkpointing == checkpointing for layer in layers_of(model))


def test_the_op_saves_only_the_layer_input():
    """What a tiled layer keeps from its forward for its backward: its input, as a checkpoint keeps it, and its
    trainable parameters (by reference, as every layer does; the engine leaves parameters in place)."""
    model = tiny("qwen3", attn="sdpa")
    layer = layers_of(model)[0]
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    positions = torch.arange(SEQ)[None]
    rotary = model.model.rotary_emb(x, positions)
    saved = []
    with apply_tiled_layer(model, TOKENS_PER_CHUNK):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            layer(x, attention_mask=None, position_embeddings=rotary, position_ids=positions)
    assert [id(t) for t in saved] == [id(x)] + [id(p) for p in layer.parameters() if p.requires_grad]


def test_backward_releases_the_call_the_loss_would_keep_until_the_next_forward():
    """A training loop's `loss` lives until the next step's forward has run (`loss = model(...).loss`), and with it the
    graph's nodes: a tiled layer's node held the layer's call, its mask and rotary tables, past backward, into the next
    forward and in the memory held between steps (on an H200, a 32 MiB mask of the previous step still allocated as
    the next began). Backward releases them; a second backward through the same graph is refused, clearly."""
    model = tiny("llama", attn="eager")
    embeds, labels = batch(model)
    layer = layers_of(model)[0]
    seen = []
    layer.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs), with_kwargs=True)
    with apply_tiled_layer(model, TOKENS_PER_CHUNK):
        loss = model(inputs_embeds=embeds, labels=labels, attention_mask=torch.ones_like(labels), use_cache=False).loss
        mask, rotary = seen[0]["attention_mask"], seen[0]["position_embeddings"][0]
        assert isinstance(mask, torch.Tensor)
        held = [weakref.ref(mask), weakref.ref(rotary)]
        seen.clear()
        del mask, rotary
        loss.backward(retain_graph=True)
        assert [ref() for ref in held] == [None, None], "the mask and rotary tables outlived backward"
        with pytest.raises(RuntimeError, match="second time"):
            loss.backward()


# --------------------------------------------------------------------------------------------------------------------
# The model integration
# --------------------------------------------------------------------------------------------------------------------


def test_remove_restores_the_model_exactly():
    model = tiny("llama")
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    handle = apply_tiled_layer(model, TOKENS_PER_CHUNK)
    assert isinstance(handle, TiledLayerHandle)
    assert handle.names == [f"model.layers.{i}" for i in range(LAYERS)]
    assert all("forward" in layer.__dict__ for layer in layers_of(model))
    tiled = step(model, embeds, labels)
    assert not torch.equal(tiled[2]["model.layers.0.mlp.down_proj.weight"],
                           ref[2]["model.layers.0.mlp.down_proj.weight"])  # fmt: skip
    handle.remove()
    assert all("forward" not in layer.__dict__ for layer in layers_of(model))  # the class's forward again
    assert_bitwise(step(model, embeds, labels), ref)
    handle.remove()  # idempotent
    assert len(handle) == 0
    with apply_tiled_layer(model, TOKENS_PER_CHUNK):  # and tiled again after removal
        assert max_difference(step(model, embeds, labels), tiled)[0] == 0.0
    assert_bitwise(step(model, embeds, labels), ref)


def test_layers_selects_decoder_layers_and_tiling_twice_is_refused():
    model = tiny("qwen2", num_hidden_layers=3)
    handle = apply_tiled_layer(model, TOKENS_PER_CHUNK, layers=[2, 0, -1])  # -1 is 2 again
    assert handle.names == ["model.layers.2", "model.layers.0"]
    assert ["forward" in layer.__dict__ for layer in layers_of(model)] == [True, False, True]
    log = CallLog(model)
    step(model, *batch(model))
    log.remove()
    assert log.answers(0, grad=False) == CHUNKS and log.answers(1, grad=False) == []
    assert log.answers(1, grad=True) == [BATCH * SEQ]
    with pytest.raises(ValueError, match=r"model.layers.2 is already tiled"):
        apply_tiled_layer(model, TOKENS_PER_CHUNK, layers=[1, 2])
    assert "forward" not in layers_of(model)[1].__dict__  # checked before anything changed
    handle.remove()
    assert apply_tiled_layer(model, TOKENS_PER_CHUNK, layers=[]).names == []


def test_deepcopy_of_a_tiled_model_tiles_its_own_layers():
    model = tiny("llama")
    embeds, labels = batch(model)
    with apply_tiled_layer(model, TOKENS_PER_CHUNK):
        original = step(model, embeds, labels)
        copied = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    assert "forward" in layers_of(copied)[0].__dict__ and "forward" not in layers_of(model)[0].__dict__
    assert layers_of(copied)[0].forward.layer is layers_of(copied)[0]
    got = step(copied, embeds, labels)
    assert all(p.grad is None for p in model.parameters())  # the copy's gradients went to the copy
    assert max_difference(got, original)[0] == 0.0


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -8, 2.5, "8", None, True])
def test_tokens_per_chunk_must_be_a_positive_int(bad):
    model = tiny("llama")
    with pytest.raises(ValueError, match="tokens_per_chunk must be a positive int"):
        apply_tiled_layer(model, bad)
    assert all("forward" not in layer.__dict__ for layer in layers_of(model))


@pytest.mark.parametrize("layers", [[2], [-3], [0, "1"], [True]])
def test_bad_layer_indices(layers):
    with pytest.raises(ValueError, match="layers must name decoder layers by index, from 0 to 1"):
        apply_tiled_layer(tiny("llama"), TOKENS_PER_CHUNK, layers=layers)


def test_model_without_decoder_layers():
    with pytest.raises(ValueError, match="Sequential has no decoder layers"):
        apply_tiled_layer(nn.Sequential(nn.Linear(4, 4)), TOKENS_PER_CHUNK)


def test_attention_that_does_not_call_the_interface_is_refused_at_apply():
    """Bloom's attention computes its own (ALiBi) attention instead of looking a function up in transformers'
    AttentionInterface: there is no call to cut the layer at."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                                                                       n_layer=2, n_head=4))  # fmt: skip
    expected = (
        r"decoder layer 0 \('transformer.h.0', BloomBlock\) has no module that looks its attention function "
        r"up in transformers' AttentionInterface"
    )
    with pytest.raises(ValueError, match=expected):
        apply_tiled_layer(model, TOKENS_PER_CHUNK)
    assert all("forward" not in layer.__dict__ for layer in layers_of(model))


def test_recorded_router_logits_are_refused():
    """A mixture of experts recording its router logits for the auxiliary loss would record each chunk's, without
    grad in the forward: the loss would train no router. Refused, naming what is recorded."""
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        num_local_experts=2, num_experts_per_tok=1)  # fmt: skip
    model = transformers.MixtralForCausalLM(config).train()
    embeds, labels = batch(model)
    with apply_tiled_layer(model, TOKENS_PER_CHUNK):
        step(model, embeds, labels)  # without the auxiliary loss: tiled, and fine
        with pytest.raises(ValueError, match="records router_logits inside its layers"):
            step(model, embeds, labels, output_router_logits=True)


def test_learned_tensor_passed_to_attention_is_refused():
    """gpt-oss passes its attention sinks (a parameter per head) to the attention function: head groups cannot take
    their share of an argument they know nothing of."""
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=2, num_experts_per_tok=1, sliding_window=16,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GptOssForCausalLM(config).train()
    with apply_tiled_layer(model, TOKENS_PER_CHUNK):
        with pytest.raises(ValueError, match=r"GptOssAttention passes a learned tensor \('s_aux'\)"):
            step(model, *batch(model))


def test_per_token_argument_it_cannot_cut_is_refused():
    model = tiny("llama", attn="sdpa")
    layer = layers_of(model)[0]
    x = torch.randn(BATCH, SEQ, HIDDEN)
    positions = torch.arange(SEQ)[None]
    rotary = model.model.rotary_emb(x, positions)
    with apply_tiled_layer(model, TOKENS_PER_CHUNK):
        with pytest.raises(ValueError, match=r"LlamaDecoderLayer got token_scores of shape \(2, 37\), a dimension "
                                             r"as long as the sequence \(37\)"):  # fmt: skip
            layer(x, position_embeddings=rotary, position_ids=positions, token_scores=torch.ones(BATCH, SEQ))


# --------------------------------------------------------------------------------------------------------------------
# The bytes per token alive at the peak of backward
# --------------------------------------------------------------------------------------------------------------------


def test_backward_peak_bytes_per_token():
    """One layer's backward, the 8B shape divided by 16 in every width, 300 tokens in chunks of 64: the sequence-long
    bytes alive at its peak, counted under a dispatch mode, are the module's count (`backward_bytes_per_token`), plus
    one head group's softmax statistics (4 heads x 4 bytes per token); under a third of the untiled layer's under full
    checkpointing with the tiled MLP. At the 8B shape the count is 39.5 KiB per token, under the 48 that
    test_gpu_tiled_layer.py holds the GPU to."""
    tokens, chunk = 300, 64
    shape = tiled_layer_memory.SHAPES["8b/16"]
    model = tiled_layer_memory.build_model("8b/16", "cpu")
    tiled = tiled_layer_memory.measure(model, "tiled", tokens, chunk)
    untiled = tiled_layer_memory.measure(model, "checkpoint+tiled-mlp", tokens, chunk)
    count = backward_bytes_per_token(shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], 2)
    statistics = (shape["heads"] // MAX_HEAD_GROUPS) * 4
    measured = tiled["sequence_peak_bytes"] / tokens
    print(f"[tiled layer] 8b/16 bytes per token at backward's peak: tiled {measured:.1f} (count {count}), "
          f"untiled under checkpointing + tiled MLP {untiled['sequence_peak_bytes'] / tokens:.1f}")  # fmt: skip
    assert count <= measured <= count + statistics
    assert 3 * tiled["sequence_peak_bytes"] <= untiled["sequence_peak_bytes"]
    assert backward_bytes_per_token(4096, 32, 8, 128, 2) == 39.5 * 1024


def test_forward_peak_bytes_per_token():
    """What a tiled layer's forward holds at once besides its input, for the planner: the sequence-long bytes alive
    over the forward, counted under a dispatch mode (the input, made before, aside), are `forward_bytes_per_token`,
    plus one head group's softmax statistics; `layer_bytes_per_token` reads both counts from the layer's config."""
    tokens, chunk = 300, 64
    shape = tiled_layer_memory.SHAPES["8b/16"]
    model = tiled_layer_memory.build_model("8b/16", "cpu")
    layer = model.model.layers[0]
    positions = torch.arange(tokens)[None]
    x = torch.randn(1, tokens, shape["hidden"], dtype=torch.bfloat16).requires_grad_()
    rotary = model.model.rotary_emb(x, positions)
    exclude = {tiled_layer_memory.StorageWeakRef(p.untyped_storage()).cdata for p in model.parameters()}
    meter = tiled_layer_memory.LiveBytes(tokens, exclude)
    with apply_tiled_layer(model, chunk), meter:
        meter.reset_peak()
        y = layer(x, attention_mask=None, position_embeddings=rotary, position_ids=positions)
    del y
    count = forward_bytes_per_token(shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], 2)
    statistics = (shape["heads"] // MAX_HEAD_GROUPS) * 4
    assert count <= meter.sequence_peak / tokens <= count + statistics
    assert forward_bytes_per_token(4096, 32, 8, 128, 2) == 16 * 1024  # attention's output and the layer's: A + X
    counts = (count, backward_bytes_per_token(shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], 2))
    assert layer_bytes_per_token(layer, 2) == counts
    assert layer_bytes_per_token(nn.Linear(2, 2), 2) is None  # no attention to read the shape of


def test_call_op_runs_the_op_through_the_callers_function():
    """The planner's layer actions run a kept-input layer's op inside a region of the engine: `call_op(function,
    *args)` gets the op and its arguments, and what it returns is the layer's output."""
    model = tiny("llama", attn="sdpa")
    embeds, labels = batch(model)
    calls = []

    def call_op(function, *args):
        calls.append(len(args))
        return function(*args)

    with apply_tiled_layer(model, TOKENS_PER_CHUNK):
        ref = step(model, embeds, labels)
    with apply_tiled_layer(model, TOKENS_PER_CHUNK, call_op=call_op):
        got = step(model, embeds, labels)
    assert len(calls) == LAYERS
    assert_bitwise(got, ref)
