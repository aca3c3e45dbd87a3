"""Soak: a ~1.1B Llama (peak_1b.py's model) trained for many steps with offloading; nothing may grow.

Not a pytest test: a script that run_all.sh runs after the suite. The run is split into windows of ``--every``
steps (one AdamW throughout); after each window it records device memory after every step, the window's peak,
the pinned pool's capacity and bytes in use, the process's RSS, and the sizes of the engine's tables (read the
way tests/test_reliability.py reads them on CPU). Over the windows that end after step ``--settle``, it asserts:

* device memory after every step identical (the allocator's count, not a tolerance);
* pinned capacity constant and no pinned block in use between steps;
* host RSS growth under ``--rss-slack-mib``;
* the engine's tables the same size (lanes, copies in flight, pool chunks and free ranges, warnings), and the
  step's copy list holding exactly that step's copies (each once, and again at each later save of its storage).

Prints a table, writes $OUT/soak_1b.json when $OUT is set, exits 1 on failure.

    python benchmarks/soak_1b.py [--steps 500] [--every 25] [--no-ckpt] [--seq 3584] [--batch 2]

The default shape, 2 x 3584 tokens, is sized from peak_1b.py's H100 numbers: a checkpointed, offloaded step took
0.253 s at 2 x 4096 tokens, so about 0.22 s here and two minutes for 500 steps. Without checkpointing the step is
bandwidth-bound (2.6x slower at 2 x 4096): pass a shorter --seq or fewer --steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import psutil
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.join(os.path.dirname(_HERE), "tests")
# run_all.sh runs Python with PYTHONSAFEPATH=1, which leaves even this folder (peak_1b.py) off sys.path. The model
# helpers are the GPU test suite's (tests/gpu/_gpu_models.py), and the engine's tables are read the way the CPU
# reliability tests read them (tests/test_reliability.py), so that the soak checks what the tests check.
sys.path[:0] = [_HERE, os.path.join(_TESTS, "gpu"), _TESTS]
from _gpu_models import dispose, enable_checkpointing, make_batch, make_ctx, run_steps  # noqa: E402
from peak_1b import add_model_args, build  # noqa: E402
from test_reliability import engine_tables  # noqa: E402

MiB = 1 << 20
# Table entries not compared with the first window's: the step's copy count depends on GPU timing, not on growth
# (a copy that finishes late moves the learned tail, kept on the GPU, to start earlier), so it is checked against
# the step's own offload count instead; the pool's bytes in use must be zero, not merely constant.
_CHECKED_APART = ("step_copies", "pool_in_use")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seq=3584, batch=2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--every", type=int, default=25, help="steps per window (one sample each)")
    p.add_argument("--settle", type=int, default=25, help="steps before flatness is required")
    p.add_argument("--no-ckpt", action="store_true", help="offloading without activation checkpointing")
    p.add_argument("--options", default="{}", help="JSON dict of extra engine options")
    p.add_argument("--rss-slack-mib", type=float, default=64.0)
    p.add_argument("--max-seconds", type=float, default=170.0, help="stop stepping past this (reported)")
    return p.parse_args(argv)


def sample(step: int, res, ctx, process: psutil.Process, cuda: bool) -> dict:
    """One window's record, taken after its last optimizer step."""
    stats = ctx.consume_stats()  # the window's counters, as a Trainer logs them; also reads back the stall events
    tables = engine_tables(ctx)
    return {
        "step": step,
        "mem_after_step": res.mem_after_step,  # every step of the window
        "window_peak": torch.cuda.max_memory_allocated() if cuda else 0,
        "rss": process.memory_info().rss,
        "tables": tables,
        "last_step_offloaded": res.stats[-1].get("tensors_offloaded"),
        "last_step_duplicates": res.stats[-1].get("tensors_kept_duplicate", 0),
        "bytes_kept_tail": res.stats[-1].get("bytes_kept_tail"),
        "bytes_offloaded_per_step": stats["bytes_offloaded"] / stats["steps"],
        "compute_wait_ms_per_step": 1000 * stats["compute_wait_s"] / stats["steps"],
    }


