"""What one invocation measures once, in its own process: library versions, the device, and the pinned (and
pageable) host<->device copy bandwidth that the transfer floor is computed from."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from typing import Any

import torch

from . import GIB, library_source_hash


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "accelerate", "peft", "trl", "liger-kernel", "hf-offload", "triton"):
        try:
            out[name] = metadata.version(name)
        except Exception:
            out[name] = None
    out["cuda"] = torch.version.cuda
    try:
        out["hf_offload-src"] = library_source_hash()
    except OSError:
        pass
    return out


def _median_seconds(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps + 1):  # first one is a warm-up
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _measure_bandwidth(device: torch.device, n: int, reps: int, res: dict[str, Any]) -> None:
    """GB/s of ``n``-byte copies: pinned H2D, D2H, both at once on two streams (their sum), pageable H2D and D2H."""
    h1 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d1 = torch.empty(n, dtype=torch.uint8, device=device)
    d2 = torch.empty(n, dtype=torch.uint8, device=device)
    h1.fill_(1)
    h2.fill_(2)
    d1.fill_(3)
    d2.fill_(4)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def h2d():
        with torch.cuda.stream(s1):
            d1.copy_(h1, non_blocking=True)

    def d2h():
        with torch.cuda.stream(s1):
            h1.copy_(d1, non_blocking=True)

    def both():
        with torch.cuda.stream(s1):
            d1.copy_(h1, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(d2, non_blocking=True)

    res["bytes"] = n
    res["h2d_GBps"] = n / _median_seconds(h2d, reps, device) / 1e9
    res["d2h_GBps"] = n / _median_seconds(d2h, reps, device) / 1e9
    res["both_GBps"] = 2 * n / _median_seconds(both, reps, device) / 1e9
    h2 = d2 = None  # frees the second pair before the pageable buffer is allocated
    hp = torch.empty(n, dtype=torch.uint8)
    hp.fill_(5)
    res["pageable_h2d_GBps"] = n / _median_seconds(lambda: d1.copy_(hp), 2, device) / 1e9
    res["pageable_d2h_GBps"] = n / _median_seconds(lambda: hp.copy_(d1), 2, device) / 1e9


def allocator_setting() -> str:
    """The CUDA caching allocator's settings from the environment, as its children inherit them: with
    ``expandable_segments:True`` a block is split to the requested size (rounded to 512 bytes), so allocated bytes
    are the requested ones; by default a large block is handed out up to 1 MiB larger, which moves a step's
    allocated peak with the process's history."""
    settings = [f"{name}={os.environ[name]}" for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                if os.environ.get(name)]  # fmt: skip
    return ", ".join(settings) or "default (no PYTORCH_CUDA_ALLOC_CONF)"


def probe(device_name: str, bw_bytes: int, reps: int = 5) -> dict[str, Any]:
    """Versions, the allocator's settings, and on a CUDA device its name, memory and copy bandwidth (``bw_bytes`` per
    copy; none when 0). A failure of the device's part is recorded as ``error``, not raised."""
    res: dict[str, Any] = {"versions": versions(), "allocator": allocator_setting()}
    try:
        device = torch.device(device_name)
        if device.type != "cuda":
            res["skipped"] = "no CUDA device"
        else:
            torch.cuda.set_device(device)
            props = torch.cuda.get_device_properties(device)
            res["device_name"] = props.name
            res["device_mem_gib"] = props.total_memory / GIB
            if bw_bytes:
                _measure_bandwidth(device, bw_bytes, reps, res)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    return res


def main(spec: dict[str, Any]) -> int:
    """Child process entry: versions, device and bandwidth written to ``spec["result_path"]``; the device's part is
    skipped on CPU (``spec["device"]``), and replaced by its error if it fails."""
    res = probe(spec["device"], int(spec["bw_bytes"]), int(spec.get("bw_reps", 5)))
    with open(spec["result_path"], "w") as f:
        json.dump(res, f, indent=1)
    return 0
