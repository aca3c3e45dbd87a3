"""hf-offload with TRL: the configurations of every TRL trainer, and training with them, on CPU.

The trainers run the engine in its CPU test mode (see `helpers`). Each comparison of offloading on and off is evidence
only because the run without offloading repeats itself bitwise, which each test checks first.
"""

import contextlib
import dataclasses
import importlib
import logging
import pickle
import pkgutil
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import transformers
import trl
from helpers import (
    COMMON_ARGS,
    CPU_TEST_MODE,
    MAX_LENGTH,
    assert_offload_stats_logged,
    assert_same_weights,
    head_hooks,
    offloading_callbacks,
    tiny_model,
    train_losses,
    wrapped,
)
from peft import LoraConfig

import hf_offload.callbacks
from hf_offload import ActivationOffloadingArguments
from hf_offload.callbacks import trl as offloading_configs
from hf_offload.callbacks.trl import (
    DistillationConfig,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    RewardConfig,
    RLOOConfig,
    SFTConfig,
)

# ---------------------------------------------------------------------------------------------------- configurations


def trl_configs() -> dict[str, type[transformers.TrainingArguments]]:
    """Every TRL configuration that subclasses `TrainingArguments`, by name, found without hf-offload's rules.

    All of `trl`'s top-level names, then every module of `trl.experimental` (imported), where a name `trl` exports
    wins (`trl.experimental.kto.KTOConfig` is a deprecated alias of `trl.KTOConfig`).
    """

    def is_training_arguments(candidate: object) -> bool:
        return isinstance(candidate, type) and issubclass(candidate, transformers.TrainingArguments)

    configs = {name: getattr(trl, name) for name in dir(trl) if is_training_arguments(getattr(trl, name))}
    experimental = importlib.import_module("trl.experimental")
    for package in pkgutil.iter_modules(experimental.__path__):
        module = importlib.import_module(f"trl.experimental.{package.name}")
        for name, candidate in vars(module).items():
            defined_here = is_training_arguments(candidate) and candidate.__module__.startswith(module.__name__)
            if defined_here and name not in configs:
                configs[name] = candidate
    return configs


def field_names(config: type) -> set[str]:
    return {field.name for field in dataclasses.fields(config)}


def test_every_trl_config_has_a_counterpart_with_all_its_fields_and_ours():
    configs = trl_configs()
    assert {"SFTConfig", "DPOConfig", "GRPOConfig", "RLOOConfig", "GKDConfig", "OnlineDPOConfig"} <= configs.keys()
    assert sorted(name for name in configs if hasattr(trl, name)) == offloading_configs.__all__
    for name, trl_config in configs.items():
        counterpart = getattr(offloading_configs, name)
        assert counterpart.__bases__ == (ActivationOffloadingArguments, trl_config), name
        assert (counterpart.__module__, counterpart.__qualname__) == ("hf_offload.callbacks.trl", name)
        assert field_names(counterpart) == field_names(trl_config) | field_names(ActivationOffloadingArguments), name
        assert "hf-offload" in counterpart.__doc__ and "activation_offloading_min_size" in counterpart.__doc__
        assert getattr(hf_offload.callbacks, name) is counterpart  # the package forwards every name
    assert set(offloading_configs.__all__) <= set(dir(offloading_configs))


def test_names_that_are_not_trl_training_configs_are_missing():
    for name in ("ModelConfig", "NoSuchConfig", "SFTTrainer"):  # ModelConfig is TRL's, but not TrainingArguments
        with pytest.raises(AttributeError, match=name):
            getattr(offloading_configs, name)
        assert not hasattr(hf_offload.callbacks, name)


@pytest.mark.parametrize("name", offloading_configs.__all__)
def test_trl_configs_parse_with_one_activation_offloading_flag(tmp_path, name):
    config_class = getattr(offloading_configs, name)
    flags = [field for field in dataclasses.fields(config_class) if field.name == "activation_offloading"]
    assert len(flags) == 1 and "hf-offload" in flags[0].metadata["help"]  # ours, where TRL has its own
    argv = ["--output_dir", str(tmp_path), "--bf16", "false", "--activation_offloading"]
    argv += ["--activation_offloading_min_size", "0"]
    (args,) = transformers.HfArgumentParser(config_class).parse_args_into_dataclasses(args=argv)
    assert isinstance(args, getattr(trl, name))
    assert args.activation_offloading is True and args.activation_offloading_min_size == 0
    assert "'60%'" in transformers.HfArgumentParser(config_class).format_help()  # `--help` works too


