"""The memory budget at work: profile the first steps, plan, apply the plan, re-plan when the step grows.

`MemoryBudgetController` is attached by `get_act_offloading_ctx_manager` when `memory_budget` is set. It counts the
training forwards of the model (grad enabled, model in training mode) and:

1. First forward: applies the safe plan (every decoder layer fully checkpointed, its input offloaded: the lowest
   memory that works without a plan) and, when the first layer of each kind is called, probes it on the very
   arguments it receives (`probes.probe_layer`, which leaves no trace in the step): the bytes it saves, the bytes a
   selective checkpoint would keep, the times of its forward, backward and selective recompute, and with
   `tile_mlp="auto"` the same with its MLP tiled, and with `tile_layer="auto"` the layer tiled whole. Every stack of
   layers is probed so, each kind in its own call: a vision tower's blocks on theirs, a language model's or a
   decoder's layers on theirs (with the encoder's states).
   Once every kind is probed it measures the link's bandwidth; if the safe plan is predicted not to fit the budget
   and tiling would lower its peak, the safe plan tiles every layer's MLP, or, where even that is predicted not to
   fit and tiling whole layers is lower still, every layer whole. The safe plan offloads the inputs the pinned pool
   has room for and keeps the rest on the device; where no safe plan fits, the profiled steps run the planner's plan
   for the first step's tokens (with the pool grown where that is what fits), decided before the layers it places
   run: a run whose first step is already long is planned for it, not profiled into running out of memory. Where
   even the lowest-memory plan is predicted to exceed the device, an `InfeasibleBudgetError` there.
2. Second forward, still safe: measures the step: memory held before it starts, the head and loss's peak over what
   the forward leaves, the head's time, and the whole step's time (the rest of the step, embedding and optimizer,
   is what the model of the safe step does not explain).
3. Third forward: plans (`search.choose_plan`) for the budget, applies the plan (`layer_actions.apply_layer_actions`)
   and sizes the engine's windows; a budget no plan fits is an `InfeasibleBudgetError` here. Where gradients
   accumulate over micro-steps and no optimizer has stepped yet, the first plan waits for the optimizer's first step,
   whose state it must count (`_first_plan_waits`), the steps running the safe plan until then. On every later
   forward it re-plans if the step has more tokens than it planned for (checked as each stack starts, before its
   layers run; each stack's tokens scale the whole step from the first step's) or the memory held between steps has
   grown (optimizer state created after a gradient accumulation cycle, where no optimizer step hook told). Such a
   step that no plan fits runs on the lowest-memory plan, with a warning: never an exception in the middle of
   training. The plans made are kept by the length they were made for (`plans_by_length`), and a step runs the one
   made for the shortest length at least its own; a step more than a length step shorter than any gets a plan of its
   own, which may keep more (`_plan_for`).
4. The closed loop: the steps a plan runs are measurements (`closed_loop.Sample`: their time; on a device, their
   peak: exactly in the profiled steps, later an upper bound, as the counter is not reset after them). After the
   `MEASURED_STEPS` steps that follow the first one on a new plan, the controller plans again with what every plan
   run so far measured (`closed_loop.measured_plans`, `choose_plan`'s `measured`: the profiled steps measured the
   safe plan; the first step's peak, the plan it ran), and switches plans when the one in force ran
   `STEP_TIME_NOISE` slower than the answer, at most `MAX_CORRECTIONS` times (the last among measured plans only),
   saying so in the log. Measurements at other lengths are scaled by the model (`MeasuredStep.scaled`). Once a plan
   has passed its check, steps are no longer timed (timing a device step waits for it).

While profiling, the device's peak-memory counter is reset at the phase boundaries it measures (the first step's
start among them).

Under `torch.distributed` every rank runs rank 0's plan, made for the longest of the ranks' steps and the smallest of
their pinned host caps (`ranks.RankAgreement`). The ranks decide together, at each training forward's start, whether
to re-plan: a rank cannot know another's step, and one re-planning alone would wait in the broadcast forever. So the
growth of a step is estimated there, before its layers run, from its input elements (`_estimated_step_tokens`)
rather than seen as each stack starts.

In the CPU test mode nothing on the host has a peak counter: static memory is counted from the parameters, the
head's peak from the tensors it saved, and the plan is computed and applied the same way, so its bookkeeping is
tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..allocator import release_unusable_cache
from ..engine import CopyWindows, EngineSettings, OffloadActivations
from ..model import find_decoder_layers, find_output_head, first_tensor
from ..options import OffloadOptions
from ..peak import queue_after_backward
from ..units import format_bytes
from .calibrate import Calibration, calibrate
from .closed_loop import (
    STATIC_GROWTH_TOLERANCE,
    peak_correction,
)
from .host import choose_plan_with_host
from .measurements import HeldMemory, LongestStep, OwnPeakCounter, budget_bytes
from .plan_application import LayersUnderPlan, engine_settings
from .plan_checks import PlanChecks
from .plans_by_length import PlansByLength
from .probes import (
    Meter,
)
from .profile import StepProfile, in_proportion, layer_tiling_available, tiling_available
from .profiled_steps import ProfiledSteps
from .ranks import AgreedHostCaps, RanksOfThisRun, runs_alone
from .search import (
    InfeasibleBudgetError,
    choose_plan,
    prediction_margin_bytes,
    safe_code,
    smallest_budget,
)
from .simulate import (
    MeasuredStep,
    Plan,
    chunk_sizes,
    simulate,
)
from .spec import MemoryBudget

__all__ = ["MemoryBudgetController"]

logger = logging.getLogger(__name__)

# The first plan waits for the optimizer's first step at most this many forwards after the profiled ones: an
# optimizer that is no `torch.optim.Optimizer` calls no step hook, and the safe plan is the slowest.
_FIRST_PLAN_WAIT_FORWARDS = 64


class _Phase(enum.Enum):
    """Where the run is, as a training forward starts (see the module docstring's numbered steps)."""

    BEFORE_TRAINING = "no training forward yet"
    FIRST_STEP = "the safe plan; each kind of layer probed as it is first called"
    MEASURED_STEP = "the safe plan, decided again with the optimizer's state; the step the profile is measured from"
    WAITING = "profiled; the first plan waits for the optimizer's first step (`_first_plan_waits`)"
    PLANNED = "a plan in force, re-planned as steps grow, checked by the closed loop"


class MemoryBudgetController:
    """Profiles, plans and applies a per-layer plan so that the step's peak stays under `memory_budget`.

    The plan has one action per checkpointable layer of every stack (a vision-language model's vision tower and
    language model, an encoder-decoder's encoder and decoder), in the order the first step called them: the
    planner's model of the step walks the layers in forward order, and a model may register its stacks in another
    (several VLMs define the language model before the vision tower). A stack is the layers of one container
    (`model.visual.blocks`, `model.language_model.layers`); each has its own number of tokens per step.

    Args:
        model: the unwrapped model (its decoder layers are found with `find_decoder_layers`).
        engine: the offloading context; its device type decides what is measured.
        memory_budget: the user's budget, parsed.
        options: the context's options (the engine's): the longest step, the tilings allowed, the tail and window.

    Raises:
        ValueError: the model has no decoder layers a plan could act on.
    """

    def __init__(self, model: nn.Module, engine: OffloadActivations, memory_budget: MemoryBudget,
                 options: OffloadOptions) -> None:  # fmt: skip
        named = find_decoder_layers(model)
        if not named:
            raise ValueError(f"memory_budget needs a transformers model with decoder layers (GradientCheckpointingLayer"
                             f"); {type(model).__name__} has none")  # fmt: skip
        self._layers = [layer for _, layer in named]
        self._model = weakref.ref(model)
        self._engine = weakref.ref(engine)
        self.memory_budget = memory_budget
        self._options = options
        self._meter = Meter(engine.device_type)
        self.held_memory = HeldMemory(model, self._meter)
        # The collaborators below hold this, not the controller: none of them refers to it, so that a dropped context
        # is freed as soon as it is dropped.
        self._budget_bytes = functools.partial(budget_bytes, memory_budget, self._meter)
        self._budget_bytes()  # a share of the device, or "auto", without a device fails here
        self._ranks = RanksOfThisRun()  # under torch.distributed, the ranks' agreement
        self.plan: Plan | None = None
        self._profile: StepProfile | None = None
        self._phase = _Phase.BEFORE_TRAINING
        self._forwards = 0  # training forwards so far: the steps a plan has run, and how long the first plan waited
        self._measured_step_faulted = False  # `step_faulted` in the measured profiled step
        self._step_tokens = 0  # this step's tokens, in the profile's terms, from the stacks that have started
        self._previous_step_tokens = 0
        self._warned_over_budget = False
        max_tokens = options.memory_budget_max_tokens
        self._longest = None if max_tokens is None else LongestStep(max_tokens, "memory_budget_max_tokens", True)
        # The plans made so far, by the tokens each was made for (`_plan_for`), and the generation of what they were
        # made with: it grows when that changes (the memory held between steps grew, the closed loop corrected a plan
        # or ended its trial, a step peaked above its plan's prediction), and a plan of an earlier one is not reused.
        self._plans = PlansByLength()
        self._generation = 0
        # The code the layers run now, and the forward that applied it.
        self._code = ""
        self._applied_at = 0
        self._peak_counter = OwnPeakCounter(self._meter)
        self.plan_checks = PlanChecks(engine, self._meter, self._peak_counter, self.held_memory, self._budget_bytes,
                                      self._ranks.agreement)  # fmt: skip
        # The steps of the optimizers that train this model since the controller began (taken off with the context's
        # hooks, or with the controller): whether the optimizer's state can exist yet (`_first_plan_waits`).
        self._optimizer_steps = _OwnOptimizerSteps(model)
        engine.track_hook(self._optimizer_steps.handle)
        # Under torch.distributed: the host caps the ranks agreed on at the latest plan, and how this rank estimates
        # its step's tokens before its layers run: in proportion to its forward's input elements
        # (`_estimated_step_tokens`), from a step whose tokens and input elements it knows.
        self._host_caps = AgreedHostCaps(engine)
        self._input_elements = 0
        self._tokens_per_elements = (0, 0)
        self.profiled_steps = ProfiledSteps(model, engine, [name for name, _ in named], self._layers, options,
                                            self._meter, self.held_memory, self._peak_counter, self.plan_checks,
                                            self._host_caps, self._budget_bytes)  # fmt: skip
        engine.track_hook(model.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
        self._layers_under_plan = LayersUnderPlan(model, engine, self._layers)
        engine.track_hook(self._layers_under_plan)
        for index, layer in enumerate(self._layers):
            hook = functools.partial(self._layer_starts, index)
            engine.track_hook(layer.register_forward_pre_hook(hook, with_kwargs=True))
        for _, module in find_output_head(model)[-1:]:  # the final norm (or the head): where the head's phase begins
            engine.track_hook(module.register_forward_pre_hook(self._head_starts))
        engine.warn_once("budget", f"hf_offload: memory_budget={memory_budget} ({format_bytes(self._budget_bytes())}) "
                         "is set, so hf-offload decides per "
                         "decoder layer whether to checkpoint it (whatever activation_checkpointing says): the first "
                         "two steps are profiled under full checkpointing (or, where that is predicted not to fit, "
                         "a plan made for the first step), then the plan is applied")  # fmt: skip

    @property
    def profile(self) -> StepProfile | None:
        """The measured step the plan in force was made from (scaled to its tokens); None before the first plan."""
        return self._profile

    @property
    def calibration(self) -> Calibration:
        """What the measured plans taught the model, as of rank 0's last plan."""
        return self.plan_checks.calibration

    @property
    def measurements(self) -> dict[str, list[dict[str, Any]]]:
        """Per plan code, the steps the closed loop measured of it (`tokens` in the profile's terms, `seconds`,
        `peak_bytes`, `profiled`, `tail_bytes`): the profiled step, the trial's and the plans' checked steps."""
        samples_by_code = self.plan_checks.samples.items()
        return {code: [dataclasses.asdict(sample) for sample in samples] for code, samples in samples_by_code}

    def expect_longest_step(self, tokens: int, source: str) -> None:
        """Tells the first plan the longest step the run may see, learned from a trainer's configuration (`source`,
        e.g. TRL's `max_length` times the batch size): it checks that a step that long fits the budget, and warns
        once where none does. `memory_budget_max_tokens`, which the user set, stands instead (and raises).

        Args:
            tokens: sequences x their padded length, per device and micro-step (see `LongestStep`).
            source: where the length comes from, for the warning.
        """
        if self._longest is None:
            self._longest = LongestStep(tokens, source, strict=False)

    # ------------------------------------------------------------------ hooks

    def _training_forward(self, module: nn.Module) -> bool:
        """A forward of the training step: not evaluation, and not a checkpoint's recomputation inside backward
        (transformers before 5.2x checkpoints `__call__`, so the layers' hooks run again there)."""
        in_backward = torch._C._current_graph_task_id() != -1
        return module.training and torch.is_grad_enabled() and not in_backward

    def _forward_starts(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not self._training_forward(module):
            return
        self._forwards += 1
        self._previous_step_tokens, self._step_tokens = self._step_tokens, 0
        self._input_elements = _input_elements(args, kwargs)
        self.held_memory.step_begins()
        if self._measured_step_faulted:  # the measured profiled step did not complete: this one is measured instead
            self._measured_step_faulted = False
            self._forwards = 2
            self.profiled_steps.start_measured_step()
        elif self._phase is _Phase.BEFORE_TRAINING:
            self._phase = _Phase.FIRST_STEP
            self._apply("C" * len(self._layers))
            self.profiled_steps.first_step_begins()
        elif self._phase is _Phase.FIRST_STEP:
            self._phase = _Phase.MEASURED_STEP
            self.profiled_steps.record_first_step()
            if not self.profiled_steps.probes_finished:
                self._finish_probes()
            else:  # decided in the first step, before the optimizer made its state: decided again with it
                self._apply_safe_plan(self.profiled_steps.measured.step_tokens)
            self._take_call_order()
            self.profiled_steps.start_measured_step()
        elif self._phase is _Phase.MEASURED_STEP:
            self._phase = _Phase.WAITING
            self.profiled_steps.measured_step_ends(self._code)
            self._first_plan()
        elif self._phase is _Phase.WAITING:
            self._first_plan()
        else:
            self._close_the_loop()
            ranks = self._ranks.agreement()
            if ranks is None:
                if self._static_grew():
                    self._generation += 1
                    self._plan_and_apply(self.plan.tokens)
                return
            # Every rank re-plans, or none: for the longest step of the ranks, or for memory held that grew on one.
            tokens, grew = ranks.largest([self._estimated_step_tokens(), int(self._static_grew())])
            if grew:
                self._generation += 1
                self._plan_and_apply(max(tokens, self.plan.tokens))
            else:
                self._plan_for(tokens)

    def step_faulted(self) -> None:
        """The training step under way did not complete: an exception left the region it ran in (one that a caller
        caught, or a retrying helper such as `auto_find_batch_size`). A step that did not complete is no measurement:
        its partial time and bytes (the head's saved bytes at 0, a fraction of the step's time) would put the plan's
        peak in the wrong place. The measured profiled step is measured again in the next step, and a step the closed
        loop times is not recorded."""
        if self._phase is _Phase.MEASURED_STEP:
            self._measured_step_faulted = True
        self.plan_checks.step_faulted()

    def _first_plan(self) -> None:
        """Makes the first plan at a training forward's start, for the profiled steps' tokens (under torch.distributed,
        the longest step of the ranks: the profiled ones, or this one), unless it waits (`_first_plan_waits`)."""
        if self._first_plan_waits():
            return
        tokens = self.profiled_steps.measured.step_tokens
        ranks = self._ranks.agreement()
        if ranks is not None:
            tokens = ranks.largest([max(tokens, self._estimated_step_tokens())])[0]
        self._check_longest_step(tokens)
        self._plan_and_apply(tokens)
        self._phase = _Phase.PLANNED
        self.plan_checks.start_timing(self.plan, self._applied_at, self._forwards)

    def _check_longest_step(self, tokens: int) -> None:
        """Where the run's longest step is known (`_longest`) and longer than the `tokens` the first plan is for:
        whether a plan fits it. If none does, an `InfeasibleBudgetError` where the user set the length, a warning
        where a trainer's configuration gave it; otherwise nothing (its plan is made when such a step comes, as for
        every longer step). Without this, a budget that fits the profiled steps but not the run's longest is found
        out at the first step that long, perhaps hours in, which then runs over the budget."""
        longest = self._longest
        if longest is None:
            return
        measured, called = self.profiled_steps.measured, self.profiled_steps.called
        last_stack = self.profiled_steps.stacks[called[-1]] if called else None
        step_tokens = longest.tokens
        if last_stack in measured.stack_tokens:  # in the profile's terms (the first stack's tokens)
            step_tokens = in_proportion(measured.step_tokens, measured.stack_tokens[last_stack], longest.tokens)
        ranks = self._ranks.agreement()
        if ranks is not None:  # each rank's stacks scale from its own first step: every rank must decide alike
            step_tokens = ranks.largest([step_tokens])[0]
        if step_tokens <= tokens:
            return
        profile, budget_bytes, margin_bytes = self._planning_inputs(step_tokens)

        def make_plan() -> Plan:
            plans_measured = self._measured_plans(profile)
            return self._choose(calibrate(profile, plans_measured)[0], budget_bytes, margin_bytes, plans_measured)

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

    def _first_plan_waits(self) -> bool:
        """Whether the first plan waits: gradients are held as this forward starts (micro-steps accumulate) and no
        optimizer has stepped since the controller began, so the optimizer's state (AdamW's: twice the trained
        parameters) does not exist yet. A plan made now would not count it, nor would the smallest budget its
        refusal names: on an H200, a budget at that minimum ran 340-390 MB over once the state appeared (gradient
        accumulation over four micro-steps, a medium Llama, full fine-tune). The steps meanwhile run the safe plan,
        at most `_FIRST_PLAN_WAIT_FORWARDS` of them. Every rank decides alike: the ranks step their optimizers and
        accumulate together."""
        if self._optimizer_steps.count or self._forwards > 3 + _FIRST_PLAN_WAIT_FORWARDS:
            return False
        if not self.held_memory.gradients_held():
            return False
        if self._forwards == 3:
            logger.info("hf_offload: memory_budget: gradients accumulate over micro-steps and no optimizer has stepped "
                        "yet; the first plan waits for the optimizer's first step, whose state it must count, and the "
                        "steps run the profiled steps' plan until then")  # fmt: skip
        return True

    def _estimated_step_tokens(self) -> int:
        """This step's tokens in the profile's terms, as estimated before its layers run: in proportion to its input
        elements (token ids, labels, masks, pixels) from the first step, or from a later step whose layers saw more
        tokens than so estimated (`_layer_starts`)."""
        tokens, elements = self._tokens_per_elements
        return in_proportion(tokens, elements, self._input_elements) if elements else tokens

    def _warn_if_compiled(self) -> None:
        """Called from the layers' pre-hooks, which Dynamo traces whether the model or its layers are compiled.

        The controller's hooks are traced when the model or its layers are compiled: they must run (they probe,
        measure and re-plan), so unlike the engine's hooks they are not `eager_only`, and each breaks the compiled
        graph (a 2-layer Llama on the CPU: 8 graphs and 13 breaks with its layers compiled, 17 and 18 compiled as a
        whole). Training stays correct; the warning says what it costs."""
        if not torch.compiler.is_compiling():
            return
        engine = self._engine()
        if engine is not None:
            engine.warn_once("budget_compiled", "hf_offload: memory_budget with a compiled model or compiled decoder "
                             "layers: the planner's hooks run inside the compiled code and break its graphs, which "
                             "costs the speed compiling was for. Use memory_budget without torch.compile, or "
                             "torch.compile without memory_budget.")  # fmt: skip

    def _close_the_loop(self) -> None:
        """At a training forward's start: records the step that just ended, and checks the plan (or ends its trial)
        once it has enough such steps (`PlanChecks.step_ended`); then times the step that starts if it checks a
        plan."""
        checks, predict = self.plan_checks, self.profiled_steps.model_prediction
        above_counted, due = checks.step_ended(self.plan, self._code, self._applied_at, self._forwards,
                                               self._previous_step_tokens, self._static_grew(), self._profile,
                                               predict)  # fmt: skip
        if above_counted:
            self._generation += 1
        if due:
            if self.plan.trial:
                self._end_trial()
            else:
                self._check_plan()
        self.plan_checks.start_timing(self.plan, self._applied_at, self._forwards)

    def _layer_starts(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        self._warn_if_compiled()
        profiled = self.profiled_steps
        if profiled.probing or not self._training_forward(layer) or not args or not isinstance(args[0], torch.Tensor):
            return  # the probes call the layers too
        tokens = args[0].shape[:-1].numel()
        measured, stack = profiled.measured, profiled.stacks[index]
        if self._phase is _Phase.FIRST_STEP:
            if not measured.step_tokens:
                self._tokens_per_elements = (tokens, self._input_elements)
            if profiled.layer_called(index, layer, args, kwargs):  # every kind of layer is probed
                self._finish_probes()
            profiled.layer_runs(self._code, args[0])  # after the probes, which may have tiled the safe plan
        elif self.plan is not None and index in profiled.stack_starts and stack in measured.stack_tokens:
            # The stack's layers have not run yet: plan for this step if it grew past the plan's tokens.
            self._step_tokens = max(
                self._step_tokens, in_proportion(measured.step_tokens, measured.stack_tokens[stack], tokens)
            )
            if self._ranks.agreement() is None:
                # A step's tokens are known whole as its only stack starts; with several, a later one may be longer
                # than the first, and plans for a shorter step would be applied and replaced within it.
                self._plan_for(self._step_tokens, shorter_plans=len(profiled.stack_starts) == 1)
                return
            if self._step_tokens <= self.plan.tokens:
                return
            # Under torch.distributed the ranks re-plan together, at a forward's start, from what each estimated of
            # its step there: this rank estimated too few tokens. It cannot re-plan alone (the others would not
            # join the broadcast), so this step runs the plan in force, and later steps are estimated from it.
            self._tokens_per_elements = (self._step_tokens, self._input_elements)
            engine = self._engine()
            if engine is not None:
                engine.warn_once("ranks_estimate", f"hf_offload: memory_budget: a step of {self._step_tokens} tokens "
                                 f"(in the profile's terms) on rank {torch.distributed.get_rank()} ran the plan made "
                                 f"for {self.plan.tokens}: its input elements predicted fewer tokens, which the ranks "
                                 "agree on before the step's layers run. Later steps are predicted from this one; "
                                 "this one may have exceeded the budget.")  # fmt: skip

    def _finish_probes(self) -> None:
        """Once every kind of layer is probed, or the first step is over: the probes are finished and the link
        measured (`ProfiledSteps.finish_probes`), and the profiled steps' plan decided."""
        self.profiled_steps.finish_probes()
        self._apply_safe_plan(self.profiled_steps.measured.step_tokens)

    def _take_call_order(self) -> None:
        """After the first step: the plan's order becomes the order it called the layers in
        (`ProfiledSteps.take_call_order`), and the head's phase is timed from the end of the last layer it called."""
        engine, called = self._engine(), self.profiled_steps.called
        self.profiled_steps.take_call_order()
        if engine is not None and called:
            engine.track_hook(self._layers[called[-1]].register_forward_hook(self._last_layer_ends))
            engine.track_hook(self._layers[called[0]].register_forward_hook(self._first_layer_ends))

    def _apply_safe_plan(self, tokens: int) -> None:
        """The profiled steps' plan, once the probes are in, for the step's own tokens, before the layers it decides
        run.

        The safe plan where it is predicted to fit the budget: every layer fully checkpointed, its input offloaded;
        its MLP tiled too if it is predicted not to fit untiled and tiling is predicted to lower its peak (at long
        context an untiled layer's recompute alone can exceed the device); the whole layer tiled if even that is
        predicted not to fit and tiling whole layers is predicted lower still. Where none of these fits, the
        planner's plan for this step (`_plan_profiled_steps`): a run whose first step is already long (packing to
        `max_length`) would otherwise run every input to a full pinned pool and keep the rest on the device (an
        8B-class model at 327,680 tokens ran out of GPU memory so, where a plan that keeps some inputs and tiles
        others fitted). The layers that ran before the last kind was probed keep the untiled safe plan in the first
        step. Decided again as the second step begins, with the memory held then: the optimizer's state, made by the
        first step's optimizer step (on an H200, 16 layers of S1's shape, AdamW: the first step peaked at 8.29 GiB,
        the second at 8.92, over a budget of 8.80 GiB that a tiled plan met at 8.69)."""
        profile = self.profiled_steps.profile_now(tokens)
        budget_bytes = self._budget_bytes()
        code = safe_code(profile)
        peak = simulate(profile, code).peak_bytes
        not_lower = []  # the tilings that could not lower the prediction, and why
        for letters, available, what in (("Tt", tiling_available, "every MLP"), ("Ll", layer_tiling_available,
                                                                                  "every layer whole")):  # fmt: skip
            if peak <= budget_bytes:
                continue
            if not available(profile):
                not_lower.append(f"tiling {what} is not available")
                continue
            tiled_code = safe_code(profile, letters)
            tiled = simulate(profile, tiled_code).peak_bytes
            if tiled < peak:  # tiling can cost memory (two chunks of 4K on a 7B shape)
                logger.info("hf_offload: the profiled steps tile %s: plan %r is predicted to peak at %.2f GiB, over "
                            "the budget of %.2f GiB", what, code, peak / 2**30, budget_bytes / 2**30)  # fmt: skip
                code, peak = tiled_code, tiled
            else:
                not_lower.append(f"tiling {what} is predicted to peak at {tiled / 2**30:.2f} GiB")
        # Under torch.distributed each rank decides its profiled steps alone, so only between safe plans: they differ
        # in what they tile and offload, not in which layers they recompute (FSDP's collectives follow those).
        engine = self._engine()
        if peak > budget_bytes and engine is not None and runs_alone():
            planned = self._plan_profiled_steps(profile, budget_bytes)
            if planned.predicted.peak_bytes < peak:
                logger.info("hf_offload: the profiled steps run plan %r, made for their %d tokens and predicted to "
                            "peak at %.2f GiB (budget %.2f GiB; %s): the safe plan %r is predicted to peak at "
                            "%.2f GiB", planned.code, tokens, planned.predicted.peak_bytes / 2**30,
                            budget_bytes / 2**30, "over it, the lowest plan the model knows of"
                            if planned.predicted.peak_bytes > budget_bytes else "within it", code,
                            peak / 2**30)  # fmt: skip
                # Not the plan in force (`memory_plan`): the profiled steps run it, and the first plan comes after.
                settings = engine_settings(planned.code, self._windows(planned), host_cap_bytes=planned.host_cap_bytes)
                self._apply(planned.code, settings, tile_tokens=planned.tile_tokens,
                            layer_tile_tokens=planned.layer_tile_tokens)  # fmt: skip
                return
        if peak > budget_bytes:  # said, so that a profiled step over the budget can be told apart from a wrong model
            logger.info("hf_offload: the profiled steps run plan %r, predicted to peak at %.2f GiB, over the budget of "
                        "%.2f GiB: %s", code, peak / 2**30, budget_bytes / 2**30,
                        "; ".join(not_lower) or "it is the lowest plan the model knows of")  # fmt: skip
        if code != self._code:
            self._apply(code, **chunk_sizes(profile, code))

    def _plan_profiled_steps(self, profile: StepProfile, budget_bytes: int) -> Plan:
        """The plan for a profiled step that the safe plan is predicted not to fit: the planner's for `profile`, with
        the pinned pool grown where that is what fits it (`_choose`), or, where no plan fits, the lowest-memory one.

        Raises:
            InfeasibleBudgetError: in the first step, where even the lowest-memory plan is predicted to exceed the
                device's memory: the step would run out of it. Otherwise the refusal waits for the first plan, made
                from the profiled steps' measurements (the model's prediction of a step can be above what it
                measures).
        """
        try:
            return self._choose(profile, budget_bytes, prediction_margin_bytes(budget_bytes), [])
        except InfeasibleBudgetError as error:
            # Less the head's bytes, which the first step only estimates: a refusal rests on what was measured.
            total = self._meter.total()
            lowest = error.lowest_plan.predicted.peak_bytes - profile.head_bytes
            if self._phase is _Phase.FIRST_STEP and total is not None and lowest > total:
                raise InfeasibleBudgetError(
                    f"hf_offload: memory_budget: the first step, of {profile.tokens} tokens, fits no plan, and the "
                    f"lowest-memory one is predicted to exceed the device's {format_bytes(total)}: {error}",
                    error.budget_bytes, error.minimum_bytes, error.lowest_plan) from None  # fmt: skip
            return error.lowest_plan

    def _head_starts(self, module: nn.Module, args: Any) -> None:
        if self._phase is not _Phase.MEASURED_STEP or not self._training_forward(module):
            return
        self.profiled_steps.head_starts()

    def _last_layer_ends(self, layer: nn.Module, args: Any, output: Any) -> None:
        tensor = first_tensor(output)
        profiled = self._phase is _Phase.MEASURED_STEP
        if not (profiled or self.plan_checks.timing) or not self._training_forward(layer):
            return
        if tensor is None or not tensor.requires_grad:
            return

        def head_done(grad: torch.Tensor) -> None:  # backward reaches the last layer: the head's part is over
            if profiled:
                self.profiled_steps.head_done()
            queue_after_backward(self._peak_counter.read_at_backward_end)

        tensor.register_hook(head_done)

    def _first_layer_ends(self, layer: nn.Module, args: Any, output: Any) -> None:
        """In the second profiled step: when backward reaches the first layer called, the gradients not created yet
        are counted (`ProfiledSteps.first_layer_reached`)."""
        tensor = first_tensor(output)
        if self._phase is not _Phase.MEASURED_STEP or not self._training_forward(layer):
            return
        if tensor is None or not tensor.requires_grad:
            return
        tensor.register_hook(self.profiled_steps.first_layer_reached)

    # ------------------------------------------------------------------ planning

    def _static_grew(self) -> bool:
        """Whether the memory held as this step began (with the gradients pending) grew past what the plan in force
        was made with, beyond the allocator's noise."""
        if self._profile is None:
            return False
        planned = self._profile.static_bytes + self._profile.gradient_bytes
        return self.held_memory.at_step_start > planned * (1 + STATIC_GROWTH_TOLERANCE)

    def _plan_and_apply(self, tokens: int) -> None:
        """Plans for `tokens` per step with the memory held now, on rank 0, and applies the plan on every rank.

        A later step that no plan fits (longer than any before it) runs on the lowest-memory plan, with a warning
        the first time: an exception there would end a run that may be hours in.

        Raises:
            InfeasibleBudgetError: for the first plan, made for the profiled steps' tokens: the budget is below the
                smallest peak any plan reaches (naming it and what dominates it).
        """
        self.held_memory.forget_parameters()
        profile, budget_bytes, margin_bytes = self._planning_inputs(tokens)
        first = self.plan is None

        def make_plan() -> Plan:
            measured = self._measured_plans(profile)
            calibrated = self.plan_checks.calibrated(profile, measured)
            try:
                plan = self._choose(calibrated, budget_bytes, margin_bytes, measured)
            except InfeasibleBudgetError as error:
                if first:
                    raise
                return error.lowest_plan
            trial = self.plan_checks.trial(calibrated, plan, measured, budget_bytes, margin_bytes) if first else None
            return trial or plan

        self._use(self._on_every_rank(make_plan), profile, budget_bytes, margin_bytes)

    def _plan_for(self, tokens: int, shorter_plans: bool = True) -> None:
        """Puts in force a plan for a step of `tokens`: the plan kept for the shortest length at least `tokens`, unless
        that length is more than a length step above the step's (`PlansByLength.length_for`) and `shorter_plans`: then
        a plan made for the step's length step, which may keep more. A step longer than every kept plan's gets a plan
        for its own length; one that no plan fits, its lowest-memory plan, which then serves the steps up to its
        length that no plan kept for a shorter length fits.

        Why plans for shorter steps: under a budget near the minimum of the longest steps, their plan tiled layers,
        and with it in force the shorter steps ran tiled too, at 0.8-1.7 s a step where plain checkpointing, which
        fitted them, ran 0.35-0.45 s (H200, `benchmarks/dynamic_padding.py`, lengths over a 2x range). Not while a
        trial runs (its steps are the trial's), nor below a plan that keeps every layer (nothing is faster). Plans
        made before what the controller knows changed are dropped (`_generation`), but for the one in force. Under
        torch.distributed every rank decides alike: the ranks agree on `tokens`, and every kept plan is rank 0's."""
        kept = self._plans.covering(tokens, self._generation, self.plan)
        if kept is None:
            self._plan_and_apply(tokens)
            return
        length = self._plans.length_for(tokens)
        keeps_everything = kept.plan.code == "K" * len(kept.plan.code)
        if shorter_plans and kept.plan.tokens > length and not keeps_everything and not self.plan.trial:
            self._plan_and_apply(length)
            return
        if kept.plan is not self.plan:
            if kept.plan.code != self.plan.code:  # between plans of one code only the windows change: not logged
                logger.info("hf_offload: a step of %d tokens: plan %r, made for %d, is in force again", tokens,
                            kept.plan.code, kept.plan.tokens)  # fmt: skip
            self._put_in_force(kept.plan, kept.profile)

    def _choose(self, profile: StepProfile, budget_bytes: int, margin_bytes: int, measured: list[MeasuredStep],
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

    def _on_every_rank(self, make_plan: Callable[[], Plan]) -> Plan:
        """`make_plan()`, or under torch.distributed rank 0's plan on every rank (`RankAgreement.rank_zeros_plan`)."""
        ranks = self._ranks.agreement()
        return make_plan() if ranks is None else ranks.rank_zeros_plan(make_plan)

    def _planning_inputs(self, tokens: int) -> tuple[StepProfile, int, int]:
        """What every plan starts from: the host caps agreed across ranks, then the profile scaled to `tokens`, the
        budget in bytes and the prediction's margin within it."""
        self._host_caps.agree(self._ranks.agreement())
        profile = self.profiled_steps.profile_now(tokens)
        budget_bytes = self._budget_bytes()
        return profile, budget_bytes, prediction_margin_bytes(budget_bytes)

    def _check_plan(self) -> None:
        """The closed loop's check of the plan in force (`PlanChecks.checked_plan`), which it replaces where the check
        answers another: a correction."""
        profile, budget_bytes, margin_bytes = self._planning_inputs(self.plan.tokens)
        in_force = self.plan
        check = functools.partial(self.plan_checks.checked_plan, in_force, profile, budget_bytes, margin_bytes,
                                  self.profiled_steps.profile_now, self._choose)  # fmt: skip
        new_plan = self._on_every_rank(check)
        if new_plan.code != in_force.code:
            self.plan_checks.correction_made()
            self._generation += 1  # what the model learned made this plan: the plans kept are from before
            self._use(new_plan, profile, budget_bytes, margin_bytes)

    def _end_trial(self) -> None:
        """The trial's steps are measured: the plan made with them (`PlanChecks.after_trial`) is put in force."""
        trial = self.plan
        self.plan_checks.trial_ends(trial)
        profile, budget_bytes, margin_bytes = self._planning_inputs(trial.tokens)
        make_plan = functools.partial(self.plan_checks.after_trial, profile, budget_bytes, margin_bytes,
                                      self.profiled_steps.profile_now, self._choose)  # fmt: skip
        self._generation += 1  # the plans kept before the trial were made without what it measured
        self._use(self._on_every_rank(make_plan), profile, budget_bytes, margin_bytes)

    def _measured_plans(self, profile: StepProfile) -> list[MeasuredStep]:
        """What each plan run so far measured, scaled to `profile` (`PlanChecks.measured_plans`)."""
        return self.plan_checks.measured_plans(profile, self.profiled_steps.profile_now)

    def _use(self, new_plan: Plan, profile: StepProfile, budget_bytes: int, margin_bytes: int) -> None:
        """Makes `new_plan` (made from `profile`) the plan in force, on the layers and in the engine's windows, and
        keeps it for the steps of its length (`_plan_for`); says so in the log, and warns where it does not fit the
        budget."""
        if not new_plan.fits(margin_bytes):
            self._over_budget(new_plan, profile, budget_bytes, margin_bytes)
        self._plans.keep(new_plan, profile, self._generation)
        self._put_in_force(new_plan, profile)
        logger.info("hf_offload: memory budget %s\n%s", self.memory_budget, new_plan.format_table())
        if profile.peak_correction_bytes:
            logger.info("hf_offload: closed loop: plan %r peaked above the model's prediction of it; the predicted "
                        "peaks above are raised by %d bytes (its excess, in proportion to this step's tokens where "
                        "they are more)", peak_correction(self.plan_checks.samples, profile.tokens)[1],
                        profile.peak_correction_bytes)  # fmt: skip
        engine = self._engine()
        if new_plan.inputs_kept_for_host:
            engine.warn_once("host_cap", f"hf_offload: {len(new_plan.inputs_kept_for_host)} checkpointed layers "
                             "keep their input on the GPU: the pinned host memory cap "
                             f"({new_plan.host_cap_bytes / 2**30:.1f} GiB"
                             f"{', grown down to the host memory reserve' if new_plan.host_growth else ''}) is full. "
                             "Raise activation_offloading_max_pinned_memory_fraction (or max_pinned_mib), or lower "
                             "activation_offloading_host_memory_reserve_mib, if the host has the room.")  # fmt: skip

    def _windows(self, plan: Plan) -> CopyWindows:
        """The engine's copy windows under `plan`: its forward window (at least the option's), its prefetch window and
        the head's (None: the engine's default)."""
        forward_window = max(plan.forward_window_bytes, self._options.forward_window_bytes)
        return CopyWindows(forward_window, plan.prefetch_window_bytes or None, plan.head_prefetch_window_bytes or None)

    def _put_in_force(self, new_plan: Plan, profile: StepProfile) -> None:
        """Makes `new_plan` (made from `profile`) the plan in force, on the layers and in the engine's windows. From
        a plan whose layers act alike (a plan kept for another length, `_plan_for`), only the windows change: the
        layers are not wrapped anew, and the steps go on counting as that code's for the closed loop, which would
        otherwise start measuring again at each switch and, with lengths varying step to step, never check a plan."""
        previous, self.plan, self._profile = self.plan, new_plan, profile
        # The engine keeps no more of its tail than the plan counted (the tail only grows, and a budget at the
        # plan's peak would not hold more): a plan chosen by its measured peak, what its measured steps kept; a
        # predicted one, the copies the model has unfinished as the forward ends. Copies beyond it are drained
        # before the head (time the model counts), not kept on top of the loss.
        samples = self.plan_checks.samples.get(new_plan.code) if new_plan.measured is not None else None
        tail_cap = max(sample.tail_bytes for sample in samples) if samples else new_plan.predicted.tail_bytes
        # The pool's cap is the one it planned with: raised, where it grew the pool.
        settings = engine_settings(new_plan.code, self._windows(new_plan), tail_cap, new_plan.host_cap_bytes, new_plan)
        acts = (new_plan.code, new_plan.tile_tokens, new_plan.layer_tile_tokens)  # what the layers are given
        if previous is not None and (previous.code, previous.tile_tokens, previous.layer_tile_tokens) == acts:
            self._layers_under_plan.apply_engine_settings(settings)
        else:
            self._apply(new_plan.code, settings, tile_tokens=new_plan.tile_tokens,
                        layer_tile_tokens=new_plan.layer_tile_tokens)  # fmt: skip
        release_unusable_cache(new_plan.predicted.peak_bytes)

    def _over_budget(self, lowest: Plan, profile: StepProfile, budget_bytes: int, margin_bytes: int) -> None:
        """Says that this step runs on the lowest-memory plan, over the budget: a warning once, then in the log."""
        peak = lowest.predicted.peak_bytes
        fitting = smallest_budget(peak, budget_bytes, margin_bytes)
        message = (f"hf_offload: no plan fits memory_budget={self.memory_budget} ({budget_bytes} bytes) at training "
                   f"forward {self._forwards}: {lowest.tokens} tokens (in the profiled step's terms), "
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

    def _apply(self, code: str, settings: EngineSettings | None = None, tile_tokens: int = 0,
               layer_tile_tokens: int = 0) -> None:  # fmt: skip
        """Applies the plan `code`, in the plan's order, to the layers and `settings` to the engine
        (`LayersUnderPlan.apply`); without settings (the profiled steps' plans), the engine's windows and caps stay as
        they are."""
        if self._engine() is None or self._model() is None:
            return
        self._code, self._applied_at = code, self._forwards
        settings = engine_settings(code) if settings is None else settings
        order = self.profiled_steps.order
        self._layers_under_plan.apply(code, order, settings, self._layer_starts, tile_tokens, layer_tile_tokens)


class _OwnOptimizerSteps:
    """Counts the steps of the optimizers that train the model: those holding one of its parameters.

    PyTorch's optimizer step hooks are process-wide (`register_optimizer_step_post_hook`). Counting every optimizer's
    steps, a second model's optimizer stepping at each of its micro-steps made this model's first plan before its
    own optimizer had made its state (the plan then ran that state over the budget); and a hook that refers to its
    counter strongly outlives a context dropped without `remove_hooks`. So an optimizer counts only if it holds one
    of the model's parameters (decided at its first step, kept per optimizer), and the hook refers to this counter
    weakly and is removed as the counter is collected. An optimizer over copies of the parameters
    (DeepSpeed's master weights) never counts: the first plan then waits its bounded number of forwards.
    """

    def __init__(self, model: nn.Module) -> None:
        self.count = 0
        self._model = weakref.ref(model)
        self._counts: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        counter = weakref.ref(self)

        def hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
            live = counter()
            if live is not None:
                live.stepped(optimizer)

        self.handle = register_optimizer_step_post_hook(hook)
        weakref.finalize(self, self.handle.remove)

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        counts = self._counts.get(optimizer)
        if counts is None:
            model = self._model()
            own = {id(parameter) for parameter in model.parameters()} if model is not None else set()
            counts = any(id(parameter) in own for group in optimizer.param_groups for parameter in group["params"])
            self._counts[optimizer] = counts
        if counts:
            self.count += 1


def _input_elements(args: tuple, kwargs: dict[str, Any]) -> int:
    """The elements of a forward's tensor arguments (token ids, labels, masks, pixels): known before any layer runs,
    they grow with the step's tokens."""
    return sum(value.numel() for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))
