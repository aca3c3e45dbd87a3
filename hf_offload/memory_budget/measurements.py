"""What the memory budget's controller measures of the run's first steps, and its reads of the device's peak counter.

`StepMeasurements` holds what the first two steps measured (the probes, the head, the step's time, what backward
left), from which `profiled_steps.ProfiledSteps` assembles the step's profile; `first_steps_head_bytes`, the head's
bytes until the second step measures them; `LongestStep`, the longest step the run will see where it is known before
training.
`OwnPeakCounter` reads and resets the device's peak-memory counter, and tells its own resets from anyone else's.
`HeldMemory`, the memory held between steps and the gradients still to come, as each training forward begins.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any

import torch
from torch import nn

from ..engine import OffloadActivations
from .probes import LayerProbe, Meter
from .sharding import local_nbytes
from .spec import MemoryBudget

__all__ = [
    "HeldMemory",
    "LongestStep",
    "OwnPeakCounter",
    "StepMeasurements",
    "budget_bytes",
    "first_steps_head_bytes",
    "first_steps_logits_bytes",
    "tail_kept",
]


# The output head and loss's bytes per token, before the second step measures them. Liger's fused linear cross-entropy
# (the model's forward is Liger's) holds the gradient of the final hidden states and a chunk of float32 logits of about
# as many elements as the hidden states, per hidden unit and token: 8 bytes measured (H100, Llama-3-8B's shape, LoRA,
# 16,384 tokens: 542,786,560 B, `prediction.profile.head_bytes` of benchmarks/results/
# 2026-11-25-nvidia-h100-80gb-hbm3-long-context-confirm-bf16-458752.json), up to 12 where the chunk's rows round up to
# a power of two. Without a fused loss, per token and vocabulary entry: the logits (2 bytes in bf16), their float32
# copy for the loss (4) and its gradient (4).
_FUSED_HEAD_BYTES_PER_TOKEN_AND_HIDDEN = 12
_HEAD_BYTES_PER_TOKEN_AND_VOCABULARY = 10


def _forward_module(model: nn.Module) -> str:
    """The module that defines the forward the model runs: its instance's own where one is set (Liger, given a model,
    patches the instance: what the Trainer's `use_liger_kernel=True` does), else its class's, seen through wrappers
    that keep the function they wrap (accelerate's mixed precision keeps `_original_forward` and sets `__wrapped__`)."""
    forward = getattr(model, "_original_forward", None) or getattr(model, "forward", None)
    function = inspect.unwrap(getattr(forward, "__func__", forward))
    return getattr(getattr(function, "__func__", function), "__module__", None) or ""


def first_steps_head_bytes(model: nn.Module, tokens: int) -> int:
    """The output head and loss's peak over what the forward leaves, for a step of `tokens`, estimated from the model's
    configuration until the second step measures it: where the first step is already long (packing to `max_length`),
    a plan that counted no head ran into it (at 327,680 tokens an 8B-class model's fused loss holds about 10 GiB).

    Args:
        model: the unwrapped model; 0 for one whose configuration names no hidden size and vocabulary.
        tokens: the step's tokens (sequences x length).
    """
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    hidden, vocabulary = getattr(config, "hidden_size", None), getattr(config, "vocab_size", None)
    if not isinstance(hidden, int) or not isinstance(vocabulary, int):
        return 0
    if _forward_module(model).startswith("liger_kernel"):
        return tokens * hidden * _FUSED_HEAD_BYTES_PER_TOKEN_AND_HIDDEN
    return tokens * vocabulary * _HEAD_BYTES_PER_TOKEN_AND_VOCABULARY


def first_steps_logits_bytes(model: nn.Module, tokens: int) -> int:
    """Of `first_steps_head_bytes`, what is certain: the logits (tokens x vocabulary, in the output head's dtype) where
    the model's forward is transformers' own, which makes them whole before its loss; 0 where another forward (Liger's
    fused linear cross-entropy, ...) may never make them, or the model has no output head.

    Args:
        model: the unwrapped model.
        tokens: the step's tokens (sequences x length).
    """
    if not _forward_module(model).startswith("transformers."):
        return 0
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0
    return tokens * weight.shape[0] * weight.element_size()


def tail_kept(engine: OffloadActivations | None) -> int:
    """What the engine's tail kept in its latest step (the one that just ended, or the one whose head runs); 0 once
    the engine is gone."""
    return int(engine.get_stats().get("bytes_kept_tail", 0)) if engine is not None else 0


def budget_bytes(memory_budget: MemoryBudget, meter: Meter) -> int:
    """The user's budget in bytes, on the device `meter` measures."""
    return memory_budget.resolve(meter.total())


@dataclasses.dataclass(frozen=True)
class LongestStep:
    """The most tokens a step of the run will hold, known before it trains, which the first plan checks
    (`Planner.check_longest_step`).

    Args:
        tokens: per device and micro-step, as the last stack the first step called sees them (a decoder-only model's
            layers, a VLM's language model, an encoder-decoder's decoder): sequences x their padded length.
        source: where it was learned, for the messages.
        strict: the user set it (`memory_budget_max_tokens`): no plan fitting it is an error; else a warning.
    """

    tokens: int
    source: str
    strict: bool


@dataclasses.dataclass
class StepMeasurements:
    """What the controller measured of the first steps, to build the profile from."""

    probes: dict[tuple, LayerProbe] = dataclasses.field(default_factory=dict)  # per stack and `layer_kind`
    # The tokens of the first layer called in the first step: the profile's tokens, which the step's own
    # measurements (head, step time) are at; and each stack's own tokens in that step, which later steps scale from.
    step_tokens: int = 0
    stack_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    device: torch.device | None = None
    d2h_bytes_per_s: float = 0.0
    h2d_bytes_per_s: float = 0.0
    # The disk tier's (`disk_offload_dir`), where there is one and it could be measured: else 0, and plans count none.
    disk_write_bytes_per_s: float = 0.0
    disk_read_bytes_per_s: float = 0.0
    step_start: Any = None
    step_s: float | None = None
    # The plan the second profiled step ran (`C` on every layer, or tiled where that alone fits): what `step_s` is the
    # time of, and so what the rest of the step (`StepProfile.other_s`) is measured against.
    safe_code: str = ""
    head_start: Any = None
    head_s: float | None = None
    held_at_step_start: int | None = None  # what was allocated as the second step began: the memory between steps
    static_at_step_start: int = 0  # that, and the gradients backward was to create (`HeldMemory.at_step_start`)
    head_bytes: int | None = None
    # CPU test mode, which has no peak counter: what the head and loss saved in the second profiled step.
    head_saved_bytes: int | None = None
    forward_peak: int | None = None  # the second step's peak before its head (the counter is reset there)
    # At the end of the second step's backward: the counter, and what was allocated (every gradient by then).
    backward_end_peak: int | None = None
    backward_end_allocated: int | None = None
    # The gradients that did not exist yet when backward reached the first layer called (the input embeddings').
    late_gradient_bytes: int = 0
    optimizer_bytes: int = 0  # what the step needed after backward on top of static memory and every gradient
    # The first step's layer calls' other arguments (masks, rotary tables), by storage (`call_argument_storages`).
    call_arguments: dict[int, tuple[int, bool]] = dataclasses.field(default_factory=dict)


class OwnPeakCounter:
    """The device's peak-memory counter as the controller reads it (`Meter.peak`), whoever else resets it.

    Whoever resets the counter between steps (a benchmark, or a training script that logs each step's peak) makes
    the read at the next forward's start a fraction of the step's peak, and a plan would seem to fit that does not.
    Until someone else resets it, the counter never reads below what it read before (`floor`), so a read below that
    means a reset. The read at the end of backward (`read_at_backward_end`) comes before any such reset, and holds
    the step's peak unless the optimizer step set it.
    """

    def __init__(self, meter: Meter) -> None:
        self._meter = meter
        self.floor = 0  # the largest read since the controller last reset the counter
        self.at_backward_end: int | None = None  # the read as the latest measured step's backward ended

    def reset(self) -> None:
        """Resets the device's counter, as the controller measures a phase from its start."""
        self._meter.reset_peak()
        self.floor = 0

    def since_own_reset(self) -> int | None:
        """The step that just ended's peak, read at the next forward's start: the device's counter if nobody else
        reset it since the controller did, else the counter as the step's backward ended (None if not read)."""
        peak, at_backward_end = self._meter.peak(), self.at_backward_end
        self.at_backward_end = None
        if peak is None or peak < self.floor:
            return at_backward_end
        self.floor = peak
        return peak

    def read_at_backward_end(self) -> None:
        """Reads the counter as a step's backward ends (queued then, `peak.queue_after_backward`)."""
        peak = self._meter.peak()
        if peak is not None and peak >= self.floor:
            self.floor = self.at_backward_end = peak

    def take_at_backward_end(self) -> int | None:
        """The read at the end of the latest backward, once."""
        peak, self.at_backward_end = self.at_backward_end, None
        return peak


class HeldMemory:
    """The memory a step holds throughout (what is allocated between steps) and the gradients backward will create,
    read once as each training forward begins (`step_begins`): a plan made within the forward, at a layer's start,
    would count what the step has made so far.

    Args:
        model: the unwrapped model, held weakly as the controller holds it.
        meter: the device's meter; in the CPU test mode, which has no allocator to read, what must be held is counted
            from the parameters and their gradients.
    """

    def __init__(self, model: nn.Module, meter: Meter) -> None:
        self._model = weakref.ref(model)
        self._meter = meter
        self._parameter_refs: list[tuple[weakref.ref, int]] | None = None  # `sized_parameters`
        # `static_bytes`, summed, as this training forward began.
        self.at_step_start = 0
        # Whether a training forward began with gradients held (gradient accumulation): plans then hold them all
        # through the step (`ProfiledSteps.profile_now`).
        self.gradients_accumulate = False

    def step_begins(self) -> None:
        """A training forward begins: reads the memory held, and whether gradients accumulate over micro-steps."""
        self.at_step_start = sum(self.static_bytes())
        self.gradients_accumulate = self.gradients_accumulate or self.gradients_held()

    def static_bytes(self) -> tuple[int, int]:
        """Memory held through the step (what is allocated between steps), and the gradients backward will create
        (none exist in the forward unless a gradient accumulation step kept them, and then they are held)."""
        pending_gradients = self.gradients()[0]
        allocated = self._meter.allocated()
        if allocated is None:  # CPU test mode: count what must be held
            parameters = [p for p in (ref() for ref, _ in self.sized_parameters()) if p is not None]
            allocated = local_nbytes(parameters) + local_nbytes(p.grad for p in parameters if p.grad is not None)
        return allocated, pending_gradients

    def gradients_held(self) -> bool:
        """Whether trained parameters hold gradients as this forward starts: micro-steps accumulate them."""
        return self.gradients()[1]

    def sized_parameters(self) -> list[tuple[weakref.ref, int]]:
        """The model's parameters, held weakly as the model is, with the bytes this rank holds of each; listed once
        per plan (`forget_parameters`): `model.parameters()` walks every submodule (0.8-2 ms on a 36-layer model), and
        every training forward counts the gradients still to come (`gradients`), which at short lengths the host
        bounds. New parameters are memory held, which makes the plan, and so this list, anew."""
        if self._parameter_refs is None:
            model = self._model()
            parameters = list(model.parameters()) if model is not None else []
            self._parameter_refs = [(weakref.ref(p), local_nbytes([p])) for p in parameters]
        return self._parameter_refs

    def forget_parameters(self) -> None:
        """A plan is made: the parameters are listed anew at the next count (`sized_parameters`)."""
        self._parameter_refs = None

    def gradients(self) -> tuple[int, bool]:
        """The bytes of the gradients the trained parameters have yet to get, and whether any of them holds one. One
        pass over the sized parameters: sizing them each step cost 0.5 ms on a 36-layer model (CPU)."""
        pending, held = 0, False
        for ref, nbytes in self.sized_parameters():
            parameter = ref()
            if parameter is None or not parameter.requires_grad:
                continue
            if parameter.grad is None:
                pending += nbytes
            else:
                held = True
        return pending, held
