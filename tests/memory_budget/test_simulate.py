"""The memory-budget planner: budget parsing, the step model on hand-computed examples, and plans.

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
import sys
import time
from pathlib import Path

import pytest

from hf_offload.memory_budget import simulate as planner
from hf_offload.memory_budget.simulate import (
    AUTO_MARGIN_MIN_BYTES,
    GIB,
    InfeasibleBudgetError,
    LayerProfile,
    MeasuredStep,
    MemoryBudget,
    Plan,
    StepProfile,
    parse_memory_budget,
    plan,
    simulate,
)

MIB = 2**20


def s1_profile(layers: int = 16, **changes) -> StepProfile:
    """S1 of the issue's table (H100), rebuilt from its measurements.

    Full checkpointing offloads 1.0 GiB of inputs (64 MiB per layer). No checkpointing peaks at the last layer's
    backward: static + 16 x saved + working = 38.88 GiB; full checkpointing at static + saved + working + one input
    = 12.35 GiB, so saved = (38.88 - 12.35 + input) / 15 = 1.773 GiB. Selective checkpointing everywhere peaks at
    24.88 GiB = static + 15 x selective + saved + working + input, so selective = 0.8355 GiB. A full checkpoint
    recomputes 5 ms, a selective one 2.3 ms; the step without checkpointing takes 307 ms.
    """
    layer = LayerProfile(
        saved_bytes=int(1.773 * GIB),
        selective_bytes=int(0.8355 * GIB),
        input_bytes=64 * MIB,
        forward_s=0.005,
        backward_s=0.010,
        selective_recompute_s=0.0023,
    )
    profile = StepProfile(
        layers=(layer,) * layers,
        static_bytes=int(8.512 * GIB),
        head_bytes=int(1.5 * GIB),
        backward_working_bytes=2 * GIB,
        head_s=0.040,
        other_s=0.027,
        d2h_bytes_per_s=55e9,
        h2d_bytes_per_s=55e9,
        host_cap_bytes=64 * GIB,
        tokens=16384,
    )
    return dataclasses.replace(profile, **changes)


def tiny_profile(**changes) -> StepProfile:
    """Two layers in round numbers (bytes, seconds), for examples computed by hand."""
    layer = LayerProfile(saved_bytes=100, selective_bytes=40, input_bytes=10, forward_s=1.0, backward_s=2.0,
                         selective_recompute_s=0.25)  # fmt: skip
    profile = StepProfile(layers=(layer, layer), static_bytes=1000, head_bytes=50, backward_working_bytes=30,
                          head_s=1.0, other_s=0.5, d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0,
                          host_cap_bytes=10**6, tokens=1)  # fmt: skip
    return dataclasses.replace(profile, **changes)


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
    return simulate(profile, planner._lowest_memory_code(profile)).peak_bytes


# Budget parsing


@pytest.mark.parametrize(
    "value, nbytes",
    [
        (123456, 123456),
        ("123456", 123456),
        ("24GiB", 24 * 2**30),
        ("20000MiB", 20000 * 2**20),
        ("512KiB", 512 * 2**10),
        ("1.5TiB", 3 * 2**39),
        ("24GB", 24 * 10**9),
        ("100B", 100),
        ("24 gib", 24 * 2**30),
        (" 2.5 mb ", 2_500_000),
        ("0.3KB", 300),  # exact decimal arithmetic: not 299
    ],
)
def test_parse_sizes(value, nbytes) -> None:
    budget = parse_memory_budget(value)
    assert budget == MemoryBudget(nbytes=nbytes)
    assert budget.resolve(None) == nbytes  # a size needs no device
    assert str(budget) == str(value).strip()


def test_parse_none_auto_and_percentages() -> None:
    assert parse_memory_budget(None) is None
    assert parse_memory_budget("none") is None
    assert parse_memory_budget("None") is None
    assert parse_memory_budget("auto") == parse_memory_budget("AUTO") == MemoryBudget()
    assert str(parse_memory_budget("auto")) == "auto"
    assert parse_memory_budget("60%") == MemoryBudget(percent=60.0)
    assert parse_memory_budget("100%").percent == 100.0
    assert parse_memory_budget("0.5 %").percent == 0.5
    assert str(parse_memory_budget("60%")) == "60%"
    budget = parse_memory_budget("24GiB")
    assert parse_memory_budget(budget) is budget


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        0,
        -1,
        1.5,
        24e9,
        math.nan,
        math.inf,
        "nan",
        "inf",
        "",
        "  ",
        "0",
        "-1",
        "-1GiB",
        "0GiB",
        "0.1B",
        "1.5",
        "24e9",
        "24 GiBs",
        "24XB",
        "GiB",
        "abc",
        "0%",
        "-5%",
        "100.5%",
        "101%",
        "60%%",
        [24],
        {"bytes": 1},
    ],
)
def test_parse_rejects_everything_else(value) -> None:
    with pytest.raises(ValueError, match=r"^memory_budget must be None.*'auto'.*'24GiB'.*'60%'; got"):
        parse_memory_budget(value)


def test_parse_names_the_option_given() -> None:
    with pytest.raises(ValueError, match=r"^activation_offloading_memory_budget must be .*got '12 parsecs'"):
        parse_memory_budget("12 parsecs", option="activation_offloading_memory_budget")


def test_resolve() -> None:
    device = 80 * GIB
    assert parse_memory_budget("60%").resolve(device) == 48 * GIB
    assert parse_memory_budget("100%").resolve(device) == device
    assert parse_memory_budget("auto").resolve(device) == device - 4 * GIB  # 5% of 80 GiB is above 2 GiB
    assert parse_memory_budget("auto").resolve(16 * GIB) == 14 * GIB  # at least 2 GiB
    for relative in ("60%", "auto"):
        with pytest.raises(ValueError, match="no device to ask.*give a size in bytes"):
            parse_memory_budget(relative).resolve(None)
    with pytest.raises(ValueError, match="'auto' leaves nothing"):
        parse_memory_budget("auto").resolve(AUTO_MARGIN_MIN_BYTES)
    with pytest.raises(ValueError, match="either a size or a percentage"):
        MemoryBudget(nbytes=1, percent=50.0)


# Profiles


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("saved_bytes", -1, "LayerProfile.saved_bytes must be an int number of bytes >= 0"),
        ("input_bytes", 1.5, "LayerProfile.input_bytes"),
        ("selective_bytes", True, "LayerProfile.selective_bytes"),
        ("forward_s", math.nan, "LayerProfile.forward_s must be a finite number >= 0"),
        ("backward_s", math.inf, "LayerProfile.backward_s"),
        ("selective_recompute_s", -0.1, "LayerProfile.selective_recompute_s"),
        ("attention_forward_s", 2.0, "attention_forward_s is part of forward_s"),
    ],
)
def test_layer_profile_validation(field, value, message) -> None:
    layer = tiny_profile().layers[0]
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(layer, **{field: value})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("layers", (), "StepProfile.layers must be one or more LayerProfile"),
        ("static_bytes", -5, "StepProfile.static_bytes"),
        ("host_cap_bytes", 2.0**30, "StepProfile.host_cap_bytes"),
        ("head_s", math.nan, "StepProfile.head_s"),
        ("d2h_bytes_per_s", 0, "StepProfile.d2h_bytes_per_s must be a finite number > 0"),
        ("h2d_bytes_per_s", math.inf, "StepProfile.h2d_bytes_per_s"),
        ("tokens", 0, "StepProfile.tokens must be an int > 0"),
    ],
)
def test_step_profile_validation(field, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_profile(**{field: value})


def test_scaled() -> None:
    layer = LayerProfile(saved_bytes=101, selective_bytes=40, input_bytes=10, forward_s=1.0, backward_s=2.0,
                         selective_recompute_s=0.25, attention_forward_s=0.5, attention_backward_s=1.0)  # fmt: skip
    profile = tiny_profile(layers=[layer], tokens=2)
    doubled = profile.scaled(4)
    assert doubled.tokens == 4
    assert doubled.layers[0] == LayerProfile(
        saved_bytes=202, selective_bytes=80, input_bytes=20,
        forward_s=0.5 * 2 + 0.5 * 4, backward_s=1.0 * 2 + 1.0 * 4, selective_recompute_s=0.5,
        attention_forward_s=2.0, attention_backward_s=4.0,
    )  # fmt: skip
    assert (doubled.static_bytes, doubled.host_cap_bytes) == (profile.static_bytes, profile.host_cap_bytes)
    assert (doubled.head_bytes, doubled.backward_working_bytes) == (100, 60)
    assert (doubled.head_s, doubled.other_s) == (2.0, 1.0)
    assert (doubled.d2h_bytes_per_s, doubled.h2d_bytes_per_s) == (100.0, 100.0)
    assert profile.scaled(3).layers[0].saved_bytes == 152  # 151.5 rounded up: never under the real size
    assert profile.scaled(2) == profile
    with pytest.raises(ValueError, match="tokens must be an int > 0"):
        profile.scaled(0)


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
    assert plan(tiny_profile(host_cap_bytes=0), 1200).predicted.host_bytes == 0


# Plans on S1


def test_s1_profile_reproduces_the_issue() -> None:
    profile = s1_profile()
    for code, peak_gib in (("K" * 16, 38.88), ("S" * 16, 24.88), ("C" * 16, 12.35)):
        assert simulate(profile, code).peak_bytes / GIB == pytest.approx(peak_gib, abs=0.01)
    assert simulate(profile, "K" * 16).step_s == pytest.approx(0.307)


def test_budget_of_everything_changes_nothing() -> None:
    profile = s1_profile()
    keep_all = simulate(profile, "K" * 16)
    for budget in (keep_all.peak_bytes, 80 * GIB):
        result = plan(profile, budget)
        assert result.code == "K" * 16
        assert result.predicted == keep_all
        assert result.forward_window_bytes == result.prefetch_window_bytes == 0


def test_sweep_of_budgets_never_exceeds_and_never_gets_faster() -> None:
    profile = s1_profile()
    keep_all = simulate(profile, "K" * 16)
    previous = None
    for percent in range(100, 34, -1):
        budget = keep_all.peak_bytes * percent // 100
        result = plan(profile, budget)
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
def test_plan_beats_or_equals_the_issues_hand_plans(hand_plan) -> None:
    profile = s1_profile()
    hand = simulate(profile, hand_plan)
    result = plan(profile, hand.peak_bytes)
    assert result.predicted.peak_bytes <= hand.peak_bytes
    assert result.predicted.step_s <= hand.step_s


@pytest.mark.parametrize("layers", [4, 5])
def test_plan_is_the_exhaustive_optimum_on_uniform_layers(layers) -> None:
    profile = s1_profile(layers)
    predictions = [simulate(profile, "".join(code)) for code in itertools.product(planner._PLANNED, repeat=layers)]
    low, high = lowest_peak(profile), simulate(profile, "K" * layers).peak_bytes
    for step in range(41):
        budget = low + (high - low) * step // 40
        fastest = min(p.step_s for p in predictions if p.peak_bytes <= budget)
        assert plan(profile, budget).predicted.step_s == pytest.approx(fastest, rel=1e-12)


def test_budget_below_the_minimum_names_it() -> None:
    profile = s1_profile()
    minimum = simulate(profile, "C" * 16).peak_bytes
    assert plan(profile, minimum).code == "C" * 15 + "K"  # the last layer's activations count at its backward anyway
    with pytest.raises(ValueError) as error:
        plan(profile, minimum - 1)
    message = str(error.value)
    assert f"{minimum / GIB:.2f} GiB ({minimum} bytes" in message
    assert f"({minimum - 1} bytes)" in message
    assert "dominated by static memory (parameters, gradients, optimizer state) 8.51 GiB" in message
    assert "layer 15's working set" in message

    with pytest.raises(ValueError, match="dominated by the head and loss 30.00 GiB"):
        plan(s1_profile(head_bytes=30 * GIB), 20 * GIB)


def test_no_host_room_means_no_offloading() -> None:
    profile = s1_profile(host_cap_bytes=0)
    assert planner._lowest_memory_code(profile) == "c" * 16
    for percent in (40, 60, 80):
        result = plan(profile, simulate(profile, "K" * 16).peak_bytes * percent // 100)
        assert result.predicted.host_bytes == 0
        assert set(result.code) <= set("Ksc")
    # Room for 4 inputs: the lowest-memory plan offloads the first 4.
    assert planner._lowest_memory_code(s1_profile(host_cap_bytes=256 * MIB)) == "CCCC" + "c" * 12


def test_random_profiles_never_exceed_and_never_lose_to_full_checkpointing() -> None:
    rng = random.Random(1234)
    for _ in range(150):
        profile = random_profile(rng, rng.randint(1, 12))
        layers = len(profile.layers)
        low, high = lowest_peak(profile), simulate(profile, "K" * layers).peak_bytes
        full = simulate(profile, "C" * layers)
        for budget in (low, rng.randint(low, high), high, high + GIB):
            result = plan(profile, budget)
            assert result.predicted.peak_bytes <= budget
            assert result.predicted.host_bytes <= profile.host_cap_bytes
            assert result.predicted == simulate(profile, result.code, result.prefetch_window_bytes)
            if full.peak_bytes <= budget and full.host_bytes <= profile.host_cap_bytes:
                assert result.predicted.step_s <= full.step_s
        with pytest.raises(ValueError, match="below the smallest peak"):
            plan(profile, low - 1)


def test_planning_128_layers_is_fast(monkeypatch) -> None:
    calls = []
    simulate_once = planner._simulate

    def counted(*args, **kwargs):
        calls.append(1)
        return simulate_once(*args, **kwargs)

    monkeypatch.setattr(planner, "_simulate", counted)
    rng = random.Random(7)
    for profile in (s1_profile(128), random_profile(rng, 128), random_profile(rng, 128)):
        low, high = lowest_peak(profile), simulate(profile, "K" * 128).peak_bytes
        for fraction in (0.0, 0.05, 0.3, 0.7, 0.99):
            calls.clear()
            start = time.perf_counter()
            result = plan(profile, int(low + (high - low) * fraction))
            assert time.perf_counter() - start < 5.0
            assert len(calls) <= 12 * 128, len(calls)  # a few simulations per layer, each linear in the layers
            assert len(result.layers) == 128


# The plan as data


def test_plan_round_trips_through_plain_data() -> None:
    result = plan(s1_profile(), 20 * GIB)
    assert Plan.from_dict(result.to_dict()) == result
    assert Plan.from_dict(json.loads(json.dumps(result.to_dict()))) == result  # what a broadcast carries


def test_plan_layers_and_windows() -> None:
    profile = s1_profile()
    result = plan(profile, 20 * GIB)
    assert result.code == "CCCCCCSSSSSSSSSK"
    assert [layer.action for layer in result.layers[5:7]] == ["full", "selective"]
    assert all(layer.offload_input for layer in result.layers[:15]) and not result.layers[15].offload_input
    assert result.head_prefetch_window_bytes == 64 * MIB  # the head reloads one input ahead
    # Backward reloads as far ahead as the budget allows: one more input would not fit.
    assert result.prefetch_window_bytes >= 64 * MIB
    assert simulate(profile, result.code, result.prefetch_window_bytes).peak_bytes <= 20 * GIB
    assert simulate(profile, result.code, result.prefetch_window_bytes + 64 * MIB).peak_bytes > 20 * GIB
    assert result.forward_window_bytes == 64 * MIB  # each input copy (1.2 ms) ends within the next forward (5 ms)
    assert result.tokens == profile.tokens and result.budget_bytes == 20 * GIB


def test_format_table() -> None:
    result = plan(s1_profile(), 20 * GIB)
    lines = result.format_table().splitlines()
    assert lines[0].startswith("Memory plan for 16384 tokens per step, budget 20.00 GiB: predicted peak ")
    assert "(backward layer 15)" in lines[0] and f"step {result.predicted.step_s * 1000:.1f} ms" in lines[0]
    assert lines[1].split() == ["layer", "action", "kept", "GiB", "offloaded", "GiB", "added", "ms"]
    assert len(lines) == 2 + 16
    assert lines[2].split() == ["0", "full,", "input", "offloaded", "0.00", "0.06", "5.00"]
    assert lines[-1].split() == ["15", "keep", "1.77", "0.00", "0.00"]


# The module itself


def test_docstring_examples() -> None:
    layer = LayerProfile(saved_bytes=2 * GIB, selective_bytes=GIB, input_bytes=GIB // 16, forward_s=0.005,
                         backward_s=0.010, selective_recompute_s=0.002)  # fmt: skip
    profile = StepProfile(layers=[layer] * 4, static_bytes=8 * GIB, head_bytes=GIB, backward_working_bytes=2 * GIB,
                          head_s=0.04, other_s=0.03, d2h_bytes_per_s=55e9, h2d_bytes_per_s=55e9,
                          host_cap_bytes=64 * GIB, tokens=16384)  # fmt: skip
    failures, tried = doctest.testmod(planner, extraglobs={"profile": profile})
    assert tried >= 7 and failures == 0


def test_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(planner.__file__).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    # units: the package's byte units, which import nothing (tests/test_units.py)
    assert {name.split(".")[0] for name in modules} <= set(sys.stdlib_module_names) | {"__future__", "units"}


def test_gradients_count_in_backward_only():
    # Keep everything: forward peak at layer 1 = 1000 + 100 + 100; head = 1000 + 200 + 50; backward layer 1 =
    # 1000 + 100 + 100 + 30. Gradients created in backward raise only the backward points.
    without = simulate(tiny_profile(), "KK")
    assert (without.peak_bytes, without.peak_at) == (1250, "head")
    with_gradients = simulate(tiny_profile(gradient_bytes=40), "KK")
    assert (with_gradients.peak_bytes, with_gradients.peak_at) == (1270, "backward layer 1")
    assert simulate(tiny_profile(gradient_bytes=10), "KK").peak_bytes == 1250  # the head still peaks


def test_a_margin_keeps_the_predicted_peak_below_the_budget():
    profile = s1_profile()
    budget = int(0.66 * simulate(profile, "K" * 16).peak_bytes)
    margin = GIB
    assert plan(profile, budget, margin).predicted.peak_bytes + margin <= budget
    assert plan(profile, budget, margin).predicted.step_s >= plan(profile, budget).predicted.step_s
    lowest = simulate(profile, "C" * 16).peak_bytes
    with pytest.raises(InfeasibleBudgetError, match="smallest budget that works is") as error:
        plan(profile, lowest + margin // 2, margin)
    # The error carries its figures and the lowest-memory plan, for a caller that must run the step anyway.
    assert isinstance(error.value, ValueError)
    refused = error.value
    assert (refused.budget_bytes, refused.minimum_bytes) == (lowest + margin // 2, lowest + margin)
    assert refused.lowest_plan.code == "C" * 16
    assert refused.lowest_plan.predicted == simulate(profile, "C" * 16, refused.lowest_plan.prefetch_window_bytes)
    assert plan(profile, refused.minimum_bytes, margin).predicted.peak_bytes + margin <= refused.minimum_bytes


def test_gradients_of_earlier_layers_do_not_exist_yet():
    # Layer 1's backward comes before layer 0's: of 40 gradient bytes, layer 0's 15 are still to come there.
    layer = tiny_profile().layers[0]
    layers = (dataclasses.replace(layer, parameter_gradient_bytes=15),) * 2
    predicted = simulate(tiny_profile(gradient_bytes=40, layers=layers), "KK")
    assert (predicted.peak_bytes, predicted.peak_at) == (1255, "backward layer 1")  # 1000 + 200 + 30 + 40 - 15
    # Pending gradients never go below nothing (a gradient accumulation step holds them in static memory).
    assert simulate(tiny_profile(gradient_bytes=0, layers=layers), "KK").peak_bytes == 1250


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
    options = [planner._layer_options(profile, layer)[letter] for layer, letter in zip(profile.layers, code)]
    assert planner._simulate(profile, options, limit=budget).prefetch_window_bytes == 200
    assert planner._simulate(profile, options, limit=budget - 1).prefetch_window_bytes < 200


def test_the_selective_offload_is_for_hand_written_plans_only():
    # Measured on the H100, its layers cost more than the model says: the planner never chooses it.
    profile = s1_profile()
    keep_all = simulate(profile, "K" * 16)
    for percent in range(35, 100, 5):
        assert "X" not in plan(profile, keep_all.peak_bytes * percent // 100).code
    assert simulate(profile, "X" * 16).layers[0].code == "X"


# Tiled MLPs (long context)


def long_profile(**changes) -> StepProfile:
    """An 8B-shape step at 256K tokens in round numbers: a layer's untiled activations (40 GiB, 20 GiB of gradient
    buffers) cannot fit next to 16 GiB of weights on an 80 GiB device; tiled, its MLP's intermediates shrink to one
    chunk (1 GiB) and the layer's working set to 12 + 1 + 8 GiB. The host holds all 32 inputs (2 GiB each)."""
    layer = LayerProfile(
        saved_bytes=40 * GIB,
        selective_bytes=20 * GIB,
        input_bytes=2 * GIB,
        forward_s=2.0,
        backward_s=5.0,
        selective_recompute_s=0.5,
        tiled_saved_bytes=12 * GIB,
        tiled_extra_s=0.2,
    )
    profile = StepProfile(layers=(layer,) * 32, static_bytes=16 * GIB, head_bytes=3 * GIB,
                          backward_working_bytes=20 * GIB, head_s=1.0, other_s=0.5, d2h_bytes_per_s=55e9,
                          h2d_bytes_per_s=55e9, host_cap_bytes=64 * GIB, tokens=262144, tile_tokens=4096,
                          tiled_backward_working_bytes=8 * GIB, tile_chunk_bytes=GIB)  # fmt: skip
    return dataclasses.replace(profile, **changes)


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


