"""The closed loop at run time: which steps a plan runs are timed and recorded, and when the plan is checked.

The steps a plan runs are measurements (`closed_loop.Sample`: their time; on a device, their peak: exactly in the
profiled steps, later an upper bound, as the counter is not reset after them). After the `MEASURED_STEPS` steps that
follow the first one on a new plan, the plan is checked: planned again with what every plan run so far measured
(`closed_loop.measured_plans`, `choose_plan`'s `measured`: the profiled steps measured the safe plan; the first
step's peak, the plan it ran), and replaced when it ran `STEP_TIME_NOISE` slower than the answer, at most
`MAX_CORRECTIONS` times (the last among measured plans only), saying so in the log. Before the first plan, plain
checkpointing may run as a trial (`PlanChecks.trial`) for `TRIAL_MEASURED_STEPS` steps. Measurements at other lengths
are scaled by the model (`MeasuredStep.scaled`). Once a plan has passed its check, steps are no longer timed (timing
a device step waits for it).

`PlanChecks` owns the samples per plan code, the timing of the checked steps, the corrections and the trials; it
decides what a check or a trial's end plans, and the planner (`planning.Planner`) puts that plan in force.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

from ..engine import OffloadActivations
from .calibrate import Calibration, calibrate
from .closed_loop import MAX_CORRECTIONS, MEASURED_STEPS, TRIAL_MEASURED_STEPS, Sample, measured_plans
from .measurements import HeldMemory, OwnPeakCounter, tail_kept
from .probes import Meter
from .profile import StepProfile
from .ranks import RankAgreement
from .search import STEP_TIME_NOISE, InfeasibleBudgetError, plan_of
from .simulate import MeasuredStep, Plan

__all__ = ["ChoosePlan", "PlanChecks", "Prediction"]

logger = logging.getLogger(__name__)

# The model's prediction of plan `code` at `tokens` with a prefetch window, as `Sample`'s fields
# (`ProfiledSteps.model_prediction`).
Prediction = Callable[[int, str, int | None], dict[str, int | None]]
# The planner's choice (`Planner.choose`): `profile`, the budget, the margin, the measured plans, measured only.
ChoosePlan = Callable[[StepProfile, int, int, list[MeasuredStep], bool], Plan]


class PlanChecks:
    """The closed loop's samples of the steps plans ran, the timing of the steps that check a plan, and the checks.

    Args:
        engine: the offloading context, held weakly: the tail its steps kept.
        meter: the device's meter, which times the steps.
        peak_counter: the device's peak counter as the controller reads it.
        held_memory: the memory held as each step begins, which a measured peak grows with.
        budget_bytes: the user's budget in bytes, on this device.
        agreement: the ranks' agreement, None when this process trains alone.
    """

    def __init__(self, engine: OffloadActivations, meter: Meter, peak_counter: OwnPeakCounter, held_memory: HeldMemory,
                 budget_bytes: Callable[[], int], agreement: Callable[[], RankAgreement | None]) -> None:  # fmt: skip
        self._engine = weakref.ref(engine)
        self._meter = meter
        self._peak_counter = peak_counter
        self._held_memory = held_memory
        self._budget_bytes = budget_bytes
        self._agreement = agreement
        self.samples: dict[str, list[Sample]] = {}  # per plan code, its clean steps
        self.calibration = Calibration()  # what the measured plans taught the model, as of rank 0's last plan
        self.corrections = 0  # the corrections made so far
        self.trialled: set[str] = set()  # the codes of the plans run as trials
        self._over_checked = -1  # the `applied_at` of the plan whose measurement a step over the budget ended
        # The step being timed: its start mark, the counter's largest read and the memory held as it began.
        self._timed_step_start: Any = None
        self._floor_at_timed_start = 0
        self._static_at_timed_start = 0  # `HeldMemory.at_step_start` as the timed step began

    @property
    def timing(self) -> bool:
        """Whether the step under way is timed, to check its plan."""
        return self._timed_step_start is not None

    def record(self, code: str, sample: Sample) -> None:
        """Records `sample`, a clean step of plan `code`."""
        self.samples.setdefault(code, []).append(sample)

    def step_faulted(self) -> None:
        """The step under way did not complete: it is not recorded (`MemoryBudgetController.step_faulted`)."""
        self._timed_step_start = None

    def steps_to_measure(self, plan: Plan | None) -> int:
        """How many steps after its first `plan`, the plan in force, is timed before it is checked (a trial's are
        fewer)."""
        return TRIAL_MEASURED_STEPS if plan is not None and plan.trial else MEASURED_STEPS

    def start_timing(self, plan: Plan | None, applied_at: int, forwards: int) -> None:
        """Times the step that starts now, training forward `forwards`, if the check of `plan` (applied at forward
        `applied_at`) is to come: it is one of the steps measured after the plan's first step (`steps_to_measure`),
        and corrections are left (or the plan is a trial)."""
        self._timed_step_start = None
        to_check = applied_at < forwards <= applied_at + self.steps_to_measure(plan)
        trial = plan is not None and plan.trial
        if to_check and (trial or self.corrections < MAX_CORRECTIONS):
            self._timed_step_start = self._meter.mark()
            self._floor_at_timed_start = self._peak_counter.floor
            self._static_at_timed_start = self._held_memory.at_step_start

    def step_ended(self, plan: Plan, code: str, applied_at: int, forwards: int, step_tokens: int, static_grew: bool,
                   profile: StepProfile | None, predict: Prediction) -> tuple[bool, bool]:  # fmt: skip
        """At training forward `forwards`'s start: records the step that just ended (of `step_tokens`) if it was timed,
        ran plan `code` (`plan`, applied at forward `applied_at`) all through and was not that plan's first.

        Args:
            static_grew: whether the memory held as this step begins grew past what the plan was made with.
            profile: the profile the plan in force was made from.
            predict: the model's prediction of a plan's step (`ProfiledSteps.model_prediction`).

        Returns:
            Whether the step peaked above what its plan counted (the plans kept for other lengths are then made
            anew), and whether the plan is now to be checked (or its trial ended): it has enough such steps.
        """
        ended = forwards - 1
        if self._timed_step_start is None or ended <= applied_at or not step_tokens:
            return False, False
        above_counted = False
        seconds = self._meter.seconds(self._timed_step_start, self._meter.mark())
        # The peak counter is not reset after the profiled steps (that would hide peaks from whoever measures them
        # over the run, as the benchmarks do): it holds the largest peak since the second step's head, an upper
        # bound of this step's. Within the budget it proves the step was. A read above every read before the step is
        # the step's own peak, exactly, whatever the budget: unless the memory held between steps grew in it
        # (optimizer state created at its end, which the next plan counts as static).
        peak = self._peak_counter.since_own_reset()
        exact = peak is not None and peak > self._floor_at_timed_start and not static_grew
        if peak is not None and peak > self._budget_bytes() and not exact:
            peak = None
        window = (plan.prefetch_window_bytes or None) if plan is not None else None
        predicted = predict(step_tokens, code, window)
        self.record(code, Sample(step_tokens, seconds, peak, tail_bytes=tail_kept(self._engine()), peak_exact=exact,
                                 static_bytes=self._static_at_timed_start, **predicted))  # fmt: skip
        # A step above what its plan counted (its prediction raised by the correction then): the plans kept for
        # other lengths were made with a correction now known to be short. Alone only: under torch.distributed
        # each rank measures its own peaks, and the ranks must reuse the same plans.
        counted = predicted["predicted_peak_bytes"]
        if exact and counted is not None and profile is not None and self._agreement() is None:
            if peak > counted + profile.peak_correction_bytes:
                above_counted = True
        # A step over the budget ends the plan's measurement there (alone: under torch.distributed every rank
        # checks at the same step). Waiting for the others ran a plan that peaked 103 MB above its prediction, up
        # to 41 MB over the budget, for three steps instead of one (a zoo shape the planner was never tuned on,
        # 5 layers offloaded whole, H200).
        first_over = (exact and peak > self._budget_bytes() and self._over_checked != applied_at
                      and self._agreement() is None)  # fmt: skip
        if first_over:
            self._over_checked = applied_at
        return above_counted, ended == applied_at + self.steps_to_measure(plan) or first_over

    def measured_plans(self, profile: StepProfile, profile_at: Callable[[int], StepProfile]) -> list[MeasuredStep]:
        """What each plan run so far measured, scaled to `profile` (`closed_loop.measured_plans`; `profile_at`, the
        profile at other tokens), its peaks grown by what the memory held grew since their steps began."""
        held = self._held_memory
        return measured_plans(self.samples, profile, profile_at, self._budget_bytes(), held.at_step_start,
                              held.gradients_accumulate, self.trialled)  # fmt: skip

    def calibrated(self, profile: StepProfile, measured: list[MeasuredStep]) -> StepProfile:
        """`profile` with what the measured plans teach the model (`calibrate`), which is kept for the log."""
        calibrated, self.calibration = calibrate(profile, measured)
        return calibrated

    def trial(self, profile: StepProfile, plan: Plan, measured: list[MeasuredStep], budget_bytes: int,
              margin_bytes: int) -> Plan | None:  # fmt: skip
        """The closed loop's trial before the first plan: every layer fully checkpointed with its input kept, where
        it is predicted to fit (with the margin, as any plan), was not measured yet, and the plan chosen is another
        that does not keep every layer (nothing is faster than that). The profiled steps measured the same with the
        inputs offloaded; the two differ by what the host spends on offloading, which the model of the GPU's time
        has not, and which made plans slower than plain checkpointing on short steps (`calibrate`). None when no
        trial is to run."""
        code = "c" * len(profile.layers)
        if plan.code in (code, "K" * len(profile.layers)) or any(step.code == code for step in measured):
            return None
        trial = plan_of(profile, code, budget_bytes, margin_bytes)
        if not trial.fits(margin_bytes):
            return None
        return dataclasses.replace(trial, trial=True, time_scale=plan.time_scale)

    def checked_plan(self, in_force: Plan, profile: StepProfile, budget_bytes: int, margin_bytes: int,
                     profile_at: Callable[[int], StepProfile], choose: ChoosePlan) -> Plan:  # fmt: skip
        """The closed loop's check of the plan in force, after its `MEASURED_STEPS` clean steps: plans again (with
        `choose`), for the same tokens (`profile`), with every plan's measurements, and answers another plan (a
        correction, logged with its figures) when the plan in force ran `STEP_TIME_NOISE` slower than that plan is
        expected to run, or peaked over the budget in one of its steps (whatever its speed: on two H200s, FSDP2 with
        ranks of different lengths, the plan made for the longest step peaked 1.3% over the budget there, 2.7% above
        its prediction, and was kept for being faster than the plan that fitted); else `in_force`. Rank 0 decides;
        the planner counts a correction (`correction_made`) where the answer is another plan."""
        measured = self.measured_plans(profile, profile_at)
        ran = next((step for step in measured if step.code == in_force.code), None)
        # None: its steps were all shorter than one tiled chunk (the model has no such step); no time: none timed
        if ran is None or ran.step_s is None:
            return in_force
        calibrated = self.calibrated(profile, measured)
        over = ran.peak_bytes is not None and ran.peak_bytes > budget_bytes
        try:
            last = self.corrections + 1 == MAX_CORRECTIONS  # then keep the best measured plan
            better = choose(calibrated, budget_bytes, margin_bytes, measured, last)
        except InfeasibleBudgetError as error:
            if not over:  # no plan is predicted to fit now, the one in force ran within: growth re-plans handle it
                return in_force
            better = error.lowest_plan  # `Planner.use` warns that it runs over the budget
        expected_s = better.expected_step_s
        if better.code == in_force.code or (not over and ran.step_s <= expected_s * (1 + STEP_TIME_NOISE)):
            return in_force
        logger.info("hf_offload: closed loop, correction %d of at most %d: plan %r ran in %.2f ms a step (the "
                    "fastest of %d steps at %d tokens, predicted %.2f ms)%s; plan %r replaces it, %s %.2f ms%s; "
                    "learned: %s",
                    self.corrections + 1, MAX_CORRECTIONS, in_force.code, ran.step_s * 1000,
                    len(self.samples[in_force.code]), profile.tokens, in_force.predicted.step_s * 1000,
                    f" and peaked at {ran.peak_bytes} bytes, over the budget of {budget_bytes}" if over else "",
                    better.code,
                    "measured at" if better.time_measured else "expected at", expected_s * 1000,
                    "" if better.measured is None or better.measured.peak_bytes is None
                    else f" with a peak of {better.measured.peak_bytes} bytes",
                    self.calibration.describe())  # fmt: skip
        return better

    def correction_made(self) -> None:
        """The plan in force was replaced after its check: one of the `MAX_CORRECTIONS`."""
        self.corrections += 1

    def trial_ends(self, trial: Plan) -> None:
        """The trial's steps are measured: its plan counts as a trial's in the measured plans from now on."""
        self.trialled.add(trial.code)

    def after_trial(self, profile: StepProfile, budget_bytes: int, margin_bytes: int,
                    profile_at: Callable[[int], StepProfile], choose: ChoosePlan) -> Plan:  # fmt: skip
        """The plan once the trial's steps are measured, for the trial's tokens (`profile`): planned with them (not a
        correction), and said in one line of the log with what was measured and learned. Rank 0 decides."""
        measured = self.measured_plans(profile, profile_at)
        calibrated = self.calibrated(profile, measured)
        try:
            plan = choose(calibrated, budget_bytes, margin_bytes, measured, False)
        except InfeasibleBudgetError as error:  # the trial ran over the budget, and the safe plan too
            plan = error.lowest_plan
        times = ", ".join(f"{step.code!r} " + ("its peak only" if step.step_s is None else
                                                f"{step.step_s * 1000:.2f} ms") for step in measured)  # fmt: skip
        logger.info("hf_offload: closed loop, trial of plain checkpointing (every input kept) over %d steps at %d "
                    "tokens: measured %s; learned: %s; plan %r, %s %.2f ms", TRIAL_MEASURED_STEPS,
                    profile.tokens, times, self.calibration.describe(), plan.code,
                    "measured at" if plan.time_measured else "expected at",
                    plan.expected_step_s * 1000)  # fmt: skip
        return plan
