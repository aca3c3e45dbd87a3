"""The Trainer integration, its arguments and the examples, on CPU (the engine's CPU test mode, see `helpers`).

TRL's trainers and configurations are tested in `test_trl.py`.
"""

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

# The examples, importable because `conftest` put their folder on the path.
import custom_loop
import pytest
import sft_trainer
import transformers
import trl_sft_lora
from helpers import (
    COMMON_ARGS,
    CPU_TEST_MODE,
    EXAMPLES,
    MAX_LENGTH,
    assert_offload_stats_logged,
    assert_same_weights,
    head_hooks,
    offload_logs,
    offloading_callbacks,
    tiny_model,
    train_losses,
    wrapped,
)

from hf_offload import TrainingArguments
from hf_offload.callbacks import registration


class HookProbe(transformers.TrainerCallback):
    """Records, at every step, whether the trainer's context method is wrapped and how many hooks the head has."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.trainer = trainer
        self.seen: list[tuple[bool, int]] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.seen.append((wrapped(self.trainer), head_hooks(self.trainer.model)))


# ---------------------------------------------------------------------------------------------------- Trainer


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


class InterruptAt(transformers.TrainerCallback):
    """Raises KeyboardInterrupt at the end of a step, as Ctrl-C in a notebook does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step:
            raise KeyboardInterrupt


