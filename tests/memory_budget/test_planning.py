"""Plans made and put in force (`memory_budget/planning.py`), end to end in CPU test mode: the profiled steps' plan
and a long first step's, the first plan, budgets below every plan (refused, or run on the lowest-memory plan with a
warning), the longest step known ahead, re-plans for longer steps and the plans kept by length, tiled MLPs and whole
layers planned only where nothing else fits, the safe plan's measured peak and the engine's tail a plan counts, and
host memory: the pinned pool grown past its cap only where no plan fits within it, or the disk tier under it. Exact
arithmetic throughout, where no tiling sums in chunks."""

import dataclasses
import logging
import re
from types import SimpleNamespace

import pytest
import torch
import transformers
from budget_runs import (
    LAYERS,
    VOCAB,
    Unchanged,
    assert_bitwise_equal,
    long_run,
    planned,
    planned_minimum,
    profiled_steps_over_the_budget,
    tiled_forwards,
    tiled_whole,
    tiny_llama,
    train,
)
from step_comparisons import relative_difference

from hf_offload import InfeasibleBudgetError, get_act_offloading_ctx_manager
from hf_offload.host_memory import HostMemory
from hf_offload.memory_budget import controller as controller_module
from hf_offload.memory_budget import measurements, probes
from hf_offload.memory_budget import profiled_steps as profiled_steps_module
from hf_offload.memory_budget.search import plan_of, prediction_margin_bytes, safe_code
from hf_offload.memory_budget.simulate import simulate
from hf_offload.units import format_bytes


@pytest.fixture(scope="module")
def baseline() -> list[torch.Tensor]:
    first = train(tiny_llama(), Unchanged())
    assert_bitwise_equal(first, train(tiny_llama(), Unchanged()))  # it repeats: the comparisons mean something
    return first


def test_a_generous_budget_keeps_everything_and_is_exact(baseline):
    results, context = planned(10 * 2**30)
    assert context.memory_plan.code == "K" * LAYERS
    assert_bitwise_equal(results, baseline)
    # A plan that moves nothing: the engine stands aside; a region entered then pushes no saved-tensor hooks, and
    # its step is counted as one stood aside.
    stats = context.get_stats()
    assert context.standing_aside == "planned" and stats["bytes_offloaded"] == 0
    assert stats["steps_stood_aside_planned"] == 1 and stats["tensors_kept_planned"] == 0


def test_a_tight_budget_gets_a_mixed_plan_that_fits_and_is_exact(baseline):
    _, roomy = planned(10 * 2**30)
    keep_all = roomy.memory_plan.predicted.peak_bytes
    lowest = planned_minimum()
    budget = (keep_all + lowest) // 2
    results, context = planned(budget)
    plan = context.memory_plan
    assert plan.predicted.peak_bytes <= budget and plan.code != "K" * LAYERS
    assert_bitwise_equal(results, baseline)


def test_a_budget_below_every_plan_is_a_clear_error_before_the_planned_step(caplog):
    """The profiled steps run the safe plan over such a budget, and the log says so and why nothing lower ran (here
    the steps are shorter than a tile's chunk), before the planned step's clear error."""
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget="1KiB")
    ids = torch.randint(VOCAB, (2, 16))
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        for _ in range(2):  # the profiled steps run under the safe plan
            with context:
                model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)  # gradients held would be micro-steps accumulating: no plan until a step
    said = [record.getMessage() for record in caplog.records if "the profiled steps run plan" in record.getMessage()]
    assert len(said) == 2 and all(message.startswith(f"hf_offload: the profiled steps run plan {'C' * LAYERS!r}, "
                                                     "made for their 32 tokens and predicted to peak at ")
                                  and "over it, the lowest plan the model knows of" in message
                                  for message in said)  # fmt: skip
    with pytest.raises(InfeasibleBudgetError) as error, context:
        model(input_ids=ids, labels=ids)
    assert str(error.value).startswith("the memory budget of 1.00 KiB (1024 bytes) is below the smallest peak")


def test_the_smallest_budget_a_refusal_names_fits_a_fresh_run_from_its_first_step(baseline, caplog):
    """The refusal is made from the profiled steps' measurements; a run started at the budget it names plans its own
    profiled steps from the probes alone, which predict more (every gradient counted as backward reaches the first
    layer, the embeddings' too). At the measured minimum (here 1.7% below), those steps ran a plan the library
    predicted to peak over the budget. The budget named is one at which a fresh run is predicted to fit from its
    first step, and no smaller: one byte less and the profiled steps are predicted over it again."""
    with pytest.raises(InfeasibleBudgetError) as refused:
        planned(1)
    minimum = refused.value.minimum_bytes
    assert minimum > refused.value.lowest_plan.predicted.peak_bytes and f"({minimum} bytes)" in str(refused.value)
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        results, context = planned(minimum)
    assert profiled_steps_over_the_budget(caplog.records) == []
    assert context.memory_plan.fits(prediction_margin_bytes(minimum))
    assert_bitwise_equal(results, baseline)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        planned(minimum - 1)
    assert len(profiled_steps_over_the_budget(caplog.records)) == 2


