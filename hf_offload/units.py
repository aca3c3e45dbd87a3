"""Byte units, and how hf-offload writes an amount of memory for a person to read.

One definition for the library: the options' MiB, the summary's sizes and the memory plan's figures come from here,
so that every message writes an amount in the unit that shows it (a budget of 1,000 bytes reads `1000 B`, not
`0.00 GiB`).
"""

from __future__ import annotations

__all__ = ["GIB", "KIB", "MIB", "format_bytes"]

KIB, MIB, GIB = 2**10, 2**20, 2**30


def format_bytes(nbytes: float) -> str:
    """`nbytes` in the largest binary unit that keeps the number at or above 1.

    Example:
        >>> format_bytes(1000), format_bytes(28 * KIB), format_bytes(1.5 * GIB)
        ('1000 B', '28.00 KiB', '1.50 GiB')
    """
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
