"""A plan applied in the middle of a training forward, as the controller applies the first step's once the last kind
of layer is probed at its first call: the layers that ran before it keep their actions until the next forward, so
that their checkpoints recompute in backward what their forward ran (CPU test mode)."""

import sys
from pathlib import Path

import pytest
import torch
import transformers

from hf_offload import InfeasibleBudgetError, get_act_offloading_ctx_manager
from hf_offload.memory_budget.layer_actions import find_decoder_layers
from hf_offload.memory_budget.plan_application import LayersUnderPlan, engine_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from _gpu_models import dispose  # noqa: E402

LAYERS = 4


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      attn_implementation="eager")  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def tiled(mlp: torch.nn.Module) -> bool:
    return "forward" in vars(mlp)


def test_a_plan_applied_mid_forward_reaches_the_layers_that_ran_at_the_next_forward():
    """Every layer checkpointed, then, as layer 2 starts, a plan that tiles every MLP: layers 0 and 1 recompute
    untiled in this step's backward (tiled, torch's checkpoint would find fewer tensors saved: a CheckpointError), and
    run tiled from the next forward on."""
    model = tiny_llama()
    engine = get_act_offloading_ctx_manager(model, device_type="cpu")
    layers = [layer for _, layer in find_decoder_layers(model)]
    under_plan = LayersUnderPlan(model, engine, layers)
    order = list(range(LAYERS))
    no_start = lambda *args: None  # noqa: E731 - transformers 5.24 on calls it only from the layers' pre-hooks
    under_plan.apply("C" * LAYERS, order, engine_settings("C" * LAYERS), no_start)
    applied_at = []

    def layer_starts(index: int, module: torch.nn.Module, args: tuple) -> None:
        if index == 2 and not applied_at:
            applied_at.append(index)
            under_plan.apply("T" * LAYERS, order, engine_settings("T" * LAYERS), no_start, tile_tokens=16)
        under_plan.layer_ran(index)

    hooks = [layer.register_forward_pre_hook(lambda module, args, index=i: layer_starts(index, module, args))
             for i, layer in enumerate(layers)]  # fmt: skip
    hooks.append(model.register_forward_pre_hook(lambda module, args: under_plan.forward_begins()))
    ids = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(1))
    try:
        with engine:
            loss = model(input_ids=ids, labels=ids).loss
        assert [tiled(layer.mlp) for layer in layers] == [False, False, True, True]
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        with engine:
            model(input_ids=ids, labels=ids).loss.backward()
        assert [tiled(layer.mlp) for layer in layers] == [True] * LAYERS
    finally:
        for hook in hooks:
            hook.remove()
        under_plan.remove()
        dispose(engine)
    assert not any(tiled(layer.mlp) for layer in layers)


@pytest.mark.skipif(not hasattr(transformers, "Qwen3_5ForCausalLM"), reason="Qwen3.5 came with transformers 5.2x")
def test_a_hybrid_whose_plan_is_made_at_its_second_kind_of_layer_trains_at_the_smallest_budget():
    """Qwen3.5's first layer is linear attention, its second full attention: the first step's plan is made as the
    second starts, once both kinds are probed, and at the smallest budget a refusal names it tiles the first layer's
    MLP, which had run untiled."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    ids = torch.randint(3, 1000, (2, 64), generator=torch.Generator().manual_seed(1234))

    def train(budget: int) -> tuple[list[float], str]:
        torch.manual_seed(0)
        model = transformers.Qwen3_5ForCausalLM(config).train()
        model.config._attn_implementation = "eager"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
        losses, codes = [], []
        try:
            for _ in range(3):
                with context:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                codes.append(context.budget_controller.planner.code)
        finally:
            dispose(context)
        return losses, codes

    with pytest.raises(InfeasibleBudgetError) as refused:
        train(1)
    losses, codes = train(refused.value.minimum_bytes)
    assert codes[0][0] in "Tt" and all(loss == loss for loss in losses), codes
