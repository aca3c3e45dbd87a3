"""Choosing a plan: on S1, on random profiles, at long context with tiled MLPs, and with measured plans.

Pure Python: nothing here needs torch or a device.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import itertools
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from step_profiles import long_profile, s1_profile, tiled_layer_profile

from hf_offload.memory_budget import actions, calibrate, checks, closed_loop, host, plans_by_length, search, spec
from hf_offload.memory_budget import profile as step_profile
from hf_offload.memory_budget import simulate as step_model
from hf_offload.memory_budget.profile import LayerProfile, StepProfile
from hf_offload.memory_budget.search import STEP_TIME_NOISE, InfeasibleBudgetError, choose_plan, plan_of
from hf_offload.memory_budget.simulate import MeasuredStep, Plan, layer_options, simulate
from hf_offload.units import GIB, MIB, format_bytes

# The part of the budget that plans: the standard library and `units` only, so that plans are computed anywhere.
PURE_MODULES = (actions, checks, spec, step_profile, step_model, search, calibrate, host, closed_loop, plans_by_length)
PURE_NAMES = {module.__name__.rpartition(".")[2] for module in PURE_MODULES}


def random_profile(rng: random.Random, layers: int) -> StepProfile:
    """Layers of very different sizes and speeds, links from slow to fast, host caps from none to ample."""
    profiles = []
    for _ in range(layers):
        saved = rng.randint(1, 4 * GIB)
        input_bytes = rng.randint(0, saved // 4)
        forward_s = rng.uniform(0.001, 0.01)
        profiles.append(LayerProfile(
            saved_bytes=saved,
            selective_bytes=rng.randint(0, saved - input_bytes),
            input_bytes=input_bytes,
            forward_s=forward_s,
            backward_s=rng.uniform(1.5, 2.5) * forward_s,
            selective_recompute_s=rng.uniform(0.2, 0.7) * forward_s,
        ))  # fmt: skip
    return StepProfile(
        layers=profiles,
        static_bytes=rng.randint(0, 20 * GIB),
        head_bytes=rng.randint(0, 4 * GIB),
        backward_working_bytes=rng.randint(0, 3 * GIB),
        head_s=rng.uniform(0, 0.05),
        other_s=rng.uniform(0, 0.05),
        d2h_bytes_per_s=rng.choice([5e9, 25e9, 55e9, 400e9]),
        h2d_bytes_per_s=rng.choice([5e9, 25e9, 55e9, 400e9]),
        host_cap_bytes=rng.choice([0, GIB, 4 * GIB, 64 * GIB]),
        tokens=4096,
    )


def lowest_peak(profile: StepProfile) -> int:
    return simulate(profile, search.safe_code(profile)).peak_bytes


# Plans on S1


def test_budget_of_everything_changes_nothing() -> None:
    profile = s1_profile()
    keep_all = simulate(profile, "K" * 16)
    for budget in (keep_all.peak_bytes, 80 * GIB):
        result = choose_plan(profile, budget)
        assert result.code == "K" * 16
        assert result.predicted == keep_all
        assert result.forward_window_bytes == result.prefetch_window_bytes == 0


def test_sweep_of_budgets_never_exceeds_and_never_gets_faster() -> None:
    profile = s1_profile()
    keep_all = simulate(profile, "K" * 16)
    previous = None
    for percent in range(100, 34, -1):
        budget = keep_all.peak_bytes * percent // 100
        result = choose_plan(profile, budget)
        assert result.predicted.peak_bytes <= budget
        assert result.predicted == simulate(profile, result.code, result.prefetch_window_bytes)
        if previous is not None:
            assert result.predicted.step_s >= previous.predicted.step_s - 1e-12, (percent, result.code)
        previous = result
    assert previous.predicted.step_s < simulate(profile, "C" * 16).step_s  # 35%: still faster than checkpointing


@pytest.mark.parametrize(
    "hand_plan",
    [
        "SSSSSSSSKKKKKKKK",
        "S" * 16,
        "CCCCCCCCKKKKKKKK",
        "CCCCSSSSSSSSSSSS",
        "CCCCCCCCSSSSSSSS",
        "CCCCCCCCCCCCKKKK",
        "C" * 16,
        "OOKKKKKKKKKKKKKK",
    ],
)
def test_plan_beats_or_equals_the_plans_written_by_hand(hand_plan) -> None:
    profile = s1_profile()
    hand = simulate(profile, hand_plan)
    result = choose_plan(profile, hand.peak_bytes)
    assert result.predicted.peak_bytes <= hand.peak_bytes
    assert result.predicted.step_s <= hand.step_s


@pytest.mark.parametrize("layers", [4, 5])
def test_plan_is_the_exhaustive_optimum_on_uniform_layers(layers) -> None:
    profile = s1_profile(layers)
    predictions = [simulate(profile, "".join(code)) for code in itertools.product(search._PLANNED, repeat=layers)]
    low, high = lowest_peak(profile), simulate(profile, "K" * layers).peak_bytes
    for step in range(41):
        budget = low + (high - low) * step // 40
        fastest = min(p.step_s for p in predictions if p.peak_bytes <= budget)
        assert choose_plan(profile, budget).predicted.step_s == pytest.approx(fastest, rel=1e-12)


@pytest.mark.parametrize("bytes_per_s", [200e9, 400e9])
def test_plan_is_the_exhaustive_optimum_with_the_window_that_fits(bytes_per_s) -> None:
    # As the controller plans: each code with the widest prefetch window its budget leaves, so a layer offloaded
    # whole can reload behind every later layer's backward. The greedy alone prices `O` out on these layers.
    profile = s1_profile(4, d2h_bytes_per_s=bytes_per_s, h2d_bytes_per_s=bytes_per_s)
    codes = ["".join(code) for code in itertools.product(search._PLANNED, repeat=4)]
    low, high = lowest_peak(profile), simulate(profile, "K" * 4).peak_bytes
    whole_offload_chosen = 0
    for step in range(21):
        budget = low + (high - low) * step // 20
        plans = [plan for plan in (plan_of(profile, code, budget) for code in codes) if plan.fits()]
        fastest = min(plans, key=lambda plan: plan.predicted.step_s)
        result = choose_plan(profile, budget)
        assert result.predicted.step_s == pytest.approx(fastest.predicted.step_s, rel=1e-12), (step, fastest.code)
        whole_offload_chosen += "O" in result.code
    assert whole_offload_chosen  # the case this test is for occurs


def test_budget_below_the_minimum_names_it() -> None:
    profile = s1_profile()
    minimum = simulate(profile, "C" * 16).peak_bytes
    # The last layer's activations count at its backward anyway.
    assert choose_plan(profile, minimum).code == "C" * 15 + "K"
    with pytest.raises(ValueError) as error:
        choose_plan(profile, minimum - 1)
    message = str(error.value)
    assert f"{minimum / GIB:.2f} GiB ({minimum} bytes" in message
    assert f"({minimum - 1} bytes)" in message
    assert "dominated by static memory (parameters, gradients, optimizer state) 8.51 GiB" in message
    assert "layer 15's working set" in message

    with pytest.raises(ValueError, match="dominated by the head and loss 30.00 GiB"):
        choose_plan(s1_profile(head_bytes=30 * GIB), 20 * GIB)


def test_the_refusal_counts_at_a_layers_backward_only_the_gradients_that_exist_then() -> None:
    """Full fine-tuning: at the first layer's backward, the gradients of the other layers exist, not its own (in its
    working bytes) nor the embeddings' (created after every layer). Counting every gradient as static made the rest
    of the peak negative in the message ("copies in flight -176.50 KiB")."""
    base = s1_profile(layers=4)
    layer = dataclasses.replace(base.layers[0], parameter_gradient_bytes=GIB)
    profile = dataclasses.replace(base, layers=(layer,) * 4, gradient_bytes=6 * GIB, late_gradient_bytes=GIB,
                                  head_bytes=MIB)  # fmt: skip
    lowest = simulate(profile, "CCCC")
    assert lowest.peak_at == "backward layer 0"
    with pytest.raises(ValueError) as error:
        choose_plan(profile, lowest.peak_bytes // 2)
    message = str(error.value)
    static = profile.static_bytes + 4 * GIB  # 6 GiB of gradients less layer 0's and the embeddings'
    assert f"static memory (parameters, gradients, optimizer state) {static / GIB:.2f} GiB" in message
    assert " -" not in message  # every part of the peak is a size


def test_the_refusal_names_the_embeddings_output_gradient_where_the_late_gradients_peak() -> None:
    """A large vocabulary's embedding gradient, made after every layer, can set the peak of the lowest plan (a
    26-layer model with a 256K vocabulary, 2K tokens): the message names the gradient of the embeddings' output
    alive then, a layer's input, and counts every gradient as static."""
    base = s1_profile(layers=4)
    profile = dataclasses.replace(base, gradient_bytes=40 * GIB, late_gradient_bytes=8 * GIB, head_bytes=MIB)
    lowest = simulate(profile, "CCCC")
    assert lowest.peak_at == "the input embeddings' gradient"
    assert lowest.peak_bytes == profile.static_bytes + 40 * GIB + base.layers[0].input_bytes
    message = str(pytest.raises(ValueError, choose_plan, profile, lowest.peak_bytes // 2).value)
    static = profile.static_bytes + 40 * GIB
    assert f"static memory (parameters, gradients, optimizer state) {static / GIB:.2f} GiB" in message
    assert f"the gradient of the embeddings' output {format_bytes(base.layers[0].input_bytes)}" in message
    assert " -" not in message


def test_the_refusal_names_the_peaks_correction_as_a_part_of_its_own() -> None:
    """A correction learned from measured plans is its own part of the refused peak, not hidden in another."""
    profile = s1_profile(layers=4, peak_correction_bytes=3 * MIB)
    lowest = simulate(profile, "CCCC")
    with pytest.raises(ValueError) as error:
        choose_plan(profile, lowest.peak_bytes // 2)
    message = str(error.value)
    assert "what measured plans peaked above their prediction 3.00 MiB" in message
    assert " -" not in message
    without = str(pytest.raises(ValueError, choose_plan, s1_profile(layers=4), lowest.peak_bytes // 2).value)
    assert "what measured plans peaked" not in without


def test_the_refusal_names_the_layers_arguments_and_counts_fsdp2s_gathered_parameters_in_the_working_set() -> None:
    """The masks and tables the model gives its layers are a part of their own; the parameters FSDP2 holds gathered
    at the peaking layer's backward (its own and the layer before it's) are in that layer's working set."""
    base = s1_profile(layers=4)
    layers = tuple(dataclasses.replace(layer, gathered_parameter_bytes=(i + 1) * MIB) for i, layer in
                   enumerate(base.layers))  # fmt: skip
    profile = dataclasses.replace(base, layers=layers, call_argument_bytes=5 * MIB)
    lowest = simulate(profile, "CCCC")
    assert lowest.peak_at == "backward layer 3"
    with pytest.raises(ValueError) as error:
        choose_plan(profile, lowest.peak_bytes // 2)
    message = str(error.value)
    assert "the masks and rotary tables the model gives its layers 5.00 MiB" in message
    assert lowest.peak_bytes == simulate(base, "CCCC").peak_bytes + 5 * MIB + 7 * MIB  # layers 3 and 2: 4 + 3 MiB
    option = layer_options(profile, profile.layers[3])["C"]
    working = format_bytes(option.saved + option.working + 7 * MIB)
    what = "its activations and gradient buffers, parameters FSDP2 gathered"
    assert f"layer 3's working set ({what}) {working}" in message
    assert " -" not in message


def test_no_host_room_means_no_offloading() -> None:
    profile = s1_profile(host_cap_bytes=0)
    assert search.safe_code(profile) == "c" * 16
    for percent in (40, 60, 80):
        result = choose_plan(profile, simulate(profile, "K" * 16).peak_bytes * percent // 100)
        assert result.predicted.host_bytes == 0
        assert set(result.code) <= set("Ksc")
    # Room for 4 inputs: the lowest-memory plan offloads the first 4.
    assert search.safe_code(s1_profile(host_cap_bytes=256 * MIB)) == "CCCC" + "c" * 12


def test_random_profiles_never_exceed_and_never_lose_to_full_checkpointing() -> None:
    rng = random.Random(1234)
    for _ in range(150):
        profile = random_profile(rng, rng.randint(1, 12))
        layers = len(profile.layers)
        low, high = lowest_peak(profile), simulate(profile, "K" * layers).peak_bytes
        full = simulate(profile, "C" * layers)
        for budget in (low, rng.randint(low, high), high, high + GIB):
            result = choose_plan(profile, budget)
            assert result.predicted.peak_bytes <= budget
            assert result.predicted.host_bytes <= profile.host_cap_bytes
            assert result.predicted == simulate(profile, result.code, result.prefetch_window_bytes)
            if full.peak_bytes <= budget and full.host_bytes <= profile.host_cap_bytes:
                assert result.predicted.step_s <= full.step_s
        with pytest.raises(ValueError, match="below the smallest peak"):
            choose_plan(profile, low - 1)


def test_planning_128_layers_is_fast(monkeypatch) -> None:
    calls = []
    simulate_once = search.simulate_step

    def counted(*args, **kwargs):
        calls.append(1)
        return simulate_once(*args, **kwargs)

    monkeypatch.setattr(search, "simulate_step", counted)
    rng = random.Random(7)
    for profile in (s1_profile(128), random_profile(rng, 128), random_profile(rng, 128)):
        low, high = lowest_peak(profile), simulate(profile, "K" * 128).peak_bytes
        for fraction in (0.0, 0.05, 0.3, 0.7, 0.99):
            calls.clear()
            start = time.perf_counter()
            result = choose_plan(profile, int(low + (high - low) * fraction))
            assert time.perf_counter() - start < 5.0
            assert len(calls) <= 16 * 128, len(calls)  # three polishes of a few simulations per layer, each linear
            assert len(result.layers) == 128


def test_plan_layers_and_windows() -> None:
    profile = s1_profile()
    result = choose_plan(profile, 20 * GIB)
    assert result.code == "CCCCCCSSSSSSSSSK"
    assert [layer.action for layer in result.layers[5:7]] == ["full", "selective"]
    assert all(layer.offload_input for layer in result.layers[:15]) and not result.layers[15].offload_input
    # The head and backward reload one input ahead: every layer sends its input alone, which the engine reloads
    # one layer ahead whatever the window.
    assert result.head_prefetch_window_bytes == result.prefetch_window_bytes == 64 * MIB
    assert simulate(profile, result.code, result.prefetch_window_bytes).peak_bytes <= 20 * GIB
    assert result.forward_window_bytes == 64 * MIB  # each input copy (1.2 ms) ends within the next forward (5 ms)
    assert result.tokens == profile.tokens and result.budget_bytes == 20 * GIB


def test_a_margin_keeps_the_predicted_peak_below_the_budget():
    profile = s1_profile()
    budget = int(0.66 * simulate(profile, "K" * 16).peak_bytes)
    margin = GIB
    assert choose_plan(profile, budget, margin).predicted.peak_bytes + margin <= budget
    assert choose_plan(profile, budget, margin).predicted.step_s >= choose_plan(profile, budget).predicted.step_s
    lowest = simulate(profile, "C" * 16).peak_bytes
    with pytest.raises(InfeasibleBudgetError, match="smallest budget that works is") as error:
        choose_plan(profile, lowest + margin // 2, margin)
    # The error carries its figures and the lowest-memory plan, for a caller that must run the step anyway.
    assert isinstance(error.value, ValueError)
    refused = error.value
    assert (refused.budget_bytes, refused.minimum_bytes) == (lowest + margin // 2, lowest + margin)
    assert refused.lowest_plan.code == "C" * 16
    assert refused.lowest_plan.predicted == simulate(profile, "C" * 16, refused.lowest_plan.prefetch_window_bytes)
    assert choose_plan(profile, refused.minimum_bytes, margin).predicted.peak_bytes + margin <= refused.minimum_bytes


def test_the_selective_offload_is_for_hand_written_plans_only():
    # Measured on the H100, its layers cost more than the model says: the planner never chooses it.
    profile = s1_profile()
    keep_all = simulate(profile, "K" * 16)
    for percent in range(35, 100, 5):
        assert "X" not in choose_plan(profile, keep_all.peak_bytes * percent // 100).code
    assert simulate(profile, "X" * 16).layers[0].code == "X"


# Tiled MLPs (long context)


def test_tiling_is_chosen_only_when_no_plan_without_it_fits() -> None:
    profile = long_profile()
    untiled = choose_plan(profile, 80 * GIB)
    assert not set(untiled.code) & set("Tt") and untiled.tile_tokens == 0 and untiled.tiled_layers == []
    tiled = choose_plan(profile, 60 * GIB)
    # The last layer's input is needed first in backward: kept, it costs no copy and the peak has room for it.
    assert tiled.code == "T" * 31 + "t" and tiled.tile_tokens == 4096 and tiled.tiled_layers == list(range(32))
    assert tiled.predicted.peak_bytes <= 60 * GIB
    assert "The MLPs of 32 layers run in chunks of 4096 tokens" in tiled.format_table()
    assert Plan.from_dict(json.loads(json.dumps(tiled.to_dict()))) == tiled
    # A measured tiled plan, however fast, does not replace an exact plan that fits...
    fast_tiled = MeasuredStep("T" * 32, step_s=0.001)
    assert choose_plan(profile, 80 * GIB, measured=[fast_tiled]).code == untiled.code
    assert choose_plan(profile, 80 * GIB, measured=[fast_tiled], measured_only=True).code == untiled.code
    # ... and where none fits, an exact plan that fit by measurement beats the tiled ones.
    exact = MeasuredStep("C" * 32, step_s=10.0, peak_bytes=60 * GIB)
    assert choose_plan(profile, 60 * GIB, measured=[fast_tiled, exact]).measured == exact


def test_polishing_takes_back_the_tiling_the_peak_does_not_need() -> None:
    # The first layers' backward comes last, when their parameter gradients have not all been created yet, and the
    # later layers' inputs are gone: with gradients of 16 GiB that frees enough for the first layers to go untiled.
    layers = [dataclasses.replace(long_profile().layers[0], parameter_gradient_bytes=GIB // 2)] * 32
    profile = long_profile(layers=layers, gradient_bytes=16 * GIB, static_bytes=10 * GIB)
    result = choose_plan(profile, 78 * GIB)
    assert "C" in result.code and "T" in result.code, result.code
    assert result.predicted.peak_bytes <= 78 * GIB
    assert result.predicted.step_s < simulate(profile, "T" * 32).step_s


def test_tiling_is_not_enough_names_what_dominates() -> None:
    with pytest.raises(ValueError, match="with every layer's MLP tiled") as error:
        choose_plan(long_profile(), 30 * GIB)
    assert "plan 'TTTT" in str(error.value)
    with pytest.raises(ValueError) as error:  # tiling not measured: the error is about the untiled plan
        choose_plan(long_profile(tile_tokens=0), 60 * GIB)
    assert "plan 'CCCC" in str(error.value) and "tiled" not in str(error.value)


def test_the_refusal_names_the_untiled_plan_where_tiling_peaks_higher() -> None:
    # On the zoo's Mistral-7B shape (8K tokens, MLP chunks of 4K: two), the tiled profiled steps measured 16.72 GiB
    # and the untiled ones 16.51: tiling can cost memory. The refusal names the lower of the two.
    profile = long_profile(tiled_backward_working_bytes=60 * GIB)
    untiled, tiled = (simulate(profile, letter * 32).peak_bytes for letter in "CT")
    assert tiled > untiled
    with pytest.raises(InfeasibleBudgetError) as error:
        choose_plan(profile, 30 * GIB)
    assert error.value.lowest_plan.code == "C" * 32 and f"({untiled} bytes; plan 'CCCC" in str(error.value)


# Layers tiled whole (longer context still)


def test_layers_are_tiled_whole_only_when_no_exact_plan_and_no_tiled_mlps_fit() -> None:
    """Every layer tiled whole peaks at 28.5 GiB, with tiled MLPs at 39, fully checkpointed at 78: each budget gets
    the fastest kind of plan that fits, and whole layers only below what tiled MLPs reach."""
    profile = tiled_layer_profile()
    for budget_gib in (80, 60, 40):  # an exact plan, then tiled MLPs
        plan = choose_plan(profile, budget_gib * GIB)
        assert not set(plan.code) & set("Ll") and plan.layer_tile_tokens == 0 and plan.tiled_whole_layers == []
    assert not set(choose_plan(profile, 80 * GIB).code) & set("TtLl")
    for budget_gib in (35, 30):
        plan = choose_plan(profile, budget_gib * GIB)
        # The last layer's input, needed first in backward, is kept: no copy, and the peak has room for it.
        assert plan.code == "L" * 31 + "l", plan.code
        assert plan.layer_tile_tokens == 4096 and plan.tile_tokens == 0 and plan.tiled_whole_layers == list(range(32))
        assert plan.predicted.peak_bytes <= budget_gib * GIB
        assert "32 layers run whole in chunks of 4096 tokens" in plan.format_table()
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
        assert plan_of(profile, plan.code, budget_gib * GIB).layer_tile_tokens == 4096
    # A measured plan of layers tiled whole, however fast, does not replace a plan with tiled MLPs that fits, nor an
    # exact one; where only it fits (the model predicts every plan over 28 GiB), it is chosen by its measurement.
    fast = MeasuredStep("L" * 32, step_s=0.001, peak_bytes=27 * GIB)
    assert choose_plan(profile, 40 * GIB, measured=[fast]).code == choose_plan(profile, 40 * GIB).code
    assert (
        choose_plan(profile, 80 * GIB, measured=[fast], measured_only=True).code == choose_plan(profile, 80 * GIB).code
    )
    assert simulate(profile, "L" * 32).peak_bytes > 28 * GIB
    assert choose_plan(profile, 28 * GIB, measured=[fast]).measured == fast
    # Switched off (not measured): the same budget is refused.
    with pytest.raises(InfeasibleBudgetError):
        choose_plan(tiled_layer_profile(layer_tile_tokens=0), 35 * GIB)


def test_polishing_moves_layers_tiled_whole_to_tiled_mlps_where_the_peak_allows() -> None:
    # As for tiled MLPs: the first layers' backward comes when the later layers' gradients are not all created yet
    # and their inputs are gone, so the layers from some point on can do with the faster tiled MLP.
    layers = [dataclasses.replace(tiled_layer_profile().layers[0], parameter_gradient_bytes=GIB // 2)] * 32
    profile = tiled_layer_profile(layers=layers, gradient_bytes=16 * GIB, static_bytes=10 * GIB)
    assert simulate(profile, "T" * 32).peak_bytes > 45 * GIB  # tiled MLPs alone do not fit
    plan = choose_plan(profile, 45 * GIB)
    assert set(plan.code) <= set("LlTt") and "L" in plan.code and "T" in plan.code, plan.code
    assert plan.code.rindex("L") < plan.code.index("T")  # the later layers, whose backward comes first
    assert plan.tile_tokens == plan.layer_tile_tokens == 4096
    assert plan.predicted.peak_bytes <= 45 * GIB
    assert plan.predicted.step_s < simulate(profile, "L" * 32).step_s


def test_a_measured_plan_that_tiles_does_not_shut_out_the_models_faster_plan_of_its_kind() -> None:
    """Dynamic padding on an H200, 1% above the named minimum: once every layer tiled whole had run at a length, the
    plan for it stayed `L` x 16 (0.98 s a step), where the model's plan tiling two layers whole (0.19-0.5 s) fitted."""
    layers = [dataclasses.replace(tiled_layer_profile().layers[0], parameter_gradient_bytes=GIB // 2)] * 32
    profile = tiled_layer_profile(layers=layers, gradient_bytes=16 * GIB, static_bytes=10 * GIB)
    budget = 45 * GIB
    model = choose_plan(profile, budget)
    assert "T" in model.code and "L" in model.code, model.code
    everything_tiled = simulate(profile, "L" * 32)
    assert model.predicted.step_s < everything_tiled.step_s
    # `L` x 32 ran as predicted: the model's plan is expected faster than it measured, and wins.
    as_predicted = MeasuredStep("L" * 32, step_s=everything_tiled.step_s, peak_bytes=everything_tiled.peak_bytes)
    assert choose_plan(profile, budget, measured=[as_predicted]).code == model.code
    # A closed loop's last correction keeps to what was measured.
    assert choose_plan(profile, budget, measured=[as_predicted], measured_only=True).measured == as_predicted
    # The model's plan measured over the budget is no candidate.
    over = MeasuredStep(model.code, step_s=model.predicted.step_s, peak_bytes=budget + 1)
    assert choose_plan(profile, budget, measured=[as_predicted, over]).measured == as_predicted
    # The same holds for tiled MLPs.
    tiled = choose_plan(long_profile(), 60 * GIB)
    slow_tiled = MeasuredStep(tiled.code, step_s=tiled.predicted.step_s * 3, peak_bytes=59 * GIB)
    others = [MeasuredStep("t" + "T" * 31, step_s=tiled.predicted.step_s, peak_bytes=59 * GIB)]
    assert choose_plan(long_profile(), 60 * GIB, measured=[slow_tiled, *others]).code == "t" + "T" * 31


def test_the_refusal_names_the_lowest_plan_layers_tiled_whole_included() -> None:
    with pytest.raises(InfeasibleBudgetError, match="with every layer tiled whole") as error:
        choose_plan(tiled_layer_profile(), 20 * GIB)
    lowest = simulate(tiled_layer_profile(), "L" * 32).peak_bytes
    assert error.value.lowest_plan.code == "L" * 32 and f"({lowest} bytes; plan 'LLLL" in str(error.value)
    assert error.value.minimum_bytes == lowest
    # Where tiling whole layers would peak higher than tiling MLPs (a large working set), the refusal names the MLPs'.
    costly = tiled_layer_profile(layer_tiled_backward_working_bytes=30 * GIB)
    assert simulate(costly, "L" * 32).peak_bytes > simulate(costly, "T" * 32).peak_bytes
    with pytest.raises(InfeasibleBudgetError, match="with every layer's MLP tiled") as error:
        choose_plan(costly, 20 * GIB)
    assert error.value.lowest_plan.code == "T" * 32 and "tiled whole" not in str(error.value)


def test_where_the_head_sets_every_plans_peak_the_lowest_plan_is_the_one_whose_layers_hold_least() -> None:
    # A first step's head, estimated from its logits (Qwen3-8B's vocabulary at 229,376 tokens, without a fused loss),
    # above every plan's layers: tiling leaves the peak where it was. Ordered by the peak alone, the refusal's lowest
    # plan kept the layers untiled, and the step that ran it ran out of memory in a layer's recomputation.
    profile = tiled_layer_profile(head_bytes=200 * GIB)
    peaks = {letter: simulate(profile, letter * 32) for letter in "CTL"}
    assert len({prediction.peak_bytes for prediction in peaks.values()}) == 1
    assert all(prediction.peak_at == "head" for prediction in peaks.values())
    with pytest.raises(InfeasibleBudgetError) as error:
        choose_plan(profile, 60 * GIB)
    assert error.value.lowest_plan.code == "L" * 32


def test_a_plan_of_any_code_gets_the_widest_window_that_fits() -> None:
    profile = s1_profile()
    chosen = choose_plan(profile, 20 * GIB)
    same = plan_of(profile, chosen.code, 20 * GIB)
    assert same.predicted == chosen.predicted and not same.trial and same.measured is None
    with pytest.raises(ValueError, match="one letter per layer"):
        plan_of(profile, "CC", 20 * GIB)


def test_a_full_host_is_said() -> None:
    profile = long_profile(host_cap_bytes=40 * GIB)  # room for 20 of the 32 inputs
    result = choose_plan(profile, 70 * GIB)
    assert result.code == "T" * 20 + "t" * 12
    assert result.inputs_kept_for_host == list(range(20, 32))
    assert (
        "12 checkpointed layers keep their input on the GPU: the host's pinned cap of 40.00 GiB is full"
        in result.format_table()
    )
    assert choose_plan(long_profile(), 60 * GIB).inputs_kept_for_host == []


# The disk tier: room past the pinned pool, at the disk's pace


def test_with_room_on_the_host_the_disk_tier_moves_nothing_and_costs_nothing() -> None:
    plain = long_profile()
    with_disk = long_profile(disk_cap_bytes=200 * GIB, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=2e9)
    for budget in (60 * GIB, 70 * GIB):
        chosen = choose_plan(with_disk, budget)
        assert chosen.predicted.disk_bytes == 0 and "Disk:" not in chosen.format_table()
        assert chosen.code == choose_plan(plain, budget).code
        assert simulate(with_disk, chosen.code).step_s == simulate(plain, chosen.code).step_s


def test_past_a_full_pinned_pool_the_plan_offloads_to_the_disk_at_its_pace() -> None:
    # Room for 20 of the 32 inputs on the host: without a disk the last 12 stay on the GPU (`test_a_full_host_is_said`).
    full_host = long_profile(host_cap_bytes=40 * GIB)
    with_disk = long_profile(host_cap_bytes=40 * GIB, disk_cap_bytes=100 * GIB, disk_write_bytes_per_s=2e9,
                             disk_read_bytes_per_s=4e9)  # fmt: skip
    assert search.safe_code(full_host) == "C" * 20 + "c" * 12 and search.safe_code(with_disk) == "C" * 32
    result = choose_plan(with_disk, 70 * GIB)
    # Beyond the 20 inputs the host holds, the plan offloads to the disk where that is faster than keeping.
    assert result.code.count("T") > 20 and result.inputs_kept_for_host == []
    on_disk = result.predicted.host_bytes - 40 * GIB
    assert on_disk > 0 and result.predicted.disk_bytes == on_disk
    assert (f"Disk: {format_bytes(on_disk)} of what the step offloads goes to the disk tier (room 100.00 GiB)"
            in result.format_table())  # fmt: skip
    # The lowest-memory plan is lower with the disk: nothing need stay on the GPU for want of room.
    lowest = search.safe_code(with_disk, "Tt")
    assert simulate(with_disk, lowest).peak_bytes < simulate(full_host, search.safe_code(full_host, "Tt")).peak_bytes
    # The disk is slower than the link: the same plan with every input on the host runs faster.
    assert simulate(long_profile(), "T" * 32).step_s < simulate(with_disk, "T" * 32).step_s
    # A disk too small for the rest: the inputs past both stay on the GPU, and the table says both were full.
    small_disk = dataclasses.replace(with_disk, disk_cap_bytes=8 * GIB)
    assert search.safe_code(small_disk) == "C" * 24 + "c" * 8
    small = choose_plan(small_disk, 70 * GIB)
    assert small.predicted.disk_bytes == 8 * GIB and small.inputs_kept_for_host == list(range(24, 32))
    assert "the host's pinned cap of 40.00 GiB and the disk tier's room of 8.00 GiB is full" in small.format_table()


def test_the_pool_and_the_disk_tier_each_take_whole_tensors() -> None:
    # What an H100 run of 524,288 tokens met: a pool cap of 61.97 GiB holds 15 inputs of 4 GiB, the disk's 38.70 GiB
    # 9; their sum has room for 25, and the plan that offloaded 25 kept the last one on the GPU, unplanned.
    places = step_model.offload_places([4 * GIB] * 25, int(61.97 * GIB), int(38.70 * GIB))
    assert places == ["host"] * 15 + ["disk"] * 9 + [None]
    # The engine takes a later tensor that fits where an earlier one did not.
    assert step_model.offload_places([3, 2, 1], 4, 0) == ["host", None, "host"]
    # 2 GiB inputs: the pool holds 20 of them (1 GiB left), the disk 11 (1 GiB left): 31, where 64 GiB is 32 inputs.
    profile = long_profile(host_cap_bytes=41 * GIB, disk_cap_bytes=23 * GIB, disk_write_bytes_per_s=2e9,
                           disk_read_bytes_per_s=4e9)  # fmt: skip
    assert search.safe_code(profile) == "C" * 31 + "c"
    every_input_offloaded = [layer_options(profile, layer)["T"] for layer in profile.layers]
    assert step_model.simulate_step(profile, every_input_offloaded).unplaced_bytes == 2 * GIB
    result = choose_plan(profile, 70 * GIB)
    assert result.code == "T" * 31 + "t" and result.predicted.disk_bytes == 22 * GIB
    assert result.inputs_kept_for_host == [31]
    assert ("the host's pinned cap of 41.00 GiB and the disk tier's room of 23.00 GiB is full "
            "(max_pinned_memory_fraction, max_pinned_mib, host_memory_reserve_mib, disk_reserve_mib)"
            in result.format_table())  # fmt: skip


def test_a_disk_tier_needs_its_bandwidths() -> None:
    with pytest.raises(ValueError, match="disk_write_bytes_per_s must be a finite number > 0"):
        long_profile(disk_cap_bytes=GIB)
    long_profile(disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9)  # measured, but no room: no tier in the plan


# Dominance: measured plans beat the model


def test_a_budget_a_measured_plan_met_is_not_refused() -> None:
    """The model over-predicts the lowest plan's peak (the zoo's Mistral-7B shape: 17.57 GiB predicted, 16.72
    GiB measured); a budget between the two is met by the measured plan, not refused."""
    profile = s1_profile()
    predicted = simulate(profile, "C" * 16)
    budget = predicted.peak_bytes - GIB // 2
    with pytest.raises(InfeasibleBudgetError):
        choose_plan(profile, budget)
    safe = MeasuredStep("C" * 16, step_s=predicted.step_s, peak_bytes=predicted.peak_bytes - GIB)
    result = choose_plan(profile, budget, margin_bytes=budget // 200, measured=[safe])
    assert (result.code, result.measured) == ("C" * 16, safe)
    assert result.fits(budget // 200) and result.predicted.peak_bytes > budget  # by its measured peak
    with pytest.raises(InfeasibleBudgetError) as error:  # a measured peak over the budget is no way out...
        choose_plan(profile, budget, measured=[dataclasses.replace(safe, peak_bytes=budget + 1)])
    # ... but it is the smallest budget known to work, below the predicted one.
    assert error.value.minimum_bytes == budget + 1
    assert f"Measured, plan {'C' * 16!r} peaked at " in str(error.value)
    assert str(error.value).endswith(f"({budget + 1} bytes): the smallest budget known to work.")


def test_the_plan_is_never_slower_than_a_measured_plan_that_fits() -> None:
    profile = s1_profile()
    budget = 20 * GIB
    chosen = choose_plan(profile, budget)
    assert chosen.code != "C" * 16 and chosen.measured is None
    # The model's choice ran slower than predicted, and nothing else was measured: the model is as wrong about the
    # other plans, whose predictions are scaled by its error, so none is faster; one as fast within the noise that
    # is simpler takes its place (the same run must end on the same plan, whichever it measured first).
    slow = MeasuredStep(chosen.code, step_s=0.5)
    again = choose_plan(profile, budget, measured=[slow])
    assert math.isclose(again.time_scale, slow.step_s / chosen.predicted.step_s)
    assert slow.step_s / (1 + STEP_TIME_NOISE) <= again.expected_step_s <= slow.step_s * (1 + STEP_TIME_NOISE)
    assert search._simplicity(again.code) < search._simplicity(chosen.code) and again.measured is None
    assert choose_plan(profile, budget, measured=[MeasuredStep(again.code, step_s=0.5)]).code == again.code
    # The safe plan, measured as predicted, puts the model's error between the two (the median of their ratios):
    # the plans that never ran are expected slower than the safe plan measured, which wins.
    as_predicted = MeasuredStep("C" * 16, step_s=simulate(profile, "C" * 16).step_s)
    switched = choose_plan(profile, budget, measured=[slow, as_predicted])
    assert switched.measured == as_predicted
    assert math.isclose(switched.time_scale, (1 + slow.step_s / chosen.predicted.step_s) / 2)
    # A closed loop's last correction keeps to what was measured.
    slower_safe = MeasuredStep("C" * 16, step_s=0.45)
    assert choose_plan(profile, budget, measured=[slow, slower_safe], measured_only=True).measured == slower_safe
    # ... unless a measured plan ran faster than any prediction: it wins, by its measurement.
    safe = MeasuredStep("C" * 16, step_s=0.2)
    assert choose_plan(profile, budget, measured=[slow, safe]).measured == safe
    # Keeping everything fits a roomy budget, unless it measured slower than a measured plan.
    assert choose_plan(profile, 64 * GIB).code == "K" * 16
    assert choose_plan(profile, 64 * GIB, measured=[MeasuredStep("K" * 16, 0.5), safe]).measured == safe
    # A plan whose measured peak exceeds the budget is not chosen, however fast it ran.
    over = MeasuredStep(chosen.code, step_s=0.01, peak_bytes=budget + 1)
    assert choose_plan(profile, budget, measured=[over]).code != chosen.code


def test_plans_within_the_noise_of_a_measured_one_end_on_the_simplest() -> None:
    # Two identical runs under a roomy budget once ended on different plans: one had measured an offloading plan a
    # hair faster than keeping every layer. Within the noise of a step's time the simplest plan wins, whichever ran.
    profile = s1_profile()
    budget, offloading = 64 * GIB, "OK" * 8
    keep = MeasuredStep("K" * 16, step_s=0.300)
    for faster_by_noise in (0.999, 0.99, 1 / (1 + STEP_TIME_NOISE) + 1e-9):
        noise = MeasuredStep(offloading, step_s=keep.step_s * faster_by_noise)
        assert choose_plan(profile, budget, measured=[keep, noise]).code == keep.code
        assert choose_plan(profile, budget, measured=[noise, keep]).code == keep.code
    # Faster by more than the noise is faster.
    faster = MeasuredStep(offloading, step_s=keep.step_s * 0.95)
    assert choose_plan(profile, budget, measured=[keep, faster]).measured == faster
    # Predictions from one profile compare exactly: no measurement, no noise, the model's fastest.
    plans = [plan_of(profile, code, 20 * GIB) for code in ("C" * 16, "CCCCCCCCCCCKKKKK", "CCCCCCSSSSSSSSSK")]
    fastest_s = min(plan.predicted.step_s for plan in plans if plan.fits())
    assert choose_plan(profile, 20 * GIB).predicted.step_s <= fastest_s


def docstring_profile() -> StepProfile:
    """The profile of `choose_plan`'s docstring example: four layers, a selective checkpoint halves what each holds."""
    layer = LayerProfile(saved_bytes=2 * GIB, selective_bytes=GIB, input_bytes=GIB // 16, forward_s=0.005,
                         backward_s=0.010, selective_recompute_s=0.002)  # fmt: skip
    return StepProfile(layers=[layer] * 4, static_bytes=8 * GIB, head_bytes=GIB, backward_working_bytes=2 * GIB,
                       head_s=0.04, other_s=0.03, d2h_bytes_per_s=55e9, h2d_bytes_per_s=55e9,
                       host_cap_bytes=64 * GIB, tokens=16384)  # fmt: skip


def test_a_profile_that_rules_out_selective_checkpoints_gets_plans_without_them() -> None:
    profile = docstring_profile()
    assert choose_plan(profile, 16 * GIB).code == "SSSK"
    ruled_out = dataclasses.replace(profile, selective_checkpoint=False)
    for budget in (16 * GIB, 15 * GIB, 14 * GIB, 20 * GIB):
        plan = choose_plan(ruled_out, budget)
        assert not set(plan.code) & set(actions.SELECTIVE_LETTERS) and plan.fits(0), plan.code
    assert set(layer_options(ruled_out, profile.layers[0])) == set("KOCc")
    with pytest.raises(ValueError, match="selectively"):
        plan_of(ruled_out, "SSSK", 16 * GIB)


def test_a_profile_whose_layers_save_what_offloading_keeps_gets_plans_that_move_inputs_only() -> None:
    """Over a fast link offloading a layer whole (`O`) beats checkpointing; where the layers save tensors the engine
    keeps in place (ring attention's DTensors), `StepProfile.offload_saved` is off and no plan counts them as moved."""
    fast = dataclasses.replace(docstring_profile(), d2h_bytes_per_s=500e9, h2d_bytes_per_s=500e9)
    assert choose_plan(fast, 14 * GIB).code == "OOOK"
    ruled_out = dataclasses.replace(fast, offload_saved=False)
    for budget in (13 * GIB, 14 * GIB, 15 * GIB, 16 * GIB, 20 * GIB):
        plan = choose_plan(ruled_out, budget)
        assert not set(plan.code) & set("OX") and plan.fits(0), plan.code
    assert set(layer_options(ruled_out, fast.layers[0])) == set("KSsCc")
    with pytest.raises(ValueError, match="offloads saved tensors beyond the input"):
        plan_of(ruled_out, "OOOK", 14 * GIB)


# The pure modules themselves (spec, profile, simulate, search, calibrate, host)


def test_docstring_examples() -> None:
    results = [doctest.testmod(module, extraglobs={"profile": docstring_profile()}) for module in PURE_MODULES]
    assert sum(tried for _, tried in results) >= 7 and not any(failures for failures, _ in results)


def test_imports_only_the_standard_library() -> None:
    for module in PURE_MODULES:
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level}
        # Relative imports: `..units`, the package's byte units, which import nothing (tests/test_units.py), and the
        # pure modules' own checks and each other.
        relative = {
            (node.level, node.module) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level
        }
        assert {name.split(".")[0] for name in imported} <= set(sys.stdlib_module_names) | {"__future__"}, module
        assert relative <= {(2, "units")} | {(1, name) for name in PURE_NAMES}, module


def test_the_planner_plans_in_a_process_without_torch() -> None:
    # What the modules' docstrings promise, run: a process where torch cannot be imported loads the planning modules
    # (past the package's `__init__`, which loads the engine) and plans a step.
    package = Path(search.__file__).parent
    script = f"""
import sys, types
sys.modules["torch"] = None  # `import torch` now raises ImportError
for name, path in (("hf_offload", {str(package.parent)!r}), ("hf_offload.memory_budget", {str(package)!r})):
    stub = types.ModuleType(name)
    stub.__path__ = [path]
    sys.modules[name] = stub
from hf_offload.memory_budget import closed_loop, host
from hf_offload.memory_budget.profile import LayerProfile, StepProfile
from hf_offload.memory_budget.search import choose_plan
layer = LayerProfile(saved_bytes=2 << 30, selective_bytes=1 << 30, input_bytes=1 << 26, forward_s=0.005,
                     backward_s=0.010, selective_recompute_s=0.002)
profile = StepProfile(layers=[layer] * 4, static_bytes=8 << 30, head_bytes=1 << 30, backward_working_bytes=2 << 30,
                      head_s=0.04, other_s=0.03, d2h_bytes_per_s=55e9, h2d_bytes_per_s=55e9, host_cap_bytes=64 << 30,
                      tokens=16384)
print(choose_plan(profile, 16 << 30).code, "torch" in sys.modules and sys.modules["torch"] is not None)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["SSSK", "False"]
