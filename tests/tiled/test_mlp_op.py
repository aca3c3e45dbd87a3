"""The sequence-tiled MLP on CPU: gradients within a measured tolerance of the untiled model for six families, bitwise
equal when nothing is tiled or the tiling is removed, LoRA, dropout, autocast, the offloading engine, errors, and
one chunk's intermediates at a time.

Tolerances, as the largest |tiled - untiled| over the largest |untiled| of each tensor (loss, input gradient, every
parameter gradient), 2 x 37 tokens in chunks of 8 (a ragged last chunk of 2), measured with torch 2.13 on CPU:

* fp32: at most 4.5e-7 over the six families (Phi3 the largest, Llama 3.3e-7), a few fp32 epsilons (1.2e-7): the
  order of a sum over 74 tokens. Asserted: 1e-5, 20x the measurement for other BLAS builds, still 10^3-10^4 below
  what a bug gives (a chunk lost or counted twice moves a weight gradient by about 1/9 of itself).
* bf16: at most 6.5e-3 (Gemma), under one bf16 epsilon (7.8e-3): each chunk's weight gradient is rounded to bf16
  before the (fp32) sum. Asserted: 2e-2.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from step_comparisons import assert_bitwise, max_difference, relative_difference, step
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_offload import get_act_offloading_ctx_manager
from hf_offload.model import find_decoder_layers
from hf_offload.tiled.apply import TiledMLPHandle, apply_tiled_mlp
from hf_offload.tiled.mlp_op import tiled_mlp

VOCAB, HIDDEN, INTERMEDIATE, LAYERS = 128, 64, 96, 2
BATCH, SEQ, CHUNK = 2, 37, 8
TOKENS = BATCH * SEQ  # 74 = 9 x 8 + 2
CHUNKS = [CHUNK] * (TOKENS // CHUNK) + [TOKENS % CHUNK]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),  # its default head_dim is 128
    "mistral": (transformers.MistralConfig, {"sliding_window": 16}),  # a window shorter than the sequence
    "gemma": (transformers.GemmaConfig, {"head_dim": 16}),  # gelu_pytorch_tanh; scales its embeddings
    "phi3": (transformers.Phi3Config, {}),  # one fused gate_up_proj, split with chunk(2, dim=-1)
}


def tiny(family: str, dtype: torch.dtype = torch.float32, **extra) -> transformers.PreTrainedModel:
    """A random-weight causal LM of `family`; the same weights at every call."""
    config_class, family_extra = FAMILIES[family]
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    config = config_class(**{**fields, **family_extra, **extra})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).train()


def batch(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Input embeddings (a leaf, so the step has an input gradient) and labels."""
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model.get_input_embeddings()(ids).detach(), ids


def mlps(model: nn.Module) -> list[nn.Module]:
    return [layer.mlp for _, layer in find_decoder_layers(model)]


