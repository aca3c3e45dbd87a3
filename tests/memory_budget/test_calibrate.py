"""What the measured plans teach the step model (`calibrate`), and the plans chosen with it (the zoo's failures of
dominance, its check (a) in benchmarks/zoo.py, rebuilt on S1's profile in proportion)."""

from __future__ import annotations

import dataclasses

import pytest
from step_profiles import s1_profile

from hf_offload.memory_budget.calibrate import Calibration, calibrate
from hf_offload.memory_budget.search import choose_plan
from hf_offload.memory_budget.simulate import MeasuredStep, simulate
from hf_offload.units import GIB

LAYERS = 16


def host_bound_profile():
    """S1 whose every time the probes measured 1.5x too long (the host paces short steps), and the measurements
    such a step makes: plain checkpointing at two thirds of the model's time, the safe plan 1.5 ms per layer slower
    (the host's work for each offloaded input), as on the zoo's 36-layer shape (1.1 ms)."""
    profile = s1_profile(other_s=0.0)
    kept = simulate(profile, "c" * LAYERS).step_s / 1.5
    offloaded = simulate(profile, "C" * LAYERS).step_s / 1.5 + LAYERS * 0.0015
    return profile, [MeasuredStep("c" * LAYERS, kept), MeasuredStep("C" * LAYERS, offloaded)]


def test_no_measurement_teaches_nothing():
    profile = s1_profile()
    calibrated, learned = calibrate(profile, [])
    assert calibrated == profile and learned == Calibration()


def test_the_scale_comes_from_a_plan_that_offloads_nothing_and_the_host_time_from_the_safe_plan():
    profile, measured = host_bound_profile()
    calibrated, learned = calibrate(profile, measured)
    assert learned.time_scale == pytest.approx(1 / 1.5)
    assert learned.input_offload_s == pytest.approx(0.0015, rel=0.05)  # the last input's copy is exposed anyway
    assert learned.learned_from == ("c" * LAYERS, "C" * LAYERS)
    for step in measured:  # the calibrated model predicts both
        assert simulate(calibrated, step.code).step_s == pytest.approx(step.step_s, rel=0.01)
    assert calibrated.layers[0].forward_s == pytest.approx(profile.layers[0].forward_s / 1.5)
    assert calibrated.d2h_bytes_per_s == profile.d2h_bytes_per_s  # the link is as measured
    assert learned.describe().startswith("the model's times x0.667, 1.47 ms per layer that offloads its input")


def test_the_safe_plan_alone_learns_no_scale_and_the_floors_hold():
    # Without a plan that offloads nothing, the rest of the step (`other_s`, from the safe plan's time) explains it.
    profile = s1_profile(input_offload_s=1e-5, saved_offload_s=1e-4)
    safe = MeasuredStep("C" * LAYERS, simulate(profile, "C" * LAYERS).step_s)
    calibrated, learned = calibrate(profile, [safe])
    assert learned.time_scale == 1.0 and calibrated.other_s == profile.other_s
    assert (learned.input_offload_s, learned.saved_offload_s) == (1e-5, 1e-4)


def test_whole_layer_offloads_that_ran_slower_than_the_model_cost_more_per_layer():
    # The zoo's Gemma-2 shape: 9 whole-layer offloads ran 61 ms over keeping everything, where the model hid them.
    profile, measured = host_bound_profile()
    code = "O" * 4 + "K" * 12
    calibrated, _ = calibrate(profile, measured)
    offloading = MeasuredStep(code, simulate(calibrated, code).step_s + 4 * 0.005)
    calibrated, learned = calibrate(profile, [*measured, offloading])
    assert learned.saved_offload_s == pytest.approx(0.005)
    assert simulate(calibrated, code).step_s == pytest.approx(offloading.step_s)


