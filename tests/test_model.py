"""CPU tests for hf_offload.model: unwrapping, head / final-norm / Liger detection, hooks, and the engine end to end.

Models are real transformers / PEFT / torch.distributed objects built from tiny configs with random weights.
The engine runs with device_type="cpu", which really copies CPU tensors into a separate host buffer, so the
statistics and the gradients below come from the real pack/unpack path.
"""

from __future__ import annotations

import copy
import gc
import logging
import socket
import warnings
import weakref

import pytest
import torch
import transformers
from in_place_rope import patch_in_place_rope
from torch import nn
from torch.utils.checkpoint import checkpoint

import hf_offload.context as hf_context
import hf_offload.model as hf_model
import hf_offload.model_hooks as hf_model_hooks
from hf_offload import OffloadActivations
from hf_offload.context import get_act_offloading_ctx_manager
from hf_offload.model import find_liger_modules, find_output_head, unwrap_model
from hf_offload.options import OffloadOptions

transformers.logging.set_verbosity_error()

VOCAB = 100


# ------------------------------------------------------------------------------------------------ tiny models


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tiny_qwen2() -> nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def tiny_gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def tiny_t5() -> nn.Module:
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    return transformers.T5ForConditionalGeneration(config)


def _bart_config(cls: type) -> transformers.PretrainedConfig:
    return cls(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip


def tiny_bart() -> nn.Module:
    return transformers.BartForConditionalGeneration(_bart_config(transformers.BartConfig))


def tiny_mbart() -> nn.Module:
    return transformers.MBartForConditionalGeneration(_bart_config(transformers.MBartConfig))


def tiny_bert_classifier() -> nn.Module:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3)  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def tiny_biogpt() -> nn.Module:
    config = transformers.BioGptConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    return transformers.BioGptForCausalLM(config)


def tiny_trocr() -> nn.Module:
    config = transformers.TrOCRConfig(vocab_size=VOCAB, d_model=32, decoder_ffn_dim=64, decoder_layers=2,
                                      decoder_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    return transformers.TrOCRForCausalLM(config)


def tiny_electra() -> nn.Module:
    config = transformers.ElectraConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                        is_decoder=True)  # fmt: skip
    return transformers.ElectraForCausalLM(config)


def tiny_llama_base() -> nn.Module:
    """A LlamaModel: a trunk with a final norm and no head."""
    return tiny_llama().model


def llama_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


# ------------------------------------------------------------------------------------------------ helpers


def our_hooks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every hook of ours (exemptions, prefetch points) left anywhere in the model: (module, "pre" | "post")."""
    found = []
    for module in model.modules():
        for kind, hooks in (("pre", module._forward_pre_hooks), ("post", module._forward_hooks)):
            found += [(module, kind) for hook in hooks.values()
                      if isinstance(getattr(hook, "__self__", None),
                                    (hf_model_hooks._ExemptHooks, hf_model_hooks._PrefetchPoints))]  # fmt: skip
    return found


def hook_counts(module: nn.Module) -> tuple[int, int]:
    return len(module._forward_pre_hooks), len(module._forward_hooks)


def names(found: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in found]


@pytest.fixture
def no_warn_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The no-head warning is once per process: start each test that checks it from a fresh process state."""
    monkeypatch.setattr(hf_context, "_no_head_warned", False)