class ChunkLog:
    """Records, per call of each MLP's `down_proj` (once per chunk when tiled), the tokens it got, whether grad was
    on (forward: off when tiled; backward's recompute: on) and the dtype."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: list[tuple[int, int, bool, torch.dtype]] = []
        self._handles = [mlp.down_proj.register_forward_pre_hook(self._hook(i)) for i, mlp in enumerate(mlps(model))]

    def _hook(self, layer: int):
        def hook(module, args):
            x = args[0]
            self.calls.append((layer, x.numel() // x.shape[-1], torch.is_grad_enabled(), x.dtype))

        return hook

    def tokens(self, layer: int, grad: bool) -> list[int]:
        return [n for i, n, g, _ in self.calls if i == layer and g == grad]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def assert_baseline_repeats(model, embeds, labels):
    """A comparison is evidence only when the untiled step repeats itself bitwise."""
    ref = step(model, embeds, labels)
    assert_bitwise(step(model, embeds, labels), ref)
    return ref


# --------------------------------------------------------------------------------------------------------------------
# Gradients against the untiled model
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiled_gradients_match_untiled(family, dtype):
    model = tiny(family, dtype)
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    handle = apply_tiled_mlp(model, tokens_per_chunk=CHUNK)
    log = ChunkLog(model)
    got = step(model, embeds, labels)
    log.remove()
    handle.remove()
    difference, where = max_difference(got, ref)
    print(f"[tiled mlp] {family} {dtype}: max relative difference {difference:.3g} ({where})")
    # Really tiled: each layer's MLP ran chunk by chunk without grad in forward, and again with grad in backward.
    for layer in range(LAYERS):
        assert log.tokens(layer, grad=False) == CHUNKS
        assert log.tokens(layer, grad=True) == CHUNKS
    # Every parameter was compared (the input embeddings get none from inputs_embeds, unless tied to the head).
    assert {name for name, p in model.named_parameters() if "embed_tokens" not in name} <= set(ref[2])
    assert difference <= TOLERANCE[dtype], f"{family} {dtype}: {where} differs by {difference:.3g}"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tokens_per_chunk", [TOKENS, 1000])
def test_chunk_at_least_the_tokens_is_bitwise_untiled(family, tokens_per_chunk):
    model = tiny(family)
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    with apply_tiled_mlp(model, tokens_per_chunk=tokens_per_chunk):
        log = ChunkLog(model)
        got = step(model, embeds, labels)
        log.remove()
    assert_bitwise(got, ref)
    # The MLP was simply called: once per layer, on all tokens, with grad, and no recompute in backward.
    assert [n for _, n, _, _ in log.calls] == [TOKENS] * LAYERS
    assert all(grad for _, _, grad, _ in log.calls)


def test_remove_restores_the_model_exactly():
    model = tiny("llama")
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    handle = apply_tiled_mlp(model, tokens_per_chunk=CHUNK)
    assert isinstance(handle, TiledMLPHandle)
    assert handle.names == [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    assert all("forward" in mlp.__dict__ for mlp in mlps(model))
    tiled = step(model, embeds, labels)
    assert not torch.equal(
        tiled[2]["model.layers.0.mlp.down_proj.weight"], ref[2]["model.layers.0.mlp.down_proj.weight"]
    )  # tiling changed the sums' order
    handle.remove()
    assert all("forward" not in mlp.__dict__ for mlp in mlps(model))  # the class's forward again
    assert_bitwise(step(model, embeds, labels), ref)
    handle.remove()  # idempotent
    assert len(handle) == 0
    # And a model can be tiled again after removal.
    with apply_tiled_mlp(model, tokens_per_chunk=CHUNK):
        again = step(model, embeds, labels)
    assert max_difference(again, tiled)[0] == 0.0
    assert_bitwise(step(model, embeds, labels), ref)


def test_remove_under_a_later_wrapper_switches_tiling_off():
    """When something wraps the MLP's forward after us, remove() leaves its attribute alone but stops tiling."""
    model = tiny("llama")
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    handle = apply_tiled_mlp(model, tokens_per_chunk=CHUNK)
    mlp = mlps(model)[0]
    ours = mlp.forward
    mlp.forward = lambda x: ours(x)  # e.g. accelerate's hooks, which replace `forward` the same way
    handle.remove()
    assert mlp.__dict__["forward"] is not ours
    log = ChunkLog(model)
    assert_bitwise(step(model, embeds, labels), ref)
    log.remove()
    assert log.tokens(0, grad=True) == [TOKENS]


def test_preexisting_instance_forward_is_restored():
    model = tiny("llama")
    mlp = mlps(model)[0]
    calls = []
    previous = mlp.forward

    def instance_forward(x):
        calls.append(x.shape[:-1])
        return previous(x)

    mlp.forward = instance_forward
    with apply_tiled_mlp(model, tokens_per_chunk=CHUNK, layers=[0]):
        step(model, *batch(model))
    assert calls[: len(CHUNKS)] == [(1, n) for n in CHUNKS]  # tiling runs the previous forward per chunk
    assert mlp.__dict__["forward"] is instance_forward


def test_layers_selects_decoder_layers():
    model = tiny("qwen2", num_hidden_layers=3)
    handle = apply_tiled_mlp(model, tokens_per_chunk=CHUNK, layers=[2, 0, -1])  # -1 is 2 again
    assert handle.names == ["model.layers.2.mlp", "model.layers.0.mlp"]
    assert ["forward" in mlp.__dict__ for mlp in mlps(model)] == [True, False, True]
    log = ChunkLog(model)
    step(model, *batch(model))
    log.remove()
    assert log.tokens(0, grad=False) == CHUNKS and log.tokens(1, grad=False) == []
    assert log.tokens(1, grad=True) == [TOKENS]
    handle.remove()
    assert apply_tiled_mlp(model, CHUNK, layers=[]).names == []


