"""What the closed loop learns from the steps plans ran: their samples, the plans' measurements, the model's errors.

`plan_checks.PlanChecks` records each clean step a plan runs as a `Sample` (its tokens, time, peak and the model's
prediction of it), in a `dict` of samples per plan code. From them this module says what each plan measured, scaled
to the step being planned (`measured_plans`: `choose_plan`'s `measured`), how far the model's peaks fell short of
what was measured (`peak_correction`), and how much of the reloads the head's own peak hides (`head_reload_hidden`).
`PlanChecks` decides when to record and when to check a plan (`MEASURED_STEPS`, `MAX_CORRECTIONS`,
`TRIAL_MEASURED_STEPS`). Pure Python, like the rest of the planning (`spec`, `profile`, `simulate`, `search`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping

from .profile import StepProfile
from .simulate import MeasuredStep, optimizer_step_bytes, unavailable_tiling

__all__ = [
    "MAX_CORRECTIONS",
    "MEASURED_STEPS",
    "STATIC_GROWTH_TOLERANCE",
    "TRIAL_MEASURED_STEPS",
    "Sample",
    "head_reload_hidden",
    "held_growth",
    "measured_plans",
    "peak_correction",
]

# Re-plan when the memory held between steps grows by more than this (optimizer state appearing); smaller changes
# are the allocator's noise and within the planner's margin.
STATIC_GROWTH_TOLERANCE = 0.02
# A plan's steps are measured from the second one on (the first pays one-off costs: allocator growth, new kernels);
# after this many, the fastest of them is compared with the other plans measured so far.
MEASURED_STEPS = 3
# At most this many replacements in a run: each costs a few steps on a plan that may be worse.
MAX_CORRECTIONS = 3
# The trial: plain checkpointing with every input kept (the simple plan the profiled steps do not run), where it is
# predicted to fit and the first plan is another, runs this many steps after its first before the plan is chosen with
# what it measured. Two: on the H100 zoo a step's time varied by up to 10% from one step to the next.
TRIAL_MEASURED_STEPS = 2

Samples = Mapping[str, list["Sample"]]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One clean step of a plan: its tokens in the profile's terms, its time, its peak (None without a counter) and
    the tail the engine kept in it; `profiled`: the second profiled step, which the model of the step is calibrated
    on (its `other_s`). `peak_exact`: the peak is this step's own (the counter rose to it in this step), not a bound
    left by an earlier one; `static_bytes`: what was held between steps, with the gradients backward was to create,
    as the step began, which its peak grows with (`measured_plans`); `predicted_peak_bytes`: the model's prediction
    of the step as it ran (its window, no correction), which an exact peak corrects (`peak_correction`);
    `head_base_bytes` and `head_reload_bytes`: its head's point without reloads and the reloads counted on top
    (`SimulatedStep`), with which an exact peak bounds what the head hides (`head_reload_hidden`).

    The first step's is a peak alone (`through_backward`): no time (the probes and the warm-up ran in it), and its
    peak is the counter's at the end of backward, as the optimizer's step then makes the optimizer's state."""

    tokens: int
    seconds: float | None
    peak_bytes: int | None
    profiled: bool = False
    tail_bytes: int = 0  # what the engine's tail kept through the step's head
    peak_exact: bool = False
    static_bytes: int | None = None  # the memory held between steps and the gradients pending, as the step began
    predicted_peak_bytes: int | None = None
    head_base_bytes: int | None = None
    head_reload_bytes: int = 0
    through_backward: bool = False


def held_growth(at_step_start: int, now: int) -> int:
    """What the memory held between steps (with the gradients pending) grew by since a measured step began, where it
    grew by more than the allocator's noise (`STATIC_GROWTH_TOLERANCE`, as for planning anew); else 0.

    Small growth is most likely the measured step's own (allocations it keeps, such as library workspaces), and so
    was in its peak: on an H200 a budget at the second profiled step's measured peak was refused by 4 MB (of 820 MB
    held) once the growth to the third step's start was added to that peak."""
    grown = now - at_step_start
    return grown if grown > at_step_start * STATIC_GROWTH_TOLERANCE else 0


