"""Training arguments that switch activation offloading on and carry its options.

`ActivationOffloadingArguments` is a dataclass mixin: put it first in the bases of any `TrainingArguments`
subclass (TRL's `SFTConfig`, `DPOConfig`, ...) and decorate the result with `@dataclass`; on its own it is also an
argument group for custom training loops. Its field `activation_offloading` has the same name as TRL's, so mixed
into a TRL config it replaces TRL's field (same flag, hf-offload's meaning) instead of adding a second one.
"""

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import transformers

from hf_offload.engine import DEFAULT_WINDOW_BYTES, OffloadActivations

_MIB = 2**20
_NATIVE_OFFLOAD_KEY = "offload"


@dataclass
class ActivationOffloadingArguments:
    r"""
    Activation offloading arguments (hf-offload), as a mixin for any `TrainingArguments` subclass.

    Parameters:
        activation_offloading (`bool`, *optional*, defaults to `False`):
            Move the activations saved for backward to host memory during the forward pass and bring them back
            before the backward pass needs them. Losses and gradients are bitwise the same as without it. With
            `activation_checkpointing`, only the checkpointed layers' inputs are saved, and those are what moves. If
            transformers' native checkpoint offload is also asked for (`activation_checkpointing_kwargs={"offload":
            True}`, or the deprecated `gradient_checkpointing_kwargs`), a warning says so and the native offload is
            turned off: hf-offload moves those inputs itself, overlapped with compute.
        activation_offloading_min_size (`int`, *optional*, defaults to `1024`):
            Bytes below which a saved tensor stays on the accelerator: not worth a copy.
        activation_offloading_use_streams (`bool`, *optional*, defaults to `True`):
            Overlap the copies with compute on side streams. `False` copies on the compute stream (slower, same
            results).
        activation_offloading_use_pin_memory (`bool`, *optional*, defaults to `True`):
            Keep offloaded tensors in pinned (page-locked) host memory. Pageable memory copies about 4x slower and
            cannot overlap with compute.
        activation_offloading_forward_window_mib (`float`, *optional*, defaults to `128`):
            MiB of forward copies in flight; when full, compute waits for the oldest copy. Also bounds the tail of
            the forward kept on the accelerator.
        activation_offloading_prefetch_window_mib (`float` or `None`, *optional*, defaults to `None`):
            MiB the backward pass reloads ahead of need; `0` reloads each tensor only when it is needed. `None`
            sizes it per step: four of the step's largest offloaded tensors, and at least 128 MiB.
        activation_offloading_keep_tail (`bool`, *optional*, defaults to `True`):
            Keep the end of the forward (needed first by backward) on the accelerator, learned from the first step.
        activation_offloading_max_pinned_memory_fraction (`float`, *optional*, defaults to `0.5`):
            Cap on pinned host memory, as a fraction of the host memory available, shared by the processes on one
            host; at most 0.9. Past the cap activations stay on the accelerator (one warning).
        activation_offloading_max_pinned_mib (`float` or `None`, *optional*, defaults to `None`):
            Explicit cap on pinned host memory in MiB; overrides `activation_offloading_max_pinned_memory_fraction`.
        activation_offloading_device_type (`str` or `None`, *optional*, defaults to `None`):
            For testing. The device type whose tensors are offloaded; `None` means the current accelerator (with none,
            offloading is inactive and says so once). `"cpu"` moves CPU tensors into a separate host buffer, which
            exercises the bookkeeping and statistics without a GPU.
    """

    activation_offloading: bool = field(
        default=False,
        metadata={"help": "Offload the activations saved for backward to host memory (hf-offload); exact, overlapped."},
    )
    activation_offloading_min_size: int = field(
        default=1024,
        metadata={"help": "Bytes below which a saved tensor stays on the accelerator."},
    )
    activation_offloading_use_streams: bool = field(
        default=True,
        metadata={"help": "Overlap the copies with compute on side streams."},
    )
    activation_offloading_use_pin_memory: bool = field(
        default=True,
        metadata={"help": "Keep offloaded tensors in pinned host memory (faster copies that can overlap)."},
    )
    activation_offloading_forward_window_mib: float = field(
        default=DEFAULT_WINDOW_BYTES / _MIB,
        metadata={"help": "MiB of forward copies in flight before compute waits for the oldest."},
    )
    activation_offloading_prefetch_window_mib: float | None = field(
        default=None,
        metadata={"help": "MiB reloaded ahead of need in backward; 0 reloads on demand only; None: four of the "
                  "step's largest offloaded tensors, at least 128 MiB."},
    )
    activation_offloading_keep_tail: bool = field(
        default=True,
        metadata={"help": "Keep the end of the forward, which backward needs first, on the accelerator."},
    )
    activation_offloading_max_pinned_memory_fraction: float = field(
        default=0.5,
        metadata={"help": "Cap on pinned host memory: fraction (at most 0.9) of available host memory, per host."},
    )
    activation_offloading_max_pinned_mib: float | None = field(
        default=None,
        metadata={"help": "Explicit cap on pinned host memory in MiB; overrides the fraction."},
    )
    activation_offloading_device_type: str | None = field(
        default=None,
        metadata={"help": "For testing: device type to offload from; None = the accelerator, 'cpu' = CPU test mode."},
    )

    def __post_init__(self) -> None:
        # Mixed into a TrainingArguments subclass, the other bases' __post_init__ runs first: it resolves the
        # deprecated checkpointing aliases that the native-offload check reads.
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        self._validate_offloading_options()
        if self.activation_offloading and isinstance(self, transformers.TrainingArguments):
            self._turn_off_native_checkpoint_offload()

    def offload_engine_options(self) -> dict[str, Any]:
        """The keyword arguments of `get_act_offloading_ctx_manager` / `OffloadActivations` these fields stand for."""
        return {option: convert(getattr(self, argument)) for option, (argument, convert) in _ENGINE_OPTIONS.items()}

    def _validate_offloading_options(self) -> None:
        """Fails at construction, naming the argument, rather than when training starts.

        The engine owns the rules (allowed values and ranges); building one applies them. Without an explicit device
        type it is built in CPU test mode, which checks the same options without touching an accelerator and without
        warning that offloading would be inactive.
        """
        options = self.offload_engine_options()
        try:
            OffloadActivations(**{**options, "device_type": options["device_type"] or "cpu"})
        except ValueError as error:
            argument = next(
                (argument for option, (argument, _) in _ENGINE_OPTIONS.items() if str(error).startswith(f"{option} ")),
                None,
            )
            if argument is None:
                raise
            raise ValueError(f"invalid {argument}={getattr(self, argument)!r}: {error}") from error

    def _turn_off_native_checkpoint_offload(self) -> None:
        # Native offload wraps each checkpointed layer in save_on_cpu, whose hooks would take the layer inputs away
        # from ours and copy them synchronously on the compute stream. transformers has resolved the deprecated
        # names by now (the old one mirrors the new one); older versions have only the old ones.
        checkpointing = any(
            getattr(self, name, None) for name in ("activation_checkpointing", "gradient_checkpointing")
        )
        names = [name for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
                 if isinstance(getattr(self, name, None), dict)]  # fmt: skip
        if not checkpointing or not any(getattr(self, name).get(_NATIVE_OFFLOAD_KEY) for name in names):
            return
        warnings.warn(
            "activation_offloading=True and activation_checkpointing_kwargs={'offload': True} would both offload the "
            "checkpointed activations: hf-offload takes over and the native offload is turned off.",
            UserWarning,
            stacklevel=4,  # the line that built the arguments
        )
        for name in names:
            # A new dict: the caller's may be shared with other arguments objects.
            kwargs = getattr(self, name)
            setattr(self, name, {key: value for key, value in kwargs.items() if key != _NATIVE_OFFLOAD_KEY})


