"""TRL's configurations with hf-offload's activation offloading: a TRL script changes only its import.

    from hf_offload.callbacks.trl import GRPOConfig   # instead of: from trl import GRPOConfig

Every TRL configuration that subclasses `transformers.TrainingArguments` has a counterpart here, with the same name:
a dataclass with the [`ActivationOffloadingArguments`] mixin first in its bases and TRL's class second, made on first
use and kept in this module, so that it pickles (the Trainer saves its arguments with `torch.save`) and parses with
`HfArgumentParser`. Its flag `activation_offloading` is TRL's own where TRL has one (SFT, DPO, KTO, Reward): TRL's
offloader is then never built. GRPO, RLOO and the distillation trainers have none, and get offloading from these.

The names served:

- every `<Name>Config` that `trl` exports (`__all__` lists them): `SFTConfig`, `DPOConfig`, `KTOConfig`,
  `RewardConfig`, `GRPOConfig`, `RLOOConfig`, `DistillationConfig` in TRL 1.16;
- every `<Name>Config` of `trl.experimental`, found where TRL keeps it, in the package whose name is the config's
  without `Config`, in snake case: `GKDConfig` is `trl.experimental.gkd.GKDConfig`, `OnlineDPOConfig` is
  `trl.experimental.online_dpo.OnlineDPOConfig`. Only that package is imported, on first use: experimental trainers
  have optional dependencies of their own, and one that fails to import breaks only itself. A name that `trl` exports
  wins: `trl.experimental.kto.KTOConfig` is a deprecated alias of `trl.KTOConfig`.

For any other subclass of `TrainingArguments`, apply the mixin yourself (see [`ActivationOffloadingArguments`]).

Raises:
    ImportError: on import, when TRL is not installed (`pip install 'hf-offload[trl]'`).
"""

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass

import transformers

from .arguments import ActivationOffloadingArguments, with_offloading_doc

try:
    import trl
except ModuleNotFoundError as error:
    if error.name != "trl":
        raise
    raise ImportError(
        "hf_offload.callbacks.trl needs TRL, an optional dependency: pip install 'hf-offload[trl]'"
    ) from error

_SUFFIX = "Config"


def _is_training_arguments(candidate: object) -> bool:
    return isinstance(candidate, type) and issubclass(candidate, transformers.TrainingArguments)


# Only `Config` names are looked at: checking a name imports what defines it, and TRL's trainers are slow to import.
__all__ = sorted(name for name in dir(trl) if name.endswith(_SUFFIX) and _is_training_arguments(getattr(trl, name)))


def _experimental_package(config_name: str) -> str | None:
    """The `trl.experimental` package that, by TRL's layout, defines `config_name`; found without importing it."""
    spec = importlib.util.find_spec("trl.experimental")
    if spec is None or spec.submodule_search_locations is None:
        return None
    wanted = config_name.removesuffix(_SUFFIX).lower()
    for package in pkgutil.iter_modules(spec.submodule_search_locations):
        if package.ispkg and package.name.replace("_", "") == wanted:
            return f"trl.experimental.{package.name}"
    return None


def _offloading_config(name: str) -> type[ActivationOffloadingArguments] | None:
    """The counterpart of TRL's configuration `name`, made anew; `None` when TRL has no such configuration."""
    if not name.endswith(_SUFFIX):
        return None
    module = "trl" if name in __all__ else _experimental_package(name)
    trl_config = None if module is None else getattr(importlib.import_module(module), name, None)
    if not _is_training_arguments(trl_config):
        return None
    summary = f"""
    [`{module}.{name}`] with activation offloading by hf-offload, which replaces TRL's own offloader where the trainer
    has one. The other parameters are those of [`{module}.{name}`]."""
    # Named as an attribute of this module, where pickle looks the class up again.
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": with_offloading_doc(summary)}
    return dataclass(type(name, (ActivationOffloadingArguments, trl_config), namespace))


def __getattr__(name: str) -> type[ActivationOffloadingArguments]:
    config = _offloading_config(name)
    if config is None:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}: no TRL configuration of that name subclasses "
            "transformers.TrainingArguments"
        )
    # Kept in the module, so that every later lookup (an import, unpickling) gets this same class.
    return globals().setdefault(name, config)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
