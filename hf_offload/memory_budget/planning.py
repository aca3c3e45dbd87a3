"""Planning at run time: the plan in force, made for a step's tokens with the memory held now, and put on the layers.

The profiled steps run the safe plan (every decoder layer fully checkpointed, its input offloaded: the lowest memory
that works without a plan), decided once the probes are in (`Planner.apply_safe_plan`); it offloads the inputs the
pinned pool has room for and keeps the rest on the device. Where it is predicted not to fit the budget, they run the
planner's plan for the first step's tokens (the pool grown where that is what fits, tiling only where nothing exact
fits), decided before the layers it places run: a run whose first step is already long is planned for it, not
profiled into running out of memory or into a plan that tiles every layer. Where even the lowest-memory plan is
predicted to exceed the device, with the head counted as the logits the model certainly makes, an
`InfeasibleBudgetError` there. Under torch.distributed, where each rank decides its profiled steps alone, they choose
between safe plans only: untiled, with every MLP tiled, or every layer tiled whole.

Then `search.choose_plan` plans for the budget (`Planner.plan_and_apply`), `layer_actions.apply_layer_actions` applies
the plan and the engine's windows are sized; a budget no plan fits is an `InfeasibleBudgetError` at the first plan. A
later step that no plan fits runs on the lowest-memory plan, with a warning: never an exception in the middle of
training. The plans made are kept by the length they were made for (`plans_by_length`), and a step runs the one made
for the shortest length at least its own; a step more than a length step shorter than any gets a plan of its own,
which may keep more (`Planner.plan_for`). The closed loop's checks (`plan_checks`) decide what replaces a plan; the
planner puts it in force. Under torch.distributed every rank runs rank 0's plan (`ranks.RankAgreement`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable

from torch import nn

from ..allocator import release_unusable_cache
from ..engine import CopyWindows, EngineSettings, OffloadActivations
from ..options import OffloadOptions
from ..units import format_bytes
from .calibrate import calibrate
from .closed_loop import STATIC_GROWTH_TOLERANCE, peak_correction
from .host import choose_plan_with_host
from .measurements import HeldMemory, LongestStep, first_steps_logits_bytes
from .plan_application import LayerStarts, LayersUnderPlan, engine_settings
from .plan_checks import PlanChecks
from .plans_by_length import PlansByLength
from .probes import Meter
from .profile import StepProfile, in_proportion, layer_tiling_available, tiling_available
from .profiled_steps import ProfiledSteps
from .ranks import AgreedHostCaps, RankAgreement, runs_alone
from .search import InfeasibleBudgetError, choose_plan, prediction_margin_bytes, safe_code, smallest_budget
from .simulate import MeasuredStep, Plan, chunk_sizes, memory_order, simulate
from .spec import MemoryBudget

__all__ = ["Planner"]

logger = logging.getLogger(__name__)

# Where the pinned pool is full and there is no disk tier, the way past the host.
_DISK_HINT = "; or set activation_offloading_disk_offload_dir to a fast local disk"


def _logits_hint(logits_bytes: int, device_bytes: int) -> str:
    """What a first step's refusal adds where the logits the model makes whole are a large share of the device."""
    if logits_bytes * 10 < device_bytes:
        return ""
    return (
        f" The model's output head makes its logits whole, {format_bytes(logits_bytes)} at this step's tokens "
        "before the loss copies them to float32: a fused loss that never makes them, such as Liger's fused "
        "linear cross-entropy (use_liger_kernel=True), holds a small share of that."
    )


