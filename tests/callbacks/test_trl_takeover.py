"""`callbacks/trl_takeover.py`: TRL's trainers train with hf-offload's offloader only, TRL's own never built, on CPU.

The trainers run the engine in its CPU test mode (see `helpers`). Each comparison of offloading on and off is evidence
only because the run without offloading repeats itself bitwise, which each test checks first.
"""

import contextlib
from collections.abc import Callable
from typing import Any

import datasets
import pytest
import torch
import transformers
import trl
from helpers import (
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
from peft import LoraConfig

from hf_offload.callbacks.trl import (
    DistillationConfig,
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    RewardConfig,
    RLOOConfig,
    SFTConfig,
)


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
