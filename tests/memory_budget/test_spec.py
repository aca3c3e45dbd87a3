"""The user's memory budget: its forms, the errors for every other value, and the bytes it resolves to.

Pure Python: nothing here needs torch or a device.
"""

from __future__ import annotations

import math

import pytest

from hf_offload.memory_budget.spec import AUTO_MARGIN_MIN_BYTES, MemoryBudget, parse_memory_budget
from hf_offload.units import GIB


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


def test_memory_budget_max_tokens_is_checked_at_construction() -> None:
    from hf_offload import OffloadOptions

    with pytest.raises(ValueError, match=r"memory_budget_max_tokens=4096 needs a memory_budget"):
        OffloadOptions(memory_budget_max_tokens=4096)
    with pytest.raises(ValueError, match=r"memory_budget_max_tokens must be None or an int >= 1, got 0"):
        OffloadOptions(memory_budget_max_tokens=0, memory_budget="2GiB", device_type="cpu")
    options = OffloadOptions(memory_budget_max_tokens="4096", memory_budget="2GiB", device_type="cpu")  # command line
    assert options.memory_budget_max_tokens == 4096
