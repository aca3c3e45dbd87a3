"""One training step under torch.profiler, saved as a gzipped chrome trace, and how busy each CUDA stream was."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from .measure import TrainStep, synchronize

# Chrome-trace categories of the work a CUDA stream runs.
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_step(train_step: TrainStep, device: torch.device, path: str) -> dict[str, Any]:
    """Runs one step under the profiler (CPU, and CUDA on a GPU) and writes its trace to ``path`` (.json.gz).
    Returns the per-stream busy times (``stream_busy``)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        train_step(False)
        synchronize(device)
    return stream_busy(save_trace(prof, path))


def save_trace(prof: Any, path: str) -> list[dict[str, Any]]:
    """Writes a finished profile's chrome trace to ``path`` (gzipped when it ends in .gz) and returns its events."""
    raw = path[:-3] if path.endswith(".gz") else path
    prof.export_chrome_trace(raw)
    events = json.loads(Path(raw).read_text()).get("traceEvents", [])
    if raw != path:
        with open(raw, "rb") as f_in, gzip.open(path, "wb") as f_out:
            shutil.copyfileobj(f_in, f_out)
        os.remove(raw)
    return events


# One piece of a stream's work: start and end (microseconds), name, and kind ("DtoH", "HtoD" or the category).
Work = tuple[float, float, str, str]


def stream_work(events: list[dict[str, Any]]) -> dict[int, list[Work]]:
    """Per CUDA stream of a chrome trace's events, its kernels, copies and memsets."""
    per_stream: dict[int, list[Work]] = {}
    for ev in events:
        stream = (ev.get("args") or {}).get("stream")
        if ev.get("ph") != "X" or ev.get("cat") not in DEVICE_WORK or stream is None:
            continue
        start, name = float(ev["ts"]), ev.get("name", "")
        kind = "DtoH" if "DtoH" in name else "HtoD" if "HtoD" in name else ev["cat"]
        per_stream.setdefault(stream, []).append((start, start + float(ev.get("dur", 0)), name, kind))
    return per_stream


def busy_and_gaps(work: list[Work]) -> tuple[float, list[tuple[float, float, str, str]]]:
    """The time a stream's work covers (the union of its intervals), and the idle gaps between: each as (gap start,
    gap end, the work before, the work after)."""
    busy, end, previous, gaps = 0.0, float("-inf"), "", []
    for start, stop, name, _ in sorted(work):
        if start > end > float("-inf"):
            gaps.append((end, start, previous, name))
        if stop > end:
            busy += stop - max(start, end)
            end, previous = stop, name
    return busy, gaps


def stream_busy(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per CUDA stream of a chrome trace's events: busy time (union of its kernels, copies and memsets), what kind of
    work it ran, and the GPU span of the whole step. Tells whether a copy stream was saturated (busy close to the span:
    bandwidth-bound) or idle part of the time (a scheduling gap the engine could close)."""
    per_stream = stream_work(events)
    if not per_stream:
        return {}
    span_start = min(piece[0] for work in per_stream.values() for piece in work)
    span_end = max(piece[1] for work in per_stream.values() for piece in work)
    out: dict[str, Any] = {"gpu_span_ms": (span_end - span_start) / 1e3, "streams": {}}
    for stream, work in per_stream.items():
        kinds: dict[str, float] = {}
        for start, stop, _, kind in work:
            kinds[kind] = kinds.get(kind, 0.0) + stop - start
        out["streams"][str(stream)] = {
            "busy_ms": busy_and_gaps(work)[0] / 1e3,
            "work": max(kinds, key=kinds.get),
            "by_kind_ms": {k: v / 1e3 for k, v in kinds.items()},
        }
    return out