def test_deepcopy_of_a_tiled_model_tiles_its_own_mlp():
    model = tiny("llama")
    embeds, labels = batch(model)
    with apply_tiled_mlp(model, tokens_per_chunk=CHUNK):
        original = step(model, embeds, labels)
        copied = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    assert "forward" in mlps(copied)[0].__dict__ and "forward" not in mlps(model)[0].__dict__
    assert mlps(copied)[0].forward.module is mlps(copied)[0]
    got = step(copied, embeds, labels)
    assert all(p.grad is None for p in model.parameters())  # the copy's gradients went to the copy
    assert max_difference(got, original)[0] == 0.0


# --------------------------------------------------------------------------------------------------------------------
# LoRA, frozen parameters, inputs without grad, dropout, autocast
# --------------------------------------------------------------------------------------------------------------------


def lora(model: nn.Module, dropout: float = 0.0) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    # init_lora_weights=False: B random too, so that A's gradient is not zero (it compares trivially when B = 0).
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", init_lora_weights=False)
    with warnings.catch_warnings():  # peft reads `is_gradient_checkpointing`, deprecated by transformers 5.2x
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, config)


@pytest.mark.parametrize("family", ["llama", "gemma", "phi3"])
def test_lora_only_adapters_get_gradients(family):
    from peft.tuners.lora import LoraLayer

    model = lora(tiny(family))
    embeds, labels = batch(model)
    ref = assert_baseline_repeats(model, embeds, labels)
    handle = apply_tiled_mlp(model, tokens_per_chunk=CHUNK)  # the PeftModel: unwrapped to find the layers
    mlp = mlps(model)[0]
    projections = ["gate_up_proj", "down_proj"] if family == "phi3" else ["gate_proj", "up_proj", "down_proj"]
    assert all(isinstance(getattr(mlp, name), LoraLayer) for name in projections)
    log = ChunkLog(model)
    got = step(model, embeds, labels)
    log.remove()
    handle.remove()
    assert log.tokens(0, grad=False) == CHUNKS
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert set(got[2]) == trainable  # only adapters got gradients, all of them
    mlp_adapters = [name for name in trainable if ".mlp." in name]
    assert mlp_adapters and all(got[2][name].abs().sum() > 0 for name in mlp_adapters)
    difference, where = max_difference(got, ref)
    print(f"[tiled mlp] {family} + LoRA fp32: max relative difference {difference:.3g} ({where})")
    assert difference <= TOLERANCE[torch.float32], f"{where} differs by {difference:.3g}"


class _ChunkedWithGrad:
    """A reference MLP forward: the same chunks as the tiled one, but with grad, so backward uses the forward's own
    graph (and dropout masks) instead of a recompute."""

    def __init__(self, forward, chunk: int) -> None:
        self.forward, self.chunk = forward, chunk

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        outs = [self.forward(flat[s : s + self.chunk].unsqueeze(0)) for s in range(0, flat.shape[0], self.chunk)]
        return torch.cat(outs, dim=1).reshape(*x.shape[:-1], -1)


def test_dropout_masks_are_replayed_in_backward():
    """LoRA dropout 0.5 inside the MLPs: the backward's recompute must draw the forward's masks, chunk by chunk."""
    model = lora(tiny("llama"), dropout=0.5)
    embeds, labels = batch(model)
    # The reference: the same chunks with grad (the forward's graph, the forward's masks).
    for mlp in mlps(model):
        mlp.forward = _ChunkedWithGrad(mlp.forward, CHUNK)
    ref = assert_baseline_repeats(model, embeds, labels)
    for mlp in mlps(model):
        del mlp.forward
    untiled = step(model, embeds, labels)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with apply_tiled_mlp(model, tokens_per_chunk=CHUNK):
        got = step(model, embeds, labels)
        torch.manual_seed(123)
        model.zero_grad(set_to_none=True)
        x = embeds.clone().requires_grad_()
        loss = model(inputs_embeds=x, labels=labels, use_cache=False).loss
        after_forward = torch.get_rng_state()
        loss.backward()
        assert torch.equal(torch.get_rng_state(), after_forward)  # backward gave the RNG back as it found it
        assert not torch.equal(after_forward, before)  # (the dropout did draw)
    difference, where = max_difference(got, ref)
    print(f"[tiled mlp] LoRA dropout 0.5: max relative difference to the chunked reference {difference:.3g} ({where})")
    assert torch.equal(got[0], ref[0])  # the same draws in forward
    assert difference <= TOLERANCE[torch.float32], f"{where} differs by {difference:.3g}"
    # Other masks than the untiled model's: with dropout, tiled and untiled are different draws altogether.
    assert max_difference(got, untiled)[0] > 1e-2


