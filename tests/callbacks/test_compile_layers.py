"""`callbacks/compile_layers.py`: the Trainer's `torch_compile=True` under offloading compiles the decoder layers and
the loss, not the whole model, in the CPU test mode; compared with the same regional compilation without offloading.
How the engine meets compiled layers and a model compiled whole is `test_compile.py`'s."""

import logging

import torch
import torch._dynamo
import transformers
from torch._dynamo.utils import counters

import hf_offload


def test_the_trainers_torch_compile_with_offloading_compiles_the_layers_and_offloads_exactly(
    tmp_path, tokenizer, lm_dataset, caplog
):
    # A model compiled whole would leave offloading nothing to do (test_compile.py), so the Trainer's torch_compile=True
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