def test_a_later_longer_step_that_no_plan_fits_runs_on_the_lowest_plan_with_one_warning(caplog):
    """Four steps of 16 tokens, then one of 24 and one of 32, under a budget just above the smallest that fits 16
    tokens: the longer steps run on the lowest-memory plan, exactly, with one warning naming the first of them."""
    lengths = (16, 16, 16, 16, 24, 32)
    baseline = train(tiny_llama(), Unchanged(), steps=len(lengths), lengths=lengths)
    assert_bitwise_equal(baseline, train(tiny_llama(), Unchanged(), steps=len(lengths), lengths=lengths))
    budget = int(planned_minimum() * 1.006)  # the plans' margin (0.5% of the budget) included
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        results = train(model, context, steps=len(lengths), lengths=lengths)
    assert_bitwise_equal(results, baseline)
    over = [record for record in caplog.records if "It runs on the lowest-memory plan" in record.getMessage()]
    assert [record.levelno for record in over] == [logging.WARNING, logging.INFO]  # the second is only logged
    message = over[0].getMessage()
    assert f"memory_budget={budget} ({budget} bytes) at training forward 5: 48 tokens" in message
    plan = context.memory_plan
    assert (plan.code, plan.tokens) == ("C" * LAYERS, 2 * 32)
    assert plan.predicted.peak_bytes > budget


# The longest step known ahead (`memory_budget_max_tokens`, or a trainer's `max_length`)


def test_a_known_longest_step_that_no_plan_fits_is_an_error_at_the_first_plan():
    """A budget just above the smallest that fits 16 tokens a sequence, in a run whose longest step the user put at
    2 x 32 tokens: no plan fits that, so the first plan refuses it (the two profiled steps ran; no planned one), naming
    the length and where it came from, and the smallest budget that fits it; without the option the same run trains
    on until a step that long comes (`test_a_later_longer_step_...`)."""
    budget = int(planned_minimum() * 1.006)  # the plans' margin (0.5% of the budget) included
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget,
                                             memory_budget_max_tokens=2 * 32)  # fmt: skip
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(InfeasibleBudgetError) as refused:
        train(model, context, steps=4, lengths=(16,))
    message = str(refused.value)
    assert message.startswith("hf_offload: memory_budget: the longest step this run may see, 64 tokens "
                              "(memory_budget_max_tokens), fits no plan: ")  # fmt: skip
    assert "lower memory_budget_max_tokens" in message
    # The two profiled forwards ran; the third was refused as it started (the controller's hook runs before ours).
    assert refused.value.minimum_bytes > budget and len(forwards) == 2
    assert refused.value.lowest_plan.tokens == 2 * 32
    # A budget that fits that step: nothing refused, and the plans are those of the run without the option
    roomy = int(refused.value.minimum_bytes * 1.01)

    def run(max_tokens: int | None) -> tuple[list, list[torch.Tensor]]:
        model = tiny_llama()
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=roomy,
                                                 memory_budget_max_tokens=max_tokens)  # fmt: skip
        in_force = []

        def record() -> None:
            in_force.append(context.memory_plan and context.memory_plan.code)

        return in_force, train(model, context, steps=6, lengths=(16, 16, 16, 16, 32, 16), after_step=record)

    without, known = run(None), run(2 * 32)
    assert without[0] == known[0] and without[0][-1] is not None
    assert_bitwise_equal(without[1], known[1])


def test_a_longest_step_from_a_trainers_config_that_no_plan_fits_is_a_warning_and_training_goes_on(caplog):
    """The Trainer's callback passes a TRL config's `per_device_train_batch_size x max_length`
    (`expect_longest_step`): where no plan fits it, one warning at the first plan names it and where it came from,
    and the run trains on, exactly; a length shorter than the profiled steps' is no check at all."""
    lengths = (16, 16, 16, 16, 16)
    baseline = train(tiny_llama(), Unchanged(), steps=len(lengths), lengths=lengths)
    budget = int(planned_minimum() * 1.006)
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
    context.budget_controller.expect_longest_step(2 * 32, "per_device_train_batch_size 2 x max_length 32 of SFTConfig")
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        results = train(model, context, steps=len(lengths), lengths=lengths)
    assert_bitwise_equal(results, baseline)
    warned = [record for record in caplog.records if "the longest step this run may see" in record.getMessage()]
    assert [record.levelno for record in warned] == [logging.WARNING]
    assert "64 tokens (per_device_train_batch_size 2 x max_length 32 of SFTConfig), fits no plan" in (
        warned[0].getMessage()
    )
    assert context.memory_plan.tokens == 2 * 16  # the plan is the profiled steps' as ever
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
    context.budget_controller.expect_longest_step(2 * 8, "shorter than the profiled steps")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        assert_bitwise_equal(train(model, context, steps=len(lengths), lengths=lengths), baseline)
    assert not any("the longest step this run may see" in record.getMessage() for record in caplog.records)


def near_the_minimum(lengths: tuple[int, ...], caplog) -> SimpleNamespace:
    """Dynamic padding: training on `lengths` (a sequence length a step) under a budget just above the smallest that
    fits 16 tokens a sequence, the plans' margin (0.5% of the budget) included; exactly as without the library. The
    model, its context, the budget, the plan in force after each step and the log's messages."""
    baseline = train(tiny_llama(), Unchanged(), steps=len(lengths), lengths=lengths)
    budget = int(planned_minimum() * 1.006)
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
    in_force = []
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        results = train(model, context, steps=len(lengths), lengths=lengths,
                        after_step=lambda: in_force.append(context.memory_plan))  # fmt: skip
    assert_bitwise_equal(results, baseline)
    return SimpleNamespace(model=model, context=context, budget=budget, in_force=in_force,
                           messages=[record.getMessage() for record in caplog.records])  # fmt: skip


