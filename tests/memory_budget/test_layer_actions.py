"""Per-layer plans on a real transformers model, in CPU test mode: every action moves or recomputes bytes as it says,
and changes no arithmetic."""

import contextlib
import weakref
from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers import checkpointing_enable
from in_place_rope import patch_in_place_rope
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import set_checkpoint_early_stop

from hf_offload import OffloadActivations, get_act_offloading_ctx_manager
from hf_offload.memory_budget import layer_actions
from hf_offload.memory_budget.layer_actions import (
    apply_layer_actions,
    find_decoder_layers,
    saved_by_selective_checkpoint,
)

LAYERS = 4
CODES = {"K": ("keep", False), "O": ("offload", True), "S": ("selective", True), "s": ("selective", False),
         "X": ("selective_offload", True), "x": ("selective_offload", False),
         "C": ("full", True), "c": ("full", False), "T": ("full_tiled_mlp", True), "t": ("full_tiled_mlp", False),
         "L": ("tiled_layer", True), "l": ("tiled_layer", False)}  # fmt: skip
# The steps' 2 x 16 tokens in two chunks, for the tiled actions.
TILE_TOKENS = 16


def tiny_llama(attention: str) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      attn_implementation=attention)  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def actions(code: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(action=CODES[c][0], offload_input=CODES[c][1]) for c in code]


def step(model, context=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    ids = torch.randint(128, (2, 16))
    model.zero_grad(set_to_none=True)
    if context is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with context:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_decoder_layers_are_found_in_forward_order():
    model = tiny_llama("eager")
    assert [name for name, _ in find_decoder_layers(model)] == [f"model.layers.{i}" for i in range(LAYERS)]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("code", ["KKKK", "OOOO", "SSSS", "ssss", "CCCC", "cccc", "CSOK", "cSsK", "KOcC",
                                  "XXXX", "xxxx", "XCSK", "OXcX", "KxSX"])  # fmt: skip
def test_every_plan_is_bitwise_equal_to_no_offloading(code, attention):
    model = tiny_llama(attention)
    baseline = step(model)
    assert torch.equal(step(model)[0], baseline[0])  # the baseline repeats itself: the comparison means something
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    applied = apply_layer_actions(model, context, actions(code))
    for _ in range(2):  # the first step teaches the tail; the second runs with it
        loss, grads = step(model, context)
        assert torch.equal(loss, baseline[0])
        for name, grad in grads.items():
            assert torch.equal(grad, baseline[1][name]), name
    applied.remove()
    context.remove_hooks()


def test_an_in_place_rotary_embedding_rules_out_selective_checkpoints(monkeypatch):
    """Liger's rotary embedding rotates the projections' outputs in place, unseen by autograd: torch's selective
    checkpoint keeps those outputs (matrix products') for its recomputation, which then rotates them a second time,
    and the gradients differ. `apply_layer_actions` refuses the selective actions on such a model, changing nothing;
    the other actions stay bitwise equal."""
    patch_in_place_rope(monkeypatch)
    baseline = step(tiny_llama("sdpa"))
    model = tiny_llama("sdpa")
    for layer in model.model.layers:  # the selective action's checkpoint, set by hand
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = layer_actions.selective_checkpoint_function()
    loss, grads = step(model)
    assert torch.equal(loss, baseline[0]) and not torch.equal(grads["model.embed_tokens.weight"],
                                                              baseline[1]["model.embed_tokens.weight"])  # fmt: skip
    model = tiny_llama("sdpa")
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    for code in ("SSSS", "KsKK", "XXXX"):
        with pytest.raises(ValueError, match=r"selectively .*modeling_llama\.apply_rotary_pos_emb"):
            apply_layer_actions(model, context, actions(code))
        assert not any(layer.gradient_checkpointing for layer in model.model.layers)
    for code in ("KOcC", "CCCC", "OOOO"):
        applied = apply_layer_actions(model, context, actions(code))
        for _ in range(2):
            loss, grads = step(model, context)
            assert torch.equal(loss, baseline[0])
            assert all(torch.equal(grad, baseline[1][name]) for name, grad in grads.items()), code
        applied.remove()
    context.remove_hooks()


def offloaded_and_planned(code: str) -> tuple[int, int, int]:
    """(tensors offloaded, bytes offloaded, bytes kept by the plan) in one step of a plan."""
    model = tiny_llama("eager")
    context = get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail=False)
    apply_layer_actions(model, context, actions(code), TILE_TOKENS, TILE_TOKENS)
    step(model, context)
    stats = context.get_stats()
    return stats["tensors_offloaded"], stats["bytes_offloaded"], stats["bytes_kept_planned"]


