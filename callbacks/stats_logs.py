"""Offload statistics as Trainer log entries, and their running total for the end-of-training summary.

Every training log gets the whole set of `offload/...` counters (the run's history and the loggers that take many
series, TensorBoard, W&B, ..., receive them all), plus a few headline entries derived from them. The console shows
only the headlines: a line of twenty raw counters is noise to a person watching the run.
"""

from collections.abc import Mapping

from hf_offload.units import GIB, MIB

__all__ = ["LOG_PREFIX", "HEADLINE_KEYS", "log_entries", "keep_headlines", "accumulate"]

LOG_PREFIX = "offload/"
# Levels read when the statistics are taken, not counts: a total keeps the latest value instead of a sum.
_LEVELS = frozenset({"pinned_bytes"})
# One counter per reason a tensor stayed on the accelerator, or offloading stood aside for a step; most are zero in a
# given run, and zeros only clutter.
_KEPT_PREFIXES = ("tensors_kept_", "bytes_kept_", "steps_stood_aside_")
# Counters that are zero in most intervals, logged only when they are not: the disk tier's, zero in every run without
# `disk_offload_dir`, and the pinned pool's growth, zero once the first step (or a longer one) has grown it.
_MOSTLY_ZERO_KEYS = ("bytes_spilled_to_disk", "bytes_read_from_disk", "disk_wait_s", "pool_grown_bytes",
                     "pool_growth_s")  # fmt: skip

# The entries the console shows, each a figure a person can act on.
HEADLINE_KEYS = (
    # What moved to host memory per step, in MiB: the console prints 4 significant digits, which shows a small
    # model's KiB (0.02734) and a large one's GiB (5120) alike; GiB rounded a few KiB to '0'.
    LOG_PREFIX + "offloaded_mib_per_step",
    LOG_PREFIX + "compute_wait_ms_per_step",  # what it cost: the compute stream's stalls on copies
    LOG_PREFIX + "peak_memory_gib",  # what memory the run has reached
)


def log_entries(stats: Mapping[str, float], peak_memory_bytes: int | None = None) -> dict[str, float]:
    """Return the `offload/...` entries for one logging interval of `OffloadActivations.consume_stats()`.

    Args:
        stats: the counters, summed over the interval, which may span several steps (a step is one forward and its
            backward, so a micro-batch under gradient accumulation).
        peak_memory_bytes: the accelerator's peak allocated memory so far, or None without an accelerator.

    Returns:
        Every non-zero counter, the `_per_step` entries (counters divided by the steps of the interval) and the
        headline entries of `HEADLINE_KEYS`.
    """
    entries = {LOG_PREFIX + key: value for key, value in stats.items()
               if value or not key.startswith(_KEPT_PREFIXES + _MOSTLY_ZERO_KEYS)}  # fmt: skip
    steps = stats["steps"]
    if steps:
        entries[LOG_PREFIX + "bytes_offloaded_per_step"] = stats["bytes_offloaded"] / steps
        entries[LOG_PREFIX + "compute_wait_s_per_step"] = stats["compute_wait_s"] / steps
        if stats.get("bytes_spilled_to_disk"):
            entries[LOG_PREFIX + "bytes_spilled_to_disk_per_step"] = stats["bytes_spilled_to_disk"] / steps
        entries[HEADLINE_KEYS[0]] = stats["bytes_offloaded"] / steps / MIB
        entries[HEADLINE_KEYS[1]] = round(1000.0 * stats["compute_wait_s"] / steps, 3)
    if peak_memory_bytes is not None:
        entries[HEADLINE_KEYS[2]] = round(peak_memory_bytes / GIB, 3)
    return entries


def keep_headlines(logs: dict[str, float]) -> None:
    """Removes, in place, every `offload/` entry that is not a headline."""
    for key in [key for key in logs if key.startswith(LOG_PREFIX) and key not in HEADLINE_KEYS]:
        del logs[key]


def accumulate(total: dict[str, float], interval: Mapping[str, float]) -> None:
    """Adds one interval's statistics into `total` (summed counters, latest levels)."""
    for key, value in interval.items():
        total[key] = value if key in _LEVELS else total.get(key, 0) + value