def test_tiling_is_chosen_only_when_no_plan_without_it_fits() -> None:
    profile = long_profile()
    untiled = plan(profile, 80 * GIB)
    assert not set(untiled.code) & set("Tt") and untiled.tile_tokens == 0 and untiled.tiled_layers == []
    tiled = plan(profile, 60 * GIB)
    # The last layer's input is needed first in backward: kept, it costs no copy and the peak has room for it.
    assert tiled.code == "T" * 31 + "t" and tiled.tile_tokens == 4096 and tiled.tiled_layers == list(range(32))
    assert tiled.predicted.peak_bytes <= 60 * GIB
    assert "The MLPs of 32 layers run in chunks of 4096 tokens" in tiled.format_table()
    assert Plan.from_dict(json.loads(json.dumps(tiled.to_dict()))) == tiled
    # A measured tiled plan, however fast, does not replace an exact plan that fits...
    fast_tiled = MeasuredStep("T" * 32, step_s=0.001)
    assert plan(profile, 80 * GIB, measured=[fast_tiled]).code == untiled.code
    assert plan(profile, 80 * GIB, measured=[fast_tiled], measured_only=True).code == untiled.code
    # ... and where none fits, an exact plan that fit by measurement beats the tiled ones.
    exact = MeasuredStep("C" * 32, step_s=10.0, peak_bytes=60 * GIB)
    assert plan(profile, 60 * GIB, measured=[fast_tiled, exact]).measured == exact


