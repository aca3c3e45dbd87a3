"""The Trainer and TRL integration of hf-offload.

Importing this package installs, once, the `Trainer.__init__` wrapper that gives every Trainer built with these
arguments and `activation_offloading=True` an `ActivationOffloadingCallback` (see `registration`). `SFTConfig` and
`DPOConfig` import TRL, so they load on first use.
"""

from typing import Any

from .arguments import ActivationOffloadingArguments, TrainingArguments
from .callback import ActivationOffloadingCallback
from .registration import install as _install_trainer_registration

_install_trainer_registration()

_TRL_CONFIGS = ("SFTConfig", "DPOConfig")

__all__ = ["ActivationOffloadingArguments", "ActivationOffloadingCallback", "TrainingArguments", *_TRL_CONFIGS]


def __getattr__(name: str) -> Any:
    if name in _TRL_CONFIGS:
        from . import trl

        return getattr(trl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