def test_after_a_step_that_no_plan_fits_the_shorter_steps_run_the_plan_that_fits_them_again(caplog):
    """Dynamic padding: steps of 16 tokens a sequence, then one of 32 that no plan fits, under a budget just above the
    smallest that fits 16. The step of 32 runs on its lowest-memory plan (one warning), the next ones of 16 on the
    plan made for them, which fits, and a second step of 32 on that lowest plan again, without planning anew;
    exactly (on an H200, the lowest plan stayed in force after such a step, and shorter steps that a plan fitted ran
    over the budget)."""
    run = near_the_minimum((16, 16, 16, 16, 32, 16, 16, 32, 16), caplog)
    assert [None if plan is None else plan.tokens for plan in run.in_force] == [None, None, 32, 32, 64, 32, 32, 64, 32]
    messages = run.messages
    assert sum("It runs on the lowest-memory plan" in message for message in messages) == 1
    assert sum(message.startswith("hf_offload: memory budget") for message in messages) == 2  # two plans made
    again = [message for message in messages if "is in force again" in message]
    assert len(again) == 3 and all("made for 32" in m for m in again[::2]) and "made for 64" in again[1], again


def test_shorter_steps_get_a_plan_of_their_own_that_keeps_more_and_longer_ones_the_plan_made_for_them_again(caplog):
    """Dynamic padding under a budget just above the smallest that fits the profiled length: the plan made for it
    checkpoints layers that a step of half the tokens need not (on an H200 such steps ran tiled, 2-4x slower than
    plain checkpointing, which fitted them). A step a length step or more shorter than every plan gets a plan for its
    length step, which keeps more; the longer steps run the plan made for them again without planning anew, and the
    shorter steps theirs; the trial of plain checkpointing runs its steps first whatever their length. Exactly, and
    every plan predicted under the budget."""
    run = near_the_minimum((16, 16, 16, 16, 8, 8, 16, 8, 12), caplog)
    in_force, budget, messages = run.in_force, run.budget, run.messages
    # Two sequences a step: 32 tokens at 16, 16 at 8 and 24 at 12, whose length step above is 32 * 2**-0.25.
    assert [None if plan is None else plan.tokens for plan in in_force] == [None, None, 32, 32, 32, 16, 32, 16, 27]
    assert in_force[4].trial and not in_force[5].trial
    long_plan, short_plan = in_force[6], in_force[5]
    assert short_plan.code.count("K") > long_plan.code.count("K")
    assert in_force[7] is short_plan  # kept, not planned anew
    assert all(plan.predicted.peak_bytes <= budget for plan in in_force[2:])
    assert not any("It runs on the lowest-memory plan" in message for message in messages)
    assert sum(message.startswith("hf_offload: memory budget") for message in messages) == 4  # trial, 32, 16, 27
    again = [message for message in messages if "is in force again" in message]
    assert again == [
        f"hf_offload: a step of 32 tokens: plan {long_plan.code!r}, made for 32, is in force again",
        f"hf_offload: a step of 16 tokens: plan {short_plan.code!r}, made for 16, is in force again",
    ]
    # Once what the controller knows changes (a correction, the trial's end, memory held that grew, a step above its
    # plan's prediction), the plans kept from before are made again rather than reused.
    run.context.budget_controller.planner.generation += 1
    train(run.model, run.context, steps=2, lengths=(16, 8))
    assert run.context.memory_plan.tokens == 16 and run.context.memory_plan is not short_plan


def test_a_longer_step_is_planned_for_before_its_layers_run():
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
    train(model, context, steps=5, lengths=(16, 16, 16, 16, 32))
    assert context.memory_plan.tokens == 2 * 32


def test_a_plan_that_moves_nothing_stands_aside_until_a_longer_step_needs_offloading():
    """Under a plan that keeps every layer, a step's region pushes no saved-tensor hooks (autograd calls no Python per
    saved tensor). A longer step that the plan no longer fits re-plans from a layer's pre-hook, inside such a region:
    the hooks are pushed there, and that very step offloads, exactly."""
    lengths = (16, 16, 16, 16, 24, 24)
    baseline = train(tiny_llama(), Unchanged(), steps=len(lengths), lengths=lengths)
    _, roomy = planned(10 * 2**30)
    model = tiny_llama()
    # 20% above keeping every layer at 16 tokens: a plan that moves some layers' activations fits 24 (the MLP is not
    # tiled, which would be exact only within rounding).
    budget = int(roomy.memory_plan.predicted.peak_bytes * 1.2)
    context = get_act_offloading_ctx_manager(model, device_type="cpu", tile_mlp=False, memory_budget=budget)
    steps = []
    results = train(model, context, len(lengths), lengths, after_step=lambda: steps.append(context.get_stats()))
    assert_bitwise_equal(results, baseline)
    assert steps[3]["steps_stood_aside_planned"] == 1 and steps[3]["bytes_offloaded"] == 0
    assert steps[4]["steps_stood_aside_planned"] == 0 and steps[4]["bytes_offloaded"] > 0
    assert context.standing_aside is None and context.memory_plan.code != "K" * LAYERS


# Tiled MLPs: planned only when nothing else fits


