#!/usr/bin/env python3
"""What pinning host memory costs the step that does it: the seconds, and whether the GPU waits.

A long-context run's first step grows the pinned pool from nothing (62.5 GiB at 327,680 tokens of an 8B model), one
layer input of 2.5 GiB at a time, on the training thread, in the forward. Each way of pinning a buffer of --gib is
timed --repeats times, each on a fresh buffer (all held until the way is done):

  register           `cudaHostRegister` of a fresh, untouched buffer: the registration faults its pages in itself
  fault-in+register  the pool's way (`host_memory._pinned_exactly`): the pages faulted in first, a byte a page, on
                     torch's intra-op threads (--threads), then registered
  host-alloc         `torch.empty(..., pin_memory=True)`: PyTorch's pinned allocator (`cudaHostAlloc`), which rounds
                     the size up to a power of two

and once more while the GPU runs about --busy-seconds of matrix products queued before the call: `gpu_done_on_return`
false means the call returned before the GPU finished, so it did not synchronise the device.

    python benchmarks/pinning.py --gib 2.5 --repeats 3 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_offload.host_memory import _pinned_exactly

GIB = 2**30


def _register(nbytes: int) -> torch.Tensor:
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    if error:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {error}")
    return buffer


def _unpin(way: str, buffer: torch.Tensor) -> None:
    if way == "register":  # `_pinned_exactly`'s buffers unregister themselves when collected
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


WAYS = {
    "register": _register,
    "fault-in+register": _pinned_exactly,
    "host-alloc": lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
}


def _busy(seconds: float) -> torch.cuda.Event:
    """Queues about `seconds` of matrix products on the current stream; returns an event recorded after them.

    Products of 16,384 x 16,384 take about 11 ms each on an H100, so a few seconds of them are a few hundred
    launches: under CUDA's queue of pending launches, which would otherwise block the host before the call."""
    a = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    a @ a  # cuBLAS's first call, out of the timing
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(4):
        a @ a
    torch.cuda.synchronize()
    each = (time.perf_counter() - started) / 4
    for _ in range(max(1, int(seconds / each))):
        a @ a
    done = torch.cuda.Event()
    done.record()
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.5, help="the buffer's size (a layer input at 327,680 tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--busy-seconds", type=float, default=5.0)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    nbytes = int(args.gib * GIB)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gib": args.gib,
                    "threads": torch.get_num_threads(), "ways": {}}  # fmt: skip
    torch.empty(1, pin_memory=True)  # the pinned allocator's own first call, out of the timings
    for way, pin in WAYS.items():
        # Every buffer is held until the way's last call: PyTorch's pinned allocator caches what it gets back, and
        # would hand a freed buffer out again untimed.
        buffers, seconds = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            buffers.append(pin(nbytes))
            seconds.append(time.perf_counter() - started)
        done = _busy(args.busy_seconds)
        started = time.perf_counter()
        buffers.append(pin(nbytes))
        busy_call_s = time.perf_counter() - started
        gpu_done_on_return = done.query()
        torch.cuda.synchronize()
        while buffers:
            _unpin(way, buffers.pop())
        result["ways"][way] = {"seconds": seconds, "s_per_gib": min(seconds) / args.gib,
                               "busy_call_s": busy_call_s, "gpu_done_on_return": gpu_done_on_return}  # fmt: skip
        print(way, json.dumps(result["ways"][way]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pinning.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
