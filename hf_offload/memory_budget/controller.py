"""The memory budget at work: profile the first steps, plan, apply the plan, re-plan when the step grows.

`MemoryBudgetController` is attached by `get_act_offloading_ctx_manager` when `memory_budget` is set. It counts the
training forwards of the model and sequences the phases (`_Phase`), each the concern of an object it owns:

1. First forward: the safe plan (`planning.Planner.apply_safe_plan`); when the first layer of each kind is called,
   it is probed on the very arguments it receives, then the link's bandwidth is measured
   (`profiled_steps.ProfiledSteps`), and the profiled steps' plan is decided again with what the probes measured.
2. Second forward, still safe: the step the profile is measured from (`ProfiledSteps`): memory held before it
   starts (`measurements.HeldMemory`), the head's peak and time, the whole step's time.
3. Third forward: the first plan (`Planner.plan_and_apply`), applied through `plan_application.LayersUnderPlan`. Where
   gradients accumulate over micro-steps and no optimizer has stepped yet, it waits for the optimizer's first step,
   whose state it must count (`_first_plan_waits`), the steps running the safe plan until then. On every later
   forward it re-plans if the step has more tokens than it planned for (checked as each stack starts, before its
   layers run; each stack's tokens scale the whole step from the first step's: `Planner.plan_for`, by
   `plans_by_length`) or the memory held between steps has grown (optimizer state created after a gradient
   accumulation cycle, where no optimizer step hook told).
4. The closed loop (`plan_checks.PlanChecks`, on `closed_loop`'s samples): the steps a plan runs are measurements;
   after a few, the plan is checked against what every plan measured, and corrected.

While profiling, the device's peak-memory counter is reset at the phase boundaries it measures (the first step's
start among them; `measurements.OwnPeakCounter`).

Under `torch.distributed` every rank runs rank 0's plan, made for the longest of the ranks' steps and the smallest of
their pinned host caps (`ranks.RankAgreement`). The ranks decide together, at each training forward's start, whether
to re-plan: a rank cannot know another's step, and one re-planning alone would wait in the broadcast forever. So the
growth of a step is estimated there, before its layers run, from its input elements (`_estimated_step_tokens`)
rather than seen as each stack starts.

None of the objects the controller owns refers back to it (the planner holds its layers' pre-hook weakly), so that a
dropped context is freed as soon as it is dropped.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..engine import OffloadActivations
from ..model import find_decoder_layers, find_output_head, first_tensor
from ..options import OffloadOptions
from ..peak import queue_after_backward
from ..units import format_bytes
from .calibrate import Calibration
from .measurements import HeldMemory, LongestStep, OwnPeakCounter, budget_bytes
from .plan_application import LayersUnderPlan
from .plan_checks import PlanChecks
from .planning import Planner
from .probes import Meter
from .profile import StepProfile, in_proportion
from .profiled_steps import ProfiledSteps
from .ranks import AgreedHostCaps, RanksOfThisRun
from .simulate import Plan
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

    It owns, one concern each: `held_memory` (the memory held between steps), `profiled_steps` (what the first steps
    measure, and the profile), `plan_checks` (the closed loop) and `planner` (the plan in force, the plans by length).

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
        self._engine = weakref.ref(engine)
        self.memory_budget = memory_budget
        self._meter = Meter(engine.device_type)
        self.held_memory = HeldMemory(model, self._meter)
        # What the objects below are given is theirs or these, never the controller: none of them refers to it.
        budget = functools.partial(budget_bytes, memory_budget, self._meter)
        budget()  # a share of the device, or "auto", without a device fails here
        self._ranks = RanksOfThisRun()  # under torch.distributed, the ranks' agreement
        self._phase = _Phase.BEFORE_TRAINING
        self._forwards = 0  # training forwards so far: the steps a plan has run, and how long the first plan waited
        self._measured_step_faulted = False  # `step_faulted` in the measured profiled step
        self._step_tokens = 0  # this step's tokens, in the profile's terms, from the stacks that have started
        self._previous_step_tokens = 0
        max_tokens = options.memory_budget_max_tokens
        self._longest = None if max_tokens is None else LongestStep(max_tokens, "memory_budget_max_tokens", True)
        self._peak_counter = OwnPeakCounter(self._meter)
        self.plan_checks = PlanChecks(engine, self._meter, self._peak_counter, self.held_memory, budget,
                                      self._ranks.agreement)  # fmt: skip
        # The steps of the optimizers that train this model since the controller began (taken off with the context's
        # hooks, or with the controller): whether the optimizer's state can exist yet (`_first_plan_waits`).
        self._optimizer_steps = _OwnOptimizerSteps(model)
        engine.track_hook(self._optimizer_steps.handle)
        # Under torch.distributed: the host caps the ranks agreed on at the latest plan, and how this rank estimates
        # its step's tokens before its layers run: in proportion to its forward's input elements
        # (`_estimated_step_tokens`), from a step whose tokens and input elements it knows.
        host_caps = AgreedHostCaps(engine)
        self._input_elements = 0
        self._tokens_per_elements = (0, 0)
        self.profiled_steps = ProfiledSteps(model, engine, [name for name, _ in named], self._layers, options,
                                            self._meter, self.held_memory, self._peak_counter, self.plan_checks,
                                            host_caps, budget)  # fmt: skip
        engine.track_hook(model.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
        self._layers_under_plan = layers_under_plan = LayersUnderPlan(model, engine, self._layers)
        engine.track_hook(layers_under_plan)
        self.planner = Planner(engine, model, layers_under_plan, self._layer_starts, memory_budget, options,
                               self._meter, self.held_memory, self.profiled_steps, self.plan_checks, host_caps, budget,
                               self._ranks.agreement)  # fmt: skip
        for index, layer in enumerate(self._layers):
            hook = functools.partial(self._layer_starts, index)
            engine.track_hook(layer.register_forward_pre_hook(hook, with_kwargs=True))
        # The final norm (or the head): where the head's phase begins. A model whose head the search does not find
        # (BioGPT's `output_projection`) begins it where its last layer ends (`_last_layer_ends`).
        tail = find_output_head(model)[-1:]
        self._head_hooked = bool(tail)
        for _, module in tail:
            engine.track_hook(module.register_forward_pre_hook(self._head_starts))
        engine.warn_once("budget", f"hf_offload: memory_budget={memory_budget} ({format_bytes(budget())}) "
                         "is set, so hf-offload decides per "
                         "decoder layer whether to checkpoint it (whatever activation_checkpointing says): the first "
                         "two steps are profiled under full checkpointing (or, where that is predicted not to fit, "
                         "a plan made for the first step), then the plan is applied")  # fmt: skip

    @property
    def plan(self) -> Plan | None:
        """The plan in force; None before the first plan."""
        return self.planner.plan

    @property
    def profile(self) -> StepProfile | None:
        """The measured step the plan in force was made from (scaled to its tokens); None before the first plan."""
        return self.planner.profile

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

    # ------------------------------------------------------------------ the phases

    def _training_forward(self, module: nn.Module) -> bool:
        """A forward of the training step: not evaluation, and not a checkpoint's recomputation inside backward
        (transformers before 5.24 checkpoints `__call__`, so the layers' hooks run again there)."""
        in_backward = torch._C._current_graph_task_id() != -1
        return module.training and torch.is_grad_enabled() and not in_backward

    def _forward_starts(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not self._training_forward(module):
            return
        self._forwards += 1
        self._previous_step_tokens, self._step_tokens = self._step_tokens, 0
        self._input_elements = _input_elements(args, kwargs)
        self.held_memory.step_begins()
        self._layers_under_plan.forward_begins()
        planner, profiled = self.planner, self.profiled_steps
        if self._measured_step_faulted:  # the measured profiled step did not complete: this one is measured instead
            self._measured_step_faulted = False
            self._forwards = 2
            profiled.start_measured_step()
        elif self._phase is _Phase.BEFORE_TRAINING:
            self._phase = _Phase.FIRST_STEP
            planner.apply("C" * len(self._layers), self._forwards)
            profiled.first_step_begins()
        elif self._phase is _Phase.FIRST_STEP:
            self._phase = _Phase.MEASURED_STEP
            profiled.record_first_step()
            if not profiled.probes_finished:
                self._finish_probes()
            else:  # decided in the first step, before the optimizer made its state: decided again with it
                planner.apply_safe_plan(profiled.measured.step_tokens, self._forwards, first_step=False)
            self._take_call_order()
            profiled.start_measured_step()
        elif self._phase is _Phase.MEASURED_STEP:
            self._phase = _Phase.WAITING
            profiled.measured_step_ends(planner.code)
            self._first_plan()
        elif self._phase is _Phase.WAITING:
            self._first_plan()
        else:
            planner.close_the_loop(self._forwards, self._previous_step_tokens)
            ranks = self._ranks.agreement()
            if ranks is None:
                if planner.static_grew():
                    planner.plan_anew(planner.plan.tokens, self._forwards)
                return
            # Every rank re-plans, or none: for the longest step of the ranks, or for memory held that grew on one.
            tokens, grew = ranks.largest([self._estimated_step_tokens(), int(planner.static_grew())])
            if grew:
                planner.plan_anew(max(tokens, planner.plan.tokens), self._forwards)
            else:
                planner.plan_for(tokens, self._forwards)

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
        self.planner.check_longest_step(tokens, self._longest)
        self.planner.plan_and_apply(tokens, self._forwards)
        self._phase = _Phase.PLANNED
        self.plan_checks.start_timing(self.plan, self.planner.applied_at, self._forwards)

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

    def _layer_starts(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        self._warn_if_compiled()
        profiled = self.profiled_steps
        if profiled.probing or not self._training_forward(layer) or not args or not isinstance(args[0], torch.Tensor):
            return  # the probes call the layers too
        self._plan_at_layer_start(index, layer, args, kwargs)
        self._layers_under_plan.layer_ran(index)

    def _plan_at_layer_start(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        """The first step's probes and plans, and a plan for a stack longer than the plan's, as layer `index` of a
        training forward starts."""
        profiled = self.profiled_steps
        tokens = args[0].shape[:-1].numel()
        measured, stack = profiled.measured, profiled.stacks[index]
        if self._phase is _Phase.FIRST_STEP:
            if not measured.step_tokens:
                self._tokens_per_elements = (tokens, self._input_elements)
            if profiled.layer_called(index, layer, args, kwargs):  # every kind of layer is probed
                self._finish_probes()
            profiled.layer_runs(self.planner.code, args[0])  # after the probes, which may have tiled the safe plan
        elif self.plan is not None and index in profiled.stack_starts and stack in measured.stack_tokens:
            # The stack's layers have not run yet: plan for this step if it grew past the plan's tokens.
            self._step_tokens = max(
                self._step_tokens, in_proportion(measured.step_tokens, measured.stack_tokens[stack], tokens)
            )
            if self._ranks.agreement() is None:
                # A step's tokens are known whole as its only stack starts; with several, a later one may be longer
                # than the first, and plans for a shorter step would be applied and replaced within it.
                self.planner.plan_for(self._step_tokens, self._forwards, shorter_plans=len(profiled.stack_starts) == 1)
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
        measured (`ProfiledSteps.finish_probes`), and the profiled steps' plan decided for the first step's tokens."""
        self.profiled_steps.finish_probes()
        first_step = self._phase is _Phase.FIRST_STEP
        self.planner.apply_safe_plan(self.profiled_steps.measured.step_tokens, self._forwards, first_step)

    def _take_call_order(self) -> None:
        """After the first step: the plan's order becomes the order it called the layers in
        (`ProfiledSteps.take_call_order`), and the head's phase is timed from the end of the last layer it called."""
        engine, called = self._engine(), self.profiled_steps.called
        self.profiled_steps.take_call_order()
        if engine is not None and called:
            engine.track_hook(self._layers[called[-1]].register_forward_hook(self._last_layer_ends))
            engine.track_hook(self._layers[called[0]].register_forward_hook(self._first_layer_ends))

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
        if profiled and not self._head_hooked:  # no head found: its phase is whatever follows the last layer
            self.profiled_steps.head_starts()

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
