"""hf-offload: exact, overlapped activation offloading for the Hugging Face Trainer and TRL.

Importing this package imports only torch and psutil. The Trainer integration (`TrainingArguments`, the
arguments mixin, `ActivationOffloadingCallback`) lives in `hf_offload.callbacks` and is loaded on first use of
those names, so the engine stays usable without transformers' Trainer machinery.
"""

from __future__ import annotations

import importlib
from typing import Any

from .engine import NoOpManager, OffloadActivations
from .memory_budget.search import InfeasibleBudgetError
from .options import OffloadOptions
from .stats import format_summary
from .versions import check_dependency_versions

__version__ = "0.1.0"

check_dependency_versions()  # one clear ImportError below the supported range, before anything fails far from it

# Names served lazily from submodules that import transformers.
_LAZY = {
    "get_act_offloading_ctx_manager": "hf_offload.context",
    "apply_tiled_mlp": "hf_offload.tiled.apply",
    "compile_decoder_layers": "hf_offload.regional_compilation",
    "compile_loss": "hf_offload.regional_compilation",
    "TrainingArguments": "hf_offload.callbacks",
    "ActivationOffloadingArguments": "hf_offload.callbacks",
    "ActivationOffloadingCallback": "hf_offload.callbacks",
}

__all__ = ["InfeasibleBudgetError", "NoOpManager", "OffloadActivations", "OffloadOptions", "format_summary", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_offload' has no attribute {name!r}")
