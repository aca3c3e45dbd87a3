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


def trace_step(train_step: TrainStep, device: torch.device, path: str) -> dict[str, Any]:
    """Runs one step under the profiler (CPU, and CUDA on a GPU) and writes its trace to ``path`` (.json.gz).
    Returns the per-stream busy times (``stream_busy``)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        train_step(False)
        synchronize(device)
    raw = path[:-3] if path.endswith(".gz") else path
    prof.export_chrome_trace(raw)
    streams = stream_busy(raw)
    with open(raw, "rb") as f_in, gzip.open(path, "wb") as f_out:
        shutil.copyfileobj(f_in, f_out)
    os.remove(raw)
    return streams


def stream_busy(trace_path: str) -> dict[str, Any]:
    """Per CUDA stream of a chrome trace: busy time (union of its kernels, copies and memsets), what kind of work
    it ran, and the GPU span of the whole step. Tells whether a copy stream was saturated (busy close to the span:
    bandwidth-bound) or idle part of the time (a scheduling gap the engine could close)."""
    events = json.loads(Path(trace_path).read_text()).get("traceEvents", [])
    per_stream: dict[int, list[tuple[float, float]]] = {}
    kinds: dict[int, dict[str, float]] = {}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stream = (ev.get("args") or {}).get("stream")
        if stream is None:
            continue
        start, dur = float(ev["ts"]), float(ev.get("dur", 0))
        per_stream.setdefault(stream, []).append((start, start + dur))
        name = ev.get("name", "")
        kind = "DtoH" if "DtoH" in name else "HtoD" if "HtoD" in name else ev["cat"]
        kinds.setdefault(stream, {}).setdefault(kind, 0.0)
        kinds[stream][kind] += dur
    if not per_stream:
        return {}
    span_start = min(a for iv in per_stream.values() for a, _ in iv)
    span_end = max(b for iv in per_stream.values() for _, b in iv)
    out: dict[str, Any] = {"gpu_span_ms": (span_end - span_start) / 1e3, "streams": {}}
    for stream, intervals in per_stream.items():
        busy, end = 0.0, float("-inf")
        for a, b in sorted(intervals):
            if b > end:
                busy += b - max(a, end)
                end = b
        main = max(kinds[stream], key=kinds[stream].get)
        out["streams"][str(stream)] = {
            "busy_ms": busy / 1e3,
            "work": main,
            "by_kind_ms": {k: v / 1e3 for k, v in kinds[stream].items()},
        }
    return out