def test_each_action_moves_what_it_says():
    outside = offloaded_and_planned("KKKK")  # the embedding's output and what runs around the layers
    assert outside[2] > 0  # the kept layers' tensors
    full = offloaded_and_planned("CCCC")
    assert full[0] - outside[0] == LAYERS and full[2] == 0  # one input per layer
    assert offloaded_and_planned("SSSS")[:2] == full[:2]  # the checkpoint's cache holds what selective saves
    kept_inputs = offloaded_and_planned("cccc")
    assert kept_inputs[0] == outside[0] and 0 < kept_inputs[2] < outside[2]  # the inputs, kept
    everything = offloaded_and_planned("OOOO")
    # every saved tensor of every layer moves: several per layer, far more bytes than the inputs alone
    assert everything[0] - outside[0] > 4 * LAYERS and everything[1] > 2 * full[1]
    one_each = offloaded_and_planned("CSOK")
    assert outside[0] < one_each[0] < everything[0] and 0 < one_each[2] < outside[2]


def test_a_layer_tiled_whole_moves_what_a_full_checkpoint_moves():
    """A layer tiled whole is its own checkpoint: it saves its input alone, which the engine offloads (`L`) or keeps
    (`l`) as it does a full checkpoint's (`C`, `c`)."""
    assert offloaded_and_planned("LLLL") == offloaded_and_planned("CCCC")
    # Kept: the inputs, and the parameters the op saves by reference (`save_for_backward`, so that an in-place change
    # is caught), which the keeping region counts with them: no bytes of their own.
    parameters = sum(p.numel() * p.element_size() for p in tiny_llama("eager").model.layers.parameters())
    kept, checkpointed = offloaded_and_planned("llll"), offloaded_and_planned("cccc")
    assert kept[:2] == checkpointed[:2] == (0, 0) and kept[2] == checkpointed[2] + parameters
    assert offloaded_and_planned("LlCC")[:2] == offloaded_and_planned("CcCC")[:2]


def tiled_whole(model) -> list[bool]:
    return [type(layer.__dict__.get("forward")).__name__ == "_TiledLayerForward" for _, layer in
            find_decoder_layers(model)]  # fmt: skip


@pytest.mark.parametrize("code", ["LLLL", "llll", "LlCK", "TtLl"])
def test_layers_tiled_whole_compute_as_the_tiled_layer_does(code):
    """Under the engine, a plan's layers tiled whole compute bitwise as `apply_tiled_layer` on those layers without
    it (the engine copies bytes), and within the tiled layer's tolerance of the untiled model (fp32: 1e-5, see
    tests/tiled/test_layer_op.py), not bitwise: sums over chunks. `remove()` gives the layers their own forward back."""
    from hf_offload.tiled.apply import apply_tiled_layer, apply_tiled_mlp

    model = tiny_llama("sdpa")
    untiled = step(model)
    whole = [i for i, letter in enumerate(code) if letter in "Ll"]
    mlps = [i for i, letter in enumerate(code) if letter in "Tt"]
    with apply_tiled_layer(model, TILE_TOKENS, layers=whole):
        if mlps:
            with apply_tiled_mlp(model, TILE_TOKENS, layers=mlps):
                reference = step(model)
        else:
            reference = step(model)
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    applied = apply_layer_actions(model, context, actions(code), TILE_TOKENS, TILE_TOKENS)
    assert tiled_whole(model) == [letter in "Ll" for letter in code]
    for _ in range(2):
        loss, grads = step(model, context)
        assert torch.equal(loss, reference[0])
        assert all(torch.equal(grad, reference[1][name]) for name, grad in grads.items())
    assert (loss - untiled[0]).abs() <= 1e-5 * untiled[0].abs()
    for name, grad in grads.items():
        assert (grad - untiled[1][name]).abs().max() <= 1e-5 * untiled[1][name].abs().max(), name
    assert not all(torch.equal(grad, untiled[1][name]) for name, grad in grads.items())  # tiled, not bitwise
    applied.remove()
    context.remove_hooks()
    assert tiled_whole(model) == [False] * LAYERS