@pytest.fixture(scope="module")
def process_group():
    """A real gloo process group of world size 1, so that a real DistributedDataParallel can be built on CPU."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch built without distributed")
    created = not dist.is_initialized()
    if created:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def lora(model: nn.Module) -> nn.Module:
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


# ------------------------------------------------------------------------------------------------ unwrapping


def test_unwrap_leaves_plain_models_and_dot_module_attributes_alone():
    model = tiny_llama()
    assert unwrap_model(model) is model
    # transformers' LeViT residual block keeps its child in `self.module`: it is a layer, not a wrapper.
    from transformers.models.levit.modeling_levit import LevitResidualLayer

    residual = LevitResidualLayer(nn.Linear(4, 4), drop_rate=0.0)
    assert isinstance(residual.module, nn.Module)
    assert unwrap_model(residual) is residual


def test_unwrap_real_ddp(process_group):
    model = tiny_llama()
    ddp = nn.parallel.DistributedDataParallel(model)
    assert unwrap_model(ddp) is model
    assert find_output_head(ddp) == [("lm_head", model.lm_head), ("model.norm", model.model.norm)]


def test_unwrap_deepspeed_engine_by_class_name():
    class DeepSpeedEngine(nn.Module):  # stands in for deepspeed.DeepSpeedEngine (matched by class name)
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    class PipelineEngine(DeepSpeedEngine):  # subclasses are wrappers too
        pass

    model = tiny_llama()
    assert unwrap_model(PipelineEngine(model)) is model


def test_unwrap_torch_compile_without_compiling():
    model = tiny_llama()
    compiled = torch.compile(model)  # returns an OptimizedModule; nothing is compiled until it is called
    assert type(compiled).__name__ == "OptimizedModule"
    assert unwrap_model(compiled) is model
    assert names(find_output_head(compiled)) == ["lm_head", "model.norm"]


def test_a_forward_compiled_as_a_whole_is_told_from_compiled_layers(process_group):
    assert not hf_model.compiled_as_a_whole(tiny_llama())
    assert hf_model.compiled_as_a_whole(torch.compile(tiny_llama()))
    assert hf_model.compiled_as_a_whole(nn.parallel.DistributedDataParallel(torch.compile(lora(tiny_llama()))))
    in_place = tiny_llama()
    in_place.compile()
    assert hf_model.compiled_as_a_whole(in_place)
    peft_in_place = lora(tiny_llama())
    peft_in_place.compile()
    assert hf_model.compiled_as_a_whole(peft_in_place)
    regional = tiny_llama()
    for layer in regional.model.layers:
        layer.compile()
    assert not hf_model.compiled_as_a_whole(regional)


def test_unwrap_peft_lora_to_base_model_and_find_its_head():
    model = tiny_llama()
    peft_model = lora(model)
    assert type(peft_model.base_model).__name__ == "LoraModel"
    assert unwrap_model(peft_model) is model
    assert find_output_head(peft_model) == [("lm_head", model.lm_head), ("model.norm", model.model.norm)]


def test_unwrap_nested_wrappers_until_fixed_point(process_group):
    model = tiny_llama()
    wrapped = torch.compile(nn.parallel.DistributedDataParallel(lora(model)))
    assert unwrap_model(wrapped) is model


# ------------------------------------------------------------------------------------------------ head detection


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (tiny_llama, ["lm_head", "model.norm"]),
        (tiny_qwen2, ["lm_head", "model.norm"]),
        (tiny_gpt2, ["lm_head", "transformer.ln_f"]),
        # The decoder's final norm is the tail; the encoder's final_layer_norm runs early and is not exempted.
        (tiny_t5, ["lm_head", "decoder.final_layer_norm"]),
        (tiny_bart, ["lm_head"]),  # BART's decoder is post-norm: no final norm
        (tiny_mbart, ["lm_head", "model.decoder.layer_norm"]),
        (tiny_bert_classifier, ["classifier"]),
        # Heads of other names; their final norms are not at the end of a trunk the search follows (BioGPT's
        # `biogpt.layer_norm` is in no decoder, ELECTRA's generator norm runs before its head).
        (tiny_biogpt, ["output_projection"]),
        (tiny_trocr, ["output_projection"]),
        (tiny_electra, ["generator_lm_head"]),
        (tiny_llama_base, ["norm"]),  # a trunk without a head: only its final norm
    ],
)
def test_find_output_head(build, expected):
    model = build()
    found = find_output_head(model)
    assert names(found) == expected
    for name, module in found:
        assert module is model.get_submodule(name)


def test_no_head_warns_once_per_process(no_warn_state):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    assert find_output_head(model) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_act_offloading_ctx_manager(model, device_type="cpu")
        get_act_offloading_ctx_manager(model, device_type="cpu")
        get_act_offloading_ctx_manager(nn.Sequential(nn.Linear(2, 2)), device_type="cpu")
    ours = [w for w in caught if "no output head" in str(w.message)]
    assert len(ours) == 1
    assert issubclass(ours[0].category, UserWarning)
    assert "warn_if_no_head=False" in str(ours[0].message)


def test_no_head_warning_can_be_disabled_and_a_head_never_warns(no_warn_state):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_act_offloading_ctx_manager(nn.Sequential(nn.Linear(8, 8)), warn_if_no_head=False, device_type="cpu")
        get_act_offloading_ctx_manager(tiny_llama(), device_type="cpu")
    assert not [w for w in caught if "no output head" in str(w.message)]
    assert hf_context._no_head_warned is False  # the once-only budget was not spent either


# ------------------------------------------------------------------------------------------------ hooks


def test_hooks_do_not_stack_and_remove_cleanly():
    model = tiny_llama()
    head, norm = model.lm_head, model.model.norm
    assert hook_counts(head) == hook_counts(norm) == (0, 0)

    # Both tail modules: the exempt region's enter and exit; the head also: its prefetch point.
    first = get_act_offloading_ctx_manager(model, device_type="cpu")
    assert hook_counts(head) == (1, 2) and hook_counts(norm) == (1, 1)
    assert list(head._forward_hooks_always_called.values()) == [True]  # the exit runs even if forward raises
    second = get_act_offloading_ctx_manager(model, device_type="cpu")
    assert hook_counts(head) == (1, 2) and hook_counts(norm) == (1, 1)
    assert all(hook.__self__._engine() is second for hook in head._forward_pre_hooks.values())

    first.remove_hooks()  # stale engine: removing its hooks again must not touch the new ones
    assert hook_counts(head) == (1, 2)
    second.remove_hooks()
    second.remove_hooks()  # idempotent
    assert our_hooks(model) == []
    assert hook_counts(head) == hook_counts(norm) == (0, 0)
    assert not head._forward_hooks_always_called


def test_peft_model_and_its_base_share_one_installation():
    model = tiny_llama()
    peft_model = lora(model)
    get_act_offloading_ctx_manager(peft_model, device_type="cpu")
    engine = get_act_offloading_ctx_manager(peft_model.get_base_model(), device_type="cpu")
    assert hook_counts(model.lm_head) == (1, 2)
    # model, head and final norm: one pre + one post each; one post on the token embeddings (a final norm run on
    # them opens no tail); prefetch points: one pre on the model, one post on the head and on each of the two layers'
    # attention
    assert len(our_hooks(peft_model)) == 11
    engine.remove_hooks()
    assert our_hooks(peft_model) == []


def test_deep_copy_of_a_hooked_model_is_rehooked_without_touching_the_original():
    model = tiny_llama()
    original = get_act_offloading_ctx_manager(model, device_type="cpu")
    clone = copy.deepcopy(model)  # e.g. a DPO reference model
    # The copy shares the hook objects (and the engine) instead of deep-copying the engine.
    assert next(iter(clone.lm_head._forward_pre_hooks.values())).__self__._engine() is original
    engine = get_act_offloading_ctx_manager(clone, device_type="cpu")
    assert hook_counts(clone.lm_head) == (1, 2)
    assert next(iter(clone.lm_head._forward_pre_hooks.values())).__self__._engine() is engine
    assert hook_counts(model.lm_head) == (1, 2)  # the original still has its own
    assert next(iter(model.lm_head._forward_pre_hooks.values())).__self__._engine() is original


def test_invalid_engine_option_raises_before_touching_hooks():
    model = tiny_llama()
    engine = get_act_offloading_ctx_manager(model, device_type="cpu")
    with pytest.raises(ValueError, match="keep_tail"):
        get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail="yes")
    assert all(hook.__self__._engine() is engine for hook in model.lm_head._forward_pre_hooks.values())
    assert hook_counts(model.lm_head) == (1, 2)


def test_engine_options_reach_the_engine():
    engine = get_act_offloading_ctx_manager(tiny_llama(), min_offload_size=7, max_fwd_stash_size=3,
                                            device_type="cpu", keep_tail=False, prefetch_window_bytes=0)  # fmt: skip
    assert engine.options == OffloadOptions(min_offload_size=7, max_fwd_stash_size=3, device_type="cpu",
                                            keep_tail=False, prefetch_window_bytes=0)  # fmt: skip
    assert engine.device_type == "cpu"
    positional = get_act_offloading_ctx_manager(tiny_llama(), False, False, 7, 3, device_type="cpu")  # TRL's order
    assert positional.options == OffloadOptions(False, False, 7, 3, device_type="cpu")
    given = OffloadOptions(min_offload_size=9, device_type="cpu")
    assert get_act_offloading_ctx_manager(tiny_llama(), options=given).options is given


# ------------------------------------------------------------------------------------------------ Liger


class FakeLigerRMSNorm(nn.Module):
    """Stands in for liger_kernel.transformers.rms_norm.LigerRMSNorm (matched by its class's module path)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.seen: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squared = x * x  # saved by the next multiply: large enough to be offloaded
        self.seen.append(weakref.ref(squared.untyped_storage()))  # storage: saved aliases share it
        return x * torch.rsqrt((squared * squared).mean(-1, keepdim=True) + 1e-6) * self.weight


FakeLigerRMSNorm.__module__ = "liger_kernel.transformers.fake"


class Plain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)


