"""`callbacks/callback.py`: the callback that runs each training forward under the offloading context, on CPU (the
engine's CPU test mode, see `helpers`): exact losses and weights, its logs, nothing left on the trainer after
training, the summary on a line of its own, and the longest step a TRL configuration allows passed to the memory
budget."""

import contextlib
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import transformers
import trl
from helpers import (
    COMMON_ARGS,
    CPU_TEST_MODE,
    EXAMPLES,
    MAX_LENGTH,
    assert_offload_stats_logged,
    assert_same_weights,
    config_args,
    head_hooks,
    offloading_callbacks,
    tiny_model,
    train_losses,
    wrapped,
)

import hf_offload
from hf_offload import TrainingArguments
from hf_offload.callbacks.trl import SFTConfig


class HookProbe(transformers.TrainerCallback):
    """Records, at every step, whether the trainer's context method is wrapped and how many hooks the head has."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.trainer = trainer
        self.seen: list[tuple[bool, int]] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.seen.append((wrapped(self.trainer), head_hooks(self.trainer.model)))


def run_trainer(tmp_path: Path, tokenizer, lm_dataset, offloading: bool, **overrides: Any) -> transformers.Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / ("on" if offloading else "off")),
        activation_offloading=offloading,
        **CPU_TEST_MODE,
        **{**COMMON_ARGS, **overrides},
    )
    trainer = transformers.Trainer(
        model=tiny_model(tokenizer),
        args=args,
        train_dataset=lm_dataset,
        eval_dataset=lm_dataset.select(range(4)),
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.add_callback(HookProbe(trainer))
    trainer.train()
    return trainer


def test_trainer_offloading_is_exact_logs_stats_and_cleans_up(tmp_path, tokenizer, lm_dataset):
    off = run_trainer(tmp_path, tokenizer, lm_dataset, offloading=False)
    on = run_trainer(tmp_path, tokenizer, lm_dataset, offloading=True)

    assert not offloading_callbacks(off)
    assert len(offloading_callbacks(on)) == 1 and on.callback_handler.callbacks[0] is offloading_callbacks(on)[0]
    assert train_losses(on) == train_losses(off)
    assert [r["eval_loss"] for r in on.state.log_history if "eval_loss" in r] == [
        r["eval_loss"] for r in off.state.log_history if "eval_loss" in r
    ]
    assert_same_weights(on.model, off.model)
    assert_offload_stats_logged(on)
    assert offloading_callbacks(on)[0].stats["steps"] == on.state.global_step * on.args.gradient_accumulation_steps

    # Wrapped, with hooks on the head, during training; nothing left afterwards.
    probe = next(cb for cb in on.callback_handler.callbacks if isinstance(cb, HookProbe))
    assert probe.seen and all(is_wrapped and hooks > 0 for is_wrapped, hooks in probe.seen)
    assert not wrapped(on) and head_hooks(on.model) == 0
    assert isinstance(on.compute_loss_context_manager(), contextlib.ExitStack)


def test_trainer_resumes_from_checkpoint_with_offloading(tmp_path, tokenizer, lm_dataset):
    overrides = {"save_strategy": "steps", "save_steps": 2, "eval_strategy": "no"}
    first = run_trainer(tmp_path, tokenizer, lm_dataset, offloading=True, **overrides)
    args = TrainingArguments(**{**first.args.to_dict(), "max_steps": 6})
    resumed = transformers.Trainer(
        model=tiny_model(tokenizer),
        args=args,
        train_dataset=lm_dataset,
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    resumed.train(resume_from_checkpoint=str(Path(args.output_dir) / "checkpoint-4"))
    logs = [record for record in resumed.state.log_history if "loss" in record and record["step"] > 4]
    assert [record["step"] for record in logs] == [5, 6]
    assert all(record["offload/bytes_offloaded"] > 0 for record in logs)
    assert not wrapped(resumed) and head_hooks(resumed.model) == 0


def test_the_summary_starts_on_a_line_of_its_own_after_the_progress_bar(tmp_path):
    # stdout and stderr (where tqdm draws) merged, as in a terminal.
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "sft_trainer.py"), "--output_dir", str(tmp_path), "--max_steps", "2",
         "--report_to", "none", "--save_strategy", "no", "--activation_offloading",
         "--activation_offloading_device_type", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]
    start = result.stdout.index("activation offloading over 2 step(s)")
    assert start == 0 or result.stdout[start - 1] in "\r\n", repr(result.stdout[start - 80 : start + 40])


def test_the_trainer_integration_imports_without_ipython():
    # transformers' notebook progress callback needs IPython, which a plain training machine may not have.
    code = "import sys; sys.modules['IPython'] = None; import hf_offload.callbacks; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


def test_sft_trainer_under_a_memory_budget_checks_the_longest_step_its_max_length_allows(
    tmp_path, tokenizer, text_dataset, caplog
):
    """The callback tells the memory budget the longest step SFTConfig allows (per_device_train_batch_size x
    max_length): a budget that no plan of that step fits is warned of at the first plan, naming where the length comes
    from (here the budget fits no step at all, which the first plan then refuses)."""
    args = SFTConfig(
        **config_args(tmp_path, True, activation_offloading_memory_budget="1", eval_strategy="no"),
        max_length=4 * MAX_LENGTH,
    )
    trainer = trl.SFTTrainer(model=tiny_model(tokenizer), args=args, train_dataset=text_dataset,
                             processing_class=tokenizer)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hf_offload"), pytest.raises(hf_offload.InfeasibleBudgetError):
        trainer.train()
    warned = [
        record.getMessage() for record in caplog.records if "the longest step this run may see" in record.getMessage()
    ]
    assert len(warned) == 1
    assert (
        f"{2 * 4 * MAX_LENGTH} tokens (per_device_train_batch_size 2 x max_length {4 * MAX_LENGTH} of SFTConfig)"
        in (warned[0])
    )


def test_the_longest_step_of_a_trl_config_is_its_max_length_times_the_batch():
    from hf_offload.callbacks.callback import _longest_step_of

    assert _longest_step_of(SimpleNamespace(max_length=1024, per_device_train_batch_size=4)) == (
        4096, "per_device_train_batch_size 4 x max_length 1024 of SimpleNamespace")  # fmt: skip
    for max_length in ({}, {"max_length": None}, {"max_length": True}):  # no length, None, a flag
        assert _longest_step_of(SimpleNamespace(per_device_train_batch_size=4, **max_length)) is None


def test_under_context_or_sequence_parallelism_the_longest_step_is_a_ranks_shard_of_the_sequence():
    """accelerate's context parallelism (`cp_size`) and DeepSpeed's Ulysses (`sp_size`) give each rank's layers its
    shard of every sequence: the longest step a rank plans for is the shard's, not the whole sequence's, which no plan
    of one rank need fit."""
    from hf_offload.callbacks.callback import _longest_step_of, _sequence_shards

    def trainer(**sizes):
        return SimpleNamespace(accelerator=SimpleNamespace(parallelism_config=SimpleNamespace(**sizes)))

    assert _sequence_shards(trainer(cp_size=4, sp_size=1, tp_size=2, dp_shard_size=2)) == 4  # TP splits no sequence
    assert _sequence_shards(trainer(cp_size=1, sp_size=8)) == 8
    assert _sequence_shards(trainer(cp_size=None, sp_size=None)) == 1
    assert _sequence_shards(SimpleNamespace(accelerator=SimpleNamespace(parallelism_config=None))) == 1
    assert _sequence_shards(SimpleNamespace()) == 1
    args = SimpleNamespace(max_length=1_048_577, per_device_train_batch_size=2)
    assert _longest_step_of(args, 4) == (2 * 262_145, "per_device_train_batch_size 2 x max_length 1048577 of "
                                         "SimpleNamespace, over 4 sequence shards")  # fmt: skip
    assert _longest_step_of(args, 1) == (2 * 1_048_577, "per_device_train_batch_size 2 x max_length 1048577 of "
                                         "SimpleNamespace")  # fmt: skip
