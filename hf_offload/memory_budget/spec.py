"""The user's memory budget: the forms it takes, and the bytes it comes to on a device.

`parse_memory_budget` reads the option `memory_budget` as it was given (a size, a share of the device's memory, or
"auto") into a `MemoryBudget`, whose `resolve` gives the bytes the step's peak must stay under. Pure Python, like the
planning it feeds (`profile`, `simulate`, `search`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ..units import GIB, format_bytes
from .checks import is_int

__all__ = ["AUTO_MARGIN_FRACTION", "AUTO_MARGIN_MIN_BYTES", "MemoryBudget", "parse_memory_budget"]

# "auto" leaves this much of the device outside the budget. The budget bounds `max_memory_allocated`, which does
# not count the CUDA context, NCCL's buffers or the memory the caching allocator reserves but cannot reuse
# (fragmentation), and the prediction itself is only trusted to within about 5%. Small devices still keep 2 GiB.
AUTO_MARGIN_FRACTION = 0.05
AUTO_MARGIN_MIN_BYTES = 2 * GIB

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_BUDGET_TEXT = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]+|%)?", re.ASCII)
_ACCEPTED_FORMS = (
    "None (no planner), 'auto' (the device's memory less a safety margin), a number of bytes > 0 (an int or a "
    "string of digits), a size such as '24GiB', '20000MiB' or '24GB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, "
    "TiB), or a share of the device's memory in (0, 100] such as '60%'"
)


@dataclass(frozen=True)
class MemoryBudget:
    """A budget for the step's peak memory, in the form the user gave it: a size, a percentage, or "auto".

    Build one with `parse_memory_budget`. At most one of `nbytes` and `percent` is set; neither means "auto".

    Args:
        nbytes: the budget in bytes.
        percent: the budget as a percentage of the device's total memory, in (0, 100].
        text: the user's spelling, given back by `str()`; not part of equality.
    """

    nbytes: int | None = None
    percent: float | None = None
    text: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.nbytes is not None and self.percent is not None:
            raise ValueError("a memory budget is either a size or a percentage, not both")
        if self.nbytes is not None and (not is_int(self.nbytes) or self.nbytes <= 0):
            raise ValueError(f"a memory budget in bytes must be an int > 0, got {self.nbytes!r}")
        if self.percent is not None and not 0 < self.percent <= 100:
            raise ValueError(f"a memory budget in percent must be in (0, 100], got {self.percent!r}")

    def __str__(self) -> str:
        if self.text:
            return self.text
        if self.nbytes is not None:
            return str(self.nbytes)
        return "auto" if self.percent is None else f"{self.percent:g}%"

    def resolve(self, device_total_bytes: int | None) -> int:
        """The budget in bytes.

        Args:
            device_total_bytes: the device's total memory, or None without a device (the CPU test mode).

        Returns:
            The budget in bytes.

        Raises:
            ValueError: for a percentage or "auto" without a device, or a device too small for "auto".

        Example:
            >>> parse_memory_budget("60%").resolve(80 * 10**9)
            48000000000
        """
        if self.nbytes is not None:
            return self.nbytes
        if device_total_bytes is None:
            raise ValueError(
                f"memory budget {str(self)!r} is relative to the device's memory, but there is no device to ask "
                "(e.g. the CPU test mode): give a size in bytes instead, such as '24GiB'"
            )
        if self.percent is not None:
            return math.floor(device_total_bytes * self.percent / 100)
        budget = device_total_bytes - max(math.ceil(device_total_bytes * AUTO_MARGIN_FRACTION), AUTO_MARGIN_MIN_BYTES)
        if budget <= 0:
            raise ValueError(
                f"memory budget 'auto' leaves nothing of a device of {format_bytes(device_total_bytes)} after its "
                f"safety margin of {format_bytes(AUTO_MARGIN_MIN_BYTES)}: give a size in bytes instead"
            )
        return budget


def parse_memory_budget(value: Any, option: str = "memory_budget") -> MemoryBudget | None:
    """Reads a memory budget as an option or a command-line string gives it.

    Args:
        value: None or "none" (no planner), "auto", an int number of bytes or a string of digits, a size string
            with a binary or decimal unit ("24GiB", "20000 MiB", "24GB", case-insensitive), a percentage of the
            device's memory ("60%"), or a `MemoryBudget` (returned as it is).
        option: the option's name as the user wrote it, for the error message.

    Returns:
        The budget, or None when the planner is off.

    Raises:
        ValueError: naming `option` and the accepted forms, for anything else (bools, floats, zero, negative or
            non-finite numbers, unknown units, percentages outside (0, 100]).

    Example:
        >>> parse_memory_budget("1.5 GiB").nbytes
        1610612736
        >>> str(parse_memory_budget("60%"))
        '60%'
    """
    if value is None or isinstance(value, MemoryBudget):
        return value
    try:  # every malformed value ends in the one message below, which lists the accepted forms
        if is_int(value):
            return MemoryBudget(nbytes=value, text=str(value))
        if not isinstance(value, str):
            raise ValueError
        text = value.strip()
        if text.lower() == "none":
            return None
        if text.lower() == "auto":
            return MemoryBudget(text=text)
        match = _BUDGET_TEXT.fullmatch(text.lower())
        if match is None:
            raise ValueError
        number, unit = match["number"], match["unit"]
        if unit == "%":
            return MemoryBudget(percent=float(number), text=text)
        if unit is None:
            return MemoryBudget(nbytes=int(number), text=text)  # a fractional number of bytes is not an int
        # Exact decimal arithmetic, floored: a budget never exceeds what was written.
        return MemoryBudget(nbytes=math.floor(Fraction(number) * _UNITS[unit]), text=text)
    except (ValueError, KeyError):
        raise ValueError(f"{option} must be {_ACCEPTED_FORMS}; got {value!r}") from None
