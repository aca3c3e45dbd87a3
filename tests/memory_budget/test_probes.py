"""Probing a layer, in the CPU test mode: the arguments a long call is probed on, and probes that leave no trace in
the step they run in."""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_layers import GradientCheckpointingLayer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from _gpu_models import build_model, make_batch, make_ctx  # noqa: E402
from budget_runs import tiny_gemma3n  # noqa: E402

from hf_offload.memory_budget.probes import (  # noqa: E402
    Meter,
    _CountSavedBytes,
    _without_the_cache,
    call_argument_storages,
    first_tokens,
    link_probe_bytes,
    measure_link_bandwidth,
)
from hf_offload.model import is_cache  # noqa: E402

transformers.logging.set_verbosity_error()

# The model families' sizes of `test_controller_families.py`.
SIZE = dict(hidden=32, layers=2, vocab=128)
SEQ = 24
ROOMY = 10 * 2**30


def test_a_layer_calls_other_arguments_are_counted_by_storage_and_an_eager_mask_grows_with_the_square():
    """The mask and the rotary tables, once per storage (both tables are views of one here), not the hidden states, a
    parameter or the cache; the mask, two dimensions as long as the sequence, is the quadratic part."""
    hidden, mask = torch.zeros(2, 10, 16), torch.zeros(2, 1, 10, 10)
    tables = torch.zeros(2, 2, 10, 4)
    cache = transformers.DynamicCache()
    weight = torch.nn.Parameter(torch.zeros(10, 10))
    kwargs = {"attention_mask": mask, "past_key_values": cache, "position_embeddings": (tables[:, 0], tables[:, 1])}
    storages = call_argument_storages((hidden, weight), kwargs)
    assert sorted(storages.values()) == [(2 * 2 * 10 * 4 * 4, False), (2 * 10 * 10 * 4, True)]
    assert set(storages) == {mask.data_ptr(), tables.data_ptr()}


def test_the_first_tokens_of_every_sequence_argument():
    hidden, mask = torch.zeros(2, 10, 10), torch.zeros(2, 1, 10, 10)  # hidden size = length: cut once
    cos = torch.zeros(2, 10, 8)
    args, kwargs = first_tokens((hidden,), {"attention_mask": mask, "position_embeddings": (cos, cos),
                                             "cache_position": torch.arange(10), "use_cache": False}, 8)  # fmt: skip
    assert args[0].shape == (2, 4, 10) and kwargs["attention_mask"].shape == (2, 1, 4, 4)
    assert kwargs["position_embeddings"][0].shape == (2, 4, 8) and kwargs["cache_position"].tolist() == [0, 1, 2, 3]
    assert kwargs["use_cache"] is False
    assert first_tokens((hidden,), {}, 20)[0][0] is hidden  # short enough: unchanged
    # Packed sequences (a vision tower's 2-d hidden states, their bounds in `cu_seqlens`) are never cut.
    packed, bounds = torch.zeros(100, 8), torch.tensor([0, 50, 100])
    args, kwargs = first_tokens((packed,), {"cu_seqlens": bounds}, 8)
    assert args[0] is packed and kwargs["cu_seqlens"] is bounds


def test_the_first_tokens_cut_again_where_a_table_is_as_wide_as_the_sequence_is_long():
    """Rotary tables of 10 values a head at 10 tokens a sequence: cut along every dimension of that size, the table
    loses its values too; `first_dim_only` cuts the sequence's alone, and a 4-d mask still along both."""
    hidden, mask, cos = torch.zeros(2, 10, 16), torch.zeros(2, 1, 10, 10), torch.zeros(2, 10, 10)
    call = {"attention_mask": mask, "position_embeddings": (cos, cos), "position_ids": torch.arange(10)[None]}
    _, every = first_tokens((hidden,), call, 8)
    assert every["position_embeddings"][0].shape == (2, 4, 4)
    args, first = first_tokens((hidden,), call, 8, first_dim_only=True)
    assert args[0].shape == (2, 4, 16) and first["attention_mask"].shape == (2, 1, 4, 4)
    assert first["position_embeddings"][0].shape == (2, 4, 10) and first["position_ids"].tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("arch", ["mixtral", "jamba"])