def test_tiling_is_planned_when_no_exact_plan_fits_and_is_close():

    baseline, roomy, seen, _ = long_run(10 * 2**30)
    assert not set(roomy.memory_plan.code) & set("Tt") and not any(map(any, seen))
    profile = roomy.budget_controller.profile
    assert profile.tile_tokens == 64 and profile.tokens == 128
    untiled, tiled = (simulate(profile, letter * LAYERS).peak_bytes for letter in "CT")
    assert tiled < untiled
    budget = (tiled + untiled) // 2
    results, context, seen, model = long_run(budget)
    plan = context.memory_plan
    assert set(plan.code) & set("Tt") and plan.tile_tokens == 64 and plan.predicted.peak_bytes <= budget
    # The profiled steps are predicted not to fit untiled either: they run the plan made for their tokens, which tiles
    # (the probe runs before the layers). The planned ones tile the layers the plan says, no more.
    assert seen[0] == seen[1] and any(seen[0]) and seen[2:] == [[letter in "Tt" for letter in plan.code]] * 2
    for a, b in zip(results, baseline):  # summed chunk by chunk: close, not bitwise
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    context.remove_hooks()
    assert tiled_forwards(model) == [False] * LAYERS

    with pytest.raises(ValueError, match="below the smallest peak"):  # the same budget, tiling switched off
        long_run(budget, tile_mlp=False, tile_layer=False)


def test_the_second_profiled_step_is_tiled_when_the_memory_held_since_the_first_leaves_no_room_untiled():
    """The profiled steps' plan is decided in the first step, before the optimizer makes its state, and again as the
    second begins (on an H200, 16 layers of S1's shape with AdamW: the first step peaked at 8.29 GiB, the second at
    8.92, over a budget of 8.80 that a tiled plan met). The CPU test mode counts parameters and gradients as the
    memory held: gradients kept from the first step (accumulated into) stand for the optimizer's state here. The
    budget fits plain checkpointing without them and tiled MLPs with them, not plain checkpointing with them."""

    def keep_gradients_once(model):
        done = []

        def after_step():
            if not done:
                done.append(True)
                for parameter in model.parameters():
                    parameter.grad = torch.zeros_like(parameter)

        return after_step

    def run(budget):
        model = tiny_llama()
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget, tile_layer=False)
        seen = []
        model.model.norm.register_forward_pre_hook(lambda *_: seen.append(tiled_forwards(model)))
        train(model, context, steps=3, lengths=(64,), after_step=keep_gradients_once(model))
        return context, seen

    roomy, _ = run(10 * 2**30)
    # Planned in the third step with every gradient held, as a step that began with gradients held makes plans
    # (gradient accumulation); the first step, before any were held, creates them in backward.
    held = roomy.budget_controller.profile
    sized = roomy.budget_controller.held_memory.sized_parameters()
    gradients = sum(nbytes for ref, nbytes in sized if ref().requires_grad)
    assert held.gradient_bytes == 0
    profile = dataclasses.replace(held, static_bytes=held.static_bytes - gradients, gradient_bytes=gradients)
    first, second, second_tiled = (simulate(p, letter * LAYERS).peak_bytes for p, letter in
                                   ((profile, "C"), (held, "C"), (held, "T")))  # fmt: skip
    budget = max(first, second_tiled) + 1
    assert budget < second, (first, second, second_tiled)
    _, seen = run(budget)
    assert seen[:2] == [[False] * LAYERS, [True] * LAYERS]


