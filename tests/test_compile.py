"""torch.compile with offloading, in the CPU test mode: the engine under compiled layers (`compile_guard.py`,
`regional_compilation.py`); the Trainer's `torch_compile=True` is `callbacks/test_compile_layers.py`'s.

Regional compilation (each decoder layer compiled) keeps hf-offload's hooks around the layers: the layers' inputs
move as without compilation, the head and the loss stay exempt. Whole-model compilation traces the hooks away and
hands the compiled graph's saved tensors over only after its forward: the engine then stands aside, with one warning.
In both, the compiled graphs are the ones compiled without hf-offload (no graph and no break added: counted with
`torch._dynamo.utils.counters`), and losses and weights are bitwise equal to the compiled run without offloading,
whose repeatability is checked first.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch._dynamo
from checkpoint_around_the_call import checkpoint_around_the_call
from compile_runs import bitwise_equal, build, train
from torch.profiler import ProfilerActivity, profile
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import hf_offload
from hf_offload.regional_compilation import checkpointed_side_effects_not_replayed

INPUT_IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=[True, False], ids=["checkpointing", "no-checkpointing"])
def regional_baseline(request) -> tuple[bool, dict]:
    baseline = train("regional", request.param, offloading=False)
    assert bitwise_equal(baseline, train("regional", request.param, offloading=False))  # the comparison means something
    return request.param, baseline


def test_regional_compilation_offloads_as_in_eager_mode_and_changes_no_graph(regional_baseline):
    checkpointing, baseline = regional_baseline
    offloaded = train("regional", checkpointing, offloading=True)
    assert bitwise_equal(baseline, offloaded)
    assert (offloaded["graphs"], offloaded["breaks"]) == (baseline["graphs"], baseline["breaks"])
    assert baseline["graphs"] >= 1  # the layers did compile
    last = offloaded["stats"][-1]
    assert last["tensors_offloaded"] > 0 and last["tensors_kept_compiled"] == 0
    assert last["bytes_kept_exempt"] > 0  # the head and the loss run eagerly, in their exempt region


@pytest.mark.parametrize("context_first", [False, True], ids=["compiled-then-context", "context-then-compiled"])
def test_whole_model_compilation_stands_aside_with_one_warning(context_first, caplog):
    baseline = train("whole", checkpointing=True, offloading=False)
    assert bitwise_equal(baseline, train("whole", checkpointing=True, offloading=False))
    with caplog.at_level(logging.WARNING, logger="hf_offload.engine"):
        offloaded = train("whole", checkpointing=True, offloading=True, context_first=context_first)
    assert bitwise_equal(baseline, offloaded)
    assert (offloaded["graphs"], offloaded["breaks"]) == (baseline["graphs"], baseline["breaks"])
    warnings = [record.message for record in caplog.records if "compiled as a whole" in record.message]
    assert len(warnings) == 1 and "compile_decoder_layers(model)" in warnings[0]
    if not context_first:  # seen as the context is built: no step offloads
        assert offloaded["stats"][0]["tensors_offloaded"] == 0 and offloaded["stats"][0]["steps_stood_aside_compiled"]
    later = offloaded["stats"][1:]  # the first step shows the compile; every later one stands aside
    # Each later step's region is entered standing aside: no saved-tensor hook is pushed, none of its tensors reaches
    # the engine, and the step is counted as one stood aside.
    assert all(stats["tensors_offloaded"] == 0 and stats["steps_stood_aside_compiled"] == 1 for stats in later)
    assert all(not stats["tensors_kept_compiled"] for stats in later)


def test_an_eager_forward_of_part_of_the_model_is_not_taken_for_a_compiled_one():
    # A custom loop may run the base model and the head itself: the model's own forward hooks never run, but the
    # decoder layers' do, so the engine knows the forward was not compiled away.
    model = build(checkpointing=False, device="cpu")
    context = hf_offload.get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    for _ in range(2):
        with context:
            hidden = model.model(input_ids=INPUT_IDS).last_hidden_state
            loss = model.lm_head(hidden).float().logsumexp(-1).mean()
        loss.backward()
    assert context.get_stats()["tensors_offloaded"] > 0 and context.get_stats()["tensors_kept_compiled"] == 0


def test_a_memory_budget_under_compilation_trains_and_says_what_it_costs(caplog):
    # The planner's hooks must run, so where Dynamo traces them they break the compiled graphs: one warning says so.
    # compile_decoder_layers checkpoints inside each layer's forward on every transformers release (before 5.24 too).
    model = build(checkpointing=True, device="cpu")
    hf_offload.compile_decoder_layers(model)
    context = hf_offload.get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget="1GiB")
    input_ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for _ in range(4):
            with context:
                loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)  # gradients held would be micro-steps accumulating: no plan until a step
    assert context.memory_plan is not None and torch.isfinite(loss)
    assert sum("memory_budget with a compiled model" in r.message for r in caplog.records) == 1


def _forward_and_backward_peak(model: torch.nn.Module, runs: torch.nn.Module) -> int:
    """The highest sum of the CPU memory allocated by a step's forward and backward (the profiler's allocations and
    frees in order), after two steps that compile and warm up."""
    input_ids = torch.randint(0, 1024, (2, 1024), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        with checkpointed_side_effects_not_replayed():  # for the model compiled whole, as in compile_runs.train
            loss = runs(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    step(), step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    live = peak = 0
    for event in sorted(profiler.profiler.function_events, key=lambda event: event.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_a_layer_checkpointed_around_its_call_is_compiled_with_its_checkpoint_inside(monkeypatch):
    # transformers < 5.24 checkpoints around the call that `layer.compile()` compiles: backward recomputes the layer by
    # running its compiled forward, which makes every tensor that graph saves at once. compile_decoder_layers puts the
    # checkpoint inside the compiled graph, whose backward recomputes as it needs (regional_compilation.py).
    checkpoint_around_the_call(monkeypatch, LlamaDecoderLayer)
    peaks = {}
    for how in ("layer.compile()", "compile_decoder_layers", "whole"):
        torch._dynamo.reset()
        model = build(checkpointing=True, device="cpu", hidden=512, layers=2, vocab=1024)
        if how == "layer.compile()":
            for layer in model.model.layers:
                layer.compile()
        elif how == "compile_decoder_layers":
            hf_offload.compile_decoder_layers(model)
            assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # what logs and warnings name
        if how != "whole":  # as the Trainer's torch_compile=True under offloading does
            hf_offload.compile_loss(model)
        runs = torch.compile(model) if how == "whole" else model
        peaks[how] = _forward_and_backward_peak(model, runs)
    assert peaks["compile_decoder_layers"] < 0.8 * peaks["layer.compile()"], peaks
    assert peaks["compile_decoder_layers"] <= peaks["whole"], peaks


def test_a_layer_with_a_forward_of_its_own_keeps_its_checkpoint_around_the_call(monkeypatch):
    # accelerate's hooks set an instance `forward` that calls the class's forward of the time: the subclass's forward,
    # which checkpoints, would never run, so that layer keeps the class whose call checkpoints it.
    checkpoint_around_the_call(monkeypatch, LlamaDecoderLayer)
    model = build(checkpointing=True, device="cpu")
    hooked, plain = model.model.layers
    layer_class = type(hooked)
    hooked.forward = functools.partial(layer_class.forward, hooked)
    hf_offload.compile_decoder_layers(model)
    assert type(hooked) is layer_class and type(plain) is not layer_class and isinstance(plain, layer_class)