class LigerToyModel(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.norm_by_class = FakeLigerRMSNorm(dim)  # exempt by class module path
        self.my_liger_act = Plain()  # exempt by name
        self.other_act = Plain()  # not exempt
        self.lm_head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        h = self.my_liger_act(self.norm_by_class(h))
        h = self.my_liger_act(h)  # the same exempt module twice in one forward
        return self.lm_head(self.other_act(h))


def test_liger_modules_found_by_name_and_by_class_module_path():
    model = LigerToyModel()  # the root's class name contains "Liger": the model itself is never exempted
    assert names(find_liger_modules(model)) == ["norm_by_class", "my_liger_act"]
    get_act_offloading_ctx_manager(model, device_type="cpu")
    assert sorted({name for name, m in model.named_modules() if name and hook_counts(m) == (1, 1)}) == [
        "my_liger_act", "norm_by_class",
    ]  # fmt: skip
    assert hook_counts(model) == (2, 1)  # the tail region's pair, and the pre-hook that reads the step's tokens
    assert hook_counts(model.lm_head) == (1, 2)  # and its prefetch point
    assert hook_counts(model.other_act) == (0, 0)


def test_liger_functions_found_in_the_code_of_the_models_classes(monkeypatch):
    model = tiny_llama()
    assert hf_model.find_liger_functions(model) == []
    patch_in_place_rope(monkeypatch)
    assert hf_model.find_liger_functions(model) == ["transformers.models.llama.modeling_llama.apply_rotary_pos_emb"]
    assert hf_model.find_liger_functions(tiny_gpt2()) == []  # another family's code is not Llama's


def _count_packs(inside, run) -> tuple[int, int, int]:
    """Independently count (tensors saved while `inside()`, their bytes, tensors saved otherwise) by `run()`."""
    counts = [0, 0, 0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if inside():
            counts[0] += 1
            counts[1] += tensor.numel() * tensor.element_size()
        else:
            counts[2] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return counts[0], counts[1], counts[2]


def _count_saved(model: nn.Module, exempt: list[nn.Module], run) -> tuple[int, int, int]:
    """Count the tensors saved inside the `exempt` modules' forwards, and the others."""
    depth = [0]
    handles = []
    for module in exempt:
        handles.append(module.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1)))
        handles.append(module.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1)))
    try:
        return _count_packs(lambda: depth[0] > 0, run)
    finally:
        for handle in handles:
            handle.remove()