def measured_plans(samples: Samples, profile: StepProfile, profile_at: Callable[[int], StepProfile],
                   budget_bytes: int, held_now: int, gradients_accumulate: bool,
                   trialled: set[str]) -> list[MeasuredStep]:  # fmt: skip
    """What each plan run so far measured, scaled to `profile`: per plan, the fastest of its steps' times and the
    largest of their peaks, each step scaled from its own tokens (`profile_at(tokens)`: the profile at a step's
    tokens). The fastest, not the median: a short step is paced by the host, whose stalls (the garbage collector, the
    VM) only ever add time, to one step and not the next (on the H100 zoo, plain checkpointing's steps spanned
    0.167-0.246 s within one run), and are no property of the plan. Only plans with `MEASURED_STEPS` steps count (one
    step is noise), the safe plan, whose profiled step the model is calibrated on, a trial's (`trialled`)
    `TRIAL_MEASURED_STEPS`, and a plan one of whose steps peaked over the budget, exactly: that one step proves the
    plan does not fit (the controller checks the plan there). Plans that tile MLPs or layers where `profile` cannot
    are left out.

    A peak grows by what the memory held between steps, with the gradients pending, grew from its step's start to
    `held_now` (`held_growth`): with gradient accumulation over three micro-steps or more, the profiled steps run
    before the optimizer made its state (AdamW's: twice the trained parameters), and a plan chosen by their peak
    would run over the budget by that state once it exists.

    The first step's peak (`Sample.through_backward`), grown so, measures the plan it ran where no later step
    measured a peak of that plan: with the optimizer's step (after the counter's read) as the model has it, and not
    under gradient accumulation (`gradients_accumulate`), whose later micro-steps hold the gradients the first step
    created in backward. It has no time: the plan's predicted time stands for it."""
    at_tokens: dict[int, StepProfile] = {}
    measured = []
    for code, all_samples in samples.items():
        plan_samples = [sample for sample in all_samples if not sample.through_backward]
        if not gradients_accumulate and not any(sample.peak_bytes is not None for sample in plan_samples):
            plan_samples += [sample for sample in all_samples if sample.through_backward]
        over_budget = any(sample.peak_exact and sample.peak_bytes > budget_bytes for sample in plan_samples)
        enough = (len(plan_samples) >= MEASURED_STEPS
                  or any(sample.profiled or sample.through_backward for sample in plan_samples)
                  or (code in trialled and len(plan_samples) >= TRIAL_MEASURED_STEPS) or over_budget)  # fmt: skip
        if not enough or unavailable_tiling(profile, code):
            continue
        steps = []
        for sample in plan_samples:
            if sample.tokens not in at_tokens:
                at_tokens[sample.tokens] = profile_at(sample.tokens)
            if unavailable_tiling(at_tokens[sample.tokens], code):
                continue  # a step shorter than one chunk ran its tiled MLPs untiled: the model has no such step
            peak = sample.peak_bytes
            if peak is not None and sample.static_bytes is not None:
                peak += held_growth(sample.static_bytes, held_now)
            if peak is not None and sample.through_backward:
                peak = max(peak, optimizer_step_bytes(at_tokens[sample.tokens]))
            steps.append(MeasuredStep(code, sample.seconds, peak).scaled(at_tokens[sample.tokens], profile))
        if not steps:
            continue
        # Its peak where every step's is known; and where some step's own peak was over the budget (the others'
        # unknown: the counter held that peak), for that proves the plan does not fit.
        known = [step.peak_bytes for step in steps if step.peak_bytes is not None]
        proven = known and (len(known) == len(steps) or max(known) > budget_bytes)
        timed = [step.step_s for step in steps if step.step_s is not None]
        measured.append(MeasuredStep(code, min(timed) if timed else None, max(known) if proven else None))
    return measured


def _exact_predicted(samples: Samples) -> Iterator[tuple[str, Sample]]:
    """(plan code, step) for each measured step whose peak is exact and whose plan the model could predict: what
    the model's corrections of peaks learn from."""
    for code, plan_samples in samples.items():
        for sample in plan_samples:
            if sample.peak_exact and sample.peak_bytes is not None and sample.predicted_peak_bytes is not None:
                yield code, sample


def peak_correction(samples: Samples, tokens: int) -> tuple[int, str]:
    """What a step of `tokens` is predicted to peak above the model: the most that a plan's step peaked above the
    model's prediction of it, among the peaks measured exactly, grown in proportion where `tokens` is longer than
    that step; and that plan's code (0 and "" when the model was never low).

    On the H100 zoo the model predicted plain checkpointing's peak within 0.2% and over-predicted the others; on an
    8-layer model with small layers it predicted `cccccccc` 0.7% low, more than the plans' margin, and the budget was
    exceeded by 4 MB. Grown with the step, because what the model misses is mostly per token: an 8B QLoRA model
    peaked 87 MB above it at 16,384 tokens and, corrected by those 87 MB, 2.2 GB above it at 524,288 (H100,
    `benchmarks/long_context.py`); never shrunk for a shorter step, where a miss that does not grow would then be
    under-counted."""
    correction, code = 0, ""
    for plan_code, sample in _exact_predicted(samples):
        excess = sample.peak_bytes - sample.predicted_peak_bytes
        grown = math.ceil(excess * max(1.0, tokens / sample.tokens)) if excess > 0 else 0
        if grown > correction:
            correction, code = grown, plan_code
    return correction, code


def head_reload_hidden(samples: Samples, tokens: int) -> int:
    """What of the reloads the head starts its own peak hides, at least, in a step of `tokens`: the most that a
    step's head point, as the model counts it, was above the step's exact peak (the head's memory was no higher), up
    to the reloads it counted; shrunk in proportion for a shorter step, where the loss's temporaries that leave the
    room are smaller, and not grown for a longer one (0 while no such peak was measured).

    On S1 (H100, 16 layers, 16K tokens, a 128K vocabulary) plans whose first layers are offloaded whole peaked
    1.7-1.8 GiB below the model, which counts one such layer's reload (1.66 GiB) at the head: the loss's fp32
    temporaries are freed by the time the head's prefetch point fires."""
    hidden = 0
    for _, sample in _exact_predicted(samples):
        above = sample.head_base_bytes + sample.head_reload_bytes - sample.peak_bytes
        bound = min(max(0, above), sample.head_reload_bytes)
        hidden = max(hidden, bound * min(tokens, sample.tokens) // sample.tokens)
    return hidden
