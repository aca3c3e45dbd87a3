"""torch.compile with offloading, in the CPU test mode (issue 21, item 1).

Regional compilation (each decoder layer compiled) keeps hf-offload's hooks around the layers: the layers' inputs
move as without compilation, the head and the loss stay exempt. Whole-model compilation traces the hooks away and
hands the compiled graph's saved tensors over only after its forward: the engine then stands aside, with one warning.
In both, the compiled graphs are the ones compiled without hf-offload (no graph and no break added: counted with
`torch._dynamo.utils.counters`), and losses and weights are bitwise equal to the compiled run without offloading,
whose repeatability is checked first.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
import transformers
from torch._dynamo.utils import counters

import hf_offload

VOCAB, LAYERS, STEPS = 256, 2, 3
INPUT_IDS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))


def build(checkpointing: bool) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, use_cache=False,
                                      attn_implementation="sdpa")  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def train(compile_how: str, checkpointing: bool, offloading: bool, context_first: bool = False) -> dict:
    """Three SGD steps; the losses, the weights, the compiled graphs and breaks, the engine's last statistics."""
    torch._dynamo.reset()
    counters.clear()
    model = build(checkpointing)
    context = None
    if offloading and context_first:
        context = hf_offload.get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    if compile_how == "regional":
        for layer in model.model.layers:
            layer.compile()
        runs = model
    else:
        runs = torch.compile(model)
    if offloading and not context_first:
        context = hf_offload.get_act_offloading_ctx_manager(runs, device_type="cpu", min_offload_size=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, stats = [], []
    for _ in range(STEPS):
        with context if context is not None else torch.enable_grad():
            loss = runs(input_ids=INPUT_IDS, labels=INPUT_IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        stats.append(context.get_stats() if context is not None else None)
    return {"losses": losses, "weights": [p.detach().clone() for p in model.parameters()], "stats": stats,
            "graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def assert_bitwise(first: dict, second: dict) -> None:
    assert all(torch.equal(a, b) for a, b in zip(first["losses"], second["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(first["weights"], second["weights"]))


@pytest.fixture(scope="module", params=[True, False], ids=["checkpointing", "no-checkpointing"])
def regional_baseline(request) -> tuple[bool, dict]:
    baseline = train("regional", request.param, offloading=False)
    assert_bitwise(baseline, train("regional", request.param, offloading=False))  # the comparison means something
    return request.param, baseline


def test_regional_compilation_offloads_as_in_eager_mode_and_changes_no_graph(regional_baseline):
    checkpointing, baseline = regional_baseline
    offloaded = train("regional", checkpointing, offloading=True)
    assert_bitwise(baseline, offloaded)
    assert (offloaded["graphs"], offloaded["breaks"]) == (baseline["graphs"], baseline["breaks"])
    assert baseline["graphs"] >= 1  # the layers did compile
    last = offloaded["stats"][-1]
    assert last["tensors_offloaded"] > 0 and last["tensors_kept_compiled"] == 0
    assert last["bytes_kept_exempt"] > 0  # the head and the loss run eagerly, in their exempt region


@pytest.mark.parametrize("context_first", [False, True], ids=["compiled-then-context", "context-then-compiled"])
def test_whole_model_compilation_stands_aside_with_one_warning(context_first, caplog):
    baseline = train("whole", checkpointing=True, offloading=False)
    assert_bitwise(baseline, train("whole", checkpointing=True, offloading=False))
    with caplog.at_level(logging.WARNING, logger="hf_offload.engine"):
        offloaded = train("whole", checkpointing=True, offloading=True, context_first=context_first)
    assert_bitwise(baseline, offloaded)
    assert (offloaded["graphs"], offloaded["breaks"]) == (baseline["graphs"], baseline["breaks"])
    warnings = [record.message for record in caplog.records if "compiled as a whole" in record.message]
    assert len(warnings) == 1 and "layer.compile()" in warnings[0]
    later = offloaded["stats"][1:]  # the first step shows the compile; every later one stands aside
    assert all(stats["tensors_offloaded"] == 0 and stats["tensors_kept_compiled"] > 0 for stats in later)


def test_an_eager_forward_of_part_of_the_model_is_not_taken_for_a_compiled_one():
    # A custom loop may run the base model and the head itself: the model's own forward hooks never run, but the
    # decoder layers' do, so the engine knows the forward was not compiled away.
    model = build(checkpointing=False)
    context = hf_offload.get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    for _ in range(2):
        with context:
            hidden = model.model(input_ids=INPUT_IDS).last_hidden_state
            loss = model.lm_head(hidden).float().logsumexp(-1).mean()
        loss.backward()
    assert context.get_stats()["tensors_offloaded"] > 0 and context.get_stats()["tensors_kept_compiled"] == 0