def test_the_probes_leave_no_trace_in_the_first_step(arch):
    """The first step, whose layers are probed, returns what it returns without a budget: as many router logits as
    the model has routers, the same losses, and no keys or values in the cache (its layers are checkpointed, where
    transformers passes none; the probes run them kept, twice). The random streams: T5's and BART's dropout in the
    bitwise test of test_controller_families.py."""
    batch = make_batch(arch, device="cpu", seq=SEQ, vocab=SIZE["vocab"])

    def first_step(budget=None):
        model = build_model(arch, device="cpu", seq=SEQ, **SIZE)
        context = make_ctx(model, device_type="cpu", memory_budget=budget) if budget else contextlib.nullcontext()
        with context:
            return model(**batch, use_cache=True)

    plain, probed = first_step(), first_step(ROOMY)
    assert len(probed.router_logits) == len(plain.router_logits) > 0
    assert plain.past_key_values.get_seq_length() == SEQ and probed.past_key_values.get_seq_length() == 0
    assert torch.equal(probed.loss, plain.loss) and torch.equal(probed.aux_loss, plain.aux_loss)


class _StreamsAfterTheSequence(torch.nn.Module):
    """A layer whose hidden states are (batch, sequence, streams, hidden), as DeepSeek-V4's hyper-connections: it
    mixes its streams with weights made from all of them, so the probe's cut along the second-to-last dimension (the
    streams) does not run; `too_large_uncut` raises an out-of-memory error on the call as it came."""

    def __init__(self, streams: int = 4, hidden: int = 8, too_large_uncut: bool = False) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(streams * hidden, streams)
        self.streams, self.too_large_uncut = streams, too_large_uncut

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.too_large_uncut and hidden.shape[-2] == self.streams:
            raise torch.OutOfMemoryError("CUDA out of memory (made up)")
        weights = self.mix(hidden.flatten(-2)).softmax(-1)  # (batch, sequence, streams)
        return hidden * weights[..., None] + position_ids[..., None, None]


def test_a_layer_whose_arguments_cannot_be_cut_is_probed_on_its_whole_call(monkeypatch):
    """Cut to fewer tokens, such a layer's arguments do not fit together (a crash in the first step, before): it is
    probed on its call as it came, and says why; where that does not fit on the device, the out-of-memory error
    says what to do."""
    from hf_offload.memory_budget import probes

    monkeypatch.setattr(probes, "PROBE_MAX_TOKENS", 16)
    hidden, positions = torch.randn(2, 24, 4, 8), torch.arange(24.0).expand(2, 24)
    probe = probes.probe_layer(_StreamsAfterTheSequence(), (hidden, positions), {}, probes.Meter("cpu"))
    assert probe.tokens == probe.step_tokens == 2 * 24 * 4
    assert probe.uncut_error.startswith("its arguments cut to fewer tokens do not run (")
    assert probe.profile.saved_bytes > 0
    with pytest.raises(torch.OutOfMemoryError, match=r"no plan can be made for a first step this long\. Start with "
                       r"shorter steps .* CUDA out of memory \(made up\)"):  # fmt: skip
        probes.probe_layer(_StreamsAfterTheSequence(too_large_uncut=True), (hidden, positions), {}, probes.Meter("cpu"))
    # A call the probe cuts is not marked.
    layer = build_model("llama", dtype="fp32", device="cpu", attn="sdpa", **SIZE).model.layers[0]
    long = torch.randn(1, SEQ, SIZE["hidden"])
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(layer.self_attn.config)
    probe = probes.probe_layer(layer, (long,), {"position_embeddings": rotary(long, torch.arange(SEQ)[None])},
                               probes.Meter("cpu"))  # fmt: skip
    assert (probe.tokens, probe.step_tokens, probe.uncut_error) == (16, SEQ, None)


def test_a_probe_drops_the_cache_under_any_name():
    # transformers 5.24 renamed the layers' `past_key_values` to `cache`: a probe that passed the step's cache on grew
    # it by its own keys, and the step's attention then saw twice its keys (a size mismatch in every budget test).
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    assert is_cache(transformers.DynamicCache(config=config))
    assert not is_cache(torch.zeros(2)) and not is_cache(None)


