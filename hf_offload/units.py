"""Byte units, and how hf-offload writes an amount of memory for a person to read.

One definition for the library: the options' MiB, the summary's sizes and the memory plan's figures come from here,
so that every message writes an amount in the unit that shows it (a budget of 1,000 bytes reads `1000 B`, not
`0.00 GiB`).
"""

from __future__ import annotations

__all__ = ["GIB", "KIB", "MIB", "byte_unit", "format_bytes"]

KIB, MIB, GIB = 2**10, 2**20, 2**30


def byte_unit(nbytes: float) -> tuple[str, int]:
    """The largest binary unit that keeps `nbytes` at or above 1, and its size: for a number, or for a column of
    numbers whose largest is `nbytes`.

    Example:
        >>> byte_unit(1000), byte_unit(1.5 * GIB)
        (('B', 1), ('GiB', 1073741824))
    """
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            return unit, scale
    return "B", 1


def format_bytes(nbytes: float) -> str:
    """`nbytes` in the largest binary unit that keeps the number at or above 1.

    Example:
        >>> format_bytes(1000), format_bytes(28 * KIB), format_bytes(1.5 * GIB)
        ('1000 B', '28.00 KiB', '1.50 GiB')
    """
    unit, scale = byte_unit(nbytes)
    return f"{nbytes:.0f} B" if scale == 1 else f"{nbytes / scale:.2f} {unit}"
