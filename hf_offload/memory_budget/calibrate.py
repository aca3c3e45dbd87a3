"""What the plans that ran teach the step model: the scale of its times, and the host's time per offloading layer.

The step model (`simulate`) times a step from the probes' per-layer times and the link's bandwidth, as the GPU would
run it. Two things it does not see, measured on the H100 shape zoo (benchmarks/zoo.py; docs/DESIGN.md, "What the
measured plans teach the model"):

* Short steps are paced by the host, not the GPU: on a 36-layer 3B shape at 4K tokens the model predicted 436 ms for
  a step that ran in 300 ms, and on a 26-layer 2B shape at 2K tokens 300 ms for 236 ms. Its layer times are too long
  against the link's, so copies that do not hide look hidden (whole-layer offloads, `O`, ran 1.05-1.5x slower than
  plain checkpointing, which the model put behind them).
* Each layer whose input goes to the host costs the host time the model has no term for: full checkpointing with the
  inputs offloaded ran 40 ms slower than with them kept on the first shape (36 layers), 70 ms on the second (26).

`calibrate` learns both from `MeasuredStep`s, in the order that separates them: the time of a plan that offloads
nothing (`Kcstl` only: plain checkpointing, the closed loop's trial) is compute alone, and scales every time of the
model (`time_scale`); what a plan that offloads only inputs (`CSTL`, the profiled safe plan) ran beyond the scaled
model is the host's time per layer that offloads its input (`input_offload_s`); what a plan with whole-layer or
selective offloads (`OX`) ran beyond that is the time per such layer (`saved_offload_s`: the host's, and copies that
the model thought hidden). Until such a plan ran, each tensor such a layer sends (`LayerProfile.saved_tensors`) is
priced as one input was: on the zoo's 28-layer LoRA shape at 4K tokens, where the host paces the step, plans
offloading 7-9 layers whole, dozens of tensors each, ran up to 1.6x the earlier run's plans without them at the same
budgets; where the GPU paces it (S1, 16K tokens) an input costs the host nothing visible, and neither do those tensors.
The answer is a profile with those times (`StepProfile.input_offload_s`,
`saved_offload_s`), which `choose_plan` searches as any other. Pure Python, like the rest of the planning.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .profile import StepProfile
from .simulate import MeasuredStep, simulate, unavailable_tiling

__all__ = ["Calibration", "calibrate"]

_NOTHING_SENT = frozenset("Kcstl")
_INPUTS_SENT = frozenset("CSTL")
_SAVED_SENT = frozenset("OX")


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` learned from the measured plans.

    Args:
        time_scale: the factor on every time of the model (layers, head, the rest of the step), from the plans that
            offload nothing; 1 without one (the profile's `other_s` then holds what the safe plan's time adds).
        input_offload_s: host time per layer that sends its input to the host (`C`, `S`, `T`, `L`).
        saved_offload_s: time per layer that sends its saved tensors to the host (`O`, `X`), beyond the model's.
        learned_from: the codes of the measured plans each figure came from, in that order.
    """

    time_scale: float = 1.0
    input_offload_s: float = 0.0
    saved_offload_s: float = 0.0
    learned_from: tuple[str, ...] = ()

    def describe(self) -> str:
        """The figures, for the log."""
        return (f"the model's times x{self.time_scale:.3f}, {self.input_offload_s * 1000:.2f} ms per layer that "
                f"offloads its input, {self.saved_offload_s * 1000:.2f} ms per layer that offloads its saved tensors "
                f"(from {', '.join(repr(code) for code in self.learned_from) or 'no measured plan'})")  # fmt: skip


def _times_scaled(profile: StepProfile, scale: float) -> StepProfile:
    """`profile` with every time of the model multiplied by `scale` (the link's bandwidth as it is)."""
    layers = tuple(
        dataclasses.replace(
            layer,
            forward_s=layer.forward_s * scale,
            backward_s=layer.backward_s * scale,
            selective_recompute_s=layer.selective_recompute_s * scale,
            attention_forward_s=layer.attention_forward_s * scale,
            attention_backward_s=layer.attention_backward_s * scale,
            tiled_extra_s=layer.tiled_extra_s * scale,
            layer_tiled_extra_s=layer.layer_tiled_extra_s * scale,
        )
        for layer in profile.layers
    )
    return dataclasses.replace(profile, layers=layers, head_s=profile.head_s * scale, other_s=profile.other_s * scale)


