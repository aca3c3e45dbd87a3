"""The Trainer and TRL integration, on CPU.

Offloading itself needs an accelerator; these tests run the engine in its CPU test mode
(`activation_offloading_device_type="cpu"`), which moves CPU tensors through a separate host buffer with the same
bookkeeping, so that the statistics are real and "bitwise equal with and without" means something.
"""

import contextlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import trl
from peft import LoraConfig

from hf_offload import ActivationOffloadingCallback, TrainingArguments
from hf_offload.callbacks import registration
from hf_offload.callbacks.trl import DPOConfig, SFTConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import custom_loop  # noqa: E402
import example_utils  # noqa: E402
import sft_trainer  # noqa: E402
import trl_sft_lora  # noqa: E402

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


@pytest.fixture(scope="module")
def text_dataset():
    return example_utils.load_text_dataset(example_utils.DataArguments()).select(range(64))


@pytest.fixture(scope="module")
def tokenizer(text_dataset):
    return example_utils.fit_word_tokenizer(text_dataset[example_utils.TEXT_COLUMN])


@pytest.fixture(scope="module")
def lm_dataset(text_dataset, tokenizer):
    return text_dataset.map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH),
        batched=True,
        remove_columns=["text"],
    )


def tiny_model(tokenizer) -> transformers.LlamaForCausalLM:
    transformers.set_seed(0)  # the same initial weights in every run that is compared
    return example_utils.tiny_llama(tokenizer, hidden_size=32)


def train_losses(trainer: transformers.Trainer) -> list[float]:
    return [record["loss"] for record in trainer.state.log_history if "loss" in record]


def offload_logs(trainer: transformers.Trainer) -> list[dict[str, Any]]:
    return [record for record in trainer.state.log_history if "loss" in record]


def assert_offload_stats_logged(trainer: transformers.Trainer) -> None:
    logs = offload_logs(trainer)
    assert len(logs) == trainer.state.global_step
    for record in logs:
        assert record["offload/steps"] == trainer.args.gradient_accumulation_steps
        assert record["offload/bytes_offloaded"] > 0
        assert record["offload/bytes_offloaded_per_step"] == record["offload/bytes_offloaded"] / record["offload/steps"]
        assert record["offload/pinned_bytes"] > 0
        assert "offload/compute_wait_s" in record
        assert any(key.startswith("offload/tensors_kept_") for key in record)
    # Evaluation and the final metrics carry no statistics.
    others = [record for record in trainer.state.log_history if "loss" not in record]
    assert any("eval_loss" in record for record in others)
    assert not any(key.startswith("offload/") for record in others for key in record)


def assert_same_weights(first: torch.nn.Module, second: torch.nn.Module) -> None:
    first_state, second_state = first.state_dict(), second.state_dict()
    assert first_state.keys() == second_state.keys()
    for name, tensor in first_state.items():
        assert torch.equal(tensor, second_state[name]), name


def offloading_callbacks(trainer: transformers.Trainer) -> list[ActivationOffloadingCallback]:
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ActivationOffloadingCallback)]