def test_layers_are_tiled_whole_when_nothing_else_fits(monkeypatch):
    """A budget between the lowest plan with tiled MLPs and the lowest with whole layers tiled: the profiled steps run
    the plan made for their tokens, which tiles the first layer whole, from the first step's first layer on, from whose
    pre-hook it was applied; the plan then tiles whole the layers that cannot do without (the first ones, whose backward
    comes last) and polishes the others back to faster actions. The predicted peak keeps under the budget, and the
    losses stay within the tiled layer's tolerance of the untiled run (fp32: 1e-5 of each tensor's largest value), not
    bitwise. Without the action, the same budget is refused."""
    from hf_offload.memory_budget.simulate import simulate
    from hf_offload.tiled.layer_op import _TiledLayerFunction

    baseline, roomy, seen, _ = long_run(10 * 2**30, record=tiled_whole)
    assert roomy.memory_plan.code == "K" * LAYERS and not any(map(any, seen))
    profile = roomy.budget_controller.profile
    assert profile.layer_tile_tokens == profile.tile_tokens == 64 and profile.tokens == 128
    untiled, mlps, whole = (simulate(profile, letter * LAYERS).peak_bytes for letter in "CTL")
    assert whole < mlps < untiled
    budget = (whole + mlps) // 2
    calls = []
    monkeypatch.setattr(_TiledLayerFunction, "apply", lambda *args, apply=_TiledLayerFunction.apply: calls.append(1)
                        or apply(*args))  # fmt: skip
    results, context, seen, model = long_run(budget, record=tiled_whole)
    plan = context.memory_plan
    whole_layers = [letter in "Ll" for letter in plan.code]
    assert plan.code.startswith("L") and not all(whole_layers), plan.code
    assert plan.layer_tile_tokens == 64 and plan.predicted.peak_bytes <= budget
    # The tiled layers of each step, the first step's first layer too; and the probe, in chunks of a half and a
    # quarter of the tokens, `_PROBE_RUNS` times each.
    assert seen[0] == seen[1] and seen[0][0] and seen[2:] == [whole_layers] * 2
    assert len(calls) == sum(map(sum, seen)) + 2 * probes._PROBE_RUNS
    # The rest of the step is what the profiled step's time leaves beyond the model of the plan it ran, tiled here:
    # against `C`'s model the tiling's own time counted as the rest of every plan's step.
    controller = context.budget_controller
    controller.profiled_steps.measured.step_s = 10.0  # a step longer than either model: nothing clamped to zero
    profile = controller.profiled_steps.profile_now(controller.profiled_steps.measured.step_tokens)
    untimed = dataclasses.replace(profile, other_s=0.0)
    ran = controller.profiled_steps.measured.safe_code
    assert ran[0] in "Ll" and simulate(untimed, ran).step_s != simulate(untimed, "C" * LAYERS).step_s
    assert profile.other_s == pytest.approx(10.0 - simulate(untimed, ran).step_s)
    assert f"{sum(whole_layers)} layers run whole in chunks of 64 tokens" in plan.format_table()
    losses, steps = results[:4], len(results[:4])
    assert all(relative_difference(a, b) <= 1e-5 for a, b in zip(losses, baseline[:steps]))
    # The last step's gradients, after three AdamW steps whose normalised updates carry the earlier steps' rounding
    # into the weights. Measured: at most 4e-5 of a tensor's largest value on the CPU this was written on, 1.7e-4 on
    # an AMD EPYC (its kernels round otherwise); a tiling that was wrong would be off by the gradients' own scale.
    assert all(relative_difference(a, b) <= 1e-3 for a, b in zip(results[steps:], baseline[steps:]))
    assert not all(torch.equal(a, b) for a, b in zip(results, baseline))  # summed chunk by chunk: not bitwise
    context.remove_hooks()
    assert tiled_whole(model) == [False] * LAYERS

    with pytest.raises(InfeasibleBudgetError, match="with every layer's MLP tiled"):  # the action switched off
        long_run(budget, tile_layer=False)
    with pytest.raises(InfeasibleBudgetError, match="with every layer tiled whole") as error:  # below every plan
        long_run(whole // 2)
    assert error.value.lowest_plan.code == "L" * LAYERS


def test_the_profiled_steps_tile_only_where_tiling_is_predicted_to_lower_the_peak(monkeypatch):
    """On the zoo's Mistral-7B shape the profiled steps of a budget below every plan tiled the MLPs and measured
    16.72 GiB, where untiled they measured 16.51: the refusal then named the higher as the smallest budget known to
    work. Here tiling is predicted to cost memory, and the profiled steps of a budget nothing fits stay untiled."""
    from hf_offload.memory_budget import planning as module

    real = module.simulate

    def tiling_costs_more(profile, code, *args, **kwargs):
        predicted = real(profile, code, *args, **kwargs)
        return dataclasses.replace(predicted, peak_bytes=predicted.peak_bytes * 10) if "T" in code else predicted

    monkeypatch.setattr(module, "simulate", tiling_costs_more)
    monkeypatch.setattr(profiled_steps_module, "simulate", tiling_costs_more)
    _, _, seen, _ = long_run(1024, steps=2)
    assert seen == [[False] * LAYERS] * 2


def test_a_budget_the_measured_safe_plan_meets_is_not_refused(monkeypatch):
    """The model over-predicts the safe plan's peak (as on the zoo's Mistral-7B shape): a budget between the
    peak the profiled steps measured and the predicted one trains on the safe plan instead of being refused. The
    CPU test mode counts no peaks, so the meter reports the second profiled step's as a tenth of the prediction."""
    predicted = planned_minimum()  # refused without a measured peak
    model = tiny_llama()
    budget = predicted // 2
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget)
    controller = context.budget_controller
    monkeypatch.setattr(controller._meter, "peak", lambda: predicted // 10 if controller._forwards == 3 else None)
    train(model, context, steps=4)
    plan = context.memory_plan
    assert plan.code == "CCCC" and plan.measured.peak_bytes == predicted // 10 and plan.predicted.peak_bytes > budget


def test_a_budget_at_the_measured_safe_peak_is_met_with_the_tail_it_measured(monkeypatch):
    """The zoo's budgets at the safe plan's measured peak were refused by 0.3-1.6%: the measured peak was recorded
    with a forward window of the engine's tail on top, which the profiled step already held. It counts as measured;
    the plan chosen by it keeps no more tail than its steps did (the engine's tail bound), so they peak where it did.
    The CPU test mode has no counters: the meter reports a fixed peak and the parameters as what is allocated."""
    model = tiny_llama()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = parameters + 3 * 2**20
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=peak)
    controller = context.budget_controller
    monkeypatch.setattr(controller._meter, "peak", lambda: peak)
    monkeypatch.setattr(controller._meter, "allocated", lambda: parameters)
    train(model, context, steps=4)
    plan = context.memory_plan
    assert plan.code == "CCCC" and plan.measured.peak_bytes == peak
    assert context._planner.max_tail_bytes == 0  # the profiled step kept none (copies finish at once on the CPU)
    assert plan.predicted.peak_bytes > peak  # the model, with its tail bound and margin, would not have fitted it


