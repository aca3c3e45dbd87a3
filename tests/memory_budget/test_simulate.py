"""The step model on hand-computed examples, and the plan as data.

Pure Python: nothing here needs torch or a device.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from step_profiles import long_profile, s1_profile, tiled_layer_profile, tiny_profile

from hf_offload.memory_budget import simulate as step_model
from hf_offload.memory_budget.search import choose_plan
from hf_offload.memory_budget.simulate import MeasuredStep, Plan, simulate
from hf_offload.units import GIB

# The model, on examples computed by hand (tiny_profile: 100 bytes saved, 1 s forward, 2 s backward, 100 B/s)


def test_keep_everything() -> None:
    predicted = simulate(tiny_profile(), "KK")
    # Forward: 1100, 1200; head: 1000 + 200 + 50; backward: 1000 + 100 + 100 + 30, then 1000 + 100 + 30.
    assert (predicted.peak_bytes, predicted.peak_at) == (1250, "head")
    assert predicted.step_s == pytest.approx(0.5 + 2 * 1.0 + 1.0 + 2 * 2.0)
    assert (predicted.host_bytes, predicted.drain_s, predicted.forward_window_bytes) == (0, 0.0, 0)
    assert [(layer.held_bytes, layer.offloaded_bytes, layer.added_s) for layer in predicted.layers] == [
        (100, 0, 0.0), (100, 0, 0.0)]  # fmt: skip
    assert predicted.code == "KK"


@pytest.mark.parametrize(
    "code, held, offloaded, recompute_s, peak",
    [
        ("CK", 0, 10, 1.0, 1160),  # head: 1000 + 100 + 50 + the input's reload, issued as the head starts
        ("cK", 10, 0, 1.0, 1160),
        ("SK", 40, 10, 0.25, 1200),
        ("sK", 50, 0, 0.25, 1200),
    ],
)
def test_checkpointed_first_layer(code, held, offloaded, recompute_s, peak) -> None:
    predicted = simulate(tiny_profile(), code)
    first = predicted.layers[0]
    assert (first.held_bytes, first.offloaded_bytes, first.recompute_s, first.stall_s) == (
        held,
        offloaded,
        recompute_s,
        0.0,
    )
    assert (predicted.peak_bytes, predicted.peak_at) == (peak, "head")
    # The 10-byte input copy (0.1 s) hides under the second layer's forward, its reload under that layer's backward.
    assert predicted.step_s == pytest.approx(7.5 + recompute_s)
    assert predicted.host_bytes == predicted.forward_window_bytes == predicted.prefetch_window_bytes == offloaded


def test_copy_hidden_by_later_forward_costs_nothing() -> None:
    predicted = simulate(tiny_profile(), "OK")
    # The 100-byte copy (1 s) runs under layer 1's forward; its reload (1 s) under layer 1's backward (2 s).
    assert predicted.step_s == pytest.approx(7.5)
    assert predicted.drain_s == 0.0
    assert predicted.layers[0].added_s == 0.0
    # The head: static + layer 1's activations + the head + layer 0's reload, issued as the head starts (the engine's
    # walk passes over kept layers); layer 1's backward holds 20 bytes less (working bytes instead of the head).
    assert (predicted.peak_bytes, predicted.peak_at) == (1000 + 100 + 50 + 100, "head")
    assert predicted.forward_window_bytes == predicted.prefetch_window_bytes == predicted.host_bytes == 100


def test_copy_not_hidden_costs_the_drain() -> None:
    predicted = simulate(tiny_profile(), "KO")
    # The last layer's copy has no forward after it: the head waits 1 s for it. Its reload is issued as the head
    # starts, so it counts in the head's memory and finishes with the head (1 s): no stall.
    assert predicted.drain_s == pytest.approx(1.0)
    assert predicted.step_s == pytest.approx(7.5 + 1.0)
    assert predicted.layers[1].stall_s == 0.0
    assert (predicted.peak_bytes, predicted.peak_at) == (1000 + 100 + 50 + 100, "head")


def test_late_reload_stalls() -> None:
    predicted = simulate(tiny_profile(h2d_bytes_per_s=25.0), "OK")
    # Layer 0's reload (4 s) is issued as the head starts and outlasts the head and layer 1's backward (3 s) by 1 s.
    assert predicted.layers[0].stall_s == pytest.approx(1.0)
    assert predicted.layers[0].added_s == pytest.approx(1.0)
    assert predicted.step_s == pytest.approx(7.5 + 1.0)


def test_copies_queue_in_order() -> None:
    predicted = simulate(tiny_profile(d2h_bytes_per_s=50.0), "OO")
    # Copies of 2 s each: layer 0's runs 1 -> 3 s, layer 1's waits for it, 3 -> 5 s; the forward ends at 2 s.
    assert predicted.drain_s == pytest.approx(3.0)
    assert predicted.forward_window_bytes == 200  # at 2 s, both copies are in flight
    assert predicted.step_s == pytest.approx(7.5 + 3.0)
    # Layer 1's forward starts with layer 0's copy in flight: 1000 + 100 + 100; layer 1's backward also holds
    # layer 0's reload: 1000 + 100 + 30 + 100.
    assert (predicted.peak_bytes, predicted.peak_at) == (1230, "backward layer 1")


def test_copy_in_flight_can_make_the_forward_the_peak() -> None:
    predicted = simulate(tiny_profile(d2h_bytes_per_s=10.0, head_bytes=0, backward_working_bytes=0), "OK")
    # Layer 1 starts with layer 0's copy (10 s) in flight: 1000 + 100 + 100. Layer 1's backward reaches the same
    # (its activations and layer 0's reload): the earliest point is named.
    assert (predicted.peak_bytes, predicted.peak_at) == (1200, "forward layer 1")
    assert predicted.drain_s == pytest.approx(9.0)


def test_simulate_rejects_bad_codes() -> None:
    for code in ("K", "KKK", "KZ", "kk", ""):
        with pytest.raises(ValueError, match="one letter per layer"):
            simulate(tiny_profile(), code)


def test_every_offloaded_byte_is_counted_on_the_host() -> None:
    predicted = simulate(tiny_profile(), "OC")
    assert predicted.host_bytes == 110
    assert choose_plan(tiny_profile(host_cap_bytes=0), 1200).predicted.host_bytes == 0


def test_gradients_count_in_backward_only():
    # Keep everything: forward peak at layer 1 = 1000 + 100 + 100; head = 1000 + 200 + 50; backward layer 1 =
    # 1000 + 100 + 100 + 30. Gradients created in backward raise only the backward points.
    without = simulate(tiny_profile(), "KK")
    assert (without.peak_bytes, without.peak_at) == (1250, "head")
    with_gradients = simulate(tiny_profile(gradient_bytes=40), "KK")
    assert (with_gradients.peak_bytes, with_gradients.peak_at) == (1270, "backward layer 1")
    assert simulate(tiny_profile(gradient_bytes=10), "KK").peak_bytes == 1250  # the head still peaks


def test_gradients_of_earlier_layers_do_not_exist_yet():
    # Layer 1's backward comes before layer 0's: of 60 gradient bytes, layer 0's 15 are still to come there. Layer 1's
    # own 15 are created by its backward and are part of its working bytes (30), as the probe measures them: they
    # are not counted twice. So 1000 + 200 + 30 + (60 - 15 - 15).
    layer = tiny_profile().layers[0]
    layers = (dataclasses.replace(layer, parameter_gradient_bytes=15),) * 2
    predicted = simulate(tiny_profile(gradient_bytes=60, layers=layers), "KK")
    assert (predicted.peak_bytes, predicted.peak_at) == (1260, "backward layer 1")
    # Pending gradients never go below nothing (a gradient accumulation step holds them in static memory).
    assert simulate(tiny_profile(gradient_bytes=0, layers=layers), "KK").peak_bytes == 1250


def test_a_layers_own_gradients_count_once_in_its_backward():
    # On the zoo's Mistral-7B shape the model counted each layer's parameter gradients (0.41 GiB) both among the
    # gradients that exist and in the layer's working bytes: the lowest plan was predicted 0.65 GiB above what it
    # measured (with the embedding's gradient, below). One layer of 15 gradient bytes, its backward's working set 30
    # (the 15 included): 1000 + 100 + 30 + 15 at the backward would be 1145 twice counted.
    layer = dataclasses.replace(tiny_profile().layers[0], parameter_gradient_bytes=15)
    profile = tiny_profile(layers=(layer,), gradient_bytes=15, head_bytes=0)
    predicted = simulate(profile, "K")
    assert (predicted.peak_bytes, predicted.peak_at) == (1130, "backward layer 0")


def test_parameters_fsdp2_gathers_count_in_their_layer_and_in_the_backward_of_the_layer_after_it():
    # Layer 0's parameters, gathered (60 bytes), are held in its forward (1000 + 100 + 60), and again from layer 1's
    # backward on, which FSDP2 runs with layer 0 gathered ahead: 1000 + 10 (layer 0's input) + 100 + 30 + 60. Without
    # that prefetch, the forward's 1160 would be the peak.
    layers = tiny_profile().layers
    profile = tiny_profile(layers=(dataclasses.replace(layers[0], gathered_parameter_bytes=60), layers[1]))
    predicted = simulate(profile, "cc")
    assert (predicted.peak_bytes, predicted.peak_at) == (1200, "backward layer 1")
    assert simulate(tiny_profile(), "cc").peak_bytes == 1140
    # Its own gathered parameters count in its backward too: layer 1's 45, with layer 0's none, 1140 + 45.
    profile = tiny_profile(layers=(layers[0], dataclasses.replace(layers[1], gathered_parameter_bytes=45)))
    assert (simulate(profile, "cc").peak_bytes, simulate(profile, "cc").peak_at) == (1185, "backward layer 1")


def test_a_forwards_peak_raises_its_forward_and_a_recomputations_backward():
    # Each layer's forward peaks at 140 bytes, 40 of temporaries on top of its 100 saved. Kept, its forward holds
    # them (layer 1's: 1000 + 100 + 140 = 1240) but its backward does not (1000 + 200 + 30): the head's 1250 peaks,
    # as before. Checkpointed, layer 1's backward recomputes its forward, 140, while its output's gradient (10, an
    # input's size) waits: 1000 + 10 (layer 0's input) + max(100 + 30, 140 + 10) = 1160, where the model without
    # the peak said 1140 (and the forward's points 1000 + 140 and 1000 + 10 + 140 stay below).
    layer = dataclasses.replace(tiny_profile().layers[0], forward_peak_bytes=140)
    profile = tiny_profile(layers=(layer, layer))
    kept = simulate(profile, "KK")
    assert (kept.peak_bytes, kept.peak_at) == (1250, "head")
    assert (simulate(profile, "cc").peak_bytes, simulate(profile, "cc").peak_at) == (1160, "backward layer 1")
    for code in ("ss", "SS", "CC", "XX"):  # every action that recomputes, whatever it holds and sends
        assert simulate(profile, code).peak_bytes == simulate(tiny_profile(), code).peak_bytes + 20, code
        assert simulate(profile, code).peak_at == "backward layer 1"
    # One layer and no head: the forward's 1000 + 140 is the step's peak.
    alone = simulate(tiny_profile(layers=(layer,), head_bytes=0), "K")
    assert (alone.peak_bytes, alone.peak_at) == (1140, "forward layer 0")


def test_the_layers_call_arguments_raise_every_point_but_the_last_two_and_an_eager_mask_grows_with_the_square():
    # Keep everything: the head's 1250 peaks (test_keep_everything); 35 bytes of mask and tables raise it to 1285. After
    # the layers' backward they are gone: 1000 + 300 of gradients + the embeddings' output gradient 10 as the late
    # ones are made, then + 0 at the optimizer's point, where 1345 and 1335 would be the peak.
    profile = tiny_profile(call_argument_bytes=35, quadratic_call_argument_bytes=20)
    assert (simulate(profile, "KK").peak_bytes, simulate(profile, "KK").peak_at) == (1285, "head")
    with_gradients = dataclasses.replace(profile, gradient_bytes=300, late_gradient_bytes=300)
    assert (simulate(with_gradients, "KK").peak_bytes, simulate(with_gradients, "KK").peak_at) == (
        1310, "the input embeddings' gradient")  # fmt: skip
    # Twice the tokens: the mask's 20 bytes four times, the tables' 15 twice.
    doubled = profile.scaled(2 * profile.tokens)
    assert (doubled.call_argument_bytes, doubled.quadratic_call_argument_bytes) == (80 + 30, 80)
    with pytest.raises(ValueError, match="quadratic_call_argument_bytes is part of call_argument_bytes"):
        tiny_profile(call_argument_bytes=10, quadratic_call_argument_bytes=11)


def test_late_gradients_exist_only_after_every_layer_and_the_optimizer_step_is_a_point():
    # 1000 of gradients are the input embeddings': backward creates them after layer 0's backward. At every layer's
    # backward they do not exist yet; as they are made, every gradient does (1000 + 1020), with the gradient of the
    # embeddings' output (a layer's input, 10 bytes); at the optimizer's step every gradient and its temporaries.
    profile = tiny_profile(gradient_bytes=1020, late_gradient_bytes=1000)
    predicted = simulate(profile, "KK")
    assert (predicted.peak_bytes, predicted.peak_at) == (2030, "the input embeddings' gradient")
    assert simulate(dataclasses.replace(profile, optimizer_bytes=7), "KK").peak_bytes == 2030
    predicted = simulate(dataclasses.replace(profile, optimizer_bytes=11), "CC")
    assert (predicted.peak_bytes, predicted.peak_at) == (2031, "the optimizer step")
    # Without the late ones, layer 1's backward holds them all: 1000 + 200 + 30 + 1020.
    assert simulate(tiny_profile(gradient_bytes=1020), "KK").peak_bytes == 2250
    with pytest.raises(ValueError, match="late_gradient_bytes is part of gradient_bytes"):
        tiny_profile(gradient_bytes=10, late_gradient_bytes=11)


def test_the_engines_tail_is_held_through_the_head_only_where_something_is_offloaded():
    # The tail is at most `tail_bytes` of the offloaded bytes the head does not reload within its window. A plan that
    # offloads nothing has no tail. "OO": 200 offloaded, one layer's 100 reloaded at the head, the tail at most 100.
    profile = tiny_profile(tail_bytes=64, backward_working_bytes=0)
    assert simulate(profile, "cc").peak_bytes == simulate(tiny_profile(backward_working_bytes=0), "cc").peak_bytes
    assert simulate(profile, "OO").peak_bytes == 1000 + 50 + 100 + 64
    assert simulate(tiny_profile(tail_bytes=500, backward_working_bytes=0), "OO").peak_bytes == 1000 + 50 + 200
    assert simulate(profile, "OK").peak_bytes == simulate(tiny_profile(backward_working_bytes=0), "OK").peak_bytes


def test_the_engines_tail_holds_only_the_copies_unfinished_as_the_forward_ends():
    # The engine learns its tail as the copies still in flight when the forward ends; a layer's copy is queued as its
    # forward ends. "OOK" at 100 bytes/s: layer 0's copy runs from t=1 to 2, layer 1's from 2 to 3, and the forward
    # ends at t=3: nothing in flight, no tail, although 100 bytes were not reloaded at the head. "OO": the forward
    # ends at t=2 with layer 1's copy queued: its 100 bytes, under the bound of 500.
    profile = tiny_profile(tail_bytes=500, backward_working_bytes=0)
    three = dataclasses.replace(profile, layers=profile.layers[:1] * 3)
    assert simulate(profile, "OO").tail_bytes == 100
    assert simulate(three, "OOK").tail_bytes == 0
    assert simulate(three, "OOK").peak_bytes == simulate(dataclasses.replace(three, tail_bytes=0), "OOK").peak_bytes
    slow = dataclasses.replace(three, d2h_bytes_per_s=50.0)  # layer 1's copy runs from t=3 to 5
    assert simulate(slow, "OOK").tail_bytes == 100


def test_what_the_head_hides_of_its_reloads_lowers_the_head_only_and_by_its_reloads_at_most():
    # "OO": 200 offloaded, one layer's 100 reloaded at the head; the head's point 1000 + 500 + 100 is the peak.
    profile = tiny_profile(head_bytes=500, backward_working_bytes=0)
    base = step_model.simulated_step(profile, "OO")
    assert (base.peak_phase, base.head_base_bytes, base.head_reload_bytes) == ("head", 1500, 100)
    assert base.peak_bytes == 1500 + 100
    hidden_40 = step_model.simulated_step(dataclasses.replace(profile, head_reload_hidden_bytes=40), "OO")
    assert hidden_40.peak_bytes == 1500 + 60 and hidden_40.head_reload_bytes == 100  # counted before what hides
    hidden_all = simulate(dataclasses.replace(profile, head_reload_hidden_bytes=10**6), "OO")
    assert hidden_all.peak_bytes == 1500  # never below the head's point without its reloads
    assert simulate(dataclasses.replace(profile, head_reload_hidden_bytes=40), "cc") == simulate(profile, "cc")


def test_the_host_time_of_offloading_layers_is_added_to_the_step():
    layers = tiny_profile().layers * 2
    base = simulate(tiny_profile(layers=layers), "CcOK")
    costed = simulate(tiny_profile(layers=layers, input_offload_s=0.5, saved_offload_s=2.0), "CcOK")
    assert costed.step_s == pytest.approx(base.step_s + 0.5 + 2.0)
    assert [layer.host_s for layer in costed.layers] == [0.5, 0.0, 2.0, 0.0]
    assert costed.layers[0].added_s == pytest.approx(base.layers[0].added_s + 0.5)


@pytest.mark.parametrize("code", ["KK", "CC", "cc", "OK"])
def test_the_peak_correction_raises_every_point_and_changes_no_time(code):
    """What measured plans peaked above their prediction raises the peak wherever it is, and the budget the search
    fits plans in lowers by as much; the step's time is the model's."""
    base = simulate(tiny_profile(), code)
    corrected = simulate(tiny_profile(peak_correction_bytes=300), code)
    assert corrected.peak_bytes == base.peak_bytes + 300 and corrected.peak_at == base.peak_at
    assert corrected.step_s == base.step_s
    plan = choose_plan(tiny_profile(), base.peak_bytes)
    corrected_plan = choose_plan(tiny_profile(peak_correction_bytes=300), base.peak_bytes + 300)
    assert corrected_plan.code == plan.code
    assert corrected_plan.predicted.peak_bytes == plan.predicted.peak_bytes + 300


def test_selective_offloaded_layer_holds_nothing_and_sends_its_outputs():
    predicted = simulate(tiny_profile(), "XK")
    first = predicted.layers[0]
    assert (first.action, first.offload_input, first.code) == ("selective_offload", True, "X")
    assert (first.held_bytes, first.offloaded_bytes, first.recompute_s) == (0, 50, 0.25)  # 40 outputs + 10 input
    assert predicted.host_bytes == 50
    # The copy (0.5 s) hides under layer 1's forward, the reload (0.5 s) under the head: only the recompute is added.
    assert predicted.step_s == pytest.approx(7.5 + 0.25)


def test_a_wider_prefetch_window_hides_reloads_behind_several_layers():
    # Three offloaded layers, then a kept one: each reload (1 s at 100 B/s) is issued one layer ahead with the
    # narrowest window; a window of all three issues them as the last layer's backward starts.
    layer = tiny_profile().layers[0]
    profile = tiny_profile(layers=(layer,) * 4, h2d_bytes_per_s=40.0)  # a reload takes 2.5 s, a backward 2 s
    narrow = simulate(profile, "OOOK")
    wide = simulate(profile, "OOOK", prefetch_window_bytes=300)
    assert narrow.prefetch_window_bytes == 100 and wide.prefetch_window_bytes == 300
    assert sum(layer.stall_s for layer in narrow.layers) > 0
    assert wide.step_s < narrow.step_s
    # The head's reloads stay within the narrowest window: the head's memory is the same.
    head = 1000 + 100 + 50 + 100
    assert narrow.peak_bytes >= head and wide.peak_bytes >= head
    # Layer 3's backward holds the reloads of the three layers before it with the wide window.
    assert wide.peak_bytes == 1000 + 100 + 30 + 300
    assert simulate(profile, "OOOK", prefetch_window_bytes=50).prefetch_window_bytes == 100  # never below one layer


def test_plan_widens_the_window_as_far_as_the_budget_allows():
    layer = tiny_profile().layers[0]
    profile = tiny_profile(layers=(layer,) * 4, h2d_bytes_per_s=40.0)
    code = "OOOK"
    budget = simulate(profile, code, prefetch_window_bytes=200).peak_bytes
    options = step_model.code_options(profile, code)
    assert step_model.simulate_step(profile, options, limit=budget).prefetch_window_bytes == 200
    assert step_model.simulate_step(profile, options, limit=budget - 1).prefetch_window_bytes < 200


def test_a_plan_whose_layers_send_their_inputs_alone_reloads_one_layer_ahead_whatever_the_window():
    # The engine reloads such a plan's inputs one layer ahead (model_hooks' prefetch points), so the model counts
    # one reload outstanding at each layer's backward, whatever window or room it is offered; a plan with a layer
    # offloading its saved tensors is still widened as far as the room allows.
    layer = tiny_profile().layers[0]
    profile = tiny_profile(layers=(layer,) * 4, h2d_bytes_per_s=40.0)
    for code in ("CCCK", "CCSc"):
        narrow = simulate(profile, code)
        assert simulate(profile, code, prefetch_window_bytes=10**6) == narrow
        assert narrow.prefetch_window_bytes == layer.input_bytes
        options = step_model.code_options(profile, code)
        assert step_model.simulate_step(profile, options, limit=10**12).prefetch_window_bytes == layer.input_bytes
    code = "OCCK"
    options = step_model.code_options(profile, code)
    widened = step_model.simulate_step(profile, options, limit=10**12)
    assert widened.prefetch_window_bytes == widened.host_bytes == layer.saved_bytes + 2 * layer.input_bytes
    # Without prefetch points (a model without attention), unpacks reload as far ahead as the window allows.
    no_points = dataclasses.replace(profile, reloads_one_layer_ahead=False)
    assert simulate(no_points, "CCCK", prefetch_window_bytes=30).prefetch_window_bytes == 30


# On S1


def test_s1_profile_reproduces_its_h100_measurements() -> None:
    profile = s1_profile()
    for code, peak_gib in (("K" * 16, 38.88), ("S" * 16, 24.88), ("C" * 16, 12.35)):
        assert simulate(profile, code).peak_bytes / GIB == pytest.approx(peak_gib, abs=0.01)
    assert simulate(profile, "K" * 16).step_s == pytest.approx(0.307)


# Tiled MLPs (long context)


def test_a_tiled_layer_holds_one_chunk_of_its_mlp() -> None:
    profile = long_profile()
    # The reloads' window is one input (2 GiB): static + tiled activations + a chunk + tiled working + one reload.
    tiled = simulate(profile, "T" * 32)
    assert tiled.peak_bytes == (16 + 12 + 1 + 8 + 2) * GIB and tiled.peak_at == "backward layer 31"
    assert simulate(profile, "C" * 32).peak_bytes == (16 + 40 + 20 + 2) * GIB
    assert [layer.action for layer in tiled.layers] == ["full_tiled_mlp"] * 32
    assert tiled.layers[0].offload_input and not simulate(profile, "t" * 32).layers[0].offload_input
    # The recompute of a tiled layer runs its MLP's forward once more.
    assert tiled.step_s == pytest.approx(simulate(profile, "C" * 32).step_s + 32 * 0.2)


def test_a_layer_tiled_whole_holds_its_own_working_set_and_one_chunk() -> None:
    profile = tiled_layer_profile()
    # static + what the tiled layer's forward holds + a chunk + its backward's working bytes + one reload.
    tiled = simulate(profile, "L" * 32)
    assert tiled.peak_bytes == int((16 + 6 + 0.5 + 4 + 2) * GIB) and tiled.peak_at == "backward layer 31"
    assert [layer.action for layer in tiled.layers] == ["tiled_layer"] * 32
    # It holds and sends what a full checkpoint does: nothing and its input, or its input and nothing.
    assert [(layer.held_bytes, layer.offloaded_bytes) for layer in tiled.layers] == [(0, 2 * GIB)] * 32
    kept = simulate(profile, "l" * 32)
    assert [(layer.held_bytes, layer.offloaded_bytes) for layer in kept.layers] == [(2 * GIB, 0)] * 32
    assert not kept.layers[0].offload_input and kept.host_bytes == 0
    # Kept inputs pile up: at the last layer's backward, the 31 before it.
    assert kept.peak_bytes == int((16 + 31 * 2 + 6 + 0.5 + 4) * GIB)
    # Its recompute is a full checkpoint's and what tiling the whole layer adds.
    full = simulate(profile, "C" * 32)
    assert tiled.step_s == pytest.approx(full.step_s + 32 * 1.0)
    assert tiled.layers[0].recompute_s == pytest.approx(full.layers[0].recompute_s + 1.0)
    # Its forward holds `layer_tiled_saved_bytes` and a chunk: with nothing on top in backward, the peak is in the
    # forward (of layer 1, while layer 0's input is on its way to the host), as early as the backward's.
    layer = dataclasses.replace(profile.layers[0], layer_tiled_saved_bytes=30 * GIB)
    heavy = simulate(tiled_layer_profile(layer_tiled_backward_working_bytes=0, layers=[layer] * 32), "L" * 32)
    assert (heavy.peak_bytes, heavy.peak_at) == (int((16 + 2 + 30 + 0.5) * GIB), "forward layer 1")
    assert "layer tiled, input offloaded" in choose_plan(profile, 30 * GIB).format_table()


@pytest.mark.parametrize("code, field", [("T" * 32, "tiled_backward_sequence_bytes"),
                                         ("L" * 32, "layer_tiled_backward_sequence_bytes")])  # fmt: skip
def test_a_tiled_backward_holds_its_whole_sequence_phase_where_that_is_more(code, field) -> None:
    """A tiled layer's backward peaks while a chunk runs or in attention's phase over the whole sequence, whichever
    holds more: below the chunk phase the floor changes nothing, above it the layer's backward holds the floor (the
    same one reload and static memory around it)."""
    profile = tiled_layer_profile(layers=[dataclasses.replace(long_profile().layers[0], layer_tiled_saved_bytes=6 * GIB,
                                                              layer_tiled_extra_s=1.0)] * 32)  # fmt: skip
    chunk_phase = simulate(profile, code)
    at_layer = chunk_phase.peak_bytes - (16 + 2) * GIB  # static and one reload
    assert simulate(dataclasses.replace(profile, **{field: at_layer - GIB}), code).peak_bytes == chunk_phase.peak_bytes
    higher = simulate(dataclasses.replace(profile, **{field: at_layer + 5 * GIB}), code)
    assert (higher.peak_bytes, higher.peak_at) == (chunk_phase.peak_bytes + 5 * GIB, chunk_phase.peak_at)
    # It grows with the step's tokens, as the chunk phase's working bytes do, and the chunk does not.
    assert getattr(profile.scaled(2 * profile.tokens), field) == 0
    assert getattr(dataclasses.replace(profile, **{field: 3}).scaled(2 * profile.tokens), field) == 6


def test_tiling_whole_layers_needs_its_measurement() -> None:
    with pytest.raises(ValueError, match=r"tiles whole layers \(L, l\), but this profile has no tiled measurement .*"
                                         r"layer_tile_tokens=0"):  # fmt: skip
        simulate(long_profile(), "L" * 32)
    with pytest.raises(ValueError, match="layer_tile_tokens=262144"):  # a step of one chunk runs untiled
        simulate(tiled_layer_profile(layer_tile_tokens=262144), "l" * 32)
    assert "L" not in step_model.layer_options(long_profile(), long_profile().layers[0])


# The plan as data


def test_plan_round_trips_through_plain_data() -> None:
    result = choose_plan(s1_profile(), 20 * GIB)
    assert Plan.from_dict(result.to_dict()) == result
    assert Plan.from_dict(json.loads(json.dumps(result.to_dict()))) == result  # what a broadcast carries


def test_format_table() -> None:
    result = choose_plan(s1_profile(), 20 * GIB)
    lines = result.format_table().splitlines()
    assert lines[0].startswith("Memory plan for 16384 tokens per step, budget 20.00 GiB: predicted peak ")
    assert "(backward layer 15)" in lines[0] and f"step {result.predicted.step_s * 1000:.1f} ms" in lines[0]
    assert lines[1].split() == ["layer", "action", "kept", "GiB", "offloaded", "GiB", "added", "ms"]
    assert len(lines) == 2 + 16
    assert lines[2].split() == ["0", "full,", "input", "offloaded", "0.00", "0.06", "5.00"]
    assert lines[-1].split() == ["15", "keep", "1.77", "0.00", "0.00"]


def test_the_table_writes_bytes_in_the_unit_its_largest_figure_reads_in() -> None:
    """A tiny model's layers (the CPU test mode's) hold KiB: a GiB column would read 0.00 on every row."""
    profile = s1_profile().scaled(16)  # 1,024 times fewer tokens: each layer holds about 1.8 MiB
    lines = choose_plan(profile, 20 * GIB).format_table().splitlines()
    assert lines[1].split() == ["layer", "action", "kept", "MiB", "offloaded", "MiB", "added", "ms"]
    assert float(lines[-1].split()[-3]) > 1.0


def test_a_measurement_scales_with_the_model() -> None:
    profile = s1_profile()
    longer = profile.scaled(2 * profile.tokens)
    at, after = simulate(profile, "C" * 16), simulate(longer, "C" * 16)
    step = MeasuredStep("C" * 16, step_s=2 * at.step_s, peak_bytes=at.peak_bytes - GIB)
    scaled = step.scaled(profile, longer)
    assert math.isclose(scaled.step_s, 2 * after.step_s)  # what the model missed, in proportion
    assert scaled.peak_bytes == after.peak_bytes - GIB  # what the model missed, in bytes
    assert MeasuredStep("C" * 16, 0.1).scaled(profile, longer).peak_bytes is None


def test_a_measured_plan_round_trips_through_plain_data() -> None:
    profile = s1_profile()
    budget = simulate(profile, "C" * 16).peak_bytes - 1  # met by the measurement only
    result = choose_plan(profile, budget, measured=[MeasuredStep("C" * 16, 0.001, GIB)])
    assert result.measured is not None
    assert Plan.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert "Chosen by measurement: its steps ran in 1.0 ms at a peak of 1.00 GiB" in result.format_table()