class Planner:
    """The plan in force and the profile it was made from, the plans kept by length, and the code the layers run.

    Every method that may put a plan on the layers takes `forwards`, the training forwards so far: the forward a plan
    is applied at, from which the closed loop counts its steps (`applied_at`).

    Args:
        engine: the offloading context, held weakly.
        model: the unwrapped model, held weakly.
        layers_under_plan: where a plan reaches the layers and the engine.
        layer_starts: the controller's pre-hook of a decoder layer, held weakly (the planner must not keep the
            controller alive): the layers' checkpoint functions call it where transformers checkpoints a whole call.
        memory_budget: the user's budget, for the log.
        options: the context's options: the forward window.
        meter: the device's meter (its memory, which a first step's refusal names).
        held_memory: the memory held between steps.
        profiled_steps: what the profiled steps measured, and the profile made from it.
        plan_checks: the closed loop: what the plans that ran measured, its trial and its checks.
        host_caps: the pinned host memory a plan may count on.
        budget_bytes: the user's budget in bytes, on this device.
        agreement: the ranks' agreement, None when this process trains alone.
    """

    def __init__(self, engine: OffloadActivations, model: nn.Module, layers_under_plan: LayersUnderPlan,
                 layer_starts: LayerStarts, memory_budget: MemoryBudget, options: OffloadOptions, meter: Meter,
                 held_memory: HeldMemory, profiled_steps: ProfiledSteps, plan_checks: PlanChecks,
                 host_caps: AgreedHostCaps, budget_bytes: Callable[[], int],
                 agreement: Callable[[], RankAgreement | None]) -> None:  # fmt: skip
        self._engine = weakref.ref(engine)
        self._model = weakref.ref(model)
        self._layers_under_plan = layers_under_plan
        self._layer_starts = weakref.WeakMethod(layer_starts)
        self._memory_budget = memory_budget
        self._options = options
        self._meter = meter
        self._held_memory = held_memory
        self._profiled_steps = profiled_steps
        self._plan_checks = plan_checks
        self._host_caps = host_caps
        self._budget_bytes = budget_bytes
        self._agreement = agreement
        self.plan: Plan | None = None
        self.profile: StepProfile | None = None  # the measured step the plan in force was made from
        # The plans made so far, by the tokens each was made for (`plan_for`), and the generation of what they were
        # made with: it grows when that changes (the memory held between steps grew, the closed loop corrected a plan
        # or ended its trial, a step peaked above its plan's prediction), and a plan of an earlier one is not reused.
        self.plans = PlansByLength()
        self.generation = 0
        # The code the layers run now, and the forward that applied it.
        self.code = ""
        self.applied_at = 0
        self._warned_over_budget = False
        # The smallest budget under which the profiled steps' plans, decided from the probes before anything is
        # measured, are predicted to fit; 0 while every one was. A refusal at the first plan names no less
        # (`_fitting_from_the_first_step`).
        self._profiled_steps_need = 0

    # ------------------------------------------------------------------ the profiled steps

    def apply_safe_plan(self, tokens: int, forwards: int, first_step: bool) -> None:
        """The profiled steps' plan, once the probes are in, for the step's own tokens, before the layers it decides
        run; `first_step`: decided in the first step.

        The safe plan where it is predicted to fit the budget: every layer fully checkpointed, its input offloaded.
        Where it is not, the planner's plan for this step (`_plan_profiled_steps`): the fastest predicted to fit, the
        pinned pool grown where that is what fits, tiling only where nothing exact fits. A run whose first step is
        already long (packing to `max_length`) would otherwise run every input to a full pinned pool and keep the rest
        on the device (an 8B-class model at 327,680 tokens ran out of GPU memory so), and the safe plan tiled throughout
        is slow (the same model and length on an H100: every layer tiled whole, 398 s; every MLP tiled, 306 s). Under
        torch.distributed each rank decides its profiled steps alone, so only between safe plans: the safe plan with
        every MLP tiled, or every layer tiled whole, where that is what fits (they differ in what they tile and offload,
        not in which layers they recompute, which FSDP's collectives follow).

        The layers that ran before the last kind was probed keep the untiled safe plan in the first step. Decided
        again as the second step begins, with the memory held then: the optimizer's state, made by the first step's
        optimizer step (on an H200, 16 layers of S1's shape, AdamW: the first step peaked at 8.29 GiB, the second at
        8.92, over a budget of 8.80 GiB that a tiled plan met at 8.69)."""
        profile = self._profiled_steps.profile_now(tokens)
        budget_bytes = self._budget_bytes()
        code = safe_code(profile)
        peak = simulate(profile, code).peak_bytes
        if peak > budget_bytes and self._engine() is not None and runs_alone():
            margin_bytes = prediction_margin_bytes(budget_bytes)
            planned = self._plan_profiled_steps(profile, budget_bytes, margin_bytes, first_step)
            if not planned.fits(margin_bytes):  # the lowest-memory plan, over: it fits a budget at `need`, and the
                # safe plan one at its peak (checked above without the margin), whichever is less
                need = smallest_budget(planned.predicted.peak_bytes, budget_bytes, margin_bytes)
                self._profiled_steps_need = max(self._profiled_steps_need, min(peak, need))
            # With the host it had and its table: what each layer was predicted to cost, and what the pinned pool
            # allowed, is what a first step slower or higher than the plans after it is checked against.
            caps = self._host_caps.caps()
            logger.info("hf_offload: the profiled steps run plan %r, made for their %d tokens and predicted to peak at "
                        "%.2f GiB (budget %.2f GiB; %s): the safe plan %r is predicted to peak at %.2f GiB; the "
                        "pinned pool's cap is %s, and it may grow to %s\n%s",
                        planned.code, tokens, planned.predicted.peak_bytes / 2**30, budget_bytes / 2**30,
                        "over it, the lowest plan the model knows of" if planned.predicted.peak_bytes > budget_bytes
                        else "within it", code, peak / 2**30, format_bytes(caps.default_bytes),
                        format_bytes(caps.most_bytes), planned.format_table())  # fmt: skip
            # Not the plan in force (`memory_plan`): the profiled steps run it, and the first plan comes after.
            settings = engine_settings(planned.code, self._windows(planned), host_cap_bytes=planned.host_cap_bytes)
            self.apply(planned.code, forwards, settings, tile_tokens=planned.tile_tokens,
                       layer_tile_tokens=planned.layer_tile_tokens)  # fmt: skip
            return
        not_lower = []  # the tilings that could not lower the prediction, and why
        for letters, available, what in (("Tt", tiling_available, "every MLP"), ("Ll", layer_tiling_available,
                                                                                  "every layer whole")):  # fmt: skip
            if peak <= budget_bytes:
                break
            if not available(profile):
                not_lower.append(f"tiling {what} is not available")
                continue
            tiled_code = safe_code(profile, letters)
            tiled = memory_order(profile, tiled_code)  # its peak first
            if tiled < memory_order(profile, code):  # tiling can cost memory
                logger.info("hf_offload: the profiled steps tile %s: plan %r is predicted to peak at %.2f GiB, over "
                            "the budget of %.2f GiB", what, code, peak / 2**30, budget_bytes / 2**30)  # fmt: skip
                code, peak = tiled_code, tiled[0]
            else:
                not_lower.append(f"tiling {what} is predicted to peak at {tiled[0] / 2**30:.2f} GiB")
        if peak > budget_bytes:  # said, so that a profiled step over the budget can be told apart from a wrong model
            self._profiled_steps_need = max(self._profiled_steps_need, peak)
            logger.info("hf_offload: the profiled steps run plan %r, predicted to peak at %.2f GiB, over the budget of "
                        "%.2f GiB: %s", code, peak / 2**30, budget_bytes / 2**30,
                        "; ".join(not_lower) or "it is the lowest plan the model knows of")  # fmt: skip
        if code != self.code:
            self.apply(code, forwards, **chunk_sizes(profile, code))

    def _plan_profiled_steps(self, profile: StepProfile, budget_bytes: int, margin_bytes: int,
                             first_step: bool) -> Plan:  # fmt: skip
        """The plan for a profiled step that the safe plan is predicted not to fit: the planner's for `profile`, with
        the pinned pool grown where that is what fits it (`choose`), or, where no plan fits, the lowest-memory one.

        Raises:
            InfeasibleBudgetError: in the first step, where even the lowest-memory plan is predicted to exceed the
                device's memory: the step would run out of it. Otherwise the refusal waits for the first plan, made
                from the profiled steps' measurements (the model's prediction of a step can be above what it
                measures).
        """
        try:
            return self.choose(profile, budget_bytes, margin_bytes, [])
        except InfeasibleBudgetError as error:
            total = self._meter.total()
            # The head's bytes are only estimated before the second step measures them, so a refusal counts only
            # what is certain of them: the logits, where the model's own forward makes them whole.
            model = self._model()
            logits = 0 if model is None else first_steps_logits_bytes(model, profile.tokens)
            certain = dataclasses.replace(profile, head_bytes=logits, host_cap_bytes=error.lowest_plan.host_cap_bytes)
            lowest = simulate(certain, error.lowest_plan.code).peak_bytes
            if first_step and total is not None and lowest > total:
                raise InfeasibleBudgetError(
                    f"hf_offload: memory_budget: the first step, of {profile.tokens} tokens, fits no plan, and the "
                    f"lowest-memory one is predicted to exceed the device's {format_bytes(total)}: {error}"
                    f"{_logits_hint(logits, total)}", error.budget_bytes, error.minimum_bytes,
                    error.lowest_plan) from None  # fmt: skip
            return error.lowest_plan

    # ------------------------------------------------------------------ plans

    def check_longest_step(self, tokens: int, longest: LongestStep | None) -> None:
        """Where the run's longest step is known (`longest`) and longer than the `tokens` the first plan is for:
        whether a plan fits it. If none does, an `InfeasibleBudgetError` where the user set the length, a warning
        where a trainer's configuration gave it; otherwise nothing (its plan is made when such a step comes, as for
        every longer step). Without this, a budget that fits the profiled steps but not the run's longest is found
        out at the first step that long, perhaps hours in, which then runs over the budget."""
        if longest is None:
            return
        measured, called = self._profiled_steps.measured, self._profiled_steps.called
        last_stack = self._profiled_steps.stacks[called[-1]] if called else None
        step_tokens = longest.tokens
        if last_stack in measured.stack_tokens:  # in the profile's terms (the first stack's tokens)
            step_tokens = in_proportion(measured.step_tokens, measured.stack_tokens[last_stack], longest.tokens)
        ranks = self._agreement()
        if ranks is not None:  # each rank's stacks scale from its own first step: every rank must decide alike
            step_tokens = ranks.largest([step_tokens])[0]
        if step_tokens <= tokens:
            return
        profile, budget_bytes, margin_bytes = self._planning_inputs(step_tokens)

        def make_plan() -> Plan:
            plans_measured = self.measured_plans(profile)
            try:
                return self.choose(calibrate(profile, plans_measured)[0], budget_bytes, margin_bytes, plans_measured)
            except InfeasibleBudgetError as error:  # made on rank 0, whose refusal every rank raises
                raise self._fitting_from_the_first_step(error) from None

        try:
            self._on_every_rank(make_plan)
        except InfeasibleBudgetError as error:
            text = (f"hf_offload: memory_budget: the longest step this run may see, {longest.tokens} tokens "
                    f"({longest.source}), fits no plan: {error}")  # fmt: skip
            if longest.strict:
                raise InfeasibleBudgetError(
                    text + " Or lower memory_budget_max_tokens to the longest step that must fit (a longer one then "
                    "runs over the budget, with a warning).", error.budget_bytes, error.minimum_bytes,
                    error.lowest_plan) from None  # fmt: skip
            engine = self._engine()
            if engine is not None:
                engine.warn_once("longest_step", text + " Training goes on; such a step, if it comes, runs over the "
                                 "budget (with a warning). memory_budget_max_tokens makes this an error before "
                                 "training, for the length given.")  # fmt: skip

    def static_grew(self) -> bool:
        """Whether the memory held as this step began (with the gradients pending) grew past what the plan in force
        was made with, beyond the allocator's noise."""
        if self.profile is None:
            return False
        planned = self.profile.static_bytes + self.profile.gradient_bytes
        return self._held_memory.at_step_start > planned * (1 + STATIC_GROWTH_TOLERANCE)

    def plan_anew(self, tokens: int, forwards: int) -> None:
        """Plans for `tokens` (`plan_and_apply`) now that what the plans were made with changed (the memory held
        grew): the plans kept before are not reused."""
        self.generation += 1
        self.plan_and_apply(tokens, forwards)

    def plan_and_apply(self, tokens: int, forwards: int) -> None:
        """Plans for `tokens` per step with the memory held now, on rank 0, and applies the plan on every rank.

        A later step that no plan fits (longer than any before it) runs on the lowest-memory plan, with a warning
        the first time: an exception there would end a run that may be hours in.

        Raises:
            InfeasibleBudgetError: for the first plan, made for the profiled steps' tokens: the budget is below the
                smallest peak any plan reaches (naming it and what dominates it).
        """
        self._held_memory.forget_parameters()
        profile, budget_bytes, margin_bytes = self._planning_inputs(tokens)
        first = self.plan is None

        def make_plan() -> Plan:
            measured = self.measured_plans(profile)
            calibrated = self._plan_checks.calibrated(profile, measured)
            try:
                plan = self.choose(calibrated, budget_bytes, margin_bytes, measured)
            except InfeasibleBudgetError as error:
                if first:
                    raise self._fitting_from_the_first_step(error) from None
                return error.lowest_plan
            trial = self._plan_checks.trial(calibrated, plan, measured, budget_bytes, margin_bytes) if first else None
            return trial or plan

        self._use(self._on_every_rank(make_plan), profile, budget_bytes, margin_bytes, forwards)

    def _fitting_from_the_first_step(self, error: InfeasibleBudgetError) -> InfeasibleBudgetError:
        """`error`, a refusal at the first plan, naming at least the smallest budget under which the profiled steps'
        plans were predicted to fit (`_profiled_steps_need`).

        The refusal is made from the profiled steps' measurements, but a run started at the budget it names plans its
        first two steps from the probes alone, before anything is measured, and that prediction is higher: it counts
        every gradient as existing when backward reaches the first layer (the embeddings' come after it) and only an
        estimate of the head. So at the measured minimum, 23 of 23 tiny families' profiled steps ran a plan predicted
        to peak 1-15% over it (CPU test mode): advice the library itself predicted would not hold. Refusing before the
        first step on that prediction instead would refuse budgets that the measured steps meet."""
        need = self._profiled_steps_need
        if need <= error.minimum_bytes:
            return error
        return InfeasibleBudgetError(
            f"{error} That is for the steps measured: a run started at {format_bytes(error.minimum_bytes)} plans its "
            f"first two steps from the probes, before anything is measured, which predict more; from its first step, "
            f"the smallest budget that works is {format_bytes(need)} ({need} bytes).", error.budget_bytes, need,
            error.lowest_plan,
        )  # fmt: skip

    def plan_for(self, tokens: int, forwards: int, shorter_plans: bool = True) -> None:
        """Puts in force a plan for a step of `tokens`: the plan kept for the shortest length at least `tokens`, unless
        that length is more than a length step above the step's (`PlansByLength.length_for`) and `shorter_plans`: then
        a plan made for the step's length step, which may keep more. A step longer than every kept plan's gets a plan
        for its own length; one that no plan fits, its lowest-memory plan, which then serves the steps up to its
        length that no plan kept for a shorter length fits.

        Why plans for shorter steps: under a budget near the minimum of the longest steps, their plan tiled layers,
        and with it in force the shorter steps ran tiled too, at 0.8-1.7 s a step where plain checkpointing, which
        fitted them, ran 0.35-0.45 s (H200, `benchmarks/dynamic_padding.py`, lengths over a 2x range). Not while a
        trial runs (its steps are the trial's), nor below a plan that keeps every layer (nothing is faster). Plans
        made before what the controller knows changed are dropped (`generation`), but for the one in force. Under
        torch.distributed every rank decides alike: the ranks agree on `tokens`, and every kept plan is rank 0's."""
        kept = self.plans.covering(tokens, self.generation, self.plan)
        if kept is None:
            self.plan_and_apply(tokens, forwards)
            return
        length = self.plans.length_for(tokens)
        keeps_everything = kept.plan.code == "K" * len(kept.plan.code)
        if shorter_plans and kept.plan.tokens > length and not keeps_everything and not self.plan.trial:
            self.plan_and_apply(length, forwards)
            return
        if kept.plan is not self.plan:
            if kept.plan.code != self.plan.code:  # between plans of one code only the windows change: not logged
                logger.info("hf_offload: a step of %d tokens: plan %r, made for %d, is in force again", tokens,
                            kept.plan.code, kept.plan.tokens)  # fmt: skip
            self.put_in_force(kept.plan, kept.profile, forwards)

    def choose(self, profile: StepProfile, budget_bytes: int, margin_bytes: int, measured: list[MeasuredStep],
               measured_only: bool = False) -> Plan:  # fmt: skip
        """`choose_plan`, with the pinned pool's cap raised down to the host's reserve where that is what makes the
        step fit (`host.choose_plan_with_host`).

        Raises:
            InfeasibleBudgetError: as `choose_plan`, with the most host the pool may take.
        """
        caps = self._host_caps.caps() if self._engine() is not None else None
        return choose_plan_with_host(
            lambda candidate: choose_plan(candidate, budget_bytes, margin_bytes, measured, measured_only=measured_only),
            profile, caps.most_bytes if caps is not None else profile.host_cap_bytes,
            caps.reserve_bytes if caps is not None else 0,
        )  # fmt: skip

    def measured_plans(self, profile: StepProfile) -> list[MeasuredStep]:
        """What each plan run so far measured, scaled to `profile` (`PlanChecks.measured_plans`)."""
        return self._plan_checks.measured_plans(profile, self._profiled_steps.profile_now)

    def _on_every_rank(self, make_plan: Callable[[], Plan]) -> Plan:
        """`make_plan()`, or under torch.distributed rank 0's plan on every rank (`RankAgreement.rank_zeros_plan`)."""
        ranks = self._agreement()
        return make_plan() if ranks is None else ranks.rank_zeros_plan(make_plan)

    def _planning_inputs(self, tokens: int) -> tuple[StepProfile, int, int]:
        """What every plan starts from: the host caps agreed across ranks, then the profile scaled to `tokens`, the
        budget in bytes and the prediction's margin within it."""
        self._host_caps.agree(self._agreement())
        profile = self._profiled_steps.profile_now(tokens)
        budget_bytes = self._budget_bytes()
        return profile, budget_bytes, prediction_margin_bytes(budget_bytes)

    # ------------------------------------------------------------------ the closed loop

    def close_the_loop(self, forwards: int, step_tokens: int) -> None:
        """At training forward `forwards`'s start: records the step that just ended (of `step_tokens`), and checks the
        plan (or ends its trial) once it has enough such steps (`PlanChecks.step_ended`); then times the step that
        starts if it checks a plan."""
        checks = self._plan_checks
        above_counted, due = checks.step_ended(self.plan, self.code, self.applied_at, forwards, step_tokens,
                                               self.static_grew(), self.profile,
                                               self._profiled_steps.model_prediction)  # fmt: skip
        if above_counted:
            self.generation += 1
        if due:
            if self.plan.trial:
                self._end_trial(forwards)
            else:
                self._check_plan(forwards)
        checks.start_timing(self.plan, self.applied_at, forwards)

    def _check_plan(self, forwards: int) -> None:
        """The closed loop's check of the plan in force (`PlanChecks.checked_plan`), which it replaces where the check
        answers another: a correction."""
        profile, budget_bytes, margin_bytes = self._planning_inputs(self.plan.tokens)
        in_force = self.plan
        check = functools.partial(self._plan_checks.checked_plan, in_force, profile, budget_bytes, margin_bytes,
                                  self._profiled_steps.profile_now, self.choose)  # fmt: skip
        new_plan = self._on_every_rank(check)
        if new_plan.code != in_force.code:
            self._plan_checks.correction_made()
            self.generation += 1  # what the model learned made this plan: the plans kept are from before
            self._use(new_plan, profile, budget_bytes, margin_bytes, forwards)

    def _end_trial(self, forwards: int) -> None:
        """The trial's steps are measured: the plan made with them (`PlanChecks.after_trial`) is put in force."""
        trial = self.plan
        self._plan_checks.trial_ends(trial)
        profile, budget_bytes, margin_bytes = self._planning_inputs(trial.tokens)
        make_plan = functools.partial(self._plan_checks.after_trial, profile, budget_bytes, margin_bytes,
                                      self._profiled_steps.profile_now, self.choose)  # fmt: skip
        self.generation += 1  # the plans kept before the trial were made without what it measured
        self._use(self._on_every_rank(make_plan), profile, budget_bytes, margin_bytes, forwards)

    # ------------------------------------------------------------------ the plan in force

    def _use(self, new_plan: Plan, profile: StepProfile, budget_bytes: int, margin_bytes: int, forwards: int) -> None:
        """Makes `new_plan` (made from `profile`) the plan in force, on the layers and in the engine's windows, and
        keeps it for the steps of its length (`plan_for`); says so in the log, and warns where it does not fit the
        budget."""
        if not new_plan.fits(margin_bytes):
            self._over_budget(new_plan, profile, budget_bytes, margin_bytes, forwards)
        self.plans.keep(new_plan, profile, self.generation)
        self.put_in_force(new_plan, profile, forwards)
        logger.info("hf_offload: memory budget %s\n%s", self._memory_budget, new_plan.format_table())
        if profile.peak_correction_bytes:
            logger.info("hf_offload: closed loop: plan %r peaked above the model's prediction of it; the predicted "
                        "peaks above are raised by %d bytes (its excess, in proportion to this step's tokens where "
                        "they are more)", peak_correction(self._plan_checks.samples, profile.tokens)[1],
                        profile.peak_correction_bytes)  # fmt: skip
        engine = self._engine()
        if new_plan.inputs_kept_for_host:
            engine.warn_once("host_cap", f"hf_offload: {len(new_plan.inputs_kept_for_host)} checkpointed layers "
                             "keep their input on the GPU: the pinned host memory cap "
                             f"({new_plan.host_cap_bytes / 2**30:.1f} GiB"
                             f"{', grown down to the host memory reserve' if new_plan.host_growth else ''}"
                             f"{', and the disk tier' if new_plan.disk_cap_bytes else ''}) is full. "
                             "Raise activation_offloading_max_pinned_memory_fraction (or max_pinned_mib), or lower "
                             "activation_offloading_host_memory_reserve_mib, if the host has the room"
                             f"{'' if new_plan.disk_cap_bytes else _DISK_HINT}.")  # fmt: skip

    def _windows(self, plan: Plan) -> CopyWindows:
        """The engine's copy windows under `plan`: its forward window (at least the option's), its prefetch window and
        the head's (None: the engine's default)."""
        forward_window = max(plan.forward_window_bytes, self._options.forward_window_bytes)
        return CopyWindows(forward_window, plan.prefetch_window_bytes or None, plan.head_prefetch_window_bytes or None)

    def put_in_force(self, new_plan: Plan, profile: StepProfile, forwards: int) -> None:
        """Makes `new_plan` (made from `profile`) the plan in force, on the layers and in the engine's windows. From
        a plan whose layers act alike (a plan kept for another length, `plan_for`), only the windows change: the
        layers are not wrapped anew, and the steps go on counting as that code's for the closed loop, which would
        otherwise start measuring again at each switch and, with lengths varying step to step, never check a plan."""
        previous, self.plan, self.profile = self.plan, new_plan, profile
        # The engine keeps no more of its tail than the plan counted (the tail only grows, and a budget at the
        # plan's peak would not hold more): a plan chosen by its measured peak, what its measured steps kept; a
        # predicted one, the copies the model has unfinished as the forward ends. Copies beyond it are drained
        # before the head (time the model counts), not kept on top of the loss.
        samples = self._plan_checks.samples.get(new_plan.code) if new_plan.measured is not None else None
        tail_cap = max(sample.tail_bytes for sample in samples) if samples else new_plan.predicted.tail_bytes
        # The pool's cap is the one it planned with: raised, where it grew the pool.
        settings = engine_settings(new_plan.code, self._windows(new_plan), tail_cap, new_plan.host_cap_bytes, new_plan)
        acts = (new_plan.code, new_plan.tile_tokens, new_plan.layer_tile_tokens)  # what the layers are given
        if previous is not None and (previous.code, previous.tile_tokens, previous.layer_tile_tokens) == acts:
            self._layers_under_plan.apply_engine_settings(settings)
        else:
            self.apply(new_plan.code, forwards, settings, tile_tokens=new_plan.tile_tokens,
                       layer_tile_tokens=new_plan.layer_tile_tokens)  # fmt: skip
        release_unusable_cache(new_plan.predicted.peak_bytes)

    def _over_budget(self, lowest: Plan, profile: StepProfile, budget_bytes: int, margin_bytes: int,
                     forwards: int) -> None:  # fmt: skip
        """Says that this step runs on the lowest-memory plan, over the budget: a warning once, then in the log."""
        peak = lowest.predicted.peak_bytes
        fitting = smallest_budget(peak, budget_bytes, margin_bytes)
        message = (f"hf_offload: no plan fits memory_budget={self._memory_budget} ({budget_bytes} bytes) at training "
                   f"forward {forwards}: {lowest.tokens} tokens (in the profiled step's terms), "
                   f"{profile.static_bytes} bytes held between steps. It runs on the lowest-memory plan "
                   f"{lowest.code!r}, predicted to peak at {peak / 2**30:.2f} GiB ({peak} bytes; a budget of "
                   f"{fitting} bytes would fit it), and so do the later steps up to that length that "
                   "no plan for a shorter length fits. Raise the budget or cap the sequence length to stay within "
                   "it.")  # fmt: skip
        if self._warned_over_budget:
            logger.info(message)
        else:
            self._warned_over_budget = True
            logger.warning(message)

    def apply(self, code: str, forwards: int, settings: EngineSettings | None = None, tile_tokens: int = 0,
              layer_tile_tokens: int = 0) -> None:  # fmt: skip
        """Applies the plan `code`, in the plan's order, to the layers and `settings` to the engine
        (`LayersUnderPlan.apply`) at training forward `forwards`; without settings (the profiled steps' plans), the
        engine's windows and caps stay as they are."""
        layer_starts = self._layer_starts()
        if self._engine() is None or self._model() is None or layer_starts is None:
            return
        self.code, self.applied_at = code, forwards
        settings = engine_settings(code) if settings is None else settings
        order = self._profiled_steps.order
        self._layers_under_plan.apply(code, order, settings, layer_starts, tile_tokens, layer_tile_tokens)