def test_a_predicted_plan_caps_the_engines_tail_at_what_it_counted(monkeypatch):
    """The model counts at the head the copies it has unfinished as the forward ends (the engine's tail, at most its
    bound): the engine may keep no more while the plan is in force, or the head would hold more than predicted. With
    copies as fast as the meter's (the CPU's) the plan counts its last layer's input only; with a link a million
    times slower, every offloaded byte the head does not reload, under the bound."""
    model = tiny_llama()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=parameters + 2**30)
    controller = context.budget_controller
    monkeypatch.setattr(controller._meter, "peak", lambda: parameters + 3 * 2**20)  # the head is measured: a bound
    monkeypatch.setattr(controller._meter, "allocated", lambda: parameters)
    train(model, context, steps=3)
    profile = controller.planner.profile
    assert profile.tail_bytes == context.options.forward_window_bytes
    slow = dataclasses.replace(profile, d2h_bytes_per_s=profile.d2h_bytes_per_s / 1e6)
    for measured_at, code in ((profile, "CCCC"), (slow, "OOOO")):
        plan = plan_of(measured_at, code, parameters + 2**30)
        controller.planner.put_in_force(plan, measured_at, controller._forwards)
        assert 0 < plan.predicted.tail_bytes < profile.tail_bytes
        assert context._planner.max_tail_bytes == plan.predicted.tail_bytes
    assert plan_of(profile, "CCCC", parameters + 2**30).predicted.tail_bytes == profile.layers[-1].input_bytes


# Host memory under a budget: the pinned pool may grow past its cap, down to the host's reserve, where no plan fits
# within it. A host whose default cap holds one layer input of a model whose lowest peak needs all of them offloaded.
HOST_LAYERS, HOST_BATCH, HOST_TOKENS, HOST_HIDDEN = 16, 16, 32, 64
HOST_INPUT_BYTES = HOST_BATCH * HOST_TOKENS * HOST_HIDDEN * 4


def host_bound_run(monkeypatch, budget, steps: int = 5, **options):
    """The context after `steps` steps (or the refusal it raised) of a model whose layer inputs matter at its peak:
    16 layers, 16 x 32 tokens; on a host with 32 GiB available (64 GiB in all) but where the default cap, half the
    memory available as psutil reads it, holds 1.5 layer inputs."""
    monkeypatch.setattr("hf_offload.host_memory.psutil.virtual_memory",
                        lambda: SimpleNamespace(available=3 * HOST_INPUT_BYTES))  # fmt: skip
    host = HostMemory(64 * 2**30, 32 * 2**30)
    monkeypatch.setattr("hf_offload.host_memory.read_host_memory", lambda: host)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=HOST_HIDDEN, intermediate_size=64,
                                      num_hidden_layers=HOST_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                                      attn_implementation="sdpa")  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=budget, tile_mlp=False,
                                             **options)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    try:
        for _ in range(steps):
            ids = torch.randint(32, (HOST_BATCH, HOST_TOKENS))
            with context:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except InfeasibleBudgetError as error:
        return error
    return context


def test_the_plan_grows_the_pinned_pool_past_its_cap_only_where_no_plan_fits_within_it(monkeypatch, caplog):
    default_cap = 3 * HOST_INPUT_BYTES // 2
    kept_to_cap = host_bound_run(monkeypatch, 1, max_pinned_memory_fraction=0.5)  # a cap the user set: kept
    grown = host_bound_run(monkeypatch, 1)
    assert isinstance(kept_to_cap, InfeasibleBudgetError) and isinstance(grown, InfeasibleBudgetError)
    assert "grown from its cap" not in str(kept_to_cap)
    assert (f"(That is with the pinned host pool grown from its cap of {default_cap / 1024:.2f} KiB to 24.00 GiB, "
            "down to the host memory reserve of 8.00 GiB.)") in str(grown)  # fmt: skip
    assert "GPU memory is what this step lacks: the host has room for every layer's saved tensors." in str(grown)
    assert grown.minimum_bytes < kept_to_cap.minimum_bytes  # the inputs on the host lower the peak
    budget = (grown.minimum_bytes + kept_to_cap.minimum_bytes) // 2
    assert isinstance(host_bound_run(monkeypatch, budget, max_pinned_memory_fraction=0.5), InfeasibleBudgetError)
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        context = host_bound_run(monkeypatch, budget)
    plan = context.memory_plan
    assert plan.host_growth == "no plan fits the budget within it, down to the host memory reserve of 8.00 GiB"
    assert plan.predicted.host_bytes > default_cap and plan.predicted.peak_bytes <= budget
    assert context._pool.cap_bytes == plan.host_cap_bytes  # the engine's pool took the plan's cap
    stats = context.get_stats()  # the last step: every input the plan offloads went to the host
    assert stats["tensors_kept_over_host_cap"] == 0 and stats["pinned_bytes"] > default_cap
    # The most: what the pool held when it was planned (grown past its cap already by the profiled steps, whose plan
    # could not fit the budget within it either) and the room above the reserve, 32 - 8 GiB.
    assert (plan.host_default_cap_bytes, plan.host_cap_bytes) == (default_cap, stats["pinned_bytes"] + 24 * 2**30)
    tables = [record.getMessage() for record in caplog.records if "Memory plan for" in record.getMessage()]
    assert tables and all(
        re.search(
            r"\nHost: [\d.]+ [KM]iB pinned of a 24.00 GiB cap \(default 192.00 KiB\), grown because no plan fits "
            r"the budget within it, down to the host memory reserve of 8.00 GiB\n",
            table,
        )  # fmt: skip
        for table in tables
    )


