"""What a Trainer run that raises out of `train()` leaves on the GPU: no more than a run without hf-offload. A refused
memory budget and a KeyboardInterrupt (Ctrl-C in a notebook) end `train()` without `on_train_end`; the wrapped
`train()` takes off what the callback attached, the context is collected with its pinned pool, and the model and the
device hold what they hold after a plain run (the weights, and the libraries' own workspaces). Needs only
transformers (no datasets, no TRL)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers

from hf_offload import ActivationOffloadingCallback, InfeasibleBudgetError, TrainingArguments


class KeepContext(transformers.TrainerCallback):
    """Keeps a weak reference to the offloading context in use, and raises KeyboardInterrupt at step `interrupt_at`."""

    def __init__(self, trainer: transformers.Trainer, interrupt_at: int | None) -> None:
        self.trainer = weakref.ref(trainer)
        self.interrupt_at = interrupt_at
        self.context: weakref.ReferenceType | None = None

    def on_step_end(self, args, state, control, **kwargs) -> None:
        ours = [c for c in self.trainer().callback_handler.callbacks if isinstance(c, ActivationOffloadingCallback)]
        context = ours[0].context if ours else None
        if context is not None:
            self.context = weakref.ref(context)
        if state.global_step == self.interrupt_at:
            raise KeyboardInterrupt


def tiny_llama(device: str) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(device, torch.bfloat16)


def train(tmp_path, model: torch.nn.Module, offloading: dict | None, interrupt_at: int | None = None) -> KeepContext:
    """A Trainer run with checkpointing, with hf-offload's options `offloading` (or without hf-offload); the callback
    that kept the context, whether `train()` returned or raised (then `.error`)."""
    ids = torch.randint(1024, (32, 512), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    common = dict(max_steps=6, per_device_train_batch_size=2, report_to="none", save_strategy="no",
                  gradient_checkpointing=True, bf16=True)  # fmt: skip
    if offloading is None:
        args = transformers.TrainingArguments(str(tmp_path / "plain"), **common)
    else:
        args = TrainingArguments(str(tmp_path / "offloaded"), activation_offloading=True, **offloading, **common)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    keeper = KeepContext(trainer, interrupt_at)
    trainer.add_callback(keeper)
    keeper.error = None
    try:
        trainer.train()
    except (InfeasibleBudgetError, KeyboardInterrupt) as error:
        keeper.error = type(error)  # the type only: the traceback's frames would hold the step's tensors
    return keeper


def left_behind(model: torch.nn.Module, device: str) -> tuple[int, int]:
    """What is on the model and the device beyond the model's weights once its trainer is gone: module hooks, and
    device bytes (the libraries' workspaces among them, which a run without hf-offload leaves too)."""
    gc.collect()
    torch.cuda.synchronize(device)
    for parameter in model.parameters():
        parameter.grad = None
    gc.collect()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return hooks, torch.cuda.memory_allocated(device) - weights


@pytest.mark.parametrize("fault", ["refused budget", "interrupt"])
def test_a_run_that_raises_out_of_train_leaves_what_a_plain_run_leaves(tmp_path, device, fault, record):
    plain = tiny_llama(device)
    train(tmp_path, plain, None)
    plain_hooks, plain_bytes = left_behind(plain, device)
    del plain

    model = tiny_llama(device)
    budget = "1" if fault == "refused budget" else "auto"
    keeper = train(tmp_path, model, {"activation_offloading_memory_budget": budget},
                   interrupt_at=3 if fault == "interrupt" else None)  # fmt: skip
    hooks, left = left_behind(model, device)
    context_alive = keeper.context is not None and keeper.context() is not None
    record("", {"fault": fault, "error": getattr(keeper.error, "__name__", None), "hooks": hooks,
                "plain_hooks": plain_hooks, "device_bytes_beyond_the_weights": left,
                "plain_device_bytes_beyond_the_weights": plain_bytes, "context_alive": context_alive},
           show=True)  # fmt: skip
    assert keeper.error is (InfeasibleBudgetError if fault == "refused budget" else KeyboardInterrupt)
    assert keeper.context is not None and not context_alive  # collected, and its pinned pool with it
    assert hooks == plain_hooks
    assert left <= plain_bytes