def check(samples: list[dict], args) -> list[str]:
    """Failures of the flatness criteria over the windows that end after --settle (empty: flat)."""
    flat = [s for s in samples if s["step"] > args.settle]
    if len(flat) < 2:
        return [f"only {len(flat)} window(s) after step {args.settle}: nothing to compare"]
    first, failures = flat[0], []
    mem = first["mem_after_step"][-1:]
    for s in flat:
        other = sorted(set(s["mem_after_step"]) - set(mem))
        if other:
            failures.append(f"window ending at step {s['step']}: memory after a step {other} != {mem}")
        changed = {
            k: (first["tables"][k], v)
            for k, v in s["tables"].items()
            if k not in _CHECKED_APART and v != first["tables"][k]
        }
        if changed:  # pool_capacity among them: the pinned pool must not grow after the first steps
            failures.append(f"step {s['step']}: engine tables changed (first, now): {changed}")
        if s["tables"]["pool_in_use"]:
            failures.append(f"step {s['step']}: {s['tables']['pool_in_use']} pinned bytes in use between steps")
        if s["tables"]["step_copies"] != s["last_step_offloaded"] + s["last_step_duplicates"]:
            failures.append(
                f"step {s['step']}: {s['tables']['step_copies']} copies listed for a step that "
                f"offloaded {s['last_step_offloaded']} tensors and saved {s['last_step_duplicates']} "
                "of their storages again"
            )
    rss_growth = (flat[-1]["rss"] - first["rss"]) / MiB
    if rss_growth >= args.rss_slack_mib:
        failures.append(f"host RSS grew by {rss_growth:.1f} MiB (limit {args.rss_slack_mib:.0f} MiB)")
    return failures


def print_table(samples: list[dict]) -> None:
    print(
        f"{'step':>5}{'alloc MiB':>11}{'peak MiB':>10}{'pinned MiB':>12}{'in use B':>10}{'RSS MiB':>9}"
        f"{'copies':>8}{'chunks':>8}{'ranges':>8}{'offl MiB':>10}{'tail MiB':>10}{'wait ms':>9}"
    )
    for s in samples:
        t = s["tables"]
        alloc = s["mem_after_step"][-1] / MiB if s["mem_after_step"] else 0.0
        print(
            f"{s['step']:>5}{alloc:>11.1f}{s['window_peak'] / MiB:>10.1f}{t['pool_capacity'] / MiB:>12.1f}"
            f"{t['pool_in_use']:>10}{s['rss'] / MiB:>9.1f}{t['step_copies']:>8}{t['pool_chunks']:>8}"
            f"{t['free_ranges']:>8}{s['bytes_offloaded_per_step'] / MiB:>10.1f}"
            f"{(s['bytes_kept_tail'] or 0) / MiB:>10.1f}{s['compute_wait_ms_per_step']:>9.2f}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device != "cpu"
    if cuda and not torch.cuda.is_available():
        print("soak_1b: no CUDA device, nothing to soak")
        return 0
    t_start = time.perf_counter()
    options = json.loads(args.options)
    if not cuda:
        options.setdefault("device_type", "cpu")  # the engine's CPU test mode: the same bookkeeping
    model = build(args)
    enable_checkpointing(model, "off" if args.no_ckpt else "nonreentrant")
    batch = make_batch("llama", batch=args.batch, seq=args.seq, vocab=args.vocab, device=args.device)
    ctx = make_ctx(model, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    process = psutil.Process()
    config = "offload" if args.no_ckpt else "ckpt+offload"
    print(
        f"soak_1b: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, {config}, seq {args.seq} x "
        f"batch {args.batch}, {args.steps} steps, a sample every {args.every}",
        flush=True,
    )

    samples, done = [], 0
    try:
        while done < args.steps and time.perf_counter() - t_start < args.max_seconds:
            steps = min(args.every, args.steps - done)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            res = run_steps(model, batch, steps=steps, ctx=ctx, keep=False, device=args.device, optimizer=optimizer)
            done += steps
            gc.collect()  # RSS should count what is held, not what a collection would free
            samples.append(sample(done, res, ctx, process, cuda))
    finally:
        dispose(ctx)
    wall = time.perf_counter() - t_start

    print_table(samples)
    failures = check(samples, args)
    stopped_early = done < args.steps
    if stopped_early:
        print(f"soak_1b: STOPPED EARLY at step {done} of {args.steps} (--max-seconds {args.max_seconds:.0f})")
    for failure in failures:
        print(f"soak_1b: FAIL {failure}")
    print(
        f"soak_1b: {'FAIL' if failures else 'flat'} over steps {args.settle + 1}-{done}, "
        f"{wall:.0f} s ({wall / max(done, 1):.3f} s per step incl. setup)"
    )
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "soak_1b.json"), "w") as fh:
            json.dump(
                {
                    "args": vars(args),
                    "config": config,
                    "steps_done": done,
                    "stopped_early": stopped_early,
                    "wall_s": wall,
                    "failures": failures,
                    "samples": samples,
                },
                fh,
                indent=1,
                default=str,
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