def test_a_config_round_trips_through_pickle(tmp_path, monkeypatch):
    config = GRPOConfig(str(tmp_path), activation_offloading=True, activation_offloading_min_size=0, bf16=False)
    torch.save(config, tmp_path / "training_args.bin")  # as the Trainer saves its arguments
    assert torch.load(tmp_path / "training_args.bin", weights_only=False) == config

    # A process that loads saved arguments has not made the class yet: unpickling makes it, by its name.
    saved = pickle.dumps(config)
    monkeypatch.delitem(vars(offloading_configs), "GRPOConfig")
    loaded = pickle.loads(saved)
    assert type(loaded) is offloading_configs.GRPOConfig and type(loaded) is not GRPOConfig
    assert loaded.to_dict() == config.to_dict()


def test_without_trl_the_import_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now fails as if TRL were not installed
    monkeypatch.delitem(sys.modules, "hf_offload.callbacks.trl", raising=False)
    monkeypatch.delattr(hf_offload.callbacks, "trl", raising=False)  # set by the import of the submodule
    advice = re.escape("pip install 'hf-offload[trl]'")
    with pytest.raises(ImportError, match=advice):
        importlib.import_module("hf_offload.callbacks.trl")
    with pytest.raises(ImportError, match=advice):
        hf_offload.callbacks.SFTConfig  # noqa: B018


# ---------------------------------------------------------------------------------------------------- trainers


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


@pytest.fixture(scope="module")
def prompts(text_dataset):
    """Prompts for the trainers that generate: the first words of each line."""
    return datasets.Dataset.from_dict({"prompt": [" ".join(text.split()[:4]) for text in text_dataset["text"][:16]]})


@pytest.fixture(scope="module")
def preferences():
    return datasets.Dataset.from_dict(
        {
            "prompt": ["Question: What do bees make? Answer:"] * 8,
            "chosen": [" Bees make honey."] * 8,
            "rejected": [" The sky is blue on a clear day."] * 8,
        }
    )


