"""Offload statistics as Trainer log entries, and their running total for the end-of-training summary."""

from collections.abc import Mapping

LOG_PREFIX = "offload/"
# Levels read when the statistics are taken, not counts: a total keeps the latest value instead of a sum.
_LEVELS = frozenset({"pinned_bytes"})
# One counter per reason a tensor stayed on the accelerator; most are zero in a given run, and zeros only clutter.
_KEPT_PREFIXES = ("tensors_kept_", "bytes_kept_")


def log_entries(stats: Mapping[str, float]) -> dict[str, float]:
    """`offload/...` entries for one logging interval of `OffloadActivations.consume_stats()`.

    Counters are sums over the interval, which may span several steps (a step is one forward and its backward, so
    a micro-batch under gradient accumulation); the `_per_step` entries divide by the number of steps.
    """
    entries = {LOG_PREFIX + key: value for key, value in stats.items() if value or not key.startswith(_KEPT_PREFIXES)}
    steps = stats["steps"]
    if steps:
        entries[LOG_PREFIX + "bytes_offloaded_per_step"] = stats["bytes_offloaded"] / steps
        entries[LOG_PREFIX + "compute_wait_s_per_step"] = stats["compute_wait_s"] / steps
    return entries


def accumulate(total: dict[str, float], interval: Mapping[str, float]) -> None:
    """Adds one interval's statistics into `total` (summed counters, latest levels)."""
    for key, value in interval.items():
        total[key] = value if key in _LEVELS else total.get(key, 0) + value