def test_a_probe_turns_the_cache_off_where_the_model_passes_use_cache_by_position():
    """RecurrentGemma calls its layers `layer(hidden, position_ids, mask, use_cache, cache)`: a probe that added
    `use_cache=False` by name passed it twice (a TypeError in the first step, under any budget)."""
    config = transformers.RecurrentGemmaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, lru_width=32, attention_window_size=16, conv1d_width=4,
        block_types=["recurrent", "attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))

    def first_step(budget=None):
        torch.manual_seed(0)
        model = transformers.RecurrentGemmaForCausalLM(config).train()
        context = make_ctx(model, device_type="cpu", memory_budget=budget) if budget else contextlib.nullcontext()
        with context:  # with its cache on, its checkpointed layers recompute from a grown cache, without hf-offload too
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss, [p.grad for p in model.parameters()]

    (plain, plain_grads), (probed, probed_grads) = first_step(), first_step(ROOMY)
    assert torch.equal(probed, plain) and all(map(torch.equal, probed_grads, plain_grads))


def test_a_probe_passes_use_cache_only_to_a_layer_that_takes_it():
    """xLSTM's blocks are `forward(x, state=None)`: a probe that added `use_cache=False` to every layer's call raised
    a TypeError in the first step, under any budget. It is added where the forward takes it by name or through
    `**kwargs`, replaced where the step's call passed it, and otherwise the call is left as it was."""

    class Layer(torch.nn.Module):
        def __init__(self, forward):
            super().__init__()
            self.forward = forward

    hidden = torch.zeros(1, 4, 8)
    cases = [
        (lambda x, state=None: x, {"state": None}, {"state": None}),
        (lambda x, *, use_cache=True: x, {}, {"use_cache": False}),
        (lambda x, use_cache=True: x, {}, {"use_cache": False}),
        (lambda x, **kwargs: x, {"mask": None}, {"mask": None, "use_cache": False}),
        (lambda x, **kwargs: x, {"use_cache": True}, {"use_cache": False}),
    ]
    for forward, kwargs, expected in cases:
        args, kwargs = _without_the_cache(Layer(forward), (hidden,), kwargs)
        assert len(args) == 1 and args[0] is hidden and kwargs == expected
    # By position, as RecurrentGemma passes it, it is replaced in place.
    args, kwargs = _without_the_cache(Layer(lambda x, use_cache=True: x), (hidden, True), {})
    assert len(args) == 2 and args[0] is hidden and args[1] is False and kwargs == {}


def test_a_probe_keeps_the_fastest_of_its_runs_after_the_first():
    """The host's stalls add time to some runs: of the probe's runs after the first (kernel selection, allocator
    growth), the fastest forward, backward and selective recompute are kept. A clock that reads each interval as
    scripted: the first run slowest, then a slow and a fast one; then the run that times the attention operators
    apart, which are part of the kept forward and backward; then the runs on fewer tokens, for bytes only."""
    from hf_offload.memory_budget import probes

    layer = build_model("llama", dtype="fp32", device="cpu", attn="sdpa", **SIZE).model.layers[0]
    hidden = torch.randn(1, SEQ, SIZE["hidden"])
    position = torch.arange(SEQ)[None]
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(layer.self_attn.config)
    # Per run, in the order measured: forward, backward, backward of the selective checkpoint; then the attention
    # operator's forward and backward (one layer, one call each); then the forward and backward on half and on a
    # quarter of the tokens, whose bytes alone are used.
    intervals = iter([9.0, 9.0, 9.0, 3.0, 6.0, 7.0, 2.0, 4.0, 5.0, 0.5, 1.5, 8.0, 8.0, 8.0, 8.0])

    class ScriptedMeter(probes.Meter):
        def seconds(self, start, end):
            return next(intervals)

    probe = probes.probe_layer(layer, (hidden,), {"position_embeddings": rotary(hidden, position)},
                               ScriptedMeter("cpu"))  # fmt: skip
    assert probes._PROBE_RUNS == 3
    assert (probe.profile.forward_s, probe.profile.backward_s) == (2.0, 4.0)
    assert probe.profile.selective_recompute_s == 5.0 - 4.0
    assert (probe.profile.attention_forward_s, probe.profile.attention_backward_s) == (0.5, 1.5)
    assert next(intervals, None) is None  # every interval read: one attention operator each way, two shorter runs


def test_a_probe_counts_the_tensors_a_layer_saves():
    """A whole-layer offload sends each tensor the layer saves through the engine's hooks (the host's cost of `O`,
    `calibrate`): the probe counts the distinct storages, parameters aside, as a plain forward saves them."""
    from hf_offload.memory_budget import probes

    layer = build_model("llama", dtype="fp32", device="cpu", attn="sdpa", **SIZE).model.layers[0]
    hidden = torch.randn(1, SEQ, SIZE["hidden"], requires_grad=True)
    position = torch.arange(SEQ)[None]
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(layer.self_attn.config)
    kwargs = {"position_embeddings": rotary(hidden, position)}
    parameters = {parameter.untyped_storage().data_ptr() for parameter in layer.parameters()}
    storages = set()

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in parameters:
            storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(hidden, **kwargs)
    probe = probes.probe_layer(layer, (hidden.detach(),), kwargs, probes.Meter("cpu"))
    assert probe.profile.saved_tensors == len(storages) > 5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_probe_times_the_fused_attention_apart(attn):
    """Attention's time grows with the square of the tokens, the rest in proportion: the probe times sdpa's fused
    operators apart, within the layer's forward and backward (on the host clock here). Eager attention's matrix
    products are not recognised: its time stays in the part that grows in proportion."""
    from hf_offload.memory_budget import probes

    layer = build_model("llama", dtype="fp32", device="cpu", attn=attn, **SIZE).model.layers[0]
    hidden = torch.randn(1, 4 * SEQ, SIZE["hidden"])
    position = torch.arange(4 * SEQ)[None]
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(layer.self_attn.config)
    profile = probes.probe_layer(layer, (hidden,), {"position_embeddings": rotary(hidden, position)},
                                 probes.Meter("cpu")).profile  # fmt: skip
    if attn == "eager":
        assert profile.attention_forward_s == profile.attention_backward_s == 0.0
    else:
        assert 0 < profile.attention_forward_s <= profile.forward_s
        assert 0 < profile.attention_backward_s <= profile.backward_s


# Layers tiled whole: probed where the model's layers can be, refused (and said) where they cannot


def probed_layer_tiling(arch: str, caplog, tokens: int = SEQ, **batch_options):
    """The first step of `arch` under a roomy budget, its steps long enough for two chunks of the hidden size: the
    probe, and what the log said of tiling whole layers."""
    batch = make_batch(arch, device="cpu", seq=tokens, vocab=SIZE["vocab"])
    model = build_model(arch, device="cpu", seq=tokens, **SIZE)
    context = make_ctx(model, device_type="cpu", memory_budget=ROOMY)
    with caplog.at_level("INFO", logger="hf_offload"), context:
        model(**batch, **batch_options)
    said = [r.getMessage() for r in caplog.records if "the planner cannot tile whole layers" in r.getMessage()]
    return next(iter(context.budget_controller.profiled_steps.measured.probes.values())), said


def test_a_layer_is_probed_tiled_whole_by_the_formulas_on_cpu(caplog):
    """The CPU test mode has no memory counter: a layer tiled whole is counted by `tiled_layer`'s formulas. Its forward
    holds its input and `forward_bytes_per_token` per token; its backward, on top of that, the rest of
    `backward_bytes_per_token` (which counts the input once) and the weights' gradients."""
    from hf_offload.tiled.integration import layer_bytes_per_token

    probe, said = probed_layer_tiling("llama", caplog, tokens=2 * SIZE["hidden"])
    assert not said and probe.layer_tiling_error is None
    tokens, profile = probe.tokens, probe.profile
    forward, backward = layer_bytes_per_token(build_model("llama", device="cpu", seq=64, **SIZE).model.layers[0], 4)
    assert profile.layer_tiled_saved_bytes == profile.input_bytes + forward * tokens
    # The backward's point, `layer_tiled_saved_bytes` + these: the count, and the weights' gradients.
    weights = profile.parameter_gradient_bytes
    assert profile.layer_tiled_saved_bytes + probe.layer_tiled_working_bytes == backward * tokens + weights
    assert profile.layer_tiled_extra_s > 0  # a tiled layer on CPU: many small calls


@pytest.mark.parametrize(("arch", "options", "reason"), [
    ("gpt_oss", {"output_router_logits": False}, r"model\.layers\.0: GptOssAttention passes a learned tensor"),
    ("mixtral", {"output_router_logits": True}, "this forward records router_logits inside its layers"),
])  # fmt: skip
def test_a_layer_that_cannot_be_tiled_whole_is_probed_without_it(caplog, arch, options, reason):
    """gpt-oss hands its attention sinks to the attention function (a tiled layer's head groups could not take their
    share: the probe's tiled run raises); a mixture of experts recording its router logits would record each chunk's
    (the op refuses). Neither gets the action, and the log says why."""
    probe, said = probed_layer_tiling(arch, caplog, tokens=2 * SIZE["hidden"], **options)
    assert probe.layer_tiled_working_bytes is None and len(said) == 1
    assert re.search(reason, said[0]), said[0]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_probe_separates_the_bytes_that_grow_with_the_square_of_the_tokens(attn):
    """Eager attention saves its softmax's weights, tokens x tokens a head in fp32: a profile scaled in proportion
    missed them at a longer step (2048 -> 4096 tokens on the GPU: predicted 8.34 GB, peaked 10.35). The probe runs
    again on the first half and quarter of the tokens and separates the part that grows with the square; fused
    attention's saved tensors are per token, so nothing there."""
    from hf_offload.memory_budget import probes

    tokens, heads = 4 * SEQ, 4
    layer = build_model("llama", dtype="fp32", device="cpu", attn=attn, heads=heads, kv_heads=2, **SIZE).model.layers[0]
    hidden = torch.randn(1, tokens, SIZE["hidden"])
    position = torch.arange(tokens)[None]
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(layer.self_attn.config)
    probe = probes.probe_layer(layer, (hidden,), {"position_embeddings": rotary(hidden, position)}, probes.Meter("cpu"))
    profile, weights = probe.profile, heads * tokens * tokens * 4
    if attn == "sdpa":
        assert profile.quadratic_saved_bytes == profile.quadratic_selective_bytes == 0
    else:
        assert weights <= profile.quadratic_saved_bytes <= profile.saved_bytes
        assert profile.quadratic_saved_bytes % weights == 0  # whole tokens x tokens tensors, nothing per token
        assert weights <= profile.quadratic_selective_bytes <= profile.selective_bytes  # q @ k's product
    # Scaled to twice the tokens, the square part grows four times and the rest twice.
    doubled = profile.scaled(tokens, 2 * tokens)
    assert doubled.saved_bytes == 2 * profile.saved_bytes + 2 * profile.quadratic_saved_bytes
    assert probe.quadratic_working_bytes == 0  # on CPU: the gradients of the input and the weights, none quadratic


def test_a_probe_measures_its_forwards_peak_and_the_part_of_it_that_grows_with_the_square_of_the_tokens():
    """A checkpoint's recomputation holds the forward's peak inside backward, temporaries included (on an H200, a
    LoRA adapter's cast inputs put SmolLM2-1.7B's step 134 MB above the model there): the probe keeps its forward's
    peak over what was allocated before it, from the last kept run, and separates its square part over the three
    lengths as it does the saved bytes'. A meter whose counter reads as scripted: per run, the forward's peak, then
    the backward's; three kept runs at 96 tokens, then the runs at 48 and 24 (1000 + 10 t + t**2 bytes forward)."""
    from hf_offload.memory_budget import probes

    def forward_peak(tokens):
        return 1000 + 10 * tokens + tokens**2

    tokens = 4 * SEQ
    peaks = iter([forward_peak(96) + 7, 500, forward_peak(96) + 3, 500, forward_peak(96), 500,
                  forward_peak(48), 500, forward_peak(24), 500])  # fmt: skip

    class CountingMeter(probes.Meter):
        def allocated(self):
            return 0

        def reset_peak(self):
            pass

        def peak(self):
            return next(peaks)

    layer = build_model("llama", dtype="fp32", device="cpu", attn="sdpa", **SIZE).model.layers[0]
    hidden = torch.randn(1, tokens, SIZE["hidden"])
    position = torch.arange(tokens)[None]
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(layer.self_attn.config)
    probe = probes.probe_layer(layer, (hidden,), {"position_embeddings": rotary(hidden, position)},
                               CountingMeter("cpu"))  # fmt: skip
    assert next(peaks, None) is None
    assert probe.profile.forward_peak_bytes == forward_peak(96)
    assert probe.profile.quadratic_forward_peak_bytes == 96**2
    doubled = probe.profile.scaled(tokens, 2 * tokens)
    assert doubled.forward_peak_bytes == 2 * (1000 + 10 * 96) + 4 * 96**2
    # Without a memory counter (the CPU test mode) nothing is measured: the model counts the saved bytes instead.
    plain = probes.probe_layer(layer, (hidden,), {"position_embeddings": rotary(hidden, position)}, probes.Meter("cpu"))
    assert plain.profile.forward_peak_bytes == plain.profile.quadratic_forward_peak_bytes == 0


def test_the_link_probe_takes_at_most_half_the_room_the_budget_leaves():
    """The link is probed inside the first profiled step, whose peak must stay under the budget: its device buffer
    takes at most half of the room above the memory allocated then (a power of two, from 1 MiB to 64 MiB)."""
    mib = 2**20
    assert link_probe_bytes(None) == 64 * mib  # no memory counter: no room known
    assert link_probe_bytes(10**12) == 64 * mib
    assert link_probe_bytes(128 * mib) == 64 * mib
    assert link_probe_bytes(44 * mib) == 16 * mib  # ZeRO-3's room on two H200s: 22 MiB fits, 16 MiB is taken
    assert link_probe_bytes(3 * mib) == mib
    assert link_probe_bytes(0) == mib and link_probe_bytes(-5 * mib) == mib  # the floor: a copy that times the link


def test_the_link_probe_copies_its_buffer_until_64_mib_each_way(monkeypatch):
    """A smaller buffer is copied as many times as 64 MiB needs, so the rate is timed over as many bytes."""
    copies = []
    original = torch.Tensor.copy_

    def counted(self, source, non_blocking=False):
        copies.append(source.numel())
        return original(self, source, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    to_host, to_device = measure_link_bandwidth(Meter("cpu"), torch.device("cpu"), False, room_bytes=8 * 2**20)
    assert to_host > 0 and to_device > 0
    assert copies == [4 * 2**20] * (2 * (1 + 16))  # each way: a warm-up, then 16 timed copies of 4 MiB


def test_saved_bytes_are_the_storages_alive_when_the_forward_ends() -> None:
    # A layer may save tensors in a part of its graph it then drops, and the allocator may place the next saved
    # tensor where a dropped one was: counted as they came, by address, that counted a dropped storage, once or
    # twice depending on where the allocator put things.
    x = torch.randn(1000, requires_grad=True)
    counter = _CountSavedBytes(set())
    with counter:
        kept = (x * 2).exp()  # exp saves its output: 4,000 bytes
        dropped = (x.repeat(2) * 3).sin()  # sin saves its input, 8,000 bytes, freed with its graph
        del dropped
        also_kept = (x * 4).exp()  # may land where the dropped output was
    assert (counter.nbytes, counter.tensors) == (2 * x.nbytes, 2)
    assert kept.grad_fn is not None and also_kept.grad_fn is not None


class _WritesIntoItsProduct(torch.nn.Module):
    """A made-up layer that adds its input in place into the output of a linear map over 3-d hidden states (an
    `_unsafe_view` of an `mm`, whose version counter is its own: torch's selective checkpoint cannot see the write),
    then computes from the sum either what autograd saves (`then="saved"`: an RMS norm's input) or only an add,
    which saves no values (`then="added"`, Falcon's case)."""

    def __init__(self, then: str) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16, bias=False)
        self.norm = torch.nn.RMSNorm(16) if then == "saved" else None
        self.then = then

    def forward(self, hidden: torch.Tensor, **kwargs) -> torch.Tensor:  # the probe passes use_cache=False
        product = self.proj(hidden)
        product += hidden
        return self.norm(product) if self.then == "saved" else product + 1


def _selectively_checkpointed_gradients_equal(layer: torch.nn.Module, hidden: torch.Tensor) -> bool:
    from hf_offload.memory_budget.layer_actions import selective_checkpoint_function

    def gradients(run):
        x = hidden.detach().clone().requires_grad_(True)
        out = run(x)
        return torch.autograd.grad(out, [x, *layer.parameters()], torch.ones_like(out))

    checkpointed = gradients(lambda x: selective_checkpoint_function()(layer, x))
    return all(torch.equal(a, b) for a, b in zip(gradients(layer), checkpointed))


@pytest.mark.parametrize("then", ["saved", "added"])
def test_a_layer_that_writes_into_a_product_a_selective_checkpoint_keeps_is_refused_where_its_gradients_would_differ(
    then,
):
    """The probe follows the write: where autograd saves something computed from the written product, the selective
    checkpoint's recomputation (which is handed the product already written and writes it again) gives other
    gradients, and the probe says the layer must not be checkpointed selectively; where nothing saved depends on it,
    the gradients are exact and the probe says nothing."""
    from hf_offload.memory_budget import probes

    torch.manual_seed(0)
    layer = _WritesIntoItsProduct(then)
    hidden = torch.randn(2, 8, 16)
    exact = _selectively_checkpointed_gradients_equal(layer, hidden)
    probe = probes.probe_layer(layer, (hidden,), {}, probes.Meter("cpu"))
    assert exact == (then == "added")
    if then == "saved":
        assert probe.selective_error.startswith("aten.add_.Tensor writes in place into the output of a matrix product")
    else:
        assert probe.selective_error is None


class _ScalesItsProductInPlace(GradientCheckpointingLayer):
    """A made-up decoder layer (checkpointed as transformers' are) whose weight is a base plus a product scaled in
    place, as peft 0.22 computes a LoRA on a mixture's experts (`delta = B @ A; delta.mul_(scaling)`, then the base
    weight plus `delta`): the write bumps the product's own version counter, which a selective checkpoint's cache
    checks in its recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16))
        self.a = torch.nn.Parameter(torch.randn(4, 16))
        self.b = torch.nn.Parameter(torch.randn(16, 4))

    def forward(self, hidden: torch.Tensor, **kwargs) -> torch.Tensor:  # the probe passes use_cache=False
        delta = self.b @ self.a
        delta.mul_(0.5)
        return torch.nn.functional.linear(hidden, self.weight + delta).relu()


def test_a_layer_whose_selective_checkpoint_would_fail_is_refused_one_without_running_it():
    """torch's selective checkpoint raises in the recomputation of such a layer; the probe, having found the write
    in the layer's kept run, neither runs the layer so nor lets a plan do it."""
    from hf_offload.memory_budget import probes
    from hf_offload.memory_budget.layer_actions import checkpointing_as, selective_checkpoint_function

    torch.manual_seed(0)
    layer, hidden = _ScalesItsProductInPlace(), torch.randn(2, 8, 16)
    x = hidden.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="mutated"), checkpointing_as(layer, selective_checkpoint_function()):
        torch.autograd.grad(layer(x), x, torch.ones_like(x))
    probe = probes.probe_layer(layer, (hidden,), {}, probes.Meter("cpu"))
    assert probe.selective_error.startswith("aten.mul_.Tensor writes in place into the output of a matrix product")
    assert probe.profile.selective_recompute_s == 0.0