def _count_saved_from(first: nn.Module, run) -> tuple[int, int, int]:
    """Count the tensors saved from `first`'s forward on, and those saved before it."""
    started = [False]
    handle = first.register_forward_pre_hook(lambda *_: started.__setitem__(0, True))
    try:
        return _count_packs(lambda: started[0], run)
    finally:
        handle.remove()


def _total_packed(stats: dict) -> int:
    return stats["tensors_offloaded"] + sum(v for k, v in stats.items() if k.startswith("tensors_kept_"))


def test_liger_modules_keep_their_tensors_exempt():
    torch.manual_seed(0)
    model = LigerToyModel()
    x = torch.randn(8, 64)
    run = lambda: model(x).sum()  # noqa: E731
    inside, inside_bytes, outside = _count_saved(model, [model.norm_by_class, model.my_liger_act, model.lm_head], run)
    assert inside > 0 and outside > 0

    engine = get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail=False, warn_if_no_head=False)
    with engine:
        run().backward()
    stats = engine.get_stats()
    assert (stats["tensors_kept_exempt"], stats["bytes_kept_exempt"]) == (inside, inside_bytes)
    assert _total_packed(stats) == inside + outside
    assert stats["tensors_offloaded"] > 0


# ------------------------------------------------------------------------------------------------ end to end


