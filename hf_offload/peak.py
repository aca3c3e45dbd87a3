"""Where a training step's memory peak is set, and how much of it offloading takes off.

Offloading lowers the device's memory only while the bytes it moved are away: from the end of their layer's forward
to their reload in backward. A step whose peak is set elsewhere (the output head and the loss at a large vocabulary,
whose logits dwarf a short step's activations; the optimizer step, which holds the gradients and the optimizer's
temporaries once every activation is gone) gains little or nothing from it, and still pays for the copies.

One step is measured (`StepPeakWatch`): the device's peak counter is reset at the boundaries of four phases and read
at their ends, and the bytes offloading held away during each phase are known to the engine:

| phase | bytes held away during it |
| --- | --- |
| forward | from 0 (its start) up to everything it offloaded (its end) |
| head and loss | everything the forward offloaded: nothing comes back before backward reaches the layers |
| backward | from everything down to 0, as backward reloads |
| optimizer step, between steps | 0 |

So the peak without offloading lies between `max(phase peak + least held away)` and `max(phase peak + most held
away)`, and the reduction offloading buys is known within those bounds without ever running a step without it
(which may not fit). `PeakReport` holds the figures and says them in words; the engine reports it once and, with the
option `min_peak_reduction`, stands aside when even the upper bound of the reduction is below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .units import format_bytes

__all__ = [
    "PhasePeak",
    "PeakReport",
    "DevicePeakCounter",
    "StepPeakWatch",
    "queue_after_backward",
    "FORWARD",
    "HEAD",
    "BACKWARD",
    "AFTER",
]

FORWARD, HEAD, BACKWARD, AFTER = "forward", "head and loss", "backward", "optimizer step and between steps"
# Without a hook on the output head the forward and the head's phase are one.
_FORWARD_AND_HEAD = "forward, head and loss"
# Steps that may be measured before giving up, when the measured one has no backward that reloads anything.
_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class PhasePeak:
    """One phase of the measured step.

    Args:
        name: the phase (`FORWARD`, `HEAD`, `BACKWARD`, `AFTER`).
        peak_bytes: the device's peak allocated memory during the phase, with offloading.
        least_away_bytes: the fewest bytes offloading held off the device at any moment of the phase.
        most_away_bytes: the most it held off the device at any moment of the phase.
    """

    name: str
    peak_bytes: int
    least_away_bytes: int
    most_away_bytes: int


@dataclasses.dataclass(frozen=True)
class PeakReport:
    """The measured step's peak, where it was set, and the bounds of the peak the step would have without offloading.

    Args:
        phases: the step's phases in order.
        tokens: the tokens of the measured step (its first decoder layer's input), 0 where unknown.
    """

    phases: tuple[PhasePeak, ...]
    tokens: int = 0

    @property
    def peak_bytes(self) -> int:
        """The step's peak with offloading."""
        return max(phase.peak_bytes for phase in self.phases)

    @property
    def set_in(self) -> str:
        """The phase whose peak is the step's (the earliest of equal ones)."""
        return max(self.phases, key=lambda phase: phase.peak_bytes).name

    @property
    def without_least_bytes(self) -> int:
        """The least the step's peak would be without offloading."""
        return max(phase.peak_bytes + phase.least_away_bytes for phase in self.phases)

    @property
    def without_most_bytes(self) -> int:
        """The most the step's peak would be without offloading."""
        return max(phase.peak_bytes + phase.most_away_bytes for phase in self.phases)

    @property
    def most_reduction(self) -> float:
        """The largest share of the peak without offloading that offloading can have taken off (0 to 1)."""
        without = self.without_most_bytes
        return (without - self.peak_bytes) / without if without else 0.0

    def describe(self) -> str:
        """The figures in one sentence."""
        if self.without_least_bytes == self.without_most_bytes:
            without = format_bytes(self.without_most_bytes)
        else:
            without = f"between {format_bytes(self.without_least_bytes)} and {format_bytes(self.without_most_bytes)}"
        least = self.without_least_bytes - self.peak_bytes
        most = self.without_most_bytes - self.peak_bytes
        lowered = format_bytes(most) if least == most else f"{format_bytes(least)} to {format_bytes(most)}"
        share = f"{100 * self.most_reduction:.1f}%"
        return (f"the step's peak is {format_bytes(self.peak_bytes)}, set in the {self.set_in}; without offloading it "
                f"would be {without}: offloading lowers it by {lowered} (at most {share})")  # fmt: skip


class DevicePeakCounter:
    """The device's allocated-memory peak counter (`torch.cuda.max_memory_allocated`), read and reset.

    Args:
        device_type: the engine's device type; a device without a peak counter (the CPU test mode) reads None.
    """

    def __init__(self, device_type: str | None) -> None:
        module = torch.get_device_module(device_type) if device_type not in (None, "cpu") else None
        self._module = module if module is not None and hasattr(module, "max_memory_allocated") else None

    def read_and_reset(self) -> int | None:
        """The peak since the last reset, then a reset; None without a counter."""
        if self._module is None:
            return None
        peak = self._module.max_memory_allocated()
        self._module.reset_peak_memory_stats()
        return peak


class StepPeakWatch:
    """Measures the phases of one step, the `measured_step`-th (counting from 1), and keeps its `PeakReport`.

    The engine calls it at the phase boundaries it sees; outside the measured step every call returns at once. The
    second step is measured by default: the first learns the tail and creates the optimizer's state. Resetting the
    device's peak counter inside that step hides earlier steps' peaks from whoever reads the counter later (the memory
    budget's profiled steps do the same); later steps are not touched.

    Args:
        read_and_reset: the device's peak counter (`DevicePeakCounter.read_and_reset`): the peak since the last call,
            then a reset; None where the device has no counter, and nothing is measured.
        measured_step: which step to measure.
    """

    def __init__(self, read_and_reset: Callable[[], int | None], measured_step: int = 2) -> None:
        self._read_and_reset = read_and_reset
        self._measured_step = measured_step
        self._attempts_left = _ATTEMPTS
        self._steps = 0
        self._phases: list[PhasePeak] | None = None  # the measured step's phases so far, while it runs
        self._tokens = 0
        self.report: PeakReport | None = None

    @property
    def measuring(self) -> bool:
        return self._phases is not None

    def step_begins(self) -> PeakReport | None:
        """A forward begins. Returns the report when this ends the measured step, else None."""
        finished = None
        if self._phases is not None:
            finished = self._end()
        self._steps += 1
        if self._steps == self._measured_step and self.report is None and self._read_and_reset() is not None:
            self._phases, self._tokens = [], 0
        return finished

    def forward_ends(self, away_bytes: int) -> None:
        """The tail of the forward (the head) begins, with `away_bytes` offloaded and off the device."""
        if self._phases is not None and not self._phases:
            self._phases.append(self._phase(FORWARD, 0, away_bytes))

    def backward_begins(self, away_bytes: int) -> None:
        """Backward reaches the first offloaded tensor: nothing has come back yet."""
        if self._phases is None or [phase.name for phase in self._phases] not in ([], [FORWARD]):
            return
        if self._phases:  # the head's phase: all the forward moved was away
            self._phases.append(self._phase(HEAD, away_bytes, away_bytes))
        else:  # no head hook marked the forward's end
            self._phases.append(self._phase(_FORWARD_AND_HEAD, 0, away_bytes))

    def backward_ends(self) -> None:
        """The backward that consumed the measured forward is over: every reload is back."""
        if self._phases is not None and self._phases and self._phases[-1].name in (HEAD, _FORWARD_AND_HEAD):
            # Everything the forward moved was away as backward began: the last phase's most.
            self._phases.append(self._phase(BACKWARD, 0, self._phases[-1].most_away_bytes))

    def note_tokens(self, tokens: int) -> None:
        """The step's tokens, told by the model's pre-hook as its forward starts."""
        if self._phases is not None and not self._tokens:
            self._tokens = tokens

    def _phase(self, name: str, least: int, most: int) -> PhasePeak:
        return PhasePeak(name, self._read_and_reset() or 0, least, most)

    def _end(self) -> PeakReport | None:
        """The next forward begins: the phase after backward (the optimizer step; nothing away) ends the step."""
        phases, self._phases = self._phases, None
        phases.append(self._phase(AFTER, 0, 0))
        if not any(phase.name == BACKWARD for phase in phases):
            # The step's backward never ran, or reloaded nothing (evaluation, or nothing offloaded): measure the next
            # one instead, a few times at most, for the counter is reset in each.
            self._attempts_left -= 1
            if self._attempts_left:
                self._measured_step = self._steps + 1
            return None
        self.report = PeakReport(tuple(phases), self._tokens)
        return self.report


def queue_after_backward(callback: Callable[[], Any]) -> bool:
    """Run `callback` when the backward pass running now ends; False (nothing queued) outside a backward pass."""
    if torch._C._current_graph_task_id() == -1:
        return False
    torch.autograd.Variable._execution_engine.queue_callback(callback)
    return True