def test_a_plan_that_cannot_tile_a_layer_changes_nothing(monkeypatch):
    """apply_tiled_layer refuses (a ValueError, e.g. an attention that does not call the interface) after the MLPs
    were tiled: they are untiled again, and no layer's attributes changed."""
    model = tiny_llama("eager")
    layers = [layer for _, layer in find_decoder_layers(model)]
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    before = [dict(layer.__dict__) for layer in layers] + [dict(layer.mlp.__dict__) for layer in layers]

    def refuse(*args, **kwargs):
        raise ValueError("cannot tile")

    monkeypatch.setattr(layer_actions, "apply_tiled_layer", refuse)
    with pytest.raises(ValueError, match="cannot tile"):
        apply_layer_actions(model, context, actions("TTLC"), TILE_TOKENS, TILE_TOKENS)
    assert [dict(layer.__dict__) for layer in layers] + [dict(layer.mlp.__dict__) for layer in layers] == before


class SelectiveOutputs(TorchDispatchMode):
    """Counts the outputs a selective checkpoint saves (calls and bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if saved_by_selective_checkpoint(func):
            self.calls += 1
            self.nbytes += sum(t.nbytes for t in (out if isinstance(out, tuple) else (out,)))
        return out


def test_a_selective_offload_sends_what_a_selective_checkpoint_saves_through_the_engine():
    counter = SelectiveOutputs()  # one layer's matrix products and attention, run plainly
    model = tiny_llama("eager")
    layer = model.model.layers[1]
    layer.register_forward_pre_hook(lambda *_: counter.__enter__() and None)
    layer.register_forward_hook(lambda *_: counter.__exit__(None, None, None))
    step(model)
    assert counter.calls == 9  # q, k, v, scores, scores @ v, o, gate, up, down
    selective, offloaded = offloaded_and_planned("KSKK"), offloaded_and_planned("KXKK")
    assert offloaded[0] - selective[0] == counter.calls and offloaded[1] - selective[1] == counter.nbytes
    assert offloaded[2] == selective[2]  # the kept layers alone
    kept_input = offloaded_and_planned("KxKK")
    assert kept_input[0] == offloaded[0] - 1 and kept_input[2] > offloaded[2]  # its input stays, counted "planned"


def stashes(monkeypatch) -> list[weakref.ref]:
    """Weak references to every stash the selective offloads make from now on."""
    made = []
    contexts = layer_actions._stash_contexts

    def recording(*args):
        modes = contexts(*args)
        made.append(weakref.ref(modes[0]._stash))
        return modes

    monkeypatch.setattr(layer_actions, "_stash_contexts", recording)
    return made


def unpacks(stats) -> int:
    return stats["prefetch_hits"] + stats["prefetch_misses"] + stats["inflight_hits"]


@pytest.mark.parametrize("early_stop", [False, True])
def test_a_selective_offload_leaves_nothing_behind(monkeypatch, early_stop):
    made = stashes(monkeypatch)
    model = tiny_llama("eager")
    context = get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail=False)
    apply_layer_actions(model, context, actions("XXXX"))
    ids = torch.randint(128, (2, 16))
    for steps in (1, 2):
        # Forcing early stop overrides the checkpoint's own setting: the recomputation then stops before the
        # layer's last matrix product, whose stashed copy is never unpacked.
        with set_checkpoint_early_stop(True) if early_stop else contextlib.nullcontext():
            with context:
                loss = model(input_ids=ids, labels=ids).loss
            assert len(made) == steps * LAYERS and all(len(ref()) == 9 for ref in made[-LAYERS:])
            loss.backward()
        del loss
        stats = context.get_stats()
        # Every tensor handed to the engine is unpacked once (duplicates share a copy), or, under early stop, all
        # but the last product of each layer; and whatever was left dies with the graph: no stash, no host block.
        expected = stats["tensors_offloaded"] + stats["tensors_kept_duplicate"] - (LAYERS if early_stop else 0)
        assert unpacks(stats) == expected
        assert all(ref() is None for ref in made)
        assert context._pool.bytes_in_use() == 0


class MatmulCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.matmuls += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def backward_matmuls(code: str) -> int:
    model = tiny_llama("eager")
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    apply_layer_actions(model, context, actions(code))
    ids = torch.randint(128, (2, 16))
    with context:
        loss = model(input_ids=ids, labels=ids).loss
    with MatmulCounter() as counter:
        loss.backward()
    return counter.matmuls


def test_selective_checkpoints_recompute_no_matmul_and_full_ones_recompute_them_all():
    plain = backward_matmuls("KKKK")
    assert backward_matmuls("SSSS") == plain
    assert backward_matmuls("XXXX") == plain
    assert backward_matmuls("KxXS") == plain
    assert backward_matmuls("CCCC") > plain + LAYERS * 7  # q, k, v, o, gate, up, down per layer


@pytest.mark.parametrize(("code", "on_unpack"), [("SSCC", False), ("SKcs", False), ("SSXS", True), ("XXXX", True),
                                                 ("xCCC", True), ("OSSS", True)])  # fmt: skip
def test_unpacks_prefetch_unless_every_layer_hands_the_engine_only_its_input(code, on_unpack):
    model = tiny_llama("eager")
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    apply_layer_actions(model, context, actions(code))
    context.prefetch_on_unpack = not on_unpack
    with context:
        model(input_ids=torch.randint(128, (2, 16)))
    assert context.prefetch_on_unpack is on_unpack


@pytest.mark.parametrize(("before", "after"), [("CCCC", "OSSS"), ("OSSS", "CCCC")])
def test_a_plan_applied_as_a_forward_starts_decides_how_that_steps_backward_prefetches(before, after):
    """The model's hooks decide whether unpacks start reloads as a forward begins. A memory plan applied at the same
    forward's start by a hook registered after theirs (the budget's controller) changes the layers: that step's
    backward prefetches the new plan's way, not the last plan's. Exact either way."""
    model = tiny_llama("eager")
    baseline = step(model)
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    applied = apply_layer_actions(model, context, actions(before))

    def new_plan(module, args):  # registered after the context's hooks, as the controller's is
        nonlocal applied
        applied.remove()
        applied = apply_layer_actions(model, context, actions(after))

    model.register_forward_pre_hook(new_plan)
    seen = []
    unpack = context._unpack
    context._unpack = lambda saved: (seen.append(context.prefetch_on_unpack), unpack(saved))[1]
    loss, grads = step(model, context)
    assert seen and set(seen) == {after != "CCCC"}
    assert torch.equal(loss, baseline[0]) and all(torch.equal(grads[n], baseline[1][n]) for n in grads)


def test_a_selective_offload_outside_the_engine_is_a_selective_checkpoint():
    model = tiny_llama("eager")
    baseline = step(model)
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    apply_layer_actions(model, context, actions("XXXX"))
    for region in (contextlib.nullcontext, context.set_aside):  # no hooks at all; hooks that keep tensors
        loss, grads = step(model, region())
        assert torch.equal(loss, baseline[0]) and all(torch.equal(grads[n], baseline[1][n]) for n in grads)
        assert backward_matmuls_of(model, region()) == 0 and context._pool is None
    loss, grads = step(model, context)
    assert torch.equal(loss, baseline[0]) and all(torch.equal(grads[n], baseline[1][n]) for n in grads)
    assert context._pool is not None


def backward_matmuls_of(model, region) -> int:
    """The matrix products a step's backward runs beyond the plain backward's (those it recomputes)."""
    ids = torch.randint(128, (2, 16))
    with region:
        loss = model(input_ids=ids, labels=ids).loss
    with MatmulCounter() as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.matmuls - backward_matmuls("KKKK")


def test_a_second_backward_recomputes_what_the_first_took():
    model = tiny_llama("eager")

    def twice(context):
        torch.manual_seed(1)
        ids = torch.randint(128, (2, 16))
        model.zero_grad(set_to_none=True)
        with context:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        with MatmulCounter() as counter:
            loss.backward()
        return counter.matmuls, {name: p.grad.clone() for name, p in model.named_parameters()}

    plain_matmuls, baseline = twice(contextlib.nullcontext())
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    apply_layer_actions(model, context, actions("XXXX"))
    matmuls, grads = twice(context)
    assert matmuls == plain_matmuls + LAYERS * 9  # the stash was emptied by the first backward
    assert all(torch.equal(grads[name], baseline[name]) for name in grads)


def run_region(function, region_input, engine=None):
    """One forward and backward of `function` on a copy of `region_input`, under a selective offload when an engine
    is given; returns the output and the input's gradient."""
    torch.manual_seed(0)
    x = region_input.detach().clone().requires_grad_(True)
    if engine is None:
        out = function(x)
    else:
        with engine:
            out = layer_actions._layer_function("selective_offload", True, engine)(function, x)
    out.sum().backward()
    return out.detach(), x.grad


