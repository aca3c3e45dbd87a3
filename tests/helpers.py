"""What the Trainer and TRL tests share: a tiny model, its tokenizer and data, the arguments, and the checks.

Everything runs on CPU. Offloading itself needs an accelerator, so the tests run the engine in its CPU test mode
(`CPU_TEST_MODE`), which moves CPU tensors through a separate host buffer with the same bookkeeping: the statistics
are real, and "bitwise equal with and without offloading" means something. `tests/conftest.py` builds the data once
per test module, as fixtures.

The examples are importable as modules (`import example_utils`) because `tests/conftest.py` puts their folder on
the path.
"""

from pathlib import Path
from typing import Any

import datasets
import example_utils
import torch
import transformers

from hf_offload import ActivationOffloadingCallback

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

MAX_LENGTH = 32
CPU_TEST_MODE = {"activation_offloading_device_type": "cpu"}
COMMON_ARGS: dict[str, Any] = {
    "max_steps": 4,
    "per_device_train_batch_size": 2,
    "per_device_eval_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-3,
    "logging_steps": 1,
    "eval_strategy": "steps",
    "eval_steps": 2,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "dataloader_num_workers": 0,
    "disable_tqdm": True,
    "seed": 0,
}


def config_args(tmp_path: Path, offloading: bool, **overrides: Any) -> dict[str, Any]:
    """The arguments of a TRL config for a short CPU run (which saves nothing)."""
    return {
        "output_dir": str(tmp_path / ("on" if offloading else "off")),
        "activation_offloading": offloading,
        "bf16": False,  # TRL defaults to True, which transformers refuses without an accelerator
        **CPU_TEST_MODE,
        **{**COMMON_ARGS, **overrides},
    }


# ---------------------------------------------------------------------------------------------------- model and data


def load_text_dataset() -> datasets.Dataset:
    """The first 64 lines of the examples' dataset, in a column `text`."""
    return example_utils.load_text_dataset(example_utils.DataArguments()).select(range(64))


def fit_tokenizer(text_dataset: datasets.Dataset) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer fitted on `text_dataset`."""
    return example_utils.fit_word_tokenizer(text_dataset[example_utils.TEXT_COLUMN])


def tokenize_for_lm(
    text_dataset: datasets.Dataset, tokenizer: transformers.PreTrainedTokenizerBase
) -> datasets.Dataset:
    """`text_dataset` tokenized for causal language modelling, each line cut to `MAX_LENGTH` tokens."""
    return text_dataset.map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH),
        batched=True,
        remove_columns=["text"],
    )


def tiny_model(tokenizer: transformers.PreTrainedTokenizerBase) -> transformers.LlamaForCausalLM:
    """A 2-layer Llama of hidden size 32, with the same random weights at every call."""
    transformers.set_seed(0)  # the same initial weights in every run that is compared
    return example_utils.tiny_llama(tokenizer, hidden_size=32)


# ---------------------------------------------------------------------------------------------------- checks


def train_losses(trainer: transformers.Trainer) -> list[float]:
    return [record["loss"] for record in offload_logs(trainer)]


def offload_logs(trainer: transformers.Trainer) -> list[dict[str, Any]]:
    """The training progress logs, which carry the `offload/...` entries."""
    return [record for record in trainer.state.log_history if "loss" in record]


def assert_offload_stats_logged(trainer: transformers.Trainer) -> None:
    """Every training log (`logging_steps=1`) has the statistics, with bytes offloaded; no other log has them."""
    logs = offload_logs(trainer)
    assert len(logs) == trainer.state.global_step
    for record in logs:
        assert record["offload/steps"] == trainer.args.gradient_accumulation_steps
        assert record["offload/bytes_offloaded"] > 0
        assert record["offload/bytes_offloaded_per_step"] == record["offload/bytes_offloaded"] / record["offload/steps"]
        assert record["offload/pinned_bytes"] > 0
        assert "offload/compute_wait_s" in record
        assert any(key.startswith("offload/tensors_kept_") for key in record)
    others = [record for record in trainer.state.log_history if "loss" not in record]
    if trainer.args.eval_strategy != "no":
        assert any("eval_loss" in record for record in others)
    assert not any(key.startswith("offload/") for record in others for key in record)


def assert_same_weights(first: torch.nn.Module, second: torch.nn.Module) -> None:
    first_state, second_state = first.state_dict(), second.state_dict()
    assert first_state.keys() == second_state.keys()
    for name, tensor in first_state.items():
        assert torch.equal(tensor, second_state[name]), name


def offloading_callbacks(trainer: transformers.Trainer) -> list[ActivationOffloadingCallback]:
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ActivationOffloadingCallback)]


def wrapped(trainer: transformers.Trainer) -> bool:
    """Whether the callback's wrapper of `compute_loss_context_manager` is in place."""
    return "compute_loss_context_manager" in vars(trainer)


def head_hooks(model: torch.nn.Module) -> int:
    """Forward hooks on the model's output head; 0 for a model without one (a sequence classifier)."""
    head = model.get_output_embeddings()
    return 0 if head is None else len(head._forward_pre_hooks) + len(head._forward_hooks)


def checkpointing_enable(model: transformers.PreTrainedModel, kwargs: dict[str, Any]) -> None:
    """Turn the model's activation checkpointing on by the name its transformers has: `activation_checkpointing_enable`
    from 5.23 on, `gradient_checkpointing_enable` before."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