class HookProbe(transformers.TrainerCallback):
    """Records, at every step, whether the trainer's context method is wrapped and how many hooks the head has."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.trainer = trainer
        self.seen: list[tuple[bool, int]] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.seen.append((wrapped(self.trainer), head_hooks(self.trainer.model)))


def wrapped(trainer: transformers.Trainer) -> bool:
    return "compute_loss_context_manager" in vars(trainer)


def head_hooks(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()
    return len(head._forward_pre_hooks) + len(head._forward_hooks)


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


def test_registration_only_for_our_arguments_with_the_flag(tmp_path, tokenizer):
    installed = transformers.Trainer.__init__
    registration.install()  # again: must not wrap twice
    assert transformers.Trainer.__init__ is installed
    model = tiny_model(tokenizer)
    plain = transformers.Trainer(model=model, args=transformers.TrainingArguments(str(tmp_path), report_to="none"))
    flag_off = transformers.Trainer(model=model, args=TrainingArguments(str(tmp_path), report_to="none"))
    assert not offloading_callbacks(plain) and not offloading_callbacks(flag_off)


# ---------------------------------------------------------------------------------------------------- arguments


def test_parse_flag_and_options_from_the_command_line(tmp_path):
    argv = [
        "--output_dir", str(tmp_path),
        "--activation_offloading",
        "--activation_offloading_min_size", "4096",
        "--activation_offloading_use_streams", "false",
        "--activation_offloading_forward_window_mib", "64",
        "--activation_offloading_prefetch_window_mib", "0",
        "--activation_offloading_keep_tail", "false",
        "--activation_offloading_max_pinned_memory_fraction", "0.25",
        "--activation_offloading_max_pinned_mib", "1.5",
        "--activation_offloading_device_type", "cpu",
    ]  # fmt: skip
    (args,) = transformers.HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=argv)
    assert args.activation_offloading is True
    assert args.offload_engine_options() == {
        "use_pin_memory": True,
        "use_streams": False,
        "min_offload_size": 4096,
        "forward_window_bytes": 64 * 2**20,
        "prefetch_window_bytes": 0,
        "keep_tail": False,
        "max_pinned_memory_fraction": 0.25,
        "max_pinned_bytes": 3 * 2**19,
        "device_type": "cpu",
    }
    (default,) = transformers.HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path)]
    )
    assert default.activation_offloading is False


@pytest.mark.parametrize("config_class", [SFTConfig, DPOConfig])
def test_trl_configs_share_trls_flag_and_parse(tmp_path, config_class):
    flags = [f for f in config_class.__dataclass_fields__.values() if f.name == "activation_offloading"]
    assert len(flags) == 1 and "hf-offload" in flags[0].metadata["help"]
    argv = ["--output_dir", str(tmp_path), "--bf16", "false", "--activation_offloading"]
    argv += ["--activation_offloading_min_size", "0"]
    (args,) = transformers.HfArgumentParser(config_class).parse_args_into_dataclasses(args=argv)
    assert isinstance(args, getattr(trl, config_class.__name__))
    assert args.activation_offloading is True and args.activation_offloading_min_size == 0


@pytest.mark.parametrize(
    ("argument", "value", "allowed"),
    [
        ("activation_offloading_min_size", "-1", "int >= 0"),
        ("activation_offloading_forward_window_mib", "0", "int >= 1"),
        ("activation_offloading_prefetch_window_mib", "-2", "int >= 0"),
        ("activation_offloading_max_pinned_memory_fraction", "1.5", "(0, 0.9]"),
        ("activation_offloading_max_pinned_mib", "-1", "int >= 0"),
        ("activation_offloading_device_type", "tpu", "None, 'cpu'"),
    ],
)
def test_bad_values_fail_at_construction_naming_the_argument(tmp_path, argument, value, allowed):
    parser = transformers.HfArgumentParser(TrainingArguments)
    with pytest.raises(ValueError, match=rf"{argument}=.*{re.escape(allowed)}"):
        parser.parse_args_into_dataclasses(args=["--output_dir", str(tmp_path), f"--{argument}", value])


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


# ---------------------------------------------------------------------------------------------------- TRL


class TrlOffloaderSpy(contextlib.nullcontext):
    """Stands in for TRL's OffloadActivations (which cannot even be built without an accelerator)."""

    built = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        TrlOffloaderSpy.built += 1

    def update_model_params(self, model: torch.nn.Module) -> None:
        pass


@pytest.fixture
def trl_offloader_spy(monkeypatch):
    monkeypatch.setattr(trl.models.activation_offloading, "OffloadActivations", TrlOffloaderSpy)
    TrlOffloaderSpy.built = 0
    return TrlOffloaderSpy