def test_gemma3n_text_layers_are_refused_a_selective_checkpoint_by_the_probe():
    """Gemma 3n's AltUp adds its input in place into a `matmul` over 4-d tensors (`predictions += hidden_states`),
    then normalizes the sum: the probe finds it. Llama's layer writes into no such output."""
    if not hasattr(transformers, "Gemma3nForCausalLM"):
        pytest.skip("this transformers has no Gemma 3n")
    from hf_offload.memory_budget import probes

    model = tiny_gemma3n()
    found = {}

    def probe(layer, args, kwargs):
        if layer not in found:
            found[layer] = None  # the probe calls the layer too
            found[layer] = probes.probe_layer(layer, args, kwargs, probes.Meter("cpu")).selective_error
        return None

    handle = model.model.layers[0].register_forward_pre_hook(probe, with_kwargs=True)
    ids = torch.randint(128, (1, 16))
    model(input_ids=ids)
    handle.remove()
    assert "aten.add_.Tensor writes in place" in found[model.model.layers[0]]
    layer = build_model("llama", dtype="fp32", device="cpu", attn="sdpa", **SIZE).model.layers[0]
    hidden = torch.randn(1, SEQ, SIZE["hidden"])
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(layer.self_attn.config)
    kwargs = {"position_embeddings": rotary(hidden, torch.arange(SEQ)[None])}
    assert probes.probe_layer(layer, (hidden,), kwargs, probes.Meter("cpu")).selective_error is None


