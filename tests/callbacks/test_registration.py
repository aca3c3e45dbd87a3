"""`callbacks/registration.py`: a Trainer built with hf-offload's arguments and `activation_offloading=True` gets
the callback, no other Trainer does, and a `train()` that raises leaves nothing on the model."""

import pytest
import transformers
from helpers import COMMON_ARGS, CPU_TEST_MODE, head_hooks, offloading_callbacks, tiny_model, wrapped

from hf_offload import TrainingArguments
from hf_offload.callbacks import registration


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