def run_sft(tmp_path: Path, tokenizer, text_dataset, offloading: bool) -> trl.SFTTrainer:
    args = SFTConfig(
        output_dir=str(tmp_path / ("on" if offloading else "off")),
        activation_offloading=offloading,
        max_length=MAX_LENGTH,
        bf16=False,
        **CPU_TEST_MODE,
        **COMMON_ARGS,
    )
    trainer = trl.SFTTrainer(
        model=tiny_model(tokenizer),
        args=args,
        train_dataset=text_dataset,
        eval_dataset=text_dataset.select(range(4)),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.train()
    return trainer


def test_sft_trainer_lora_uses_our_offloader_only_and_is_exact(tmp_path, tokenizer, text_dataset, trl_offloader_spy):
    off = run_sft(tmp_path, tokenizer, text_dataset, offloading=False)
    on = run_sft(tmp_path, tokenizer, text_dataset, offloading=True)

    assert on.args.activation_checkpointing  # SFTConfig's default: what moves are the checkpointed layers' inputs
    assert trl_offloader_spy.built == 0
    assert isinstance(on.maybe_activation_offload_context, contextlib.nullcontext)
    assert len(offloading_callbacks(on)) == 1
    assert train_losses(on) == train_losses(off)
    assert_same_weights(on.model, off.model)
    assert_offload_stats_logged(on)
    assert not wrapped(on) and head_hooks(on.model) == 0

    # TRL's own configuration still gets TRL's own offloader: the guard only steps aside for claimed models.
    trl_args = trl.SFTConfig(str(tmp_path / "trl"), activation_offloading=True, bf16=False, use_cpu=True)
    trl.SFTTrainer(model=tiny_model(tokenizer), args=trl_args, train_dataset=text_dataset, processing_class=tokenizer)
    assert trl_offloader_spy.built == 1


def test_dpo_trainer_runs_with_our_offloader(tmp_path, tokenizer, trl_offloader_spy):
    import datasets

    preferences = datasets.Dataset.from_dict(
        {
            "prompt": ["Question: What do bees make? Answer:"] * 8,
            "chosen": [" Bees make honey."] * 8,
            "rejected": [" The sky is blue on a clear day."] * 8,
        }
    )
    args = DPOConfig(
        output_dir=str(tmp_path),
        activation_offloading=True,
        max_length=MAX_LENGTH,
        bf16=False,
        **CPU_TEST_MODE,
        **{**COMMON_ARGS, "max_steps": 2, "eval_steps": 1},
    )
    trainer = trl.DPOTrainer(
        model=tiny_model(tokenizer),
        ref_model=tiny_model(tokenizer),  # built from a config: TRL cannot load a reference copy by name
        args=args,
        train_dataset=preferences,
        eval_dataset=preferences.select(range(2)),
        processing_class=tokenizer,
    )
    trainer.train()
    assert trl_offloader_spy.built == 0
    assert_offload_stats_logged(trainer)
    assert not wrapped(trainer) and head_hooks(trainer.model) == 0


# ---------------------------------------------------------------------------------------------------- examples

EXAMPLE_ARGS = ["--max_steps", "2", "--activation_offloading", "--activation_offloading_device_type", "cpu"]
TRAINER_EXAMPLE_ARGS = ["--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--use_cpu", "true"]


@pytest.mark.parametrize("example", [sft_trainer, trl_sft_lora])
def test_trainer_examples_run_with_offloading(tmp_path, example, capsys):
    trainer = example.main(["--output_dir", str(tmp_path), *EXAMPLE_ARGS, *TRAINER_EXAMPLE_ARGS])
    assert all(record["offload/bytes_offloaded"] > 0 for record in offload_logs(trainer))
    assert "activation offloading over" in capsys.readouterr().out  # the end-of-training summary


def test_custom_loop_example_is_exact(capsys):
    with_offloading = custom_loop.main([*EXAMPLE_ARGS, "--max_length", str(MAX_LENGTH)])
    assert "activation offloading over 2 step(s)" in capsys.readouterr().out
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
    assert "'offload/bytes_offloaded'" in done.stdout