def test_past_a_capped_pinned_pool_the_plan_offloads_to_the_disk_tier(monkeypatch, caplog, tmp_path):
    """A budget that no plan meets within the pinned cap the user set (the inputs past it would stay on the device)
    is met with the disk tier under the pool: the plan counts the disk's room and offloads past the cap, and the
    engine spills what the pool refuses, none kept on the device for want of room."""
    capped = host_bound_run(monkeypatch, 1, max_pinned_memory_fraction=0.5)
    grown = host_bound_run(monkeypatch, 1)
    budget = (grown.minimum_bytes + capped.minimum_bytes) // 2  # refused within the cap (the test above)
    disk = {"max_pinned_memory_fraction": 0.5, "disk_offload_dir": str(tmp_path), "disk_reserve_bytes": 0}
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        context = host_bound_run(monkeypatch, budget, **disk)
    plan = context.memory_plan
    assert plan.predicted.peak_bytes <= budget and plan.host_growth == ""  # the cap the user set is kept
    # What the pool holds stays within its cap (whole layer inputs: one of the 1.5 it has room for); the rest, disk.
    on_host = plan.predicted.host_bytes - plan.predicted.disk_bytes
    assert plan.disk_cap_bytes > 0 and plan.predicted.disk_bytes > 0 and on_host <= plan.host_cap_bytes
    stats = context.get_stats()  # the last step: what the pool refused went to the disk, and came back
    assert stats["tensors_kept_over_host_cap"] == 0
    assert stats["bytes_spilled_to_disk"] == stats["bytes_read_from_disk"] >= plan.predicted.disk_bytes
    said = [record.getMessage() for record in caplog.records]
    assert any(re.match(r"hf_offload: the disk tier in .* writes [\d.]+ GB/s and reads [\d.]+ GB/s", line)
               for line in said)  # fmt: skip
    assert any("\nDisk: " in line and "of what the step offloads goes to the disk tier" in line for line in said)


@pytest.mark.parametrize("probe_tokens", [None, 64], ids=["probed-whole", "probed-on-an-eighth"])
def test_a_first_step_the_safe_plan_does_not_fit_runs_a_plan_made_for_it_before_its_layers(monkeypatch, caplog,
                                                                                          probe_tokens):  # fmt: skip
    """A run whose first step is already long (packing to `max_length`): the safe plan's inputs would fill the pinned
    pool and the rest stay on the device (an 8B-class model at 327,680 tokens ran out of GPU memory so). Here a
    budget that the first step, as the model predicts it, meets only with a plan that grows the pool: that step runs
    the planner's plan, made for its own tokens as its first layer starts, and no input stays on the device for want
    of host memory. Also where the probes see an eighth of the step's tokens, as they see a long step's first 32K."""
    if probe_tokens is not None:
        monkeypatch.setattr(probes, "PROBE_MAX_TOKENS", probe_tokens)
    default_cap = 3 * HOST_INPUT_BYTES // 2
    # The first step as the controller sees it once the probes are in (under a budget that plans nothing yet): the
    # safe plan offloads the inputs the pool has room for and keeps the others on the device.
    roomy = host_bound_run(monkeypatch, 2**40, steps=1, tile_layer=False)
    controller = roomy.budget_controller
    profile = controller.profiled_steps.profile_now(controller.profiled_steps.measured.step_tokens)
    safe = safe_code(profile)
    assert safe == "C" + "c" * (HOST_LAYERS - 1)
    safe_peak = simulate(profile, safe).peak_bytes
    with pytest.raises(InfeasibleBudgetError) as lowest:
        controller.planner.choose(profile, 1, 0, [])
    assert lowest.value.minimum_bytes < safe_peak * 0.98
    budget = (lowest.value.minimum_bytes + safe_peak) // 2
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        context = host_bound_run(monkeypatch, budget, steps=1, tile_layer=False)
    controller = context.budget_controller
    assert controller.plan is None  # still profiling: the plan the layers ran is the profiled steps'
    first_step_code = controller.planner.code
    assert first_step_code != "C" * HOST_LAYERS and context._pool.cap_bytes > default_cap
    stats = context.get_stats()
    assert stats["tensors_kept_over_host_cap"] == 0 and stats["pinned_bytes"] > default_cap
    probed = [record.getMessage() for record in caplog.records if record.getMessage().startswith("hf_offload: probed")]
    probe_said = (r"hf_offload: probed model\.layers\.0 on \d+ of its call's 512 tokens in ([\d.]+) s \((.*)\): at "
                  rf"that call it saves [\d.]+ [KM]iB \(input {HOST_INPUT_BYTES // 1024}\.00 KiB\)")  # fmt: skip
    assert len(probed) == 1 and (said := re.match(probe_said, probed[0]))
    # Where the probe's time went, measurement by measurement, in the order they ran.
    phases = dict(re.fullmatch(r"(.+) ([\d.]+) s", part).groups() for part in said.group(2).split(", "))
    assert list(phases) == ["kept and selectively checkpointed", "attention", "on fewer tokens"]  # nothing tiled
    assert sum(float(s) for s in phases.values()) <= float(said.group(1)) + 0.02  # each rounded to 0.01 s
    said = [record.getMessage() for record in caplog.records if "the profiled steps run plan" in record.getMessage()]
    assert said and said[0].startswith(f"hf_offload: the profiled steps run plan {first_step_code!r}, made for their "
                                       f"{HOST_BATCH * HOST_TOKENS} tokens and predicted to peak at ")  # fmt: skip
    assert f"(budget {budget / 2**30:.2f} GiB; within it): the safe plan {safe!r} is predicted to peak at" in said[0]
    # With the pinned pool's caps then, and the plan's table: what each layer was predicted to cost, one line each.
    lines = said[0].split("\n")
    assert lines[0].endswith(f"the pinned pool's cap is {format_bytes(default_cap)}, and it may grow to "
                             f"{format_bytes(context._pool.cap_bytes)}")  # fmt: skip
    assert lines[1].startswith(f"Memory plan for {HOST_BATCH * HOST_TOKENS} tokens per step") and lines[-1].startswith(
        f"{HOST_LAYERS - 1:>5}  ")  # fmt: skip


