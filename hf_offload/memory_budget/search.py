"""Choosing a plan: the per-layer actions with the shortest predicted step whose predicted peak fits the budget.

The controller measures a `StepProfile` during the first steps, calls `choose_plan(profile, budget_bytes)` and
applies the plan's layers with the windows it names. The search is greedy, then polished, and judges every candidate
by the step model (`simulate`); plans that ran (`MeasuredStep`) count by what they measured. A budget that no plan
fits is an `InfeasibleBudgetError`, which names the smallest budget that works and what dominates it. Pure Python,
like the rest of the planning (`spec`, `profile`, `simulate`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from ..units import format_bytes
from .actions import ACTIONS, KEEP
from .checks import is_int
from .profile import StepProfile, layer_tiling_available, tiling_available
from .simulate import (
    LayerOption,
    MeasuredStep,
    Plan,
    SimulatedStep,
    all_placed,
    check_code,
    chunk_sizes,
    code_options,
    describe_peak,
    gathered_parameters,
    gradients_at_backward,
    late_gradients_bytes,
    layer_options,
    memory_order,
    offload_places,
    prediction_of,
    simulate_step,
)

__all__ = [
    "InfeasibleBudgetError",
    "PREDICTION_MARGIN",
    "STEP_TIME_NOISE",
    "choose_plan",
    "plan_of",
    "prediction_margin_bytes",
    "safe_code",
    "smallest_budget",
]

# Plans that never ran are made for this share of the budget less than the budget: on S1 and S2 (H100) the predicted
# peaks were within 0.1% of the measured ones once the tail was counted, and the budget must hold on every step, not on
# average.
PREDICTION_MARGIN = 0.005
# Step times vary by about 1% from one step to the next. Plans the model predicts from one profile compare exactly, but
# a measured plan's time carries that noise: where a measured plan is within this share of the fastest candidate, the
# two are told apart by noise, not by speed, and the simplest of the plans that close is chosen (`_simplicity`), so
# that the same run ends on the same plan (two identical runs under a roomy budget once ended one on offloading every
# other layer, measured, the other on keeping every layer).
STEP_TIME_NOISE = 0.02


# The actions the planner chooses among: all but the selective offload (`X`). On S1 and S2 (H100) its layers cost
# about 2.5 ms each more than the model predicts from their recompute and copies (`benchmarks/run.py`'s plan modes),
# which left plans with `X` slower than plans without; it stays an action for hand-written plans.
_PLANNED = "KOSsCc"


def _own_seconds(profile: StepProfile, options: list[dict[str, LayerOption]]) -> list[dict[str, float]]:
    """Per layer and action, the time it adds as if every other layer kept everything.

    Recompute, plus the part of its copy that the later layers' forwards cannot hide, plus the part of its reload
    that the next layer's backward (the head, for the last layer) cannot hide, plus the host's time for it. The
    planner orders its changes by these; every candidate plan is then judged by `simulate_step`, which also sees
    copies queueing behind each other.
    """
    layers = profile.layers
    later_forward_s = 0.0
    seconds: list[dict[str, float]] = [{} for _ in layers]
    for i in range(len(layers) - 1, -1, -1):
        reload_cover_s = layers[i + 1].backward_s if i + 1 < len(layers) else profile.head_s
        for letter, option in options[i].items():
            copy_exposed = max(0.0, option.offloaded / profile.d2h_bytes_per_s - later_forward_s)
            reload_exposed = max(0.0, option.offloaded / profile.h2d_bytes_per_s - reload_cover_s)
            seconds[i][letter] = option.recompute_s + copy_exposed + reload_exposed + option.host_s
        later_forward_s += layers[i].forward_s
    return seconds


def _next_option(
    current: str, candidates: Iterable[str], held: dict[str, int], seconds: dict[str, float]
) -> str | None:
    """The candidate holding less than `current` that frees the most bytes per second it adds.

    Ties go to the smaller step, so that no option on the way is skipped; None if no candidate holds less.
    """
    best, best_key = None, None
    for candidate in candidates:
        freed = held[current] - held[candidate]
        if freed <= 0:
            continue
        added = seconds[candidate] - seconds[current]
        key = (math.inf if added <= 0 else freed / added, -freed)
        if best_key is None or key > best_key:
            best, best_key = candidate, key
    return best


def _greedy_plans(
    profile: StepProfile,
    options: list[dict[str, LayerOption]],
    seconds: list[dict[str, float]],
    planned: str,
) -> list[list[str]]:
    """The greedy's sequence of plans from keeping everything, each one layer change further than the last.

    Each layer's changes follow the lower convex hull of its (bytes held, seconds added) options among `planned`,
    e.g. keep -> selective -> full; all layers' changes are merged by bytes freed per second added, earlier layers
    first on ties (they free memory for more of the step). A change whose offloaded bytes the host (and the disk
    tier) would have no room for (`all_placed`) becomes the layer's best change that has room.
    """
    held = [{letter: option.held for letter, option in layer.items()} for layer in options]
    offloaded = [{letter: option.offloaded for letter, option in layer.items()} for layer in options]
    changes = []  # (bytes freed per second added, layer, action code)
    for i in range(len(options)):
        current = "K"
        while (target := _next_option(current, planned, held[i], seconds[i])) is not None:
            added = seconds[i][target] - seconds[i][current]
            freed = held[i][current] - held[i][target]
            changes.append((math.inf if added <= 0 else freed / added, i, target))
            current = target
    changes.sort(key=lambda change: (-change[0], change[1]))  # stable: a layer's own changes stay in hull order

    letters, plans = ["K"] * len(options), []
    sizes = [0] * len(options)  # what each layer offloads under `letters`

    def placed(i: int, letter: str) -> bool:
        """Whether the host (and the disk tier) would have room for every layer's offloaded bytes with layer `i`
        under `letter`."""
        sizes[i], current = offloaded[i][letter], sizes[i]
        fits = all_placed(profile, sizes)
        sizes[i] = current
        return fits

    for _, i, target in changes:
        current = letters[i]
        if held[i][target] >= held[i][current]:
            continue  # a fallback for the host cap already went past it
        if not placed(i, target):
            fitting = [letter for letter in planned if placed(i, letter)]
            target = _next_option(current, fitting, held[i], seconds[i])
            if target is None:
                continue
        sizes[i] = offloaded[i][target]
        letters[i] = target
        plans.append(letters.copy())
    return plans


def _offload_prefix_limit(profile: StepProfile, options: list[dict[str, LayerOption]]) -> int:
    """How many layers from the first the greedy's plans are also tried with offloaded whole (`O`): as many as the
    later layers' forwards can hide the copies of, one more.

    The greedy ranks a layer's actions as if the next layer's backward alone hid its reload (`_own_seconds`), which
    prices `O` out on every layer. With the window the budget leaves after the head, a first layer's reload comes
    back behind all the layers' backward, and its copy went out behind all their forwards: such a prefix can beat
    checkpointing's recompute where the link is fast enough. `simulate_step` judges each such plan, copies queueing
    and window included.
    """
    queued_s, later_forward_s = 0.0, sum(layer.forward_s for layer in profile.layers)
    for i, layer in enumerate(profile.layers[:-1]):
        later_forward_s -= layer.forward_s
        queued_s += options[i]["O"].offloaded / profile.d2h_bytes_per_s
        if queued_s > later_forward_s:
            return i + 1
    return len(profile.layers) - 1


def safe_code(profile: StepProfile, letters_of: str = "Cc") -> str:
    """The safe plan: every layer fully checkpointed (`Cc`; its MLP tiled, `Tt`; or tiled whole, `Ll`), inputs
    offloaded from the first layer on while the host (with a disk tier, the disk too) has room
    (`offload_places`), kept on the device after: what the engine does with a full pinned pool, which a
    plan that offloads every input would not predict."""
    offloaded, kept = letters_of
    inputs = [layer.input_bytes for layer in profile.layers]
    places = offload_places(inputs, profile.host_cap_bytes, profile.disk_cap_bytes)
    return "".join(kept if place is None else offloaded for place in places)


def _simplicity(code: Sequence[str]) -> tuple[int, int, int]:
    """How much a plan changes from keeping every layer, least first: the tiling it uses (none, MLPs, whole layers),
    then its layers that do not keep, then those whose tensors travel to the host."""
    actions = [ACTIONS[letter] for letter in code]
    return _tiling_kind(code), sum(action.action != KEEP for action in actions), sum(action.moves for action in actions)


def _tiling_kind(code: Sequence[str]) -> int:
    """The plan's tiling: `actions.NO_TILING` for an exact plan, `TILED_MLPS` for one that tiles MLPs (`T`, `t`),
    `TILED_LAYERS` for one that tiles whole layers (`L`, `l`), the order in which `choose_plan` turns to them."""
    return max((ACTIONS[letter].tiling for letter in code), default=0)


# The tilings `choose_plan` turns to, in this order, where no plan without them fits (`_tiling_kind` 1 and 2): their
# letters, and whether a profile measured them.
_TILINGS = (("Tt", tiling_available), ("Ll", layer_tiling_available))


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget: even the lowest-memory plan is predicted to peak above it.

    The message names the budget, that peak and what dominates it.

    Attributes:
        budget_bytes: the budget that was asked for.
        minimum_bytes: the smallest budget that works for this step: the lowest plan's peak, plus the margin plans
            keep at that budget for the prediction's error (`smallest_budget`).
        lowest_plan: that lowest-memory plan, for a caller that must run the step anyway (it exceeds the budget).
    """

    def __init__(self, message: str, budget_bytes: int, minimum_bytes: int, lowest_plan: Plan) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.lowest_plan = lowest_plan