def test_random_numbers_drawn_after_a_stashed_op_are_drawn_again(monkeypatch):
    # On a GPU, attention with dropout is a stashed op that draws random numbers. On the CPU no stashed op draws any,
    # so dropout stands in for it: the uniform numbers drawn after it must be those of the forward.
    monkeypatch.setattr(layer_actions, "_SAVED_BY_SELECTIVE_CHECKPOINT",
                        layer_actions._SAVED_BY_SELECTIVE_CHECKPOINT | {torch.ops.aten.native_dropout})  # fmt: skip
    weight, region_input = torch.randn(64, 64), torch.randn(64, 64)

    def region(x):
        h = torch.native_dropout(x @ weight, 0.5, True)[0]
        return h * torch.rand_like(h)

    engine = OffloadActivations(device_type="cpu")
    reference = run_region(region, region_input)
    got = run_region(region, region_input, engine)
    assert engine.get_stats()["tensors_offloaded"] == 4  # the input, the product, dropout's output and mask
    assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])


def test_a_selective_offload_refuses_a_write_into_a_stashed_output():
    weight, region_input = torch.randn(64, 64), torch.randn(64, 64)

    def region(x):
        h = x @ weight
        h.add_(1)
        return h

    run_region(region, region_input)  # fine without a checkpoint
    with pytest.raises(RuntimeError, match="writes in place into the output of a matrix product"):
        run_region(region, region_input, OffloadActivations(device_type="cpu"))


