"""Keeps TRL's own activation offloader out of trainers whose activation offloading hf-offload handles.

TRL's trainers that have an offloader (SFT, DPO, KTO and Reward in TRL 1.16, and the experimental GKD and GOLD through
their base `SFTTrainer`) read `args.activation_offloading` at the end of their `__init__` and build their offloader
with the `get_act_offloading_ctx_manager` their module imported; `training_step` then runs under
`self.maybe_activation_offload_context`. With hf-offload's arguments that flag is ours, so TRL would build
a second offloader: it would install hooks on the output head that it keeps no handles for, and it fails outright
on a machine without an accelerator. Replacing the context afterwards is too late for both, so:

1. `claim_trl_offloader`, called from `Trainer.__init__` (before the TRL subclass reaches that line), guards the
   builder in the trainer's TRL modules: for the claimed model the guard returns a no-op context and builds
   nothing; for every other model it calls TRL's builder unchanged.
2. `disable_trl_offloader`, at the start of training, makes sure the context is a no-op, whoever built it.

The other trainers (GRPO, RLOO, Distillation, most experimental ones) have no offloader: none of their modules imports
the builder, so nothing is guarded or claimed, and there is no context to replace. Their offloading is the callback's
alone: `Trainer.training_step` runs `compute_loss` under `compute_loss_context_manager`, after `_prepare_inputs` has
generated the completions (without gradients, so outside the context and saving nothing).
"""

import contextlib
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import transformers

__all__ = ["claim_trl_offloader", "disable_trl_offloader"]

logger = logging.getLogger(__name__)

_TRL_BUILDER = "get_act_offloading_ctx_manager"
_TRL_CONTEXT = "maybe_activation_offload_context"
# Models whose TRL trainer is being built with hf-offload in charge; each claim is used by one builder call.
_claimed_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


class _TrlBuilderGuard:
    """Stands in for TRL's builder in a TRL trainer module."""

    def __init__(self, trl_builder: Callable[..., Any]) -> None:
        self.trl_builder = trl_builder

    def __call__(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if model in _claimed_models:
            _claimed_models.discard(model)
            logger.info("hf-offload handles activation offloading for this trainer; TRL's offloader is not built")
            return contextlib.nullcontext()
        return self.trl_builder(model, *args, **kwargs)


def claim_trl_offloader(trainer: transformers.Trainer) -> None:
    """Makes the TRL subclass of `trainer` (if any) skip building its offloader for `trainer.model`."""
    modules = {sys.modules.get(cls.__module__) for cls in type(trainer).__mro__ if cls.__module__.startswith("trl.")}
    guarded = False
    for module in modules:
        builder = getattr(module, _TRL_BUILDER, None)
        if builder is None:
            continue
        if not isinstance(builder, _TrlBuilderGuard):
            setattr(module, _TRL_BUILDER, _TrlBuilderGuard(builder))
        guarded = True
    if guarded:
        _claimed_models.add(trainer.model)


def disable_trl_offloader(trainer: transformers.Trainer) -> None:
    """Replaces a TRL trainer's offload context with a no-op (TRL enters it around every `training_step`)."""
    trl_context = getattr(trainer, _TRL_CONTEXT, None)
    if trl_context is None or isinstance(trl_context, contextlib.nullcontext):
        return
    logger.warning(
        "%s built TRL's activation offloader although hf-offload handles activation offloading: it is replaced by "
        "a no-op (hooks it installed on the output head, if any, cannot be removed)",
        type(trainer).__name__,
    )
    setattr(trainer, _TRL_CONTEXT, contextlib.nullcontext())
