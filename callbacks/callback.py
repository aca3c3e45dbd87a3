"""The Trainer callback that runs each training forward pass under the activation offloading context."""

import contextlib
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm
from transformers import TrainerCallback, TrainerControl, TrainerState

from hf_offload.context import get_act_offloading_ctx_manager
from hf_offload.engine import OffloadActivations
from hf_offload.stats import format_summary
from hf_offload.units import GIB

from .arguments import ActivationOffloadingArguments
from .compile_layers import compile_trainers_decoder_layers
from .stats_logs import LOG_PREFIX, accumulate, keep_headlines, log_entries
from .trl_takeover import disable_trl_offloader

__all__ = ["ActivationOffloadingCallback"]

_CONTEXT_METHOD = "compute_loss_context_manager"
# transformers' callbacks that print the logs to the console, by name: importing the notebook one needs IPython.
_CONSOLE_CALLBACKS = frozenset({"ProgressCallback", "PrinterCallback", "NotebookProgressCallback"})


def _longest_step_of(args: Any, sequence_shards: int = 1) -> tuple[int, str] | None:
    """The longest step a TRL trainer's configuration allows, per device and micro-step, with where it comes from:
    its `max_length` (SFT, DPO, KTO, Reward, ...: what sequences are truncated or packed to) times
    `per_device_train_batch_size`, over the `sequence_shards` that context or sequence parallelism splits each
    sequence into (a rank's layers see its shard only); None where the configuration has no such length."""
    max_length = getattr(args, "max_length", None)
    batch = getattr(args, "per_device_train_batch_size", None)
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1 or not isinstance(batch, int):
        return None
    source = f"per_device_train_batch_size {batch} x max_length {max_length} of {type(args).__name__}"
    if sequence_shards > 1:
        return batch * -(-max_length // sequence_shards), f"{source}, over {sequence_shards} sequence shards"
    return batch * max_length, source


def _sequence_shards(trainer: Any) -> int:
    """Into how many shards the trainer's accelerator splits each sequence: accelerate's context parallelism
    (`ParallelismConfig.cp_size`) or DeepSpeed's Ulysses sequence parallelism (`sp_size`); 1 without either."""
    config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    sizes = [getattr(config, name, None) for name in ("cp_size", "sp_size")]
    return math.prod(size for size in sizes if isinstance(size, int) and size > 1)


class _ConsoleHeadlines(TrainerCallback):
    """Placed right before the console callbacks: leaves them only the headline `offload/` entries.

    The callbacks before it (TensorBoard, W&B, ...) and the run's log history have received every entry by then.
    """

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, logs: dict | None = None,
               **kwargs: Any) -> None:  # fmt: skip
        if logs is not None:
            keep_headlines(logs)


def _peak_memory_bytes(device_type: str) -> int | None:
    """The accelerator's peak allocated memory, or None in CPU test mode or without such a counter."""
    if device_type == "cpu":
        return None
    device_module = torch.get_device_module(device_type)
    return device_module.max_memory_allocated() if hasattr(device_module, "max_memory_allocated") else None


