"""Amounts of memory as people read them: in the unit that shows them, from one formatter (`hf_offload.units`)."""

import doctest

import pytest

from hf_offload import units
from hf_offload.memory_budget.profile import LayerProfile, StepProfile
from hf_offload.memory_budget.search import choose_plan
from hf_offload.stats import format_summary


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (1000, "1000 B"), (1024, "1.00 KiB"), (28 * 2**10, "28.00 KiB"), (1.5 * 2**20, "1.50 MiB"),
     (2**30 - 1, "1024.00 MiB"), (80 * 2**30, "80.00 GiB")],
)  # fmt: skip
def test_format_bytes_writes_the_largest_unit_that_keeps_a_number_of_at_least_one(nbytes, text):
    assert units.format_bytes(nbytes) == text


def test_the_examples_in_the_docstrings_hold():
    assert doctest.testmod(units).failed == 0


def test_a_tiny_budget_too_small_for_any_plan_is_written_in_bytes():
    layer = LayerProfile(saved_bytes=100, selective_bytes=40, input_bytes=10, forward_s=1.0, backward_s=2.0,
                         selective_recompute_s=0.25)  # fmt: skip
    profile = StepProfile(layers=(layer, layer), static_bytes=1000, head_bytes=50, backward_working_bytes=30,
                          head_s=1.0, other_s=0.5, d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0,
                          host_cap_bytes=10**6, tokens=1)  # fmt: skip
    with pytest.raises(ValueError) as error:
        choose_plan(profile, 1000)
    assert "0.00 GiB" not in str(error.value)
    assert str(error.value).startswith("the memory budget of 1000 B (1000 bytes) is below the smallest peak")


def test_the_summary_writes_each_size_in_the_unit_that_shows_it():
    summary = format_summary({"steps": 1, "bytes_offloaded": 28 * 2**10, "tensors_offloaded": 3, "pinned_bytes": 512})
    assert "moved to host memory per step: 28.00 KiB (3 tensors)" in summary and "512 B" in summary
