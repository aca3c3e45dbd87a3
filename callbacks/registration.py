"""Automatic registration: a Trainer built with hf-offload's arguments gets an ActivationOffloadingCallback, and
whatever the callback attached is taken off when `train()` ends, by any path.

Callbacks are passed to `Trainer.__init__` before the trainer exists, and ours needs the trainer, so the only way
to make `activation_offloading=True` the single change a script needs is to act at the end of `Trainer.__init__`.
`install()` wraps `transformers.Trainer.__init__` once per process (idempotent, also across re-imports); every
subclass (TRL's included) reaches it through `super().__init__`. For any other arguments the wrapper does nothing.

`on_train_end` is not called when `train()` raises (an `InfeasibleBudgetError`, an out-of-memory error, a
KeyboardInterrupt in a notebook): the model would keep the context's hooks and its plan's checkpointing, and the
process an optimizer hook, and a later run on the same model, without hf-offload, would still offload or recompute.
So `install()` also wraps `transformers.Trainer.train`, whose `finally` has the callback take off what it attached
(`release`).
"""

import functools
from typing import Any

import transformers

from .arguments import ActivationOffloadingArguments
from .callback import ActivationOffloadingCallback
from .compile_layers import claim_torch_compile
from .trl_takeover import claim_trl_offloader

__all__ = ["install", "register", "release"]

_MARKER = "__hf_offload_registers_callback__"


def install() -> None:
    """Wrap `transformers.Trainer.__init__` so that it ends with `register`, and `transformers.Trainer.train` so that
    it ends with `release`, whether it returns or raises; a no-op if already wrapped.

    Called once when `hf_offload.callbacks` is imported.
    """
    original_init, original_train = transformers.Trainer.__init__, transformers.Trainer.train
    if getattr(original_init, _MARKER, False):
        return

    @functools.wraps(original_init)
    def __init__(self: transformers.Trainer, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        register(self)

    @functools.wraps(original_train)
    def train(self: transformers.Trainer, *args: Any, **kwargs: Any) -> Any:
        try:
            return original_train(self, *args, **kwargs)
        finally:
            release(self)

    setattr(__init__, _MARKER, True)
    transformers.Trainer.__init__ = __init__
    transformers.Trainer.train = train


def register(trainer: transformers.Trainer) -> None:
    """Add an `ActivationOffloadingCallback` to `trainer` if its arguments ask for offloading and it has none.

    The callback goes first, so that the log entries it adds reach every other callback; TRL's own offloader is
    then kept from being built (`trl_takeover.claim_trl_offloader`). With `torch_compile=True`, accelerate is kept
    from compiling the model as a whole, and the callback compiles its decoder layers (`compile_layers`).

    Args:
        trainer: a trainer at the end of its `__init__`.
    """
    args = trainer.args
    if not (isinstance(args, ActivationOffloadingArguments) and args.activation_offloading):
        return
    callbacks = trainer.callback_handler.callbacks
    if any(isinstance(callback, ActivationOffloadingCallback) for callback in callbacks):
        return
    # First in line: the entries it adds to the logs in on_log must be there when the progress bar, the printer and
    # the reporting integrations (all registered earlier) receive them.
    callbacks.insert(0, ActivationOffloadingCallback(trainer, layer_compile_options=claim_torch_compile(trainer)))
    claim_trl_offloader(trainer)


def release(trainer: transformers.Trainer) -> None:
    """Take off whatever the trainer's offloading callback attached to its model, if it has one (see the module
    docstring); after a run that ended normally, `on_train_end` already has, and this does nothing."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ActivationOffloadingCallback):
            callback.release()
