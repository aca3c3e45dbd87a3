#!/usr/bin/env python3
"""Where the time of a short step goes with checkpointing + hf-offload: variants interleaved in one process.

`run.py` runs each mode in its own process; this script builds one model and alternates blocks of steps of several
variants on it, so that the variants see the same GPU clocks, allocator and host. For each variant it reports the
median step, the host time spent inside the engine's hooks, and, from one profiled step, how the compute stream
spent the step: busy, idle (and the largest idle gaps, with the kernels around them), copies on each stream, and the
CUDA runtime calls the host made (waits and synchronisations included). Each block also runs its steps once more
without synchronising between them (pipelined, as a training loop runs). Also how far the host ran ahead of the GPU:
if the GPU finishes the backward a moment after the host has issued it, the step is bound by the host, and every
microsecond of Python in a hook is a microsecond of the step.

Usage (GPU machine):
  python benchmarks/short_steps.py --scenario M36 --out $OUT
  python benchmarks/short_steps.py --scenario M36 --variants ckpt,ckpt+hfo,ckpt+hfo:use_streams=False
  python benchmarks/short_steps.py --scenario M36 --regional --variants ckpt,ckpt+hfo
  python benchmarks/short_steps.py --scenario gemma2-2b-2k --variants ckpt,ckpt+hfo --span forward
A variant is `ckpt` (checkpointing alone), `none` (no checkpointing, no offloading), or `ckpt+hfo` / `hfo` with
`:key=value` engine options after it (`ckpt+hfo:min_offload_size=1099511627776`: nothing eligible).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the working tree's hf_offload first
import torch  # noqa: E402
from harness.modes import parse_mode  # noqa: E402
from harness.offloaders import disable_checkpointing, enable_checkpointing  # noqa: E402
from harness.scenarios import SCENARIOS  # noqa: E402
from harness.trace import busy_and_gaps, save_trace, stream_work  # noqa: E402
from harness.worker import build_scenario  # noqa: E402

import hf_offload  # noqa: E402
from hf_offload.engine import OffloadActivations  # noqa: E402

DEFAULT_VARIANTS = "ckpt,ckpt+hfo,ckpt+hfo:min_offload_size=1099511627776,ckpt+hfo:use_streams=False"
# The caching allocator's counters read around each block's timed steps, per step (does a
# variant make the allocator map memory, release it, retry or synchronise every step?). With expandable segments
# `num_device_alloc` counts the pages mapped; `num_sync_all_streams` counts the full synchronisations that
# `empty_cache` and an out-of-memory retry make; `allocation.all.allocated` every block handed out.
ALLOCATOR_COUNTERS = (
    "allocation.all.allocated",
    "num_device_alloc",
    "num_device_free",
    "num_alloc_retries",
    "num_sync_all_streams",
)


class HookClock:
    """Host seconds spent inside the engine's pack, unpack and prefetch entry points (patched on the class)."""

    NAMES = ("_pack", "_unpack", "_prefetch_from_hook", "_begin_step")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for name in self.NAMES:
            original = getattr(OffloadActivations, name)
            setattr(OffloadActivations, name, self._timed(name, original))

    def _timed(self, name: str, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return wrapper

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def parse_variant(text: str) -> tuple[bool, bool, dict[str, Any]]:
    """'ckpt+hfo:use_streams=False' -> (checkpointing, offloading, options)."""
    name, _, options_text = text.partition(":")
    if name not in ("none", "ckpt", "hfo", "ckpt+hfo"):
        raise SystemExit(f"unknown variant {text!r}: none, ckpt, hfo or ckpt+hfo[:key=value,...]")
    options = {}
    for item in filter(None, options_text.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):  # a word, such as memory_budget=auto
            options[key.strip()] = value.strip()
    return name.startswith("ckpt"), "hfo" in name, options


def trace_name(variant: str) -> str:
    """The variant in the characters a file name brought back from the GPU machine may hold."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in variant)


def set_checkpointing(model: torch.nn.Module, on: bool) -> None:
    if on:
        enable_checkpointing(model, offload=False)
    else:
        disable_checkpointing(model)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="M36", choices=sorted(SCENARIOS))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--rounds", type=int, default=3, help="blocks of each variant, interleaved")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per block (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2, help="steps per block before timing (the tail is learned)")
    ap.add_argument("--trace", default="ckpt,ckpt+hfo", help="variants to profile one step of")
    ap.add_argument(
        "--cprofile",
        default=None,
        metavar="VARIANTS",
        help="also run 5 steps of each of these variants (comma-separated) under cProfile, after --warmup steps: the "
        "functions that took the most host time on the main thread (the forward's; backward runs on autograd's), and "
        "where each variant's own time per function differs from the first's",
    )
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="move every object alive after the model is built out of the garbage collector's reach (gc.freeze()), "
        "as training loops that manage the collector do: a full collection then scans only what the steps allocate",
    )
    ap.add_argument("--stack", action="store_true",
                    help="trace with Python stacks (torch.profiler's with_stack): the host time of each Python "
                         "function and operator, per thread, in each traced variant, and where it differs from the "
                         "first traced variant's")  # fmt: skip
    ap.add_argument("--regional", action="store_true",
                    help="compile each decoder layer (regional compilation), as run.py's '/regional' modes do; every "
                         "variant then runs on the compiled layers")  # fmt: skip
    ap.add_argument(
        "--span",
        choices=("step", "forward"),
        default="step",
        help="what the offload context wraps: the forward and the backward (run.py's default) or the forward only (as "
        "the Trainer callback and TRL's trainers wrap `compute_loss`): saved-tensor hooks held while backward runs "
        "cost host time of their own",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    scenario = SCENARIOS[args.scenario]
    # As run.py builds it (Liger before the model exists, LoRA after), checkpointing off: each variant sets its own.
    built_as = parse_mode("none/regional" if args.regional else "none")
    notes: list[str] = []
    built = build_scenario(args.scenario, args.seed, built_as, device, {"notes": notes})
    if scenario.liger and not built.facts["liger"]:
        raise SystemExit(f"{args.scenario} runs with Liger, which could not be applied here: {notes}")
    model, optimizer, input_ids = built.model, built.optimizer, built.input_ids
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    clock = HookClock()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    traced = {v.strip() for v in args.trace.split(",") if v.strip()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def forward(context: Any, stack: contextlib.ExitStack) -> torch.Tensor:
        """The step's forward under `context` (entered on `stack`), which `--span forward` exits before backward."""
        if context is not None:
            stack.enter_context(context)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        if args.span == "forward":
            stack.close()
        return loss

    def step(context: Any) -> dict[str, float]:
        """One step, synchronised before and after, as the benchmark times it; host-side marks along the way."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            loss = forward(context, stack)
            t_forward = time.perf_counter()
            loss.backward()
        t_backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t_issued = time.perf_counter()
        torch.cuda.synchronize()
        t_end = time.perf_counter()
        return {
            "s": t_end - t0,
            "forward_issued_s": t_forward - t0,
            "backward_issued_s": t_backward - t0,
            "all_issued_s": t_issued - t0,
            "host_ahead_s": t_end - t_issued,
        }

    def pipelined(context: Any, steps: int) -> float:
        """Seconds per step over `steps` steps with no synchronisation between them, as a training loop runs (it
        syncs only to log): the host may then issue a step's forward while the GPU still runs the last optimizer
        step, so host time that the per-step synchronisation exposes can hide there."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            with contextlib.ExitStack() as stack:
                forward(context, stack).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    results: dict[str, dict[str, Any]] = {
        v: {
            "steps": [],
            "pipelined_s": [],
            "hooks": defaultdict(float),
            "calls": defaultdict(int),
            "allocator": defaultdict(float),
        }
        for v in variants
    }
    for round_index in range(args.rounds):
        # Each round starts one variant later: no variant always follows the same one (the allocator's and the host's
        # state after a variant may favour or slow the next).
        for variant in variants[round_index % len(variants) :] + variants[: round_index % len(variants)]:
            checkpointing, offloading, options = parse_variant(variant)
            set_checkpointing(model, checkpointing)
            context = hf_offload.get_act_offloading_ctx_manager(model, **options) if offloading else None
            for _ in range(args.warmup):
                step(context)
            clock.reset()
            counters_before = torch.cuda.memory_stats()
            for _ in range(args.steps):
                results[variant]["steps"].append(step(context))
            counters_after = torch.cuda.memory_stats()
            for name in ALLOCATOR_COUNTERS:
                added = counters_after.get(name, 0) - counters_before.get(name, 0)
                results[variant]["allocator"][name] += added / args.steps / args.rounds
            for name, seconds in clock.seconds.items():
                results[variant]["hooks"][name] += seconds / args.steps / args.rounds
                results[variant]["calls"][name] += clock.calls[name] // args.steps // args.rounds
            results[variant]["pipelined_s"].append(pipelined(context, args.steps))
            if context is not None:
                results[variant]["stats"] = {k: v for k, v in context.get_stats().items()}
                if context.memory_plan is not None:  # a plan is made per block: it may differ between blocks
                    results[variant].setdefault("plans", []).append(context.memory_plan.code)
            if round_index == args.rounds - 1 and variant in traced:
                path = out / f"short-steps-{args.scenario}-{trace_name(variant)}.json.gz"
                results[variant]["trace"] = trace_summary(step, context, str(path), args.stack)
            if context is not None:
                context.remove_hooks()
            del context
            steps = results[variant]["steps"]
            print(
                f"round {round_index + 1} {variant}: median so far "
                f"{statistics.median(s['s'] for s in steps) * 1e3:.1f} ms",
                flush=True,
            )

    profiled = {variant: host_profile(variant, model, step, args.warmup)
                for variant in filter(None, (v.strip() for v in (args.cprofile or "").split(",")))}  # fmt: skip
    print_profile_differences(profiled)

    def lower_quartile(times: list[float]) -> float:
        """This host's hiccups (a stalled host thread in a host-bound step) only ever add time: the lower quartile
        of many steps resolves a 1-2% difference where the median, which they reach, does not."""
        return statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0]

    baseline = statistics.median(s["s"] for s in results[variants[0]]["steps"])
    quartile_baseline = lower_quartile([s["s"] for s in results[variants[0]]["steps"]])
    pipelined_baseline = statistics.median(results[variants[0]]["pipelined_s"])
    print(f"\n{args.scenario}: {scenario.describe()}; {args.rounds} rounds x {args.steps} steps, interleaved"
          + (", decoder layers compiled" if args.regional else "")
          + (", gc.freeze()" if args.gc_freeze else "")
          + f"; PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")  # fmt: skip
    print(f"{'variant':52s} {'median ms':>9s} {'ratio':>6s} {'p25 ms':>7s} {'ratio':>6s} {'pipelined ms':>12s} "
          f"{'ratio':>6s} {'host ahead ms':>13s} {'hooks ms':>8s}")  # fmt: skip
    for variant in variants:
        steps = results[variant]["steps"]
        median = statistics.median(s["s"] for s in steps)
        quartile = lower_quartile([s["s"] for s in steps])
        flowing = statistics.median(results[variant]["pipelined_s"])
        ahead = statistics.median(s["host_ahead_s"] for s in steps)
        hooks = sum(results[variant]["hooks"].values())
        results[variant]["median_s"] = median
        results[variant]["pipelined_median_s"] = flowing
        results[variant]["lower_quartile_s"] = quartile
        print(f"{variant:52s} {median * 1e3:9.1f} {median / baseline:6.3f} {quartile * 1e3:7.1f} "
              f"{quartile / quartile_baseline:6.3f} {flowing * 1e3:12.1f} "
              f"{flowing / pipelined_baseline:6.3f} {ahead * 1e3:13.1f} {hooks * 1e3:8.1f}")  # fmt: skip
    print("\nthe allocator's counters per timed step: " + ", ".join(ALLOCATOR_COUNTERS))
    for variant in variants:
        counts = results[variant]["allocator"]
        print(f"{variant:52s} " + " ".join(f"{counts[name]:10.1f}" for name in ALLOCATOR_COUNTERS))
    for variant in variants:
        trace = results[variant].get("trace")
        if trace:
            print(f"\n{variant}: trace " + json.dumps({k: v for k, v in trace.items() if k not in ("gaps", "host")}))
            for gap in trace["gaps"][:8]:
                print("   gap", json.dumps(gap))
    stacked = [variant for variant in variants if "host" in results[variant].get("trace", {})]
    for variant in stacked[1:]:
        first, this = results[stacked[0]]["trace"]["host"], results[variant]["trace"]["host"]
        names = set(first) | set(this)
        ms = {name: this.get(name, {"ms": 0.0})["ms"] - first.get(name, {"ms": 0.0})["ms"] for name in names}
        print(f"\nhost time, {variant} less {stacked[0]} (ms, inclusive; the 30 largest differences):")
        for name in sorted(names, key=lambda name: -abs(ms[name]))[:30]:
            counts = f"{first.get(name, {}).get('count', 0)} -> {this.get(name, {}).get('count', 0)}"
            print(f"  {ms[name]:+8.2f}  ({counts:>11s})  {name}")
    (out / f"short-steps-{args.scenario}.json").write_text(
        json.dumps(
            {
                "scenario": args.scenario,
                "command": " ".join(sys.argv),
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "allocator_config": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                "results": results,
            },
            indent=1,
            default=str,
        )
    )
    return 0