def _llama_step(model: nn.Module, batch: dict[str, torch.Tensor], ctx=None) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(**batch).loss
        loss.backward()
    else:
        with ctx:
            loss = model(**batch).loss
            loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_llama_head_and_norm_exempt_rest_offloaded_and_gradients_exact():
    model = tiny_llama()
    batch = llama_batch()
    ref_loss, ref_grads = _llama_step(model, batch)
    # The tail region runs from the final norm to the end of the model's forward: norm, head and loss.
    inside, inside_bytes, outside = _count_saved_from(model.model.norm, lambda: model(**batch).loss)
    head_only, _, _ = _count_saved(model, [model.lm_head, model.model.norm], lambda: model(**batch).loss)
    assert inside > head_only >= 3  # lm_head input and weight, the norm's saved tensors, then the loss

    engine = get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail=False)
    loss, grads = _llama_step(model, batch, engine)
    stats = engine.get_stats()
    assert stats["steps"] == 1
    assert (stats["tensors_kept_exempt"], stats["bytes_kept_exempt"]) == (inside, inside_bytes)
    assert _total_packed(stats) == inside + outside
    assert stats["tensors_offloaded"] > 0 and stats["bytes_offloaded"] > 0
    assert stats["prefetch_misses"] + stats["prefetch_hits"] + stats["inflight_hits"] > 0  # they came back

    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name

    # Outside the context the hooks stay inert: no region is entered, the engine's counters do not move.
    _llama_step(model, batch)
    assert engine.get_stats() == stats

    # Without the exemption the same tensors are offloaded instead: the count above came from the hooks.
    engine.remove_hooks()
    bare = OffloadActivations(device_type="cpu")  # installed on no model: no hooks
    _llama_step(model, batch, bare)
    assert bare.get_stats()["tensors_kept_exempt"] == 0
    assert bare.get_stats()["tensors_offloaded"] > stats["tensors_offloaded"]


class CheckpointedBlock(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.liger_norm = FakeLigerRMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.liger_norm(self.proj(x))


class CheckpointedToy(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.block = CheckpointedBlock()
        self.lm_head = nn.Linear(64, 64)
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=False) if self.use_checkpoint else self.block(x)
        return self.lm_head(h)


@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_exempt_module_inside_checkpointed_layer_does_not_defeat_checkpointing(use_checkpoint):
    torch.manual_seed(0)
    model = CheckpointedToy(use_checkpoint)
    x = torch.randn(8, 64, requires_grad=True)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model.block.liger_norm.seen.clear()

    engine = get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail=False)
    with engine:
        out = model(x).sum()
        intermediate_alive = model.block.liger_norm.seen[0]() is not None
        out.backward()
    if use_checkpoint:
        # Checkpointing's own hooks are innermost inside the block: the Liger module must not push a NoOp region
        # over them, or autograd would keep the activations checkpointing drops.
        assert not intermediate_alive
        assert engine.get_stats()["tensors_kept_exempt"] == 2  # only lm_head (input, weight)
    else:
        assert intermediate_alive
        assert engine.get_stats()["tensors_kept_exempt"] > 2
    for got, want in zip((p.grad for p in model.parameters()), ref):
        assert torch.equal(got, want)


def test_exception_in_exempt_module_exits_its_region():
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4))
    model.lm_head = Boom()
    engine = get_act_offloading_ctx_manager(model, device_type="cpu")
    with engine:
        with pytest.raises(RuntimeError, match="boom"):
            model.lm_head(torch.randn(2, 4))
        # The always_call forward hook popped the NoOp region: the engine is innermost again.
        assert torch._C._autograd._top_saved_tensors_default_hooks(True)[0] == engine.pack_hook
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