def test_inputs_without_grad_and_frozen_parameters():
    model = tiny("llama")
    mlp = mlps(model)[0]
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(4))
    grad_out = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5))

    def run(x_requires_grad: bool, tiled: bool):
        mlp.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_(x_requires_grad)
        with apply_tiled_mlp(model, CHUNK, layers=[0]) if tiled else TiledMLPHandle():
            out = mlp(leaf)
        out.backward(grad_out)
        return leaf.grad, {name: p.grad for name, p in mlp.named_parameters()}

    # The input needs no gradient: only the weights get one.
    x_grad, grads = run(False, tiled=True)
    ref_x_grad, ref_grads = run(False, tiled=False)
    assert x_grad is None and ref_x_grad is None
    assert all(relative_difference(grads[n], ref_grads[n]) <= 1e-5 for n in ref_grads)
    # Frozen weights: only the input gets a gradient.
    mlp.requires_grad_(False)
    x_grad, grads = run(True, tiled=True)
    ref_x_grad, _ = run(True, tiled=False)
    assert all(g is None for g in grads.values())
    assert relative_difference(x_grad, ref_x_grad) <= 1e-5
    # Only one weight trainable: it alone is an input of the op, and gets its gradient.
    mlp.up_proj.weight.requires_grad_(True)
    x_grad, grads = run(True, tiled=True)
    ref_x_grad, ref_grads = run(True, tiled=False)
    assert [n for n, g in grads.items() if g is not None] == ["up_proj.weight"]
    assert relative_difference(grads["up_proj.weight"], ref_grads["up_proj.weight"]) <= 1e-5
    assert relative_difference(x_grad, ref_x_grad) <= 1e-5


def test_no_grad_forward_is_tiled_and_close():
    model = tiny("phi3")
    embeds, labels = batch(model)
    with torch.no_grad():
        ref = model(inputs_embeds=embeds, labels=labels).loss
        with apply_tiled_mlp(model, CHUNK):
            log = ChunkLog(model)
            got = model(inputs_embeds=embeds, labels=labels).loss
            log.remove()
    assert log.tokens(0, grad=False) == CHUNKS
    assert relative_difference(got, ref) <= 1e-6


def test_autocast_is_replayed_in_the_recompute():
    """Under bf16 autocast the forward computes in bf16; the recompute in backward, which runs outside the user's
    autocast block, must too (or it would compute other numbers, in fp32, with twice the memory)."""
    model = tiny("qwen3")
    embeds, labels = batch(model)

    def autocast_step(enabled: bool = True):
        model.zero_grad(set_to_none=True)
        x = embeds.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = model(inputs_embeds=x, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = autocast_step()
    rounding = max_difference(ref, autocast_step(enabled=False))[0]  # what bf16 autocast itself changes
    with apply_tiled_mlp(model, CHUNK):
        log = ChunkLog(model)
        got = autocast_step()
        log.remove()
    recompute_dtypes = {dtype for _, _, grad, dtype in log.calls if grad}
    assert len(log.tokens(0, grad=True)) == len(CHUNKS)
    assert recompute_dtypes == {torch.bfloat16}, recompute_dtypes
    difference, where = max_difference(got, ref)
    print(
        f"[tiled mlp] qwen3 fp32 + bf16 autocast: max relative difference {difference:.3g} ({where}); "
        f"untiled with and without autocast: {rounding:.3g}"
    )
    # Under autocast every gradient passes through bf16 products, so any change in their rounding (here the chunks'
    # weight-gradient sums) shows at bf16's scale: measured 1.1e-2, against 1.6e-2 between the untiled step with and
    # without autocast. Asserted: no more than twice what autocast itself changes.
    assert difference <= 2 * rounding, f"{where} differs by {difference:.3g}"


def test_the_op_on_a_plain_module():
    """`tiled_mlp` itself, on a 3-d input that is not contiguous, with a bias (a parameter every chunk uses)."""
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(HIDDEN, INTERMEDIATE), nn.GELU(), nn.Linear(INTERMEDIATE, HIDDEN))
    x = torch.randn(SEQ, BATCH, HIDDEN).transpose(0, 1).requires_grad_()  # (2, 37, 64), not contiguous
    params = list(net.parameters())
    out = tiled_mlp(net, x, CHUNK, params)
    grads = torch.autograd.grad(out.square().sum(), [x, *params])
    ref_out = net(x)
    ref_grads = torch.autograd.grad(ref_out.square().sum(), [x, *params])
    assert out.shape == ref_out.shape and relative_difference(out, ref_out) <= 1e-6
    assert all(relative_difference(g, r) <= 1e-5 for g, r in zip(grads, ref_grads))
    assert tiled_mlp(net, x, TOKENS, params).grad_fn.name() == ref_out.grad_fn.name()  # untiled: the module's graph