def test_polishing_takes_back_the_tiling_the_peak_does_not_need() -> None:
    # The first layers' backward comes last, when their parameter gradients have not all been created yet, and the
    # later layers' inputs are gone: with gradients of 16 GiB that frees enough for the first layers to go untiled.
    layers = [dataclasses.replace(long_profile().layers[0], parameter_gradient_bytes=GIB // 2)] * 32
    profile = long_profile(layers=layers, gradient_bytes=16 * GIB, static_bytes=10 * GIB)
    result = plan(profile, 78 * GIB)
    assert "C" in result.code and "T" in result.code, result.code
    assert result.predicted.peak_bytes <= 78 * GIB
    assert result.predicted.step_s < simulate(profile, "T" * 32).step_s


def test_tiling_is_not_enough_names_what_dominates() -> None:
    with pytest.raises(ValueError, match="with every layer's MLP tiled") as error:
        plan(long_profile(), 30 * GIB)
    assert "plan 'TTTT" in str(error.value)
    with pytest.raises(ValueError) as error:  # tiling not measured: the error is about the untiled plan
        plan(long_profile(tile_tokens=0), 60 * GIB)
    assert "plan 'CCCC" in str(error.value) and "tiled" not in str(error.value)


def test_tiling_needs_a_step_longer_than_a_chunk() -> None:
    assert planner.tiling_available(long_profile())
    assert not planner.tiling_available(long_profile(tile_tokens=0))
    assert not planner.tiling_available(long_profile(tile_tokens=262144))
    with pytest.raises(ValueError, match="tiles MLPs"):
        simulate(long_profile(tile_tokens=262144), "T" * 32)


def test_scaling_keeps_the_chunk() -> None:
    profile = long_profile()
    double = profile.scaled(2 * profile.tokens)
    assert double.tile_tokens == 4096 and double.tile_chunk_bytes == GIB
    assert double.tiled_backward_working_bytes == 16 * GIB
    assert double.layers[0].tiled_saved_bytes == 24 * GIB
    assert double.layers[0].tiled_extra_s == pytest.approx(0.4)


def test_a_full_host_is_said() -> None:
    profile = long_profile(host_cap_bytes=40 * GIB)  # room for 20 of the 32 inputs
    result = plan(profile, 70 * GIB)
    assert result.code == "T" * 20 + "t" * 12
    assert result.inputs_kept_for_host == list(range(20, 32))
    assert (
        "12 checkpointed layers keep their input on the GPU: the host's pinned cap of 40.00 GiB is full"
        in result.format_table()
    )
    assert plan(long_profile(), 60 * GIB).inputs_kept_for_host == []


# Dominance: measured plans beat the model


def test_a_budget_a_measured_plan_met_is_not_refused() -> None:
    """The model over-predicts the lowest plan's peak (the issue's Mistral-7B shape: 17.57 GiB predicted, 16.72
    GiB measured); a budget between the two is met by the measured plan, not refused."""
    profile = s1_profile()
    predicted = simulate(profile, "C" * 16)
    budget = predicted.peak_bytes - GIB // 2
    with pytest.raises(InfeasibleBudgetError):
        plan(profile, budget)
    safe = MeasuredStep("C" * 16, step_s=predicted.step_s, peak_bytes=predicted.peak_bytes - GIB)
    result = plan(profile, budget, margin_bytes=budget // 200, measured=[safe])
    assert (result.code, result.measured) == ("C" * 16, safe)
    assert result.fits(budget // 200) and result.predicted.peak_bytes > budget  # by its measured peak
    with pytest.raises(InfeasibleBudgetError) as error:  # a measured peak over the budget is no way out...
        plan(profile, budget, measured=[dataclasses.replace(safe, peak_bytes=budget + 1)])
    # ... but it is the smallest budget known to work, below the predicted one.
    assert error.value.minimum_bytes == budget + 1
    assert f"Measured, plan {'C' * 16!r} peaked at " in str(error.value)
    assert str(error.value).endswith(f"({budget + 1} bytes): the smallest budget known to work.")


def test_the_plan_is_never_slower_than_a_measured_plan_that_fits() -> None:
    profile = s1_profile()
    budget = 20 * GIB
    chosen = plan(profile, budget)
    assert chosen.code != "C" * 16 and chosen.measured is None
    # The model's choice ran slower than predicted, and nothing else was measured: the model is as wrong about the
    # other plans, whose predictions are scaled by its error, and the plan stays.
    slow = MeasuredStep(chosen.code, step_s=0.5)
    again = plan(profile, budget, measured=[slow])
    assert (again.code, again.measured) == (chosen.code, slow)
    assert math.isclose(again.time_scale, slow.step_s / chosen.predicted.step_s)
    # The safe plan, measured as predicted, puts the model's error between the two (the median of their ratios):
    # the plans that never ran are expected slower than the safe plan measured, which wins.
    as_predicted = MeasuredStep("C" * 16, step_s=simulate(profile, "C" * 16).step_s)
    switched = plan(profile, budget, measured=[slow, as_predicted])
    assert switched.measured == as_predicted
    assert math.isclose(switched.time_scale, (1 + slow.step_s / chosen.predicted.step_s) / 2)
    # A closed loop's last correction keeps to what was measured.
    slower_safe = MeasuredStep("C" * 16, step_s=0.45)
    assert plan(profile, budget, measured=[slow, slower_safe], measured_only=True).measured == slower_safe
    # ... unless a measured plan ran faster than any prediction: it wins, by its measurement.
    safe = MeasuredStep("C" * 16, step_s=0.2)
    assert plan(profile, budget, measured=[slow, safe]).measured == safe
    # Keeping everything fits a roomy budget, unless it measured slower than a measured plan.
    assert plan(profile, 64 * GIB).code == "K" * 16
    assert plan(profile, 64 * GIB, measured=[MeasuredStep("K" * 16, 0.5), safe]).measured == safe
    # A plan whose measured peak exceeds the budget is not chosen, however fast it ran.
    over = MeasuredStep(chosen.code, step_s=0.01, peak_bytes=budget + 1)
    assert plan(profile, budget, measured=[over]).code != chosen.code


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
    result = plan(profile, budget, measured=[MeasuredStep("C" * 16, 0.001, GIB)])
    assert result.measured is not None
    assert Plan.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert "Chosen by measurement: its steps ran in 1.0 ms at a peak of 1.00 GiB" in result.format_table()
