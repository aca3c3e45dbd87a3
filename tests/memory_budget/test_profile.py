"""Profiles of a step: their checks, and how they scale to another number of tokens.

Pure Python: nothing here needs torch or a device.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from step_profiles import long_profile, tiled_layer_profile, tiny_profile

from hf_offload.memory_budget.profile import LayerProfile, layer_tiling_available, tiling_available
from hf_offload.memory_budget.simulate import simulate
from hf_offload.units import GIB


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


def test_tiling_needs_a_step_longer_than_a_chunk() -> None:
    assert tiling_available(long_profile())
    assert not tiling_available(long_profile(tile_tokens=0))
    assert not tiling_available(long_profile(tile_tokens=262144))
    with pytest.raises(ValueError, match="tiles MLPs"):
        simulate(long_profile(tile_tokens=262144), "T" * 32)


def test_scaling_keeps_the_chunk() -> None:
    profile = long_profile()
    double = profile.scaled(2 * profile.tokens)
    assert double.tile_tokens == 4096 and double.tile_chunk_bytes == GIB
    assert double.tiled_backward_working_bytes == 16 * GIB
    assert double.layers[0].tiled_saved_bytes == 24 * GIB
    assert double.layers[0].tiled_extra_s == pytest.approx(0.4)


def test_tiling_whole_layers_needs_a_step_longer_than_a_chunk_and_scales_like_tiled_mlps() -> None:
    profile = tiled_layer_profile()
    assert layer_tiling_available(profile) and not layer_tiling_available(long_profile())
    assert not layer_tiling_available(tiled_layer_profile(layer_tile_tokens=262144))
    double = profile.scaled(2 * profile.tokens)
    assert (double.layer_tile_tokens, double.layer_tile_chunk_bytes) == (4096, GIB // 2)  # a chunk is a chunk
    assert double.layer_tiled_backward_working_bytes == 8 * GIB
    assert double.layers[0].layer_tiled_saved_bytes == 12 * GIB
    assert double.layers[0].layer_tiled_extra_s == pytest.approx(2.0)
    # Its extra attention forward grows with the square of the tokens.
    attention = tiled_layer_profile(layers=[dataclasses.replace(profile.layers[0], attention_forward_s=0.5)] * 32)
    assert attention.scaled(2 * profile.tokens).layers[0].layer_tiled_extra_s == pytest.approx(0.5 * 2 + 0.5 * 4)