def _residuals(profile: StepProfile, steps: Sequence[MeasuredStep], letters: frozenset[str]) -> list[float]:
    """Per step, what it ran beyond the model's prediction, per layer whose letter is in `letters`."""
    return [(step.step_s - simulate(profile, step.code).step_s) / sum(letter in letters for letter in step.code)
            for step in steps]  # fmt: skip


def calibrate(profile: StepProfile, measured: Sequence[MeasuredStep]) -> tuple[StepProfile, Calibration]:
    """The profile with what the measured plans teach the model, and those figures.

    Args:
        profile: the measured step; its `input_offload_s` and `saved_offload_s` are the floors of what is learned (a
            layer's offload never costs the host less than its hooks).
        measured: plans that ran, at `profile`'s tokens (see `MeasuredStep.scaled`); those that tile MLPs or layers
            where `profile` cannot, and those whose time was not measured, are left out.

    Returns:
        `(calibrated profile, Calibration)`; the profile as it is (and a neutral calibration) without measured plans.

    Example:
        A model twice too slow, whose offloaded inputs cost the host 1 ms a layer:

        >>> from hf_offload.memory_budget.profile import LayerProfile
        >>> layer = LayerProfile(saved_bytes=2**30, selective_bytes=2**29, input_bytes=2**10, forward_s=0.004,
        ...                      backward_s=0.008, selective_recompute_s=0.002)
        >>> profile = StepProfile(layers=[layer] * 4, static_bytes=2**33, head_bytes=2**30,
        ...                       backward_working_bytes=2**30, head_s=0.02, other_s=0.0, d2h_bytes_per_s=55e9,
        ...                       h2d_bytes_per_s=55e9, host_cap_bytes=2**36, tokens=4096)
        >>> model = simulate(profile, "cccc").step_s
        >>> _, learned = calibrate(profile, [MeasuredStep("cccc", model / 2), MeasuredStep("CCCC", model / 2 + 0.004)])
        >>> round(learned.time_scale, 3), round(learned.input_offload_s * 1000, 3)
        (0.5, 1.0)
    """
    usable = [step for step in measured if step.step_s is not None and not unavailable_tiling(profile, step.code)]
    quiet = [step for step in usable if set(step.code) <= _NOTHING_SENT]
    inputs = [step for step in usable if set(step.code) & _INPUTS_SENT and not set(step.code) & _SAVED_SENT]
    saved = [step for step in usable if set(step.code) & _SAVED_SENT]
    floors = (profile.input_offload_s, profile.saved_offload_s)
    calibrated = dataclasses.replace(profile, input_offload_s=0.0, saved_offload_s=0.0)
    scale, learned_from = 1.0, []
    if quiet:
        # Their time is the model's compute alone: the rest of the step (`other_s`, which the controller derives from
        # the safe plan's time) is in the scale, not beside it.
        bare = dataclasses.replace(calibrated, other_s=0.0)
        ratios = [step.step_s / model for step in quiet if (model := simulate(bare, step.code).step_s) > 0]
        if ratios:
            scale = statistics.median(ratios)
            calibrated = _times_scaled(bare, scale)
            learned_from += [step.code for step in quiet]
    input_s = floors[0]
    if inputs:
        input_s = max(input_s, statistics.median(_residuals(calibrated, inputs, _INPUTS_SENT)))
        learned_from += [step.code for step in inputs]
    calibrated = dataclasses.replace(calibrated, input_offload_s=input_s)
    saved_s = floors[1]
    if saved:
        saved_s = max(saved_s, statistics.median(_residuals(calibrated, saved, _SAVED_SENT)))
        learned_from += [step.code for step in saved]
    else:  # until one ran: each tensor such a layer sends costs the host what an input did
        saved_s = max(saved_s, input_s * max(layer.saved_tensors for layer in profile.layers))
    calibrated = dataclasses.replace(calibrated, saved_offload_s=saved_s)
    return calibrated, Calibration(scale, input_s, saved_s, tuple(learned_from))