def attachments(model: transformers.PreTrainedModel) -> tuple[int, int, list[str]]:
    """What a run can leave on a model and in the process: module hooks, optimizer hooks for every optimizer, and the
    decoder layers' own checkpointing attributes (a plan sets them on the instance)."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    hooks = sum(len(module._forward_pre_hooks) + len(module._forward_hooks) for module in model.modules())
    planned = [name for name, module in model.named_modules() if "gradient_checkpointing" in vars(module)]
    return hooks, len(_global_optimizer_post_hooks), planned


@pytest.mark.parametrize("fault", ["refused budget", "interrupt"])
def test_a_run_that_raises_out_of_train_leaves_nothing_on_the_model(tmp_path, tokenizer, lm_dataset, fault):
    """on_train_end is not called when train() raises: the wrapped train() takes off what the callback attached, so a
    following run on the same model, without hf-offload, trains as on a fresh model (no plan, no recomputation)."""
    from hf_offload import InfeasibleBudgetError

    model = tiny_model(tokenizer)
    before = attachments(model)
    overrides = {"eval_strategy": "no", "gradient_accumulation_steps": 1}
    budget = {"activation_offloading_memory_budget": "1" if fault == "refused budget" else "1GiB"}
    args = TrainingArguments(str(tmp_path / "faulted"), activation_offloading=True, **CPU_TEST_MODE, **budget,
                             **{**COMMON_ARGS, **overrides})  # fmt: skip
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=lm_dataset, data_collator=collator)
    trainer.add_callback(InterruptAt(3))
    with pytest.raises(InfeasibleBudgetError if fault == "refused budget" else KeyboardInterrupt):
        trainer.train()
    assert attachments(model) == before and not wrapped(trainer) and head_hooks(model) == 0

    # The same model again, with transformers' own arguments: each layer's MLP runs once a step, as on a fresh model.
    calls = []
    handles = [layer.mlp.register_forward_hook(lambda *_: calls.append(1)) for layer in model.model.layers]
    plain = transformers.TrainingArguments(str(tmp_path / "plain"), **{**COMMON_ARGS, **overrides, "max_steps": 2})
    transformers.Trainer(model=model, args=plain, train_dataset=lm_dataset, data_collator=collator).train()
    assert len(calls) == 2 * len(model.model.layers)
    for handle in handles:
        handle.remove()
    assert attachments(model) == before


def test_registration_only_for_our_arguments_with_the_flag(tmp_path, tokenizer):
    installed = transformers.Trainer.__init__
    registration.install()  # again: must not wrap twice
    assert transformers.Trainer.__init__ is installed
    model = tiny_model(tokenizer)
    plain = transformers.Trainer(model=model, args=transformers.TrainingArguments(str(tmp_path), report_to="none"))
    flag_off = transformers.Trainer(model=model, args=TrainingArguments(str(tmp_path), report_to="none"))
    assert not offloading_callbacks(plain) and not offloading_callbacks(flag_off)


# ---------------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("kwargs_name", ["activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"])
def test_native_checkpoint_offload_is_turned_off_with_a_warning(tmp_path, kwargs_name):
    native = {"offload": True, "use_reentrant": False}
    with pytest.warns(UserWarning, match="native offload is turned off"):
        args = TrainingArguments(
            str(tmp_path), activation_offloading=True, activation_checkpointing=True, **{kwargs_name: native}
        )
    assert args.activation_checkpointing_kwargs == args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert native == {"offload": True, "use_reentrant": False}  # the caller's dict is left alone
    without_ours = TrainingArguments(str(tmp_path), activation_checkpointing=True, **{kwargs_name: native})
    assert without_ours.activation_checkpointing_kwargs == native


# ---------------------------------------------------------------------------------------------------- examples

EXAMPLE_ARGS = ["--max_steps", "2", "--activation_offloading", "--activation_offloading_device_type", "cpu"]
TRAINER_EXAMPLE_ARGS = ["--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--use_cpu", "true"]


@pytest.mark.parametrize("example", [sft_trainer, trl_sft_lora])
def test_trainer_examples_run_with_offloading(tmp_path, example, capsys):
    trainer = example.main(["--output_dir", str(tmp_path), *EXAMPLE_ARGS, *TRAINER_EXAMPLE_ARGS])
    assert all(record["offload/bytes_offloaded"] > 0 for record in offload_logs(trainer))
    assert "activation offloading over" in capsys.readouterr().out  # the end-of-training summary


@pytest.mark.parametrize("example", ["sft_trainer.py", "trl_sft_lora.py", "custom_loop.py"])
def test_each_example_prints_its_help(example):
    done = subprocess.run([sys.executable, str(EXAMPLES / example), "--help"], capture_output=True, text=True,
                          timeout=240, cwd=EXAMPLES)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--activation_offloading" in done.stdout


def test_without_the_examples_extra_an_example_says_which_extra_to_install():
    # `pip install -e .` installs no datasets library; run the example as if it were missing.
    code = (f"import runpy, sys; sys.modules['datasets'] = None; sys.argv = ['sft_trainer.py', '--help']; "
            f"runpy.run_path({str(EXAMPLES / 'sft_trainer.py')!r}, run_name='__main__')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=EXAMPLES)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().endswith('the examples need the "examples" extra: pip install -e ".[examples]"')


def test_custom_loop_example_is_exact(capsys):
    with_offloading = custom_loop.main([*EXAMPLE_ARGS, "--max_length", str(MAX_LENGTH)])
    summary = capsys.readouterr().out.split("activation offloading over 2 step(s)", 1)[1]
    # The summary speaks of the CPU test mode it ran in, not of a GPU and pinned memory.
    assert summary.startswith(" in CPU test mode") and "GPU" not in summary.replace("no GPU involved", "")
    assert "pinned" not in summary
    without = custom_loop.main(["--max_steps", "2", "--max_length", str(MAX_LENGTH)])
    assert with_offloading == without


def test_two_processes_each_offload_and_the_main_one_summarises(tmp_path):
    """torchrun (as `accelerate launch` does): every rank builds its own callback and engine; one summary."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(EXAMPLES / "sft_trainer.py"), "--output_dir", str(tmp_path), *EXAMPLE_ARGS, *TRAINER_EXAMPLE_ARGS,
        "--log_level", "info",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=EXAMPLES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Total train batch size (w. parallel, distributed & accumulation) = 16" in done.stdout + done.stderr
    assert done.stdout.count("activation offloading over 2 step(s)") == 1
    assert "'offload/offloaded_mib_per_step'" in done.stdout  # the console shows the headline entries