def _infeasible(profile: StepProfile, budget_bytes: int, margin_bytes: int, lowest_plan: Plan,
                chosen: Sequence[LayerOption], run: SimulatedStep) -> InfeasibleBudgetError:  # fmt: skip
    """The error for a budget below the lowest-memory plan's peak, with what that peak is made of."""
    code = lowest_plan.code
    minimum = smallest_budget(run.peak_bytes, budget_bytes, margin_bytes)
    static = profile.static_bytes
    if run.peak_phase in ("embeddings", "optimizer"):
        static += profile.gradient_bytes
    elif run.peak_phase == "backward":
        static += gradients_at_backward(profile)[run.peak_layer]
    if run.peak_phase == "head":
        at_peak = ("the head and loss", profile.head_bytes)
    elif run.peak_phase == "embeddings":
        at_peak = ("the gradient of the embeddings' output",
                   late_gradients_bytes(profile) - static - profile.peak_correction_bytes)  # fmt: skip
    elif run.peak_phase == "optimizer":
        at_peak = ("the optimizer step's temporaries", profile.optimizer_bytes)
    else:
        i, option = run.peak_layer, chosen[run.peak_layer]
        in_forward, in_backward = gathered_parameters(profile)
        gathered = in_backward[i] if run.peak_phase == "backward" else in_forward[i]
        working = (option.saved + option.working if run.peak_phase == "backward"
                   else max(option.saved, option.forward_peak)) + gathered  # fmt: skip
        what = "its activations and gradient buffers" + (", parameters FSDP2 gathered" if gathered else "")
        at_peak = (f"layer {i}'s working set ({what})", working)
    correction = profile.peak_correction_bytes
    arguments = profile.call_argument_bytes if run.peak_phase not in ("embeddings", "optimizer") else 0
    parts = [
        ("static memory (parameters, gradients, optimizer state)", static),
        at_peak,
        (
            "the layers' held inputs, reloads and copies in flight",
            run.peak_bytes - static - at_peak[1] - correction - arguments,
        ),
    ]
    if arguments:
        parts.append(("the masks and rotary tables the model gives its layers", arguments))
    if correction:
        parts.append(("what measured plans peaked above their prediction", correction))
    parts.sort(key=lambda part: -part[1])
    (largest_name, largest_bytes), *others = parts
    named = [f"{name} {format_bytes(nbytes)}" for name, nbytes in others]
    rest = " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 2 else named)
    message = (
        f"the memory budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the smallest peak this "
        f"step can reach, {format_bytes(run.peak_bytes)} ({run.peak_bytes} bytes; plan {code!r}, peak at "
        f"{describe_peak(run)}), dominated by {largest_name} {format_bytes(largest_bytes)}, then {rest}"
        + (", with every layer's MLP tiled" if "T" in code or "t" in code else "")
        + (", with every layer tiled whole" if "L" in code or "l" in code else "")
        + (
            f"; plans keep a margin below the budget for the prediction's error, so the smallest budget that works "
            f"is {format_bytes(minimum)} ({minimum} bytes)"
            if minimum != run.peak_bytes
            else ""
        )
        + ". Raise the budget, or shorten the sequences or the batch."
    )
    return InfeasibleBudgetError(message, budget_bytes, minimum, lowest_plan)