def test_gemma3n_layers_sharing_keys_and_values_are_probed_on_their_first_tokens(monkeypatch):
    """Gemma 3n's last layers read the keys and values of earlier ones from a `KVSharingDict` (a `UserDict`, which
    pytrees do not enter), as long as the sequence: cut with the other arguments, every layer runs on the probe's
    tokens (on the whole call, before: the cut call did not run), and the step's own dictionary is left as it was."""
    if not hasattr(transformers, "Gemma3nForCausalLM"):
        pytest.skip("this transformers has no Gemma 3n")
    from hf_offload.memory_budget import probes

    monkeypatch.setattr(probes, "PROBE_MAX_TOKENS", 16)
    model = tiny_gemma3n()
    probed = {}

    def probe(layer, args, kwargs):
        if layer in probed:
            return None  # the probe's own calls of the layer
        shared = kwargs["shared_kv_states"]
        before = {key: tuple(map(id, value)) for key, value in shared.items()}
        probed[layer] = None
        probed[layer] = probes.probe_layer(layer, args, kwargs, probes.Meter("cpu"))
        assert {key: tuple(map(id, value)) for key, value in shared.items()} == before
        return None

    for layer in model.model.layers:
        layer.register_forward_pre_hook(probe, with_kwargs=True)
    model(input_ids=torch.randint(128, (1, 24)))
    assert len(probed) == len(model.model.layers) and any(layer.self_attn.is_kv_shared_layer for layer in probed)
    for layer, found in probed.items():
        assert found.uncut_error is None and found.tokens < found.step_tokens, type(layer).__name__


