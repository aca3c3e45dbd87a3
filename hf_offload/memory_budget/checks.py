"""Checks of the numbers the memory budget's pure modules are given: ints that are ints to a user (not bools), byte
counts and seconds. An error names the value as `owner.name`."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

__all__ = ["is_int", "check_bytes", "check_seconds"]


def is_int(value: Any) -> bool:
    """Whether `value` is an int, and not a bool (True is an int to Python, not to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_bytes(owner: str, name: str, value: Any) -> None:
    if not is_int(value) or value < 0:
        raise ValueError(f"{owner}.{name} must be an int number of bytes >= 0, got {value!r}")


def check_seconds(owner: str, name: str, value: Any, positive: bool = False) -> None:
    number = not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value)
    if not number or value < 0 or (positive and value == 0):
        raise ValueError(f"{owner}.{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