def prediction_margin_bytes(budget_bytes: int) -> int:
    """What a plan that never ran keeps below `budget_bytes` for the prediction's error (`PREDICTION_MARGIN`)."""
    return int(budget_bytes * PREDICTION_MARGIN)


def smallest_budget(peak_bytes: int, budget_bytes: int, margin_bytes: int) -> int:
    """The smallest budget under which a predicted peak of `peak_bytes` fits, for a refusal to name.

    Where `margin_bytes` is `prediction_margin_bytes(budget_bytes)`, as the controller keeps it, the margin grows with
    the budget: the named budget's own margin must leave room, or the budget named in a refusal is refused in turn
    (at a budget of 1 byte the margin is 0). Any other margin is a fixed number of bytes.
    """
    if margin_bytes != prediction_margin_bytes(budget_bytes):
        return peak_bytes + margin_bytes
    budget = math.ceil(peak_bytes / (1 - PREDICTION_MARGIN))
    while budget - prediction_margin_bytes(budget) < peak_bytes:
        budget += 1
    while budget - 1 - prediction_margin_bytes(budget - 1) >= peak_bytes:
        budget -= 1
    return budget


# A candidate plan: its letters, one per layer, and its simulation with the widest prefetch window that fits.
_Candidate = tuple[list[str], SimulatedStep]