# --------------------------------------------------------------------------------------------------------------------
# The offloading engine
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [True, False], ids=["nonreentrant", "no-checkpointing"])
@pytest.mark.parametrize("span", ["fwd", "fwd_bwd"])
def test_with_the_offloading_engine(span, checkpointing):
    """Tiled MLPs with hf-offload's engine (CPU test mode), under non-reentrant checkpointing or none: bitwise equal to
    the same tiled model without the engine, which copies bytes only. The context spans the forward, or forward and
    backward (then the recompute in the tiled backward runs inside it). Without checkpointing the engine sees the
    op's saved tensors: the MLP's input, offloaded, and its parameters, which it leaves in place."""
    model = tiny("llama")
    if checkpointing:
        with warnings.catch_warnings():  # transformers 5.2x renamed gradient_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    embeds, labels = batch(model)
    handle = apply_tiled_mlp(model, CHUNK)
    ref = assert_baseline_repeats(model, embeds, labels)
    context = get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail=False)
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
            got = (
                loss.detach(),
                x.grad,
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )  # noqa: E501
            assert_bitwise(got, ref)
            assert context.get_stats().get("bytes_offloaded", 0) > 0
    finally:
        context.remove_hooks()
        handle.remove()


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -8, 2.5, 8.0, "8", None, True])
def test_tokens_per_chunk_must_be_a_positive_int(bad):
    model = tiny("llama")
    with pytest.raises(ValueError, match="tokens_per_chunk must be a positive int"):
        apply_tiled_mlp(model, bad)
    assert all("forward" not in mlp.__dict__ for mlp in mlps(model))


def test_model_without_decoder_layers():
    with pytest.raises(ValueError, match="Sequential has no decoder layers"):
        apply_tiled_mlp(nn.Sequential(nn.Linear(4, 4)), CHUNK)


def test_layer_without_mlp_names_the_layer_and_changes_nothing():
    model = tiny("mistral")
    del model.model.layers[1].mlp
    with pytest.raises(
        ValueError,
        match=r"decoder layer 1 \('model.layers.1', MistralDecoderLayer\) has no MLP: "
        r"looked for a child module named 'mlp'",
    ):
        apply_tiled_mlp(model, CHUNK)
    assert "forward" not in model.model.layers[0].mlp.__dict__  # layer 0 was checked first, but not tiled
    assert apply_tiled_mlp(model, CHUNK, layers=[0]).names == ["model.layers.0.mlp"]


@pytest.mark.parametrize("layers", [[2], [-3], [0, "1"], [1.0], [True]])
def test_bad_layer_indices(layers):
    with pytest.raises(ValueError, match="layers must name decoder layers by index, from 0 to 1"):
        apply_tiled_mlp(tiny("llama"), CHUNK, layers=layers)


def test_tiling_twice_is_refused():
    model = tiny("llama")
    handle = apply_tiled_mlp(model, CHUNK, layers=[1])
    with pytest.raises(ValueError, match=r"model.layers.1.mlp is already tiled"):
        apply_tiled_mlp(model, 16)
    assert "forward" not in mlps(model)[0].__dict__
    handle.remove()
    apply_tiled_mlp(model, 16).remove()