class HeadThenFail(nn.Module):
    """A model whose forward raises after its head ran, inside the tail region."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 4)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.body(x))
        if self.fail:
            raise RuntimeError("loss failed")
        return logits.softmax(-1).sum()


def _hook_stack_top() -> object:
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def test_tail_region_closes_after_an_exception_and_outside_the_model_forward():
    model = HeadThenFail()
    engine = get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    x = torch.randn(4, 8, requires_grad=True)
    with engine:
        model(x).backward()
        kept = engine.get_stats()["tensors_kept_exempt"]
        assert kept >= 3  # the head's input and weight, and the softmax after it: the loss stays too
        model.fail = True
        with pytest.raises(RuntimeError, match="loss failed"):
            model(x)
        assert _hook_stack_top()[0] == engine.pack_hook  # the region was popped by the always-called hook
        model.lm_head(torch.randn(2, 8, requires_grad=True))  # the head alone, outside the model's forward
        assert _hook_stack_top()[0] == engine.pack_hook
    assert _hook_stack_top() is None


class NormsItsEmbeddingsFirst(nn.Module):
    """NanoChat's order: the final norm runs on the token embeddings before the layers, and again after them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 32)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embed_tokens(ids))
        for layer in self.layers:
            hidden = layer(hidden)
        return self.lm_head(self.norm(hidden)).logsumexp(-1).sum()


def test_a_final_norm_run_on_the_embeddings_does_not_open_the_tail():
    """Opened at that first call, the tail region kept every layer's tensors, and offloading moved nothing."""
    torch.manual_seed(0)
    model = NormsItsEmbeddingsFirst()
    ids = torch.randint(32, (2, 8))
    model(ids).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    engine = get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    with engine:
        model(ids).backward()
    stats = engine.get_stats()
    # Each layer's Linear input and GELU input, and the first norm's input, went to the host.
    assert stats["tensors_offloaded"] >= 5
    assert stats["tensors_kept_exempt"] >= 3  # the tail still kept: the final norm's input, the head's, the loss's
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))


# ------------------------------------------------------------------------------------------------ prefetch points


@pytest.mark.parametrize(
    "build, expected",
    [
        (tiny_llama, ["model.layers.0.self_attn", "model.layers.1.self_attn"]),
        (tiny_gpt2, ["transformer.h.0.attn", "transformer.h.1.attn"]),
        # T5: each block's self-attention, never the cross-attention (`EncDecAttention`) of decoder blocks.
        (tiny_t5, [f"{stack}.block.{i}.layer.0.SelfAttention" for stack in ("decoder", "encoder") for i in (0, 1)]),
    ],
)
def test_attention_modules_found_once_per_block(build, expected):
    assert sorted(names(hf_model.find_attention_modules(build()))) == sorted(expected)


@pytest.mark.parametrize("checkpointing", [None, "nonreentrant", "reentrant"])
def test_prefetch_points_fire_at_the_head_and_in_the_middle_of_each_block_backward(checkpointing):
    """Reloads start at the head's gradient, before backward's first unpack. With checkpointing, each block's saved
    input is unpacked as its backward starts; the next reload must start from the block's attention gradient,
    after that unpack and before the next block's. Gradients stay exact."""
    model = tiny_llama()
    if checkpointing:
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    batch = llama_batch()
    ref_loss, ref_grads = _llama_step(model, batch)

    engine = get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail=False)
    events: list[str] = []
    unpack, prefetch = engine._unpack, engine._prefetch_from_hook
    engine._unpack = lambda saved: (events.append("unpack"), unpack(saved))[1]
    engine._prefetch_from_hook = lambda step, window: (events.append("prefetch"), prefetch(step, window))[1]
    loss, grads = _llama_step(model, batch, engine)

    assert engine.prefetch_on_unpack is (checkpointing is None)
    assert events.count("prefetch") == 3  # the head, then one point per block
    assert events[0] == "prefetch" and "unpack" in events
    if checkpointing:
        # Per block: the saved inputs (hidden states, rotary cos/sin) unpacked together, then the point.
        blocks = "".join("u" if e == "unpack" else "p" for e in events).split("p")
        assert len(blocks) == 4 and not blocks[0] and blocks[1] and blocks[2] and not blocks[3], events
    assert torch.equal(loss, ref_loss)
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_the_heads_prefetch_stays_within_the_head_window():
    """A memory plan that prefetches far ahead keeps the head's reloads to one layer: the head's hook passes the
    engine's head window, the blocks' hooks none (the step's whole window), and the reloads the head starts stay
    within it."""
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = llama_batch()
    engine = get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail=False)
    windows: list[int | None] = []
    prefetch = engine._prefetch_from_hook
    engine._prefetch_from_hook = lambda step, window: (windows.append(window), prefetch(step, window))[1]
    _llama_step(model, batch, engine)
    assert windows == [None, None, None]  # without a plan the head reloads as far as the prefetch window allows

    engine.use_windows(64 * 2**20, 10**9, head_prefetch_window_bytes=1)
    windows.clear()
    _llama_step(model, batch, engine)
    assert windows == [1, None, None]