class _Search:
    """What the stages of one `choose_plan` call share: the profile, each layer's options and the seconds each adds
    on its own (`_own_seconds`), the peak not to exceed, the plans that ran by code and the model's error in time."""

    def __init__(self, profile: StepProfile, budget_bytes: int, margin_bytes: int,
                 measured: Sequence[MeasuredStep]) -> None:  # fmt: skip
        for step in measured:
            check_code(profile, step.code)
        self.profile = profile
        self.budget_bytes = budget_bytes
        self.margin_bytes = margin_bytes
        self.limit = budget_bytes - margin_bytes
        self.by_code = {step.code: step for step in measured}
        self.options = [layer_options(profile, layer) for layer in profile.layers]
        # Those of `_PLANNED` the profile offers (`layer_options`: no selective ones where the model rules them out).
        self.planned = "".join(letter for letter in _PLANNED if letter in self.options[0])
        self.seconds = _own_seconds(profile, self.options)
        self.time_scale = self._model_error_in_time()

    def _model_error_in_time(self) -> float:
        """The measured plans' median ratio of measured to predicted step time, 1 without any: a prediction compared
        with a measurement is scaled by it (a model that over-predicts every step would otherwise lose every
        comparison to a measurement)."""
        ratios = [step.step_s / run.step_s for step in self.by_code.values()
                  if step.step_s is not None and (run := self.run_of(step.code)).step_s > 0]  # fmt: skip
        return statistics.median(ratios) if ratios else 1.0

    def options_of(self, letters: Sequence[str]) -> list[LayerOption]:
        return [layer[letter] for layer, letter in zip(self.options, letters)]

    def run_of(self, letters: Sequence[str]) -> SimulatedStep:
        return simulate_step(self.profile, self.options_of(letters), limit=self.limit)

    def candidate(self, code: Sequence[str]) -> _Candidate:
        letters = list(code)
        return letters, self.run_of(letters)

    def fits(self, run: SimulatedStep) -> bool:
        """Whether the model fits the plan: its predicted peak within the budget less the margin, what it offloads
        within the host cap (and the disk tier's room)."""
        return run.peak_bytes <= self.limit and not run.unplaced_bytes

    def as_plan(self, letters: Sequence[str], run: SimulatedStep) -> Plan:
        code = "".join(letters)
        return Plan(
            budget_bytes=self.budget_bytes,
            tokens=self.profile.tokens,
            predicted=prediction_of(code, self.options_of(code), run),
            host_cap_bytes=self.profile.host_cap_bytes,
            disk_cap_bytes=self.profile.disk_cap_bytes,
            measured=self.by_code.get(code),
            **chunk_sizes(self.profile, code),
            time_scale=self.time_scale,
        )

    def admissible(self, candidate: _Candidate) -> bool:
        """Whether the plan fits by its measured peak where it ran (`Plan.fits`), else by the model, and the host has
        room for what it offloads."""
        letters, run = candidate
        return self.as_plan(letters, run).fits(self.margin_bytes) and not run.unplaced_bytes

    def fastest(self, candidates: list[_Candidate]) -> Plan:
        """The fastest plan, or where a measured one is within `STEP_TIME_NOISE` of it, the simplest of those."""
        plans = sorted((self.as_plan(*candidate) for candidate in candidates), key=lambda plan: plan.expected_step_s)
        close = [plan for plan in plans if plan.expected_step_s <= plans[0].expected_step_s * (1 + STEP_TIME_NOISE)]
        if not any(plan.time_measured for plan in close):
            return plans[0]
        return min(close, key=lambda plan: _simplicity(plan.code))

    def measured_candidates(self, tiling_kind: int) -> list[_Candidate]:
        """The plans that ran with this `_tiling_kind` that are admissible, in the order they were given."""
        candidates = (self.candidate(code) for code in self.by_code if _tiling_kind(code) == tiling_kind)
        return [candidate for candidate in candidates if self.admissible(candidate)]

    def fastest_exact(self, lowest: _Candidate, measured: list[_Candidate]) -> Plan:
        """Where the lowest-memory exact plan fits: the fastest of the greedy's first fitting plan, its best plan with
        the first layers offloaded whole and `lowest`, each polished, and the `measured` plans.

        A plan the model fits that measured over the budget is no candidate; the polished lowest-memory plan stays
        one whatever it measured, the last resort.
        """
        others = [*measured]
        greedy = self.first_fitting(_greedy_plans(self.profile, self.options, self.seconds, self.planned))
        if greedy is not None:
            others.append(self.polish(*greedy))
        if "O" in self.planned:
            in_place = _greedy_plans(self.profile, self.options, self.seconds, planned=self.planned.replace("O", ""))
            offloaded_first = self.fastest_offload_prefix(in_place, _offload_prefix_limit(self.profile, self.options))
            if offloaded_first is not None:
                others.append(self.polish(*offloaded_first))
        return self.fastest([self.polish(*lowest), *filter(self.admissible, others)])

    def fastest_tiled(self, lowest: _Candidate, measured_only: bool) -> tuple[Plan | None, _Candidate]:
        """Where no exact plan fits: the MLPs tiled, then (slower, and lower at long context) whole layers tiled, each
        kind only where the one before does not fit, by measurement or by the model.

        The model's plan of a kind starts from its lowest-memory plan, and polishing moves the layers that can do
        without to faster actions (a layer tiled whole may go back to a tiled MLP, or to an exact action). Its plan
        and the measured ones of the kind compete by their expected times, as exact plans do: a measured plan that
        tiles every layer must not shut out the model's plan that tiles two (dynamic padding on an H200, 1% above
        the minimum: the plan for 5,167 tokens stayed `L` x 16 at 0.98 s a step after the loop had replaced it at
        6,144 tokens by `LLTCCCCCCCcccccc` at 0.19-0.5 s).

        Returns:
            The plan, or None where no tiling fits; and the lowest-memory plan of `lowest` and those tried, for the
            refusal to name (tiling can cost memory).
        """
        planned = self.planned
        for kind, (letters, available) in enumerate(_TILINGS, start=1):
            measured_here = self.measured_candidates(tiling_kind=kind)
            if not available(self.profile) or (measured_only and measured_here):
                if measured_here:
                    return self.fastest(measured_here), lowest
                continue
            planned += letters
            tiled = self.candidate(safe_code(self.profile, letters))
            if self.fits(tiled[1]):
                polished = self.polish(*tiled, planned=planned)
                # One that measured over the budget is no candidate, unless nothing else is (as before measurements).
                return self.fastest([*measured_here, *filter(self.admissible, [polished])] or [polished]), lowest
            if measured_here:
                return self.fastest(measured_here), lowest
            if memory_order(self.profile, "".join(tiled[0])) < memory_order(self.profile, "".join(lowest[0])):
                lowest = tiled
        return None, lowest

    def refusal(self, lowest: _Candidate) -> InfeasibleBudgetError:
        """The error for a budget that no plan fits, naming `lowest`, the lowest-memory plan (`_infeasible`).

        A measured plan that peaked below the smallest budget the lowest-memory plan needs (over this budget, or it
        would have been chosen) is the smallest budget known to work: the error names it instead.
        """
        letters, run = lowest
        error = _infeasible(self.profile, self.budget_bytes, self.margin_bytes, self.as_plan(letters, run),
                            self.options_of(letters), run)  # fmt: skip
        met = min((step for step in self.by_code.values() if step.peak_bytes is not None),
                  key=lambda step: step.peak_bytes, default=None)  # fmt: skip
        if met is not None and met.peak_bytes < error.minimum_bytes:
            return InfeasibleBudgetError(f"{error} Measured, plan {met.code!r} peaked at "
                                         f"{format_bytes(met.peak_bytes)} ({met.peak_bytes} bytes): the smallest "
                                         "budget known to work.",
                                         self.budget_bytes, met.peak_bytes, error.lowest_plan)  # fmt: skip
        return error

    def first_fitting(self, plans: list[list[str]]) -> _Candidate | None:
        """The first of the greedy's plans that fits, by binary search: their peak falls from one to the next (all
        but always monotonically; whatever the search returns was checked by the simulation)."""
        low, high, found = 0, len(plans) - 1, None
        while low <= high:
            middle = (low + high) // 2
            run = self.run_of(plans[middle])
            if self.fits(run):
                found, high = (plans[middle], run), middle - 1
            else:
                low = middle + 1
        return found

    def fastest_offload_prefix(self, plans: list[list[str]], most_layers: int) -> _Candidate | None:
        """The fastest first fitting plan among the greedy's `plans` with their first 1, 2, ... `most_layers` layers
        offloaded whole (`O`). None if no such plan fits."""
        best = None
        for prefix in range(1, most_layers + 1):
            found = self.first_fitting([["O"] * prefix + letters[prefix:] for letters in plans])
            if found is not None and (best is None or found[1].step_s < best[1].step_s):
                best = found
        return best

    def polish(self, letters: list[str], run: SimulatedStep, planned: str | None = None) -> _Candidate:
        """Moves each layer, once, to the first action that still fits and makes the step faster.

        A layer tries the actions of `planned` (by default the exact ones the profile allows) no dearer on their own
        than its current one, cheapest first (ties included: an input kept rather than offloaded costs the same
        recompute and no copy). The layers that could save the most go first; on ties the last first, whose changes
        freed memory for the fewest points of the step.
        """
        planned = planned or self.planned
        seconds = self.seconds
        order = sorted(
            range(len(letters)),
            key=lambda i: (min(seconds[i][letter] for letter in planned) - seconds[i][letters[i]], -i),
        )
        for i in order:
            current_s = seconds[i][letters[i]]
            alternatives = sorted(
                (letter for letter in planned if letter != letters[i] and seconds[i][letter] <= current_s),
                key=lambda letter: seconds[i][letter],
            )
            for letter in alternatives:
                trial = letters.copy()
                trial[i] = letter
                trial_run = self.run_of(trial)
                if self.fits(trial_run) and trial_run.step_s < run.step_s:
                    letters, run = trial, trial_run
                    break
        return letters, run


