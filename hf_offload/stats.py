"""Counters that one training step of the engine produces, and their report.

A *step* is one forward pass and the backward pass that consumes it. The engine records every saved tensor it
sees as either offloaded or kept (with the reason it was kept), every reload as a prefetch hit or miss, and how
long the compute stream stalled waiting on a copy. Stall times are measured on the GPU with timing events; they
are read back lazily (never forcing a device sync inside a step) and resolved when someone asks for the numbers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .peak import PeakReport
from .units import format_bytes

__all__ = ["KEPT_REASONS", "STAND_ASIDE_REASONS", "OffloadStats", "StatsRecorder", "format_summary"]

# Why a saved tensor stayed where it was, with the words the summary explains each reason in.
KEPT_REASONS: dict[str, str] = {
    "too_small": "under min_offload_size, not worth a copy",
    "parameter": "a parameter or buffer, resident anyway",
    "duplicate": "a view of a tensor already moved, restored from that copy",
    "tail": "the end of the forward, which backward needs first",
    "exempt": "the output head, the loss and Liger kernels",
    "planned": "layers the memory plan keeps on the device",
    "over_host_cap": "the pinned host pool reached its cap",
    "host_reserve": "growing the pinned host pool would have left less than host_memory_reserve available",
    "pinned_alloc_failed": "allocating pinned host memory failed",
    "disk_reserve": "the disk tier's reserve of free disk space (disk_reserve) was reached",
    "disk_failed": "writing it to the disk tier failed",
    "not_on_accelerator": "on another device type",
    "in_backward": "saved during backward (reentrant checkpointing), used at once",
    "unsupported_type": "a tensor subclass (DTensor, quantized, sparse)",
    "compiled": "saved by a model compiled as a whole, after its forward: moving them cannot lower the peak",
    "cannot_lower_peak": "offloading stood aside: it lowered the measured step's peak less than min_peak_reduction",
}
# Why offloading may stand aside for whole steps (`OffloadActivations.standing_aside`), keys of `KEPT_REASONS`: the
# tensors of a step in a region entered while it stood aside never reach the engine, so such steps are counted, not
# their tensors.
STAND_ASIDE_REASONS = ("compiled", "cannot_lower_peak", "planned")


class OffloadStats:
    """Counters of one step, or of several steps summed."""

    def __init__(self) -> None:
        self.steps = 0
        self.tensors_offloaded = 0
        self.bytes_offloaded = 0
        self.kept_tensors: Counter[str] = Counter()
        self.kept_bytes: Counter[str] = Counter()
        self.steps_stood_aside: Counter[str] = Counter()
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self.inflight_hits = 0
        self.bytes_spilled_to_disk = 0  # written to the disk tier (`disk_offload_dir`), of the bytes offloaded
        self.bytes_read_from_disk = 0
        self.disk_wait_seconds = 0.0  # the host blocked on the disk tier: a write to free a staging buffer, a read
        self.pool_grown_bytes = 0  # the pinned pool's growth: the first step's, or a longer step's
        self.pool_growth_seconds = 0.0  # the calling thread's time in that growth (pinning host memory)
        self.discarded = False  # a step that did not complete, taken out of the running total (`discard_step`)
        self._wait_seconds = 0.0
        # (start, end) timing events around each stall of the compute stream, not yet read back.
        self._pending_waits: list[tuple[Any, Any]] = []

    def add_wait(self, start_event: Any, end_event: Any) -> None:
        """A possible stall: from `start_event` (compute reaches a wait) to `end_event` (the awaited copy is done),
        if the copy is done later; the copy may complete first, and the stall is then zero."""
        self._pending_waits.append((start_event, end_event))

    def collect_finished_waits(self) -> None:
        """Reads back the stalls whose events have completed, without blocking."""
        still_pending = []
        for start, end in self._pending_waits:
            if end.query() and start.query():
                self._wait_seconds += max(start.elapsed_time(end), 0.0) / 1000.0
            else:
                still_pending.append((start, end))
        self._pending_waits = still_pending

    def compute_wait_seconds(self) -> float:
        """Total stall time; waits for outstanding timing events (a device sync on those events only)."""
        for start, end in self._pending_waits:
            start.synchronize()
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
        for reason in STAND_ASIDE_REASONS:
            out[f"steps_stood_aside_{reason}"] = self.steps_stood_aside[reason]
        out["prefetch_hits"] = self.prefetch_hits
        out["prefetch_misses"] = self.prefetch_misses
        out["inflight_hits"] = self.inflight_hits
        out["compute_wait_s"] = self.compute_wait_seconds()
        out["pinned_bytes"] = pinned_bytes
        out["bytes_spilled_to_disk"] = self.bytes_spilled_to_disk
        out["bytes_read_from_disk"] = self.bytes_read_from_disk
        out["disk_wait_s"] = self.disk_wait_seconds
        out["pool_grown_bytes"] = self.pool_grown_bytes
        out["pool_growth_s"] = self.pool_growth_seconds
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

    def begin_step(self, stood_aside: str | None = None) -> None:
        """A step begins; `stood_aside`: why offloading stands aside in it (`STAND_ASIDE_REASONS`), if it does."""
        self.total.collect_finished_waits()
        self.step = OffloadStats()
        for stats in self._both():
            stats.steps += 1
            if stood_aside is not None:
                stats.steps_stood_aside[stood_aside] += 1

    def discard_step(self) -> None:
        """The current step did not complete (an exception left it): it is no step, and what it counted leaves the
        running total (the step's own counters stay, for whoever asks what the aborted step did). Its copies'
        stalls, if any, stay in the total (their events are still pending)."""
        step, total = self.step, self.total
        if step.discarded:  # an enclosing region of the same step ended by the same exception
            return
        step.discarded = True
        # The pool's growth is left in the total: the pool keeps what the aborted step grew it by.
        total.steps -= step.steps
        total.steps_stood_aside -= step.steps_stood_aside
        total.tensors_offloaded -= step.tensors_offloaded
        total.bytes_offloaded -= step.bytes_offloaded
        total.kept_tensors -= step.kept_tensors
        total.kept_bytes -= step.kept_bytes
        for kind in (
            "prefetch_hits",
            "prefetch_misses",
            "inflight_hits",
            "bytes_spilled_to_disk",
            "bytes_read_from_disk",
            "disk_wait_seconds",
        ):
            setattr(total, kind, getattr(total, kind) - getattr(step, kind))

    def offloaded(self, nbytes: int) -> None:
        for stats in self._both():
            stats.tensors_offloaded += 1
            stats.bytes_offloaded += nbytes

    def kept(self, reason: str, nbytes: int) -> None:
        for stats in self._both():
            stats.kept_tensors[reason] += 1
            stats.kept_bytes[reason] += nbytes

    def unoffloaded(self, reason: str, nbytes: int) -> None:
        """A tensor counted as offloaded stayed on the device after all (the disk tier refused it, or its write
        failed): counted as kept, for `reason`, instead."""
        for stats in self._both():
            stats.tensors_offloaded -= 1
            stats.bytes_offloaded -= nbytes
        self.kept(reason, nbytes)

    def spilled(self, nbytes: int) -> None:
        for stats in self._both():
            stats.bytes_spilled_to_disk += nbytes

    def read_from_disk(self, nbytes: int) -> None:
        for stats in self._both():
            stats.bytes_read_from_disk += nbytes

    def disk_wait(self, seconds: float) -> None:
        for stats in self._both():
            stats.disk_wait_seconds += seconds

    def pool_grown(self, nbytes: int, seconds: float) -> None:
        for stats in self._both():
            stats.pool_grown_bytes += nbytes
            stats.pool_growth_seconds += seconds

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


def format_summary(stats: dict[str, int | float], device_type: str = "cuda", peak: PeakReport | None = None,
                   accumulation_steps: int = 1) -> str:  # fmt: skip
    """A few lines a person reads about a stats dict from `get_stats()` or `consume_stats()`.

    The engine's step is one forward and backward pass: with gradient accumulation, a micro-step, and the summary says
    so (a run of 4 optimizer steps accumulating over 4 micro-steps each is 16 of them).

    Args:
        stats: the counters.
        device_type: the engine's device type (`engine.device_type`): the words for where kept tensors stayed.
            `"cpu"` is the CPU test mode, where CPU tensors are copied to a separate host buffer.
        peak: the measured step's peak (`engine.peak_report`): where it is set, and what offloading took off it.
        accumulation_steps: the forward and backward passes of one optimizer step (gradient accumulation).

    Returns:
        The summary, one figure per line, each explained in a few words.
    """
    steps = max(int(stats.get("steps", 0)), 1)
    test_mode = device_type == "cpu"
    device = "GPU" if device_type == "cuda" else device_type.upper()
    kept = [f"    {reason}: {format_bytes(stats.get(f'bytes_kept_{reason}', 0) / steps)} ({meaning})"
            for reason, meaning in KEPT_REASONS.items() if stats.get(f"tensors_kept_{reason}", 0)]  # fmt: skip
    hits, misses = stats.get("prefetch_hits", 0), stats.get("prefetch_misses", 0)
    reloads = hits + misses
    ready = (f"{hits:.0f} of {reloads:.0f} ({100.0 * hits / reloads:.0f}%) were copied back ahead of need; the "
             "others when backward reached them" if reloads else "none were needed")  # fmt: skip
    if test_mode and reloads:  # no side streams: "0 of 60 ahead of need" would read as a failure
        ready = (f"{reloads:.0f} ({hits:.0f} started ahead by the prefetch bookkeeping; the CPU test mode copies "
                 "synchronously, so no copy overlaps compute)")  # fmt: skip
    over, step = f"{steps} step(s)", "step"
    if accumulation_steps > 1:
        step = "micro-step"
        over = f"{steps} micro-step(s) ({steps / accumulation_steps:g} optimizer steps of {accumulation_steps})"
    grown = ""
    if stats.get("pool_grown_bytes"):  # in the steps that grew it: the first, or a longer one
        grown = (f", grown by {format_bytes(stats['pool_grown_bytes'])} in these {step}s, which took "
                 f"{stats.get('pool_growth_s', 0.0):.2f} s of the training thread")  # fmt: skip
    lines = [
        f"activation offloading over {over}"
        + (" in CPU test mode (CPU tensors copied to a separate host buffer; no GPU involved):" if test_mode else ":"),
        f"  moved to host memory per {step}: {format_bytes(stats.get('bytes_offloaded', 0) / steps)} "
        f"({stats.get('tensors_offloaded', 0) / steps:.0f} tensors)",
        f"  {'kept in place' if test_mode else f'kept on the {device}'} per {step}:"
        + ("\n" + "\n".join(kept) if kept else " nothing"),
        f"  reloads in backward: {ready}",
        f"  compute waited for copies: {1000.0 * stats.get('compute_wait_s', 0.0) / steps:.2f} ms per {step}",
        f"  {'host buffer' if test_mode else 'pinned host memory'} held (a pool reused every {step}): "
        f"{format_bytes(stats.get('pinned_bytes', 0))}{grown}",
    ]
    if stats.get("bytes_spilled_to_disk", 0) or stats.get("bytes_read_from_disk", 0):
        lines.append(
            f"  of which spilled to disk per {step}: {format_bytes(stats['bytes_spilled_to_disk'] / steps)} "
            f"written, {format_bytes(stats.get('bytes_read_from_disk', 0) / steps)} read back; the host "
            f"waited for the disk {1000.0 * stats.get('disk_wait_s', 0.0) / steps:.2f} ms per {step}"
        )
    aside = [f"{stats[f'steps_stood_aside_{reason}']:.0f} ({KEPT_REASONS[reason]})" for reason in STAND_ASIDE_REASONS
             if stats.get(f"steps_stood_aside_{reason}", 0)]  # fmt: skip
    if aside:
        lines.append(f"  {step}s in which offloading stood aside (moved nothing): {'; '.join(aside)}")
    if peak is not None:
        lines.append(f"  peak memory, measured in step 2: {peak.describe()}")
    return "\n".join(lines)