def test_prefetch_hook_without_a_forward_does_nothing():
    engine = get_act_offloading_ctx_manager(tiny_llama(), device_type="cpu")
    engine.prefetch_hook()(torch.zeros(1))  # no step yet
    assert engine.get_stats()["prefetch_hits"] == engine.get_stats()["prefetch_misses"] == 0


def test_fsdp2_gathered_parameters_are_never_offloaded(process_group):
    """FSDP2 gathers each layer's parameters into new storage in the layer's pre-forward hook, after the engine
    read the step's parameter pointers; the linear layers then save views (`weight.t()`) of those gathered
    parameters. None of them may be offloaded, and the gradients stay exact."""
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard

    def build() -> nn.Module:
        model = tiny_llama()
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)

    batch = llama_batch()
    ref_loss, ref_grads = _llama_step(build(), batch)
    model = build()
    engine = get_act_offloading_ctx_manager(model, device_type="cpu")
    # Storages of the parameters of the module running now (gathered by FSDP2's hooks, which run before ours); a
    # pointer of an earlier module may since have been freed and reused by an activation.
    live: set[int] = set()

    def note_parameters(module: nn.Module, args) -> None:
        pointers = {p.untyped_storage().data_ptr() for p in module.parameters(recurse=False)}
        if pointers:
            live.clear()
            live.update(pointers)

    for module in model.modules():
        module.register_forward_pre_hook(note_parameters)
    offloaded_parameters = []
    offload = engine._offload

    def audited(tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in live or isinstance(tensor._base, nn.Parameter):
            offloaded_parameters.append(tuple(tensor.shape))
        return offload(tensor)

    engine._offload = audited
    loss, grads = _llama_step(model, batch, engine)
    assert engine.get_stats()["tensors_kept_parameter"] > 0
    assert offloaded_parameters == []
    assert engine.get_stats()["tensors_offloaded"] > 0
    assert torch.equal(loss, ref_loss)
    for name in ref_grads:
        assert torch.equal(grads[name].full_tensor(), ref_grads[name].full_tensor()), name


def test_a_removed_or_replaced_context_says_so_and_offloads_nothing(caplog):
    """Without its hooks a context would offload the head and the loss too: after `remove_hooks()`, or once another
    context was built for its model, entering it offloads nothing, and one warning says which context to use."""
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))

    def steps(context, count: int = 1) -> dict:
        """What `count` steps under `context` counted."""
        context.consume_stats()
        for _ in range(count):
            with context:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return context.consume_stats()

    first = get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    assert steps(first)["tensors_offloaded"] > 0
    second = get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        replaced = steps(first, 2)
        assert steps(second)["tensors_offloaded"] > 0
        second.remove_hooks()
        removed = steps(second)
    assert replaced["tensors_offloaded"] == removed["tensors_offloaded"] == replaced["steps"] == removed["steps"] == 0
    assert sum("hooks were removed" in record.getMessage() for record in caplog.records) == 2  # once per context


def test_a_context_dropped_without_removing_its_hooks_does_not_outlive_its_last_reference():
    """The model's hooks refer to the context weakly: a context dropped without `remove_hooks()` is collected with
    its host pool, and the hooks it left behind do nothing."""
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    context = get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    with context:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    dropped = weakref.ref(context)
    del context, loss
    gc.collect()
    assert dropped() is None
    model(input_ids=ids, labels=ids).loss.backward()  # the hooks left behind run, and do nothing