PROFILED_STEPS = 5


def host_profile(variant: str, model: torch.nn.Module, step: Any, warmup: int) -> dict[str, tuple[int, float]]:
    """`PROFILED_STEPS` steps of `variant` under cProfile (after `warmup` steps, so that a memory plan is settled):
    where the main thread's time goes. Returns, per function, its calls and own seconds per step."""
    import cProfile
    import pstats

    checkpointing, offloading, options = parse_variant(variant)
    set_checkpointing(model, checkpointing)
    context = hf_offload.get_act_offloading_ctx_manager(model, **options) if offloading else None
    for _ in range(warmup):
        step(context)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(PROFILED_STEPS):
        step(context)
    profiler.disable()
    print(f"\ncProfile of {PROFILED_STEPS} steps of {variant}, by own time:")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(45)
    print(f"cProfile of {PROFILED_STEPS} steps of {variant}, by cumulative time, hf_offload only:")
    stats.sort_stats("cumulative").print_stats("hf_offload", 30)
    if context is not None:
        context.remove_hooks()
    own: dict[str, tuple[int, float]] = {}
    for (path, line, name), (_, calls, own_seconds, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        own[f"{path}:{line}({name})"] = (calls // PROFILED_STEPS, own_seconds / PROFILED_STEPS)
    return own


def print_profile_differences(profiled: dict[str, dict[str, tuple[int, float]]]) -> None:
    """Per variant after the first, the functions whose own time per step differs most from the first variant's:
    host time a variant adds shows where it is spent, even where the added calls are each cheap."""
    if len(profiled) < 2:
        return
    (first_name, first), *others = profiled.items()
    for variant, this in others:
        names = set(first) | set(this)
        added = {name: this.get(name, (0, 0.0))[1] - first.get(name, (0, 0.0))[1] for name in names}
        total = sum(added.values())
        print(f"\nmain thread's own time per step, {variant} less {first_name}: {total * 1e3:+.2f} ms in all; the 30 "
              f"largest differences (ms, calls per step):")  # fmt: skip
        for name in sorted(names, key=lambda name: -abs(added[name]))[:30]:
            calls = f"{first.get(name, (0, 0))[0]} -> {this.get(name, (0, 0))[0]}"
            print(f"  {added[name] * 1e3:+8.3f}  ({calls:>11s})  {name}")


def host_time(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per thread and name, the Python functions' and operators' host time in a trace (inclusive: a function's time
    holds its callees'), the 400 largest."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("python_function", "cpu_op", "user_annotation"):
            key = f"tid {event.get('tid')} {event.get('cat')} {event.get('name', '')[:120]}"
            totals[key]["count"] += 1
            totals[key]["ms"] += float(event.get("dur", 0)) / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]["ms"])[:400])


def trace_summary(run_step: Any, context: Any, path: str, stack: bool = False) -> dict[str, Any]:
    """One step under torch.profiler: the compute stream's busy and idle time, its largest gaps, the copies per
    stream and the runtime calls, from the chrome trace (saved gzipped at `path`); with `stack`, Python stacks too,
    and the host's time per function and operator (`host_time`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
        run_step(context)
    events = save_trace(prof, path)
    device_work = stream_work(events)
    copies: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for stream, work in device_work.items():
        for start, stop, name, kind in work:
            if kind in ("DtoH", "HtoD", "gpu_memcpy"):
                copies[f"stream {stream} {name}"]["count"] += 1
                copies[f"stream {stream} {name}"]["ms"] += (stop - start) / 1e3
    runtime: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("cuda_runtime", "cuda_driver"):
            runtime[event.get("name", "")]["count"] += 1
            runtime[event.get("name", "")]["ms"] += float(event.get("dur", 0)) / 1e3
    # The compute stream: the one with the most kernel time.
    compute = max(device_work, key=lambda s: sum(b - a for a, b, _, kind in device_work[s] if kind == "kernel"))
    span_start = min(piece[0] for work in device_work.values() for piece in work)
    span_end = max(piece[1] for work in device_work.values() for piece in work)
    busy, idle = busy_and_gaps(device_work[compute])
    gaps = sorted(
        (
            {"ms": (after - before) / 1e3, "at": round((before - span_start) / (span_end - span_start), 3),
             "after": previous[:60], "before": following[:60]}
            for before, after, previous, following in idle
        ),
        key=lambda gap: -gap["ms"],
    )  # fmt: skip
    return {
        "gpu_span_ms": (span_end - span_start) / 1e3,
        "compute_busy_ms": busy / 1e3,
        "compute_idle_ms": (span_end - span_start - busy) / 1e3,
        "gaps_over_50us": sum(gap["ms"] > 0.05 for gap in gaps),
        "copies": dict(copies),
        "runtime": {k: v for k, v in sorted(runtime.items(), key=lambda kv: -kv[1]["ms"])[:14]},
        "gaps": gaps[:20],
        **({"host": host_time(events)} if stack else {}),
    }


if __name__ == "__main__":
    sys.exit(main())
