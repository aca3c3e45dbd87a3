"""Per-layer plans on a real transformers model, in CPU test mode: every action moves or recomputes bytes as it says,
and changes no arithmetic."""

from types import SimpleNamespace

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from hf_offload import get_act_offloading_ctx_manager
from hf_offload.layer_plan import apply_layer_plan, find_decoder_layers

LAYERS = 4
CODES = {"K": ("keep", False), "O": ("offload", True), "S": ("selective", True), "s": ("selective", False),
         "C": ("full", True), "c": ("full", False)}  # fmt: skip


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
@pytest.mark.parametrize("code", ["KKKK", "OOOO", "SSSS", "ssss", "CCCC", "cccc", "CSOK", "cSsK", "KOcC"])
def test_every_plan_is_bitwise_equal_to_no_offloading(code, attention):
    model = tiny_llama(attention)
    baseline = step(model)
    assert torch.equal(step(model)[0], baseline[0])  # the baseline repeats itself: the comparison means something
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    applied = apply_layer_plan(model, context, actions(code))
    for _ in range(2):  # the first step teaches the tail; the second runs with it
        loss, grads = step(model, context)
        assert torch.equal(loss, baseline[0])
        for name, grad in grads.items():
            assert torch.equal(grad, baseline[1][name]), name
    applied.remove()
    context.remove_hooks()


def offloaded_and_planned(code: str) -> tuple[int, int, int]:
    """(tensors offloaded, bytes offloaded, bytes kept by the plan) in one step of a plan."""
    model = tiny_llama("eager")
    context = get_act_offloading_ctx_manager(model, device_type="cpu", keep_tail=False)
    apply_layer_plan(model, context, actions(code))
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
    apply_layer_plan(model, context, actions(code))
    ids = torch.randint(128, (2, 16))
    with context:
        loss = model(input_ids=ids, labels=ids).loss
    with MatmulCounter() as counter:
        loss.backward()
    return counter.matmuls


def test_selective_checkpoints_recompute_no_matmul_and_full_ones_recompute_them_all():
    plain = backward_matmuls("KKKK")
    assert backward_matmuls("SSSS") == plain
    assert backward_matmuls("CCCC") > plain + LAYERS * 7  # q, k, v, o, gate, up, down per layer


def test_removing_a_plan_restores_the_layers():
    model = tiny_llama("eager")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = [layer for _, layer in find_decoder_layers(model)]
    before = [(layer.gradient_checkpointing, layer._gradient_checkpointing_func) for layer in layers]
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    applied = apply_layer_plan(model, context, actions("KOSC"))
    # Kept layers run through a "checkpoint function" that does not checkpoint; offloaded ones run plainly.
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, True, True]
    applied.remove()
    assert [(layer.gradient_checkpointing, layer._gradient_checkpointing_func) for layer in layers] == before
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)


def test_a_plan_must_fit_the_model():
    model = tiny_llama("eager")
    context = get_act_offloading_ctx_manager(model, device_type="cpu")
    with pytest.raises(ValueError, match="3 layer actions but LlamaForCausalLM has 4"):
        apply_layer_plan(model, context, actions("KKK"))
    with pytest.raises(ValueError, match="unknown layer actions"):
        apply_layer_plan(model, context, [SimpleNamespace(action="tile", offload_input=True)] * LAYERS)
