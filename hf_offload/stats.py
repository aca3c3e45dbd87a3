"""Counters that one training step of the engine produces, and their report.

A *step* is one forward pass and the backward pass that consumes it. The engine records every saved tensor it
sees as either offloaded or kept (with the reason it was kept), every reload as a prefetch hit or miss, and how
long the compute stream stalled waiting on a copy. Stall times are measured on the GPU with timing events; they
are read back lazily (never forcing a device sync inside a step) and resolved when someone asks for the numbers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

KEPT_REASONS: tuple[str, ...] = (
    "too_small",  # below min_offload_size: not worth a copy
    "parameter",  # a parameter or buffer (by storage): it stays on the GPU anyway
    "duplicate",  # shares a storage span already offloaded this step: restored as a view of that copy
    "tail",  # packed at the end of the forward, needed first in backward: moving it only costs
    "exempt",  # saved inside an exempt module (output head, Liger kernels) or a NoOpManager region
    "over_host_cap",  # the pinned host pool reached its cap
    "not_on_accelerator",  # the tensor lives on the CPU (or another device type)
    "in_backward",  # saved during backward (reentrant checkpoint recompute): used at once, never moved
    "unsupported_type",  # tensor subclasses (DTensor, quantized, sparse): kept rather than risk a wrong restore
)


class OffloadStats:
    """Counters of one step, or of several steps summed."""

    def __init__(self) -> None:
        self.steps = 0
        self.tensors_offloaded = 0
        self.bytes_offloaded = 0
        self.kept_tensors: Counter[str] = Counter()
        self.kept_bytes: Counter[str] = Counter()
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self.inflight_hits = 0
        self._wait_seconds = 0.0
        # (start, end) timing events around each stall of the compute stream, not yet read back.
        self._pending_waits: list[tuple[Any, Any]] = []

    def add_wait(self, start_event: Any, end_event: Any) -> None:
        self._pending_waits.append((start_event, end_event))

    def collect_finished_waits(self) -> None:
        """Reads back the stalls whose events have completed, without blocking."""
        still_pending = []
        for start, end in self._pending_waits:
            if end.query():
                self._wait_seconds += start.elapsed_time(end) / 1000.0
            else:
                still_pending.append((start, end))
        self._pending_waits = still_pending

    def compute_wait_seconds(self) -> float:
        """Total stall time; waits for outstanding timing events (a device sync on those events only)."""
        for _, end in self._pending_waits:
            end.synchronize()
        self.collect_finished_waits()
        return self._wait_seconds

    def as_dict(self, pinned_bytes: int = 0) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "steps": self.steps,
            "tensors_offloaded": self.tensors_offloaded,
            "bytes_offloaded": self.bytes_offloaded,
        }
        for reason in KEPT_REASONS:
            out[f"tensors_kept_{reason}"] = self.kept_tensors[reason]
            out[f"bytes_kept_{reason}"] = self.kept_bytes[reason]
        out["prefetch_hits"] = self.prefetch_hits
        out["prefetch_misses"] = self.prefetch_misses
        out["inflight_hits"] = self.inflight_hits
        out["compute_wait_s"] = self.compute_wait_seconds()
        out["pinned_bytes"] = pinned_bytes
        return out


class StatsRecorder:
    """Records every event into the current step's counters and into a running total.

    The step counters answer "what did the last step do" (`OffloadActivations.get_stats`); the total answers
    "what happened since I last asked" (`consume_stats`, used by the Trainer callback once per logging interval,
    which may span several micro-batches).
    """

    def __init__(self) -> None:
        self.step = OffloadStats()
        self.total = OffloadStats()

    def _both(self) -> tuple[OffloadStats, OffloadStats]:
        return self.step, self.total

    def begin_step(self) -> None:
        self.total.collect_finished_waits()
        self.step = OffloadStats()
        for stats in self._both():
            stats.steps += 1

    def offloaded(self, nbytes: int) -> None:
        for stats in self._both():
            stats.tensors_offloaded += 1
            stats.bytes_offloaded += nbytes

    def kept(self, reason: str, nbytes: int) -> None:
        for stats in self._both():
            stats.kept_tensors[reason] += 1
            stats.kept_bytes[reason] += nbytes

    def reload(self, kind: str) -> None:
        """kind: 'prefetch_hits', 'prefetch_misses' or 'inflight_hits'."""
        for stats in self._both():
            setattr(stats, kind, getattr(stats, kind) + 1)

    def wait(self, start_event: Any, end_event: Any) -> None:
        for stats in self._both():
            stats.add_wait(start_event, end_event)

    def consume_total(self, pinned_bytes: int) -> dict[str, int | float]:
        out = self.total.as_dict(pinned_bytes)
        self.total = OffloadStats()
        return out


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_summary(stats: dict[str, int | float]) -> str:
    """A few human lines about a stats dict from `get_stats()` or `consume_stats()`."""
    steps = max(int(stats.get("steps", 0)), 1)
    kept = {
        reason: stats.get(f"bytes_kept_{reason}", 0)
        for reason in KEPT_REASONS
        if stats.get(f"tensors_kept_{reason}", 0)
    }
    kept_text = ", ".join(f"{reason} {_size(nbytes / steps)}" for reason, nbytes in kept.items()) or "nothing"
    reloads = stats.get("prefetch_hits", 0) + stats.get("prefetch_misses", 0)
    ready = f"{100.0 * stats.get('prefetch_hits', 0) / reloads:.0f}%" if reloads else "n/a"
    return "\n".join(
        [
            f"activation offloading over {steps} step(s):",
            f"  offloaded per step: {_size(stats.get('bytes_offloaded', 0) / steps)} "
            f"({stats.get('tensors_offloaded', 0) / steps:.0f} tensors)",
            f"  kept on the GPU per step: {kept_text}",
            f"  reloads ready when needed: {ready}; compute waited on copies "
            f"{1000.0 * stats.get('compute_wait_s', 0.0) / steps:.2f} ms per step",
            f"  pinned host memory held: {_size(stats.get('pinned_bytes', 0))}",
        ]
    )