def _same(value: Any) -> Any:
    return value


def _mib_to_bytes(mib: float | None) -> int | None:
    return None if mib is None else int(mib * _MIB)


# Engine option -> (the argument that sets it, conversion from the argument's unit). The one place they are paired.
_ENGINE_OPTIONS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "use_pin_memory": ("activation_offloading_use_pin_memory", _same),
    "use_streams": ("activation_offloading_use_streams", _same),
    "min_offload_size": ("activation_offloading_min_size", _same),
    "forward_window_bytes": ("activation_offloading_forward_window_mib", _mib_to_bytes),
    "prefetch_window_bytes": ("activation_offloading_prefetch_window_mib", _mib_to_bytes),
    "keep_tail": ("activation_offloading_keep_tail", _same),
    "max_pinned_memory_fraction": ("activation_offloading_max_pinned_memory_fraction", _same),
    "max_pinned_bytes": ("activation_offloading_max_pinned_mib", _mib_to_bytes),
    "device_type": ("activation_offloading_device_type", _same),
}


def with_offloading_doc(summary: str) -> str:
    """A docstring for a class that applies the mixin: its summary, then the mixin's parameters."""
    return summary + "\n\n    Parameters:" + ActivationOffloadingArguments.__doc__.split("Parameters:", 1)[1]


@dataclass
class TrainingArguments(ActivationOffloadingArguments, transformers.TrainingArguments):
    __doc__ = with_offloading_doc(
        """
    [`transformers.TrainingArguments`] plus activation offloading (hf-offload).

    Setting `activation_offloading=True` is the only change a working `Trainer` script needs: every `Trainer` built
    with these arguments gets an `ActivationOffloadingCallback` automatically. The other parameters are those of
    [`transformers.TrainingArguments`]."""
    )