def test_removing_a_plan_restores_the_layers():
    model = tiny_llama("eager")
    checkpointing_enable(model, {"use_reentrant": False})
    layers = [layer for _, layer in find_decoder_layers(model)]
    before = [(layer.gradient_checkpointing, layer._gradient_checkpointing_func) for layer in layers]
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    hooks = [(dict(layer._forward_pre_hooks), dict(layer._forward_hooks)) for layer in layers]  # the context's
    applied = apply_layer_actions(model, context, actions("KOSC"))
    # Kept layers run through a "checkpoint function" that does not checkpoint; offloaded ones run plainly.
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, True, True]
    applied.remove()
    assert [(layer.gradient_checkpointing, layer._gradient_checkpointing_func) for layer in layers] == before
    assert [(dict(layer._forward_pre_hooks), dict(layer._forward_hooks)) for layer in layers] == hooks


def test_a_plan_must_fit_the_model():
    model = tiny_llama("eager")
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    with pytest.raises(ValueError, match="3 layer actions but LlamaForCausalLM has 4"):
        apply_layer_actions(model, context, actions("KKK"))
    with pytest.raises(ValueError, match="unknown layer actions"):
        apply_layer_actions(model, context, [SimpleNamespace(action="tile", offload_input=True)] * LAYERS)