def test_mixture_of_experts_is_refused():
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        num_local_experts=2, num_experts_per_tok=1)  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp \(MixtralSparseMoeBlock\) is a mixture-of-experts"):
        apply_tiled_mlp(model, CHUNK)


def test_a_mixture_of_experts_is_refused_by_its_recorded_router_whatever_its_experts_are_called():
    """JetMoE's experts are `input_linear` and `output_linear`: its recorded router (`JetMoeTopKGating`) shows the
    block for what it is. Tiled, its router ran once per chunk and its auxiliary loss took each chunk for a layer."""
    config = transformers.JetMoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                       kv_channels=16, num_local_experts=2, num_experts_per_tok=1)  # fmt: skip
    model = transformers.JetMoeForCausalLM(config)
    refusal = r"model.layers.0.mlp \(JetMoeMoE\) is a mixture-of-experts block: .* per call \(JetMoeTopKGating\)"
    with pytest.raises(ValueError, match=refusal):
        apply_tiled_mlp(model, CHUNK)


def test_a_module_that_is_not_position_wise_is_an_error():
    def pools(x):  # mixes tokens: (..., n, hidden) -> (..., 1, hidden)
        return x.mean(dim=-2, keepdim=True)

    with pytest.raises(RuntimeError, match="a tiled MLP must map"):
        tiled_mlp(pools, torch.randn(BATCH, SEQ, HIDDEN), CHUNK)


# --------------------------------------------------------------------------------------------------------------------
# One chunk's intermediates at a time
# --------------------------------------------------------------------------------------------------------------------


class LiveIntermediates(TorchDispatchMode):
    """Tracks the bytes of live intermediate-sized tensors (last dimension `widths`, more than one token row that is
    not a weight's `hidden` rows) after every operation, forward and backward, by storage (views counted once)."""

    def __init__(self, widths: set[int]) -> None:
        super().__init__()
        self.widths = widths
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def live(self) -> int:
        # A weak reference keeps its StorageImpl's address from being reused, so keys never collide.
        self.storages = {key: entry for key, entry in self.storages.items() if not entry[0].expired()}
        return sum(size for _, size in self.storages.values())

    def reset_peak(self) -> None:
        self.peak = self.live()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in self.widths \
                    and t.numel() // t.shape[-1] != HIDDEN:  # fmt: skip
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                self.storages.setdefault(ref.cdata, (ref, storage.nbytes()))
        self.peak = max(self.peak, self.live())
        return out


def intermediate_peaks(mlp: nn.Module, tokens: int, widths: set[int]) -> tuple[int, int]:
    """(forward peak, backward peak) of live intermediate bytes for one MLP call on `tokens` tokens."""
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(7)).requires_grad_()
    with LiveIntermediates(widths) as probe:
        out = mlp(x)
        forward_peak = probe.peak
        probe.reset_peak()
        out.sum().backward()
        backward_peak = probe.peak
    return forward_peak, backward_peak


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_one_chunk_of_intermediates_at_a_time(family):
    model = tiny(family)
    mlp = mlps(model)[0]
    widths = {INTERMEDIATE, 2 * INTERMEDIATE}  # Phi3's fused gate_up_proj is 2 x intermediate wide
    one_chunk = intermediate_peaks(mlp, CHUNK, widths)  # the untiled MLP on one chunk
    untiled = intermediate_peaks(mlp, TOKENS, widths)
    with apply_tiled_mlp(model, CHUNK, layers=[0]):
        tiled = intermediate_peaks(mlp, TOKENS, widths)
    print(
        f"[tiled mlp] {family} live intermediate bytes (forward, backward): one chunk {one_chunk}, "
        f"untiled {untiled}, tiled {tiled}"
    )
    # The probe sees the untiled MLP hold all the tokens' intermediates...
    assert untiled[0] >= 3 * TOKENS * INTERMEDIATE * 4 and untiled[1] >= untiled[0]
    # ... and the tiled one never more than the untiled MLP does for one chunk, in forward and in backward.
    assert 0 < tiled[0] <= one_chunk[0]
    assert 0 < tiled[1] <= one_chunk[1]
    assert tiled[0] * 4 < untiled[0] and tiled[1] * 4 < untiled[1]
