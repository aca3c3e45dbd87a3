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
from compile_runs import bitwise_equal, build, train
from torch._dynamo.utils import counters

import hf_offload

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


def test_the_trainers_torch_compile_with_offloading_compiles_the_layers_and_offloads_exactly(
    tmp_path, tokenizer, lm_dataset, caplog
):
    # A model compiled whole would leave offloading nothing to do (see above), so the Trainer's torch_compile=True
    # compiles the decoder layers under offloading. The comparison is the same regional compilation without it.
    from helpers import COMMON_ARGS, CPU_TEST_MODE, assert_same_weights, tiny_model

    def run(name: str, torch_compile: bool, offloading: bool, compile_layers: bool = False) -> tuple:
        torch._dynamo.reset()
        counters.clear()
        model = tiny_model(tokenizer)
        if compile_layers:
            hf_offload.compile_decoder_layers(model)
            assert hf_offload.compile_loss(model) and not hf_offload.compile_loss(model)  # once
        args = hf_offload.TrainingArguments(output_dir=str(tmp_path / name), torch_compile=torch_compile,
                                            activation_offloading=offloading, **CPU_TEST_MODE,
                                            **{**COMMON_ARGS, "eval_strategy": "no"})  # fmt: skip
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=lm_dataset,
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
        )
        trainer.train()
        losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
        graphs = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        return trainer, losses, graphs

    regional, regional_losses, regional_graphs = run("regional", torch_compile=False, offloading=False,
                                                     compile_layers=True)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        offloaded, offloaded_losses, offloaded_graphs = run("offloaded", torch_compile=True, offloading=True)
    assert offloaded_losses == regional_losses
    assert_same_weights(offloaded.model, regional.model)
    assert offloaded_graphs == regional_graphs and regional_graphs[0] >= 1  # compiled, and no graph or break added
    assert all(layer._compiled_call_impl is not None for layer in offloaded.model.model.layers)
    assert hasattr(offloaded.model.loss_function, "_torchdynamo_orig_callable")
    assert not isinstance(offloaded.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    stats = offloaded.callback_handler.callbacks[0].stats
    assert stats["tensors_offloaded"] > 0 and not stats.get("steps_stood_aside_compiled")
    warnings = [record.getMessage() for record in caplog.records if "decoder layers" in record.getMessage()]
    assert len(warnings) == 1 and "LlamaDecoderLayer) and its loss" in warnings[0]

    # A model that model_init builds anew in train() gets its layers compiled too (as training begins).
    torch._dynamo.reset()
    args = hf_offload.TrainingArguments(output_dir=str(tmp_path / "model_init"), torch_compile=True,
                                        activation_offloading=True, **CPU_TEST_MODE,
                                        **{**COMMON_ARGS, "eval_strategy": "no", "max_steps": 1})  # fmt: skip
    built = []

    def model_init() -> transformers.PreTrainedModel:
        built.append(tiny_model(tokenizer))
        return built[-1]

    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = transformers.Trainer(model_init=model_init, args=args, train_dataset=lm_dataset, data_collator=collator)
    trainer.train()
    assert len(built) == 2 and trainer.model is built[-1]
    assert all(layer._compiled_call_impl is not None for layer in trainer.model.model.layers)

    # Without offloading, torch_compile=True is left to the Trainer: the model compiled as a whole.
    whole, _, _ = run("whole", torch_compile=True, offloading=False)
    assert isinstance(whole.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert all(layer._compiled_call_impl is None for layer in whole.model.model.layers)


def test_a_memory_budget_under_compilation_trains_and_says_what_it_costs(caplog):
    # The planner's hooks must run, so where Dynamo traces them (transformers that checkpoint a layer inside its
    # forward) they break the compiled graphs: one warning says so. Where the layer's whole call is checkpointed, the
    # controller starts each layer from its checkpoint function, eagerly, and nothing is traced or said.
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
    traced = hasattr(type(model.model.layers[0]).forward, "__wrapped__")  # the checkpointing wrapper of `forward`
    assert sum("memory_budget with a compiled model" in r.message for r in caplog.records) == (1 if traced else 0)
