"""TRL's configurations with hf-offload's activation offloading: a TRL script changes only its import.

    from hf_offload.callbacks.trl import SFTConfig   # instead of: from trl import SFTConfig

Importing this module imports TRL (an optional dependency: `pip install hf-offload[trl]`).
"""

from dataclasses import dataclass

import trl

from .arguments import ActivationOffloadingArguments, with_offloading_doc


@dataclass
class SFTConfig(ActivationOffloadingArguments, trl.SFTConfig):
    __doc__ = with_offloading_doc(
        """
    [`trl.SFTConfig`] with activation offloading by hf-offload instead of TRL's offloader. The other parameters are
    those of [`trl.SFTConfig`]."""
    )


@dataclass
class DPOConfig(ActivationOffloadingArguments, trl.DPOConfig):
    __doc__ = with_offloading_doc(
        """
    [`trl.DPOConfig`] with activation offloading by hf-offload instead of TRL's offloader. The other parameters are
    those of [`trl.DPOConfig`]."""
    )