def completion_length(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward function: completions of different lengths get different advantages."""
    return [float(len(completion)) for completion in completions]


def config_args(tmp_path: Path, offloading: bool, **overrides: Any) -> dict[str, Any]:
    """The arguments of a TRL config for a short CPU run (which saves nothing)."""
    return {
        "output_dir": str(tmp_path / ("on" if offloading else "off")),
        "activation_offloading": offloading,
        "bf16": False,  # TRL defaults to True, which transformers refuses without an accelerator
        **CPU_TEST_MODE,
        **{**COMMON_ARGS, **overrides},
    }


def assert_offloading_is_exact(train: Callable[[bool], transformers.Trainer]) -> transformers.Trainer:
    """Trains twice without offloading, then with; each run's losses and final weights must be bitwise equal.

    Returns:
        The trainer that ran with offloading.
    """
    baseline = train(False)
    for offloading in (False, True):  # first the baseline's repeat: without it the comparison is no evidence
        run = train(offloading)
        assert train_losses(run) == train_losses(baseline), f"offloading={offloading}"
        assert_same_weights(run.model, baseline.model)
    return run


def assert_trl_offloader_replaced_by_ours(trainer: transformers.Trainer, trl_offloader_spy: type) -> None:
    assert trl_offloader_spy.built == 0
    assert isinstance(getattr(trainer, "maybe_activation_offload_context", None), (contextlib.nullcontext, type(None)))
    assert len(offloading_callbacks(trainer)) == 1
    assert_offload_stats_logged(trainer)  # with bytes offloaded at every step
    assert not wrapped(trainer) and head_hooks(trainer.model) == 0


def test_sft_trainer_lora_uses_our_offloader_only_and_is_exact(tmp_path, tokenizer, text_dataset, trl_offloader_spy):
    def train(offloading: bool) -> trl.SFTTrainer:
        trainer = trl.SFTTrainer(
            model=tiny_model(tokenizer),
            args=SFTConfig(**config_args(tmp_path, offloading), max_length=MAX_LENGTH),
            train_dataset=text_dataset,
            eval_dataset=text_dataset.select(range(4)),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
        )
        trainer.train()
        return trainer

    on = assert_offloading_is_exact(train)
    assert on.args.activation_checkpointing  # SFTConfig's default: what moves are the checkpointed layers' inputs
    assert_trl_offloader_replaced_by_ours(on, trl_offloader_spy)

    # TRL's own configuration still gets TRL's own offloader: the guard only steps aside for claimed models.
    trl_args = trl.SFTConfig(str(tmp_path / "trl"), activation_offloading=True, bf16=False, use_cpu=True)
    trl.SFTTrainer(model=tiny_model(tokenizer), args=trl_args, train_dataset=text_dataset, processing_class=tokenizer)
    assert trl_offloader_spy.built == 1


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


def test_dpo_trainer_uses_our_offloader_only_and_is_exact(tmp_path, tokenizer, preferences, trl_offloader_spy):
    def train(offloading: bool) -> trl.DPOTrainer:
        trainer = trl.DPOTrainer(
            model=tiny_model(tokenizer),
            ref_model=tiny_model(tokenizer),  # built from a config: TRL cannot load a reference copy by name
            args=DPOConfig(**config_args(tmp_path, offloading, max_steps=2, eval_steps=1), max_length=MAX_LENGTH),
            train_dataset=preferences,
            eval_dataset=preferences.select(range(2)),
            processing_class=tokenizer,
        )
        trainer.train()
        return trainer

    assert_trl_offloader_replaced_by_ours(assert_offloading_is_exact(train), trl_offloader_spy)


@pytest.mark.parametrize(
    ("config_class", "trainer_class"), [(GRPOConfig, trl.GRPOTrainer), (RLOOConfig, trl.RLOOTrainer)]
)
def test_generating_trainers_offload_and_are_exact(
    tmp_path, tokenizer, prompts, trl_offloader_spy, config_class, trainer_class
):
    """GRPO and RLOO have no offloader of their own: ours wraps the loss, not the generation before it."""

    def train(offloading: bool) -> transformers.Trainer:
        args = config_class(
            **config_args(tmp_path, offloading, max_steps=2, eval_strategy="no"),
            num_generations=2,  # the per-device batch of 2 holds one prompt's group
            max_completion_length=8,
            beta=0.0,  # no reference model, which TRL would load by the name of a model built from a config
        )
        trainer = trainer_class(
            model=tiny_model(tokenizer),
            reward_funcs=completion_length,
            args=args,
            train_dataset=prompts,
            processing_class=tokenizer,
        )
        trainer.train()
        return trainer

    on = assert_offloading_is_exact(train)  # the sampled completions too: they are drawn from the seeded generator
    assert_trl_offloader_replaced_by_ours(on, trl_offloader_spy)


def test_kto_reward_and_distillation_trainers_offload_with_ours_only(
    tmp_path, tokenizer, prompts, preferences, trl_offloader_spy
):
    """KTO and Reward have TRL's offloader, Distillation has none; each trains with ours."""
    common = config_args(tmp_path, offloading=True, max_steps=2, eval_strategy="no")
    labelled = datasets.Dataset.from_dict(
        {
            "prompt": preferences["prompt"],
            "completion": [*preferences["chosen"][:4], *preferences["rejected"][:4]],
            "label": [True] * 4 + [False] * 4,
        }
    )
    scorer_config = tiny_model(tokenizer).config
    scorer_config.num_labels = 1
    teacher = tiny_model(tokenizer)
    torch.nn.init.normal_(teacher.lm_head.weight)  # a teacher unlike the student, so that the loss is not zero

    trainers = [
        trl.KTOTrainer(
            model=tiny_model(tokenizer),
            ref_model=tiny_model(tokenizer),
            args=KTOConfig(**common, max_length=MAX_LENGTH),
            train_dataset=labelled,
            processing_class=tokenizer,
        ),
        trl.RewardTrainer(
            model=transformers.LlamaForSequenceClassification(scorer_config),
            args=RewardConfig(**common, max_length=MAX_LENGTH),
            train_dataset=preferences.remove_columns("prompt"),
            processing_class=tokenizer,
        ),
        trl.DistillationTrainer(
            model=tiny_model(tokenizer),
            teacher_model=teacher,
            args=DistillationConfig(**common, max_completion_length=8),
            train_dataset=prompts,
            processing_class=tokenizer,
        ),
    ]
    for trainer in trainers:
        trainer.train()
        assert_trl_offloader_replaced_by_ours(trainer, trl_offloader_spy)
        assert train_losses(trainer)[0] != 0