class _SavesASubclass(torch.nn.Module):
    """A layer whose forward saves a tensor subclass for its backward, as torch's ring attention saves DTensors under
    context parallelism."""

    class Marked(torch.Tensor):
        pass

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        marked = self.proj(hidden).as_subclass(self.Marked)
        return (marked * marked).as_subclass(torch.Tensor)


def test_a_layer_saving_what_offloading_keeps_is_planned_without_offloading_it_and_is_never_tiled_whole():
    """Offloading moves plain tensors only: a layer that saves a tensor subclass gets `offload_error` (no plan
    counts those bytes as moved, `StepProfile.offload_saved`), its bytes counted all the same, and is not tiled
    whole, decided before any chunk runs (under context parallelism the ranks' layers get different masks, so a
    tiled run refused on one rank only would leave another in ring attention's exchange)."""
    from hf_offload.memory_budget import probes

    def tile_layer(tokens):
        raise AssertionError("the layer was run tiled whole")

    probe = probes.probe_layer(_SavesASubclass(), (torch.randn(2, 16, 8),), {}, probes.Meter("cpu"),
                               tile_layer=tile_layer)  # fmt: skip
    assert probe.offload_error.startswith("it saves Markeds, which offloading keeps on the device")
    assert probe.layer_tiling_error.startswith("it saves Markeds, as torch's ring attention does")
    assert probe.profile.saved_bytes >= 2 * 16 * 8 * 4
    plain = probes.probe_layer(torch.nn.Linear(8, 8), (torch.randn(2, 16, 8),), {}, probes.Meter("cpu"))
    assert plain.offload_error is None