class ActivationOffloadingCallback(TrainerCallback):
    """Wraps the trainer's `compute_loss` in hf-offload's context while training, and reports what it moved.

    `Trainer`s built with hf-offload's arguments (`hf_offload.TrainingArguments`, `hf_offload.callbacks.trl.SFTConfig`,
    ... with `activation_offloading=True`) get this callback automatically, as the first of their callbacks; build
    one yourself only for a trainer that has none.

    - `on_train_begin` compiles the model's decoder layers where the registration took the Trainer's `torch_compile`
      over (`layer_compile_options`; see `compile_layers`), then builds the context for the trainer's model (after
      transformers has applied checkpointing, Liger kernels and the distributed wrappers, so the model's exemptions
      see the final modules) and wraps the trainer instance's `compute_loss_context_manager`, which `training_step`
      enters around `compute_loss`: only the training forward passes run under it, and backward brings the tensors
      back whenever it runs. A TRL trainer's own offloader (`maybe_activation_offload_context`) is replaced by a
      no-op.
    - `on_step_end` prints the memory plan (with `activation_offloading_memory_budget`) when a new one is in force.
    - `on_log` adds `offload/...` entries (counters summed since the previous log) to each training log: all of them
      for the log history and the reporting integrations, the headline ones (`stats_logs.HEADLINE_KEYS`) for the
      console.
    - `on_train_end` removes the wrapping and the context's module hooks, and prints a summary on the main process,
      on lines of its own (above an open progress bar).

    With no accelerator the context is inactive (the engine says so once) and nothing is wrapped.

    Args:
        trainer: the trainer whose `compute_loss` runs under the context; held weakly. Its arguments must be
            [`ActivationOffloadingArguments`] (the callback reads `activation_offloading` and `offload_options()`).
        layer_compile_options: `torch.compile`'s keyword arguments for each decoder layer, compiled as training
            begins, when the trainer's `torch_compile` was taken over (`compile_layers.claim_torch_compile`); None
            compiles nothing.
    """

    def __init__(self, trainer: transformers.Trainer, layer_compile_options: dict[str, Any] | None = None) -> None:
        # Events receive the model but not the trainer, which owns the method to wrap. A weak reference: the trainer
        # owns this callback, and a cycle would keep the model's memory alive until the garbage collector runs.
        self._trainer = weakref.ref(trainer)
        self._context: OffloadActivations | None = None
        self._replaced_method: Callable[[], Any] | None = None  # an instance attribute that our wrapper shadows
        self._stats: dict[str, float] = {}
        self._shown_plan: Any = None  # the memory plan last printed, so that each new one is printed once
        self._layer_compile_options = layer_compile_options

    @property
    def context(self) -> OffloadActivations | None:
        """The offloading context in use while training (its `memory_plan` is the plan in force under a memory
        budget); None outside training, when offloading is off, or when the context is inactive (no accelerator)."""
        return self._context

    @property
    def stats(self) -> dict[str, float]:
        """Statistics summed over the current (or last) training run; empty when offloading was inactive."""
        return dict(self._stats)

    def on_train_begin(
        self, args: ActivationOffloadingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Build the offloading context for the trainer's model and wrap its `compute_loss_context_manager`.

        Does nothing when `args.activation_offloading` is False, or when the context is inactive (no accelerator).

        Args:
            args: the training arguments, with hf-offload's fields.
            state: the trainer's state.
            control: the trainer's control flags.
            **kwargs: the other objects the trainer passes to its callbacks (unused).
        """
        self.release()  # a previous train() that raised never reached on_train_end
        self._stats = {}
        if not args.activation_offloading:
            return
        trainer = self._get_trainer()
        if self._layer_compile_options is not None:  # before the context: accelerate compiles nothing in its place
            compile_trainers_decoder_layers(trainer.model, self._layer_compile_options)
        disable_trl_offloader(trainer)
        context = get_act_offloading_ctx_manager(trainer.model_wrapped, options=args.offload_options())
        if not context.active:
            context.remove_hooks()
            return
        self._context = context
        longest = _longest_step_of(args, _sequence_shards(trainer))
        if context.budget_controller is not None and longest is not None:
            context.budget_controller.expect_longest_step(*longest)
        self._place_console_headlines(trainer)
        self._replaced_method = vars(trainer).get(_CONTEXT_METHOD)
        original = getattr(trainer, _CONTEXT_METHOD)

        def compute_loss_context_manager() -> contextlib.ExitStack:
            # Entered on call, like transformers' own (its autocast is entered when the stack is built); if entering
            # ours fails, the `with` exits the original's context again.
            with contextlib.ExitStack() as stack:
                stack.enter_context(original())
                stack.enter_context(context)
                return stack.pop_all()

        setattr(trainer, _CONTEXT_METHOD, compute_loss_context_manager)

    def on_log(
        self,
        args: ActivationOffloadingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the `offload/...` entries of the interval since the previous log to a training log.

        Evaluation logs and the final metrics (logs without `"loss"`) get no entries. The entries go into `logs`
        and into the matching record of `state.log_history`.

        Args:
            args: the training arguments.
            state: the trainer's state, whose last log record gets the entries too.
            control: the trainer's control flags.
            logs: the log being emitted, updated in place.
            **kwargs: the other objects the trainer passes to its callbacks (unused).
        """
        # Training progress logs carry "loss"; evaluation logs and the final metrics do not, and get no entries.
        if self._context is None or logs is None or "loss" not in logs:
            return
        interval = self._context.consume_stats()
        accumulate(self._stats, interval)
        entries = log_entries(interval, _peak_memory_bytes(self._context.device_type))
        memory_plan = self._memory_plan()
        if memory_plan is not None:
            entries[LOG_PREFIX + "plan_predicted_peak_gib"] = round(memory_plan.predicted.peak_bytes / GIB, 3)
            entries[LOG_PREFIX + "plan_predicted_step_s"] = round(memory_plan.predicted.step_s, 4)
        logs.update(entries)
        # Trainer.log appends its record to the history just before this event, as a copy of `logs`.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(entries)

    def on_step_end(
        self, args: ActivationOffloadingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Print the memory plan, on the main process, when a new one is in force (with a memory budget only).

        Args:
            args: the training arguments.
            state: the trainer's state.
            control: the trainer's control flags.
            **kwargs: the other objects the trainer passes to its callbacks (unused).
        """
        # With a memory budget, the plan appears after the profiled steps (and again after a re-plan).
        memory_plan = self._memory_plan()
        if memory_plan is not None and memory_plan is not self._shown_plan and state.is_world_process_zero:
            tqdm.write(memory_plan.format_table())
        self._shown_plan = memory_plan

    def on_train_end(
        self, args: ActivationOffloadingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Print the run's summary on the main process, then unwrap the trainer and remove the context's hooks.

        Args:
            args: the training arguments.
            state: the trainer's state.
            control: the trainer's control flags.
            **kwargs: the other objects the trainer passes to its callbacks (unused).
        """
        if self._context is None:
            return
        accumulate(self._stats, self._context.consume_stats())
        if state.is_world_process_zero:
            # tqdm.write: print() would join the progress bar
            tqdm.write(format_summary(self._stats, self._context.device_type, self._context.peak_report,
                                      accumulation_steps=args.gradient_accumulation_steps))  # fmt: skip
        self.release()

    def release(self) -> None:
        """Restores the trainer's method and takes off what the context attached to the model: its hooks (the process's
        optimizer hook too), the memory plan's checkpointing and tiled layers; the context, and its pinned pool with
        it, is then no longer referred to. Idempotent; called by `on_train_end`, and when `train()` ends by an
        exception (`registration.release`), where `on_train_end` is not called."""
        if self._context is None:
            return
        trainer = self._get_trainer()
        if self._replaced_method is None:
            delattr(trainer, _CONTEXT_METHOD)
        else:
            setattr(trainer, _CONTEXT_METHOD, self._replaced_method)
        self._replaced_method = None
        callbacks = trainer.callback_handler.callbacks
        callbacks[:] = [callback for callback in callbacks if not isinstance(callback, _ConsoleHeadlines)]
        self._context.remove_hooks()
        self._context = None

    @staticmethod
    def _place_console_headlines(trainer: transformers.Trainer) -> None:
        callbacks = trainer.callback_handler.callbacks
        console = next((i for i, callback in enumerate(callbacks) if type(callback).__name__ in _CONSOLE_CALLBACKS),
                       None)  # fmt: skip
        if console is not None:
            callbacks.insert(console, _ConsoleHeadlines())

    def _memory_plan(self) -> Any:
        """The memory budget's plan in force (`hf_offload.memory_budget.simulate.Plan`), or None without a budget or
        before it."""
        return self._context.memory_plan if self._context is not None else None

    def _get_trainer(self) -> transformers.Trainer:
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError("ActivationOffloadingCallback outlived its Trainer")
        return trainer