def test_a_first_step_the_untiled_safe_plan_does_not_fit_runs_the_planners_plan_not_every_layer_tiled(monkeypatch):
    """Where the safe plan fits only with its MLPs tiled, the profiled steps run the planner's plan for their tokens,
    which tiles only where it must: the safe plan tiled throughout is slow (an 8B-class model's first step of 327,680
    tokens on an H100: every layer tiled whole, 398 s; every MLP tiled, 306 s)."""
    roomy = long_run(10 * 2**30, steps=1)[1].budget_controller
    tokens = roomy.profiled_steps.measured.step_tokens
    profile = roomy.profiled_steps.profile_now(tokens)
    untiled, tiled = (simulate(profile, safe_code(profile, letters)).peak_bytes for letters in ("Cc", "Tt"))
    assert tiled < untiled
    budget = (untiled + tiled) // 2
    chosen = []

    def choose(self, *args, original=controller_module.Planner.choose, **kwargs):
        chosen.append(original(self, *args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(controller_module.Planner, "choose", choose)
    _, context, seen, _ = long_run(budget, steps=1)
    planner = context.budget_controller.planner
    assert chosen and context.budget_controller.plan is None  # chosen in the first step, which it ran
    assert planner.code == chosen[0].code != safe_code(profile, "Tt")
    assert chosen[0].predicted.peak_bytes <= budget
    assert seen == [[letter in "Tt" for letter in planner.code]]  # from the first layer on


def test_a_first_step_no_plan_fits_on_the_device_is_refused_before_its_layers_run(monkeypatch):
    """Where even the lowest-memory plan is predicted to exceed the device's memory, the first step is refused as its
    first layer starts, naming what it would need and what it lacks: never an out-of-memory error inside it."""
    seen = []
    monkeypatch.setattr(controller_module.MemoryBudgetController, "_layer_starts",
                        _recording(controller_module.MemoryBudgetController._layer_starts, seen))  # fmt: skip
    monkeypatch.setattr(probes.Meter, "total", lambda self: 2**20)
    error = host_bound_run(monkeypatch, 2**19, steps=1, tile_layer=False)
    assert isinstance(error, InfeasibleBudgetError)
    refusal = (f"hf_offload: memory_budget: the first step, of {HOST_BATCH * HOST_TOKENS} tokens, fits no plan, and "
               "the lowest-memory one is predicted to exceed the device's 1.00 MiB")  # fmt: skip
    assert str(error).startswith(refusal)
    assert "memory is what this step lacks" in str(error)
    assert set(seen) == {0}  # refused in the first layer's pre-hook (the probes call it too): no layer ran


def test_a_first_step_whose_logits_alone_exceed_the_device_is_refused_naming_them(monkeypatch):
    """The head's bytes are only estimated before the second step measures them, so the first step's refusal counts
    only what is certain of them: the logits, which transformers' own forward makes whole. A step that no plan fits
    because of them is refused before its layers run, and the error names them and a fused loss; counting no head,
    it ran (Qwen3-8B's shape at 229,376 tokens without a fused loss, on an H100: out of memory inside the step)."""

    def first_step(total=None):
        if total is not None:
            monkeypatch.setattr(probes.Meter, "total", lambda self: total)
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=4096, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1,
                                          attn_implementation="sdpa")  # fmt: skip
        model = transformers.LlamaForCausalLM(config).train()
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=1, tile_mlp=False,
                                                 tile_layer=False)  # fmt: skip
        ids = torch.randint(4096, (2, 64))
        with context:
            model(input_ids=ids, labels=ids).loss.backward()
        return context, model

    context, model = first_step()  # no device memory to refuse against: it runs
    controller = context.budget_controller
    tokens = controller.profiled_steps.measured.step_tokens
    profile = controller.profiled_steps.profile_now(tokens)
    with pytest.raises(InfeasibleBudgetError) as lowest:
        controller.planner.choose(profile, 1, 0, [])
    logits = measurements.first_steps_logits_bytes(model, tokens)
    assert logits == 128 * 4096 * 4
    code = lowest.value.lowest_plan.code
    without_head, with_logits = (simulate(dataclasses.replace(profile, head_bytes=head), code).peak_bytes
                                 for head in (0, logits))  # fmt: skip
    assert without_head < with_logits
    with pytest.raises(InfeasibleBudgetError) as refused:
        first_step(total=(without_head + with_logits) // 2)
    message = str(refused.value)
    assert message.startswith(f"hf_offload: memory_budget: the first step, of {tokens} tokens, fits no plan")
    assert "The model's output head makes its logits whole, 2.00 MiB at this step's tokens" in message
    assert "Liger's fused linear cross-entropy" in message


def _recording(method, seen: list):
    """`method`, recording the index of each layer whose pre-hook it is called for."""

    def recorded(self, index, *args, **kwargs):
        seen.append(index)
        return method(self, index, *args, **kwargs)

    return recorded


def test_a_plan_that_fits_within_the_pinned_cap_does_not_grow_it(monkeypatch):
    context = host_bound_run(monkeypatch, 2**30)
    plan = context.memory_plan
    assert plan.host_growth == "" and plan.host_default_cap_bytes == 0
    assert context._pool.cap_bytes == plan.host_cap_bytes == 3 * HOST_INPUT_BYTES // 2