def choose_plan(profile: StepProfile, budget_bytes: int, margin_bytes: int = 0, measured: Sequence[MeasuredStep] = (),
         measured_only: bool = False) -> Plan:  # fmt: skip
    """The per-layer actions with the shortest predicted step whose predicted peak fits the budget.

    Greedy, then polished. The greedy changes one layer at a time from keeping everything, taking first the
    changes that free the most bytes per second they add (see `_greedy_plans`); a binary search finds the first of
    its plans that fits. Polishing moves each layer, one at a time, to the cheapest action that still fits if that
    makes the step faster, which undoes changes the peak did not need (a change frees memory only for the points
    of the step after its layer). The greedy ranks a layer's whole offload (`O`) as if its reload had one layer's
    backward to hide behind, which prices it out; so its plans are also tried with the first layers offloaded whole
    (as many as the forward can hide the copies of) and the rest kept in place (`_Search.fastest_offload_prefix`), where
    the prefetch window lets their reloads come back behind every later layer's backward. The greedy's plan, the
    best such plan and the lowest-memory plan are polished, and the fastest wins: the result is never slower than
    the lowest-memory plan. Every candidate is judged by `simulate_step` with the widest prefetch window that fits,
    so the plan never exceeds the budget. About 15 simulations per layer at most, each linear in the layers. The
    selective offload (`X`) is not chosen (see `_PLANNED`).

    Tiled MLPs (`T`, `t`) are not exact, so they are chosen only when no plan without them fits (and the profile
    measured them, see `tiling_available`): then every layer starts fully checkpointed with its MLP tiled, and
    polishing moves each layer that can do without back to a faster action. Layers tiled whole (`L`, `l`, see
    `layer_tiling_available`), not exact either and slower, come only after that: when no plan with tiled MLPs
    fits either, every layer starts tiled whole, and polishing moves each layer that can do without to a tiled MLP
    or an exact action.

    A heuristic: on uniform layers it matches an exhaustive search (see the tests); with layers of different
    sizes and slow links, where copies queue behind each other, it can miss the fastest plan by a few percent.

    Plans that ran (`measured`) are measurements, and a measurement beats the model: a measured plan fits if its
    measured peak is within the budget (the margin is for predictions), and is as fast as it measured. Where a
    measured plan's time is within `STEP_TIME_NOISE` of the fastest candidate's, that is noise, and the simplest of
    the plans that close wins (`_simplicity`: keeping every layer before any other). So the result is never slower
    than the fastest measured plan that fits by more than the noise, and a budget that a measured plan met is
    never refused (a plan without tiling that fits by measurement beats tiling). The plans that never ran are
    compared with them by their predictions scaled by the model's error in time (`Plan.time_scale`).

    Args:
        profile: the measured step.
        budget_bytes: the budget for the step's peak, in bytes.
        margin_bytes: how far below the budget the predicted peak must stay (for the prediction's error); the
            controller's is `prediction_margin_bytes(budget_bytes)`, which a refusal counts at the budget it names
            (`smallest_budget`).
        measured: plans that ran, with their measurements at `profile`'s tokens (see `MeasuredStep.scaled`).
        measured_only: the fastest of the measured exact plans that fit, if any fits: for a closed loop's last
            correction, after which a plan the model proposes would never be measured.

    Returns:
        The plan. When keeping everything fits, every layer keeps.

    Raises:
        InfeasibleBudgetError: if even the lowest-memory plan (every layer fully checkpointed, its MLP tiled or the
            whole layer tiled where that is available, inputs offloaded as far as the host cap allows) does not fit,
            nor does any measured plan: the message names its peak (the lowest of the untiled and tiled plans': on a
            7B shape at 8K tokens in two chunks, tiling measured higher), what dominates it, and the budget; the
            error carries that plan.
        ValueError: `budget_bytes` is not an int > 0.

    Example:
        >>> from hf_offload.memory_budget.profile import LayerProfile, StepProfile
        >>> from hf_offload.memory_budget.simulate import simulate
        >>> from hf_offload.units import GIB
        >>> layer = LayerProfile(saved_bytes=2 * GIB, selective_bytes=GIB, input_bytes=GIB // 16, forward_s=0.005,
        ...                      backward_s=0.010, selective_recompute_s=0.002)
        >>> profile = StepProfile(layers=[layer] * 4, static_bytes=8 * GIB, head_bytes=GIB,
        ...                       backward_working_bytes=2 * GIB, head_s=0.04, other_s=0.03, d2h_bytes_per_s=55e9,
        ...                       h2d_bytes_per_s=55e9, host_cap_bytes=64 * GIB, tokens=16384)
        >>> simulate(profile, "KKKK").peak_bytes / GIB
        18.0
        >>> choose_plan(profile, 16 * GIB).code
        'SSSK'
        >>> round(choose_plan(profile, 16 * GIB).predicted.step_s, 3)
        0.136
    """
    if not is_int(budget_bytes) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be an int > 0, got {budget_bytes!r}")
    search = _Search(profile, budget_bytes, margin_bytes, measured)
    # Tiling is not exact: a measured plan that tiles is a candidate only where no exact plan fits (and one that tiles
    # whole layers only where no plan with tiled MLPs fits either, see `_Search.fastest_tiled`).
    exact_measured = search.measured_candidates(tiling_kind=0)
    if measured_only and exact_measured:
        return search.fastest(exact_measured)
    keep_all = search.candidate("K" * len(profile.layers))
    if search.admissible(keep_all):  # nothing is faster, unless it measured slower than a measured plan
        return search.fastest([keep_all, *exact_measured])
    lowest = search.candidate(safe_code(profile))
    if search.fits(lowest[1]):
        return search.fastest_exact(lowest, exact_measured)
    if exact_measured:  # the model over-predicts a peak that a measurement met
        return search.fastest(exact_measured)
    tiled, lowest = search.fastest_tiled(lowest, measured_only)
    if tiled is None:
        raise search.refusal(lowest)
    return tiled


def plan_of(profile: StepProfile, code: str, budget_bytes: int, margin_bytes: int = 0) -> Plan:
    """The plan `code` as `choose_plan` would make it, for a plan it did not choose (a closed loop's trial): its
    prediction with the widest prefetch window that keeps the peak within the budget less the margin.

    Raises:
        ValueError: `code` does not have one valid letter per layer, or `budget_bytes` is not an int > 0.
    """
    if not is_int(budget_bytes) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be an int > 0, got {budget_bytes!r}")
    check_code(profile, code)
    options = code_options(profile, code)
    run = simulate_step(profile, options, limit=budget_bytes - margin_bytes)
    return Plan(budget_bytes=budget_bytes, tokens=profile.tokens, predicted=prediction_of(code, options, run),
                host_cap_bytes=profile.host_cap_bytes, disk_cap_bytes=profile.disk_cap_bytes,
                **chunk_sizes(profile, code))  # fmt: skip
