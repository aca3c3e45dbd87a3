"""The Trainer and TRL integration of hf-offload.

Importing this package installs, once, the `Trainer.__init__` wrapper that gives every Trainer built with these
arguments and `activation_offloading=True` an `ActivationOffloadingCallback` (see `registration`). TRL's
configurations (`SFTConfig`, `GRPOConfig`, ... every name that `hf_offload.callbacks.trl` serves) are served here
too; they import TRL, so they load on first use.
"""

from typing import Any

from .arguments import ActivationOffloadingArguments, TrainingArguments
from .callback import ActivationOffloadingCallback
from .registration import install as _install_trainer_registration

_install_trainer_registration()

# TRL's configurations are left out: listing them would make `import *` need TRL.
__all__ = ["ActivationOffloadingArguments", "ActivationOffloadingCallback", "TrainingArguments"]


def __getattr__(name: str) -> Any:
    if name.endswith("Config"):
        from . import trl

        return getattr(trl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