def test_until_a_whole_layer_offload_ran_each_tensor_it_sends_costs_what_an_input_did():
    """The zoo's LoRA shape (H100, 28 layers, 4K tokens): plans starting with 7-9 whole-layer offloads, each layer
    sending dozens of tensors through the engine's hooks, ran up to 1.6x the plans without them. Before any such plan
    ran, the host's time per offloaded input, learned from the safe plan, is each tensor's; once one ran, its own
    measurement rules."""
    profile, measured = host_bound_profile()
    counted = dataclasses.replace(profile, layers=[dataclasses.replace(layer, saved_tensors=20)
                                                   for layer in profile.layers])  # fmt: skip
    _, learned = calibrate(counted, measured)
    assert learned.saved_offload_s == pytest.approx(20 * learned.input_offload_s)
    assert calibrate(profile, measured)[1].saved_offload_s == 0.0  # not counted: nothing to go by
    code = "O" * 4 + "K" * 12
    calibrated, _ = calibrate(counted, measured)
    ran = MeasuredStep(code, simulate(calibrated, code).step_s - 4 * 0.02)  # the host hid most of it
    _, learned = calibrate(counted, [*measured, ran])
    assert learned.saved_offload_s < 20 * learned.input_offload_s


def test_with_what_it_learned_the_plan_keeps_inputs_rather_than_offloading_them():
    """The zoo's 36-layer shape at 65-75% of no offloading's peak: 'C' x 32 then 'K' x 4, 1.05-1.16x plain
    checkpointing, which fits those budgets. With the host's time per offloaded input learned, the plan keeps every
    input and spends the room on kept layers: expected faster than plain checkpointing measured."""
    profile, measured = host_bound_profile()
    budget = simulate(profile, "c" * LAYERS).peak_bytes + 3 * GIB
    before = choose_plan(profile, budget, budget // 200)
    assert "C" in before.code
    calibrated, _ = calibrate(profile, measured)
    after = choose_plan(calibrated, budget, budget // 200, measured)
    assert not set(after.code) & set("CSOX") and "K" in after.code, after.code
    assert after.expected_step_s < measured[0].step_s
    assert after.predicted.peak_bytes <= budget - budget // 200


def test_tiled_measurements_where_the_profile_cannot_tile_are_left_out():
    profile, measured = host_bound_profile()
    tiled = MeasuredStep("T" * LAYERS, 1.0)
    assert calibrate(profile, [*measured, tiled])[1] == calibrate(profile, measured)[1]


def test_a_scaled_profile_keeps_every_other_field():
    profile, measured = host_bound_profile()
    calibrated, _ = calibrate(dataclasses.replace(profile, tail_bytes=GIB, late_gradient_bytes=0), measured)
    assert calibrated.tail_bytes == GIB and calibrated.static_bytes == profile.static_bytes


def test_layers_tiled_whole_count_as_full_checkpoints_do():
    """`l` sends nothing, as `c` does: a plan of it scales the model's times, its tiled layers' extra time with them;
    `L` sends its input, as `C` does: what it ran beyond that is the host's time per offloaded input. Left out where
    the profile cannot tile whole layers."""
    from step_profiles import tiled_layer_profile

    profile = tiled_layer_profile(other_s=0.0)
    layers = len(profile.layers)
    kept = simulate(profile, "l" * layers).step_s / 2
    offloaded = simulate(profile, "L" * layers).step_s / 2 + layers * 0.002
    measured = [MeasuredStep("l" * layers, kept), MeasuredStep("L" * layers, offloaded)]
    calibrated, learned = calibrate(profile, measured)
    assert learned.time_scale == pytest.approx(0.5) and learned.learned_from == ("l" * layers, "L" * layers)
    # Some of the 2 ms is copies the halved compute no longer hides (2 GiB inputs): the host's time is the rest.
    assert 0.001 < learned.input_offload_s < 0.002
    for step in measured:  # the calibrated model predicts both
        assert simulate(calibrated, step.code).step_s == pytest.approx(step.step_s, rel=0.01)
    assert calibrated.layers[0].layer_tiled_extra_s == pytest.approx(profile.layers[0].layer_tiled_extra_s / 2)
    untiled = dataclasses.replace(profile, layer_tile_tokens=0)
    assert calibrate(untiled, [MeasuredStep("l" * layers, kept)]) == calibrate(untiled, [])
