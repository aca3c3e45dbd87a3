#!/usr/bin/env python3
"""The host time the engine's hooks add to a step, measured without a model.

A short step with checkpointing is nearly bound by the host: on a 36-layer model at 4K tokens, the host needs
about as long to issue the forward as the GPU needs to run it, so each microsecond of Python in a pack hook is a
microsecond of the step. This script isolates that cost: a chain of `--layers` multiplications, each saving one
16 MiB bf16 tensor (what a checkpointed layer saves: its input), run forward and backward with and without
`OffloadActivations`, the GPU work kept tiny so that the host's time is what is measured. It reports the host
microseconds per offloaded tensor, forward (pack) and backward (unpack plus its prefetch), with prefetch points as
the model layer places them under checkpointing (`prefetch_on_unpack=False`, a hook mid-layer) and without.

Usage (GPU machine): python benchmarks/hook_cost.py [--engine-root DIR] [--label NAME]
`--engine-root` puts another copy of the package first on the path (to compare two versions in one call).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-root", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--label", default="working tree")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--primitives", action="store_true", help="also time the torch calls a hook is made of")
    ap.add_argument("--profile", action="store_true",
                    help="also run the checkpointing-like case under cProfile and write where its host time goes "
                         "(hook-cost-<label>-profile.txt: the calls by their own time)")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sys.path.insert(0, args.engine_root)
    import torch

    from hf_offload import OffloadActivations

    device = torch.device("cuda")
    scales = [torch.ones((), device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(args.layers)]
    start = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step(engine: OffloadActivations | None, prefetch_points: bool) -> tuple[float, float]:
        """Host seconds to issue the forward and the backward (the GPU is synchronised before each)."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hidden = start
        with engine if engine is not None else contextlib.nullcontext():
            for scale in scales:
                hidden = hidden * scale  # saves `hidden` (16 MiB) for the gradient of `scale`
                if engine is not None and prefetch_points:
                    hidden.register_hook(engine.prefetch_hook())
            loss = hidden.float().mean()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        return t1 - t0, t3 - t2

    def measure(engine: OffloadActivations | None, prefetch_points: bool = False) -> dict[str, float]:
        if engine is not None:
            engine.prefetch_on_unpack = not prefetch_points
        for _ in range(5):
            step(engine, prefetch_points)
        forward, backward = zip(*(step(engine, prefetch_points) for _ in range(args.steps)))
        return {"forward_ms": statistics.median(forward) * 1e3, "backward_ms": statistics.median(backward) * 1e3}

    rows = {}
    for _ in range(2):  # interleaved, twice: the second round is reported
        rows["no offloading"] = measure(None)
        rows["offload, prefetch on unpack"] = measure(OffloadActivations())
        rows["offload, prefetch points (checkpointing)"] = measure(OffloadActivations(), prefetch_points=True)
        rows["nothing eligible"] = measure(OffloadActivations(min_offload_size=2**40))
    base = rows["no offloading"]
    print(
        f"{args.label}: {args.layers} tensors of {args.tokens * args.hidden * 2 / 2**20:.0f} MiB, host time per "
        f"step (median of {args.steps}), and per tensor over no offloading"
    )
    result = {"label": args.label, "torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": {}}
    for name, row in rows.items():
        per_pack = (row["forward_ms"] - base["forward_ms"]) / args.layers * 1e3
        per_unpack = (row["backward_ms"] - base["backward_ms"]) / args.layers * 1e3
        result["rows"][name] = {**row, "pack_us": per_pack, "unpack_us": per_unpack}
        print(
            f"  {name:42s} forward {row['forward_ms']:7.2f} ms ({per_pack:+7.1f} us/tensor)   backward "
            f"{row['backward_ms']:7.2f} ms ({per_unpack:+7.1f} us/tensor)"
        )
    if args.primitives:
        result["primitives_us"] = time_primitives(torch, start.detach())
    name = "".join(c if c.isalnum() else "-" for c in args.label)
    if args.profile:
        engine = OffloadActivations()
        engine.prefetch_on_unpack = False
        measure(engine, prefetch_points=True)  # warm: the pool, the streams
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            step(engine, prefetch_points=True)
        profiler.disable()
        report = io.StringIO()
        report.write(f"{args.steps} steps x {args.layers} tensors, prefetch points (checkpointing); cProfile adds its "
                     "own time to every Python call, so read the shares, not the microseconds\n")  # fmt: skip
        pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(40)
        Path(args.out, f"hook-cost-{name}-profile.txt").write_text(report.getvalue())
    Path(args.out, f"hook-cost-{name}.json").write_text(json.dumps(result, indent=1))
    return 0


def time_primitives(torch: object, tensor: object) -> dict[str, float]:
    """Host microseconds per call of the torch operations that the hooks are made of (median of 5 x 200 calls)."""
    cuda = torch.cuda
    side = cuda.Stream()
    compute = cuda.current_stream()
    pinned = torch.empty(tensor.numel() * 2, dtype=torch.uint8, pin_memory=True)
    host = pinned.view(tensor.dtype)
    event = cuda.Event()
    event.record()
    index = tensor.device.index

    def enter_side_stream() -> None:
        with cuda.stream(side):
            pass

    calls = {
        "current_stream(torch.device)": lambda: cuda.current_stream(tensor.device),
        "current_stream(int)": lambda: cuda.current_stream(index),
        "with stream(side)": enter_side_stream,
        "side.wait_stream(compute)": lambda: side.wait_stream(compute),
        "side.wait_event(event)": lambda: side.wait_event(event),
        "Event(enable_timing=True).record()": lambda: cuda.Event(enable_timing=True).record(side),
        "Event().record()": lambda: cuda.Event().record(side),
        "event.query()": event.query,
        "torch.empty on cuda, 16 MiB": lambda: torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device),
        "pinned[a:b].view(dtype)": lambda: pinned[512 : 512 + tensor.numel() * 2].view(tensor.dtype),
        "host.copy_(cuda 16 MiB, non_blocking)": lambda: host.copy_(tensor.view(-1), non_blocking=True),
        "untyped_storage().data_ptr()": lambda: tensor.untyped_storage().data_ptr(),
        "tensor.device.type": lambda: tensor.device.type,
        "detach().as_strided()": lambda: tensor.detach().as_strided((tensor.numel(),), (1,), 0),
        "torch._C._current_graph_task_id()": torch._C._current_graph_task_id,
    }
    out = {}
    for name, call in calls.items():
        runs = []
        for _ in range(5):
            cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                call()
            runs.append((time.perf_counter() - t0) / 200 * 1e6)
        out[name] = statistics.median(runs)
        print(f"  {name:42s} {out[name]:7.2f} us")
    cuda.synchronize()
    return out


if __name__ == "__main__":
    sys.exit(main())
