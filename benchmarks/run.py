#!/usr/bin/env python3
"""Side-by-side benchmark of activation offloading in the Hugging Face training stack.

Builds a Llama-style model from a config with random weights (bf16, fused AdamW on the trainable parameters,
labels = input_ids, sdpa attention) and times training steps in each mode, every mode in its own process:

  none         no offloading, no checkpointing
  ckpt         non-reentrant activation checkpointing alone
  ckpt+native  checkpointing with transformers' own offload flag (save_on_cpu on the compute stream)
  trl          TRL's offloader (trl.models.activation_offloading), streams on
  trl-sync     TRL's offloader with use_streams=False
  ckpt+trl     checkpointing plus TRL's offloader
  hfo          ours: hf_offload.get_act_offloading_ctx_manager
  ckpt+hfo     checkpointing plus ours
(also accepted, not in "all": ckpt+trl-sync, and)
  ckpt-every-K[+OFFLOADER]  checkpointing on every K-th decoder layer only (K >= 2), with an offloader or without
  plan@P       ours with memory_budget = P% of the `none` mode's peak in the same run (`none` must run too);
               the budget decides per layer what is kept, offloaded or checkpointed (--budget-sweep adds a range)
  plan@auto    ours with memory_budget="auto" (the device's memory less the library's margin)

Usage (on the GPU machine; see benchmarks/README.md):
  python benchmarks/run.py --scenarios S1,S2 --modes all --steps 10 --warmup 3 --out benchmarks/results
  python benchmarks/run.py --scenarios S3
  python benchmarks/run.py --scenarios S1 --profile ckpt+hfo          # one-step chrome trace
  python benchmarks/run.py --scenarios S1 --modes none,ckpt,plan@66 --budget-sweep 35:95:5   # the planner
  python benchmarks/run.py --scenarios tiny --device cpu              # CPU smoke test of the harness

Writes <out>/<date>-<device>-<scenarios>[-<tag>].md and .json (and .log); copies them into $OUT when OUT is set.
This file is the command line; the harness itself is in benchmarks/harness/ (its __init__.py lists the modules).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from pathlib import Path

# `harness` sits next to this file; Python puts this folder on sys.path, except under PYTHONSAFEPATH=1.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import GIB, REPO  # noqa: E402
from harness.modes import ALL_MODES, Mode, budget_sweep, parse_mode  # noqa: E402
from harness.runner import RunConfig, run  # noqa: E402
from harness.scenarios import SCENARIOS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="S1,S2", help=f"comma list of {', '.join(SCENARIOS)}")
    ap.add_argument(
        "--modes",
        default=None,
        help="comma list, or 'all' (default all; with --budget-sweep none,ckpt; with --profile none)",
    )
    ap.add_argument(
        "--budget-sweep",
        default=None,
        metavar="START:STOP:STEP",
        help="adds plan@START, plan@START+STEP, ..., plan@STOP to the modes (percent of none's peak)",
    )
    ap.add_argument(
        "--plan-cpu-reference-bytes",
        type=int,
        default=None,
        metavar="N",
        help="on CPU (no peak counter to measure none's peak), plan@P budgets P%% of N bytes",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default per scenario: S1/S2 10, S3 5)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps, >= 1 (default S1/S2 3, S3 2)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument(
        "--tag",
        default=None,
        help="appended to the reports' names (<date>-<device>-<scenarios>-<tag>.md): for a scenario's "
        "modes split across invocations",
    )
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--span",
        choices=("step", "forward"),
        default="step",
        help="what the TRL/hf_offload context wraps: forward+backward (step) or the forward only",
    )
    ap.add_argument(
        "--hfo-opt",
        action="append",
        default=[],
        help="engine option for hfo modes, key=value[,key=value] (e.g. forward_window_bytes=268435456)",
    )
    ap.add_argument("--profile", default=None, help="mode(s) to trace one step of (chrome trace, .json.gz)")
    ap.add_argument("--mode-timeout", type=float, default=300.0, help="seconds one mode's process may take")
    ap.add_argument(
        "--budget",
        type=float,
        default=570.0,
        help="seconds for the whole run; modes that would start past it are skipped",
    )
    ap.add_argument("--bw-bytes", type=int, default=GIB, help="size of the bandwidth probe's copies")
    ap.add_argument("--no-bandwidth", action="store_true")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True, warn_only=True) in every mode (for gradient checks)",
    )
    args = ap.parse_args(argv)

    t_start = time.time()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; known: {', '.join(SCENARIOS)}")
    if args.modes is None:
        args.modes = "" if args.profile else "none,ckpt" if args.budget_sweep else "all"
    try:
        modes = _mode_list(args.modes, args.budget_sweep)
        prof_modes = _mode_list(args.profile or "", None)
    except ValueError as e:
        ap.error(str(e))
    if args.warmup is not None and args.warmup < 1:
        ap.error("--warmup must be >= 1 (step 1 also takes the gradient fingerprint)")
    hfo_opts = _parse_opts(args.hfo_opt)

    if args.device is None:
        try:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except Exception:
            args.device = "cpu"
    if args.device == "cuda":
        args.device = "cuda:0"  # torch.cuda.set_device refuses a device without an index

    config = RunConfig(
        scenarios=scenarios,
        modes=modes,
        profile_modes=prof_modes,
        warmup=args.warmup,
        steps=args.steps,
        out_dir=Path(args.out),
        device=args.device,
        seed=args.seed,
        span=args.span,
        hfo_opts=hfo_opts,
        mode_timeout=args.mode_timeout,
        budget=args.budget,
        bw_bytes=args.bw_bytes,
        no_bandwidth=args.no_bandwidth,
        deterministic=args.deterministic,
        plan_cpu_reference_bytes=args.plan_cpu_reference_bytes,
        tag=args.tag,
        command="python "
        + " ".join([os.path.relpath(__file__, REPO)] + (sys.argv[1:] if argv is None else list(argv))),
    )
    return run(config, started_at=t_start)


def _mode_list(modes: str, sweep: str | None) -> list[str]:
    """A comma list of modes (with 'all' expanded), then the sweep's plan modes, checked, each once: a second
    spelling of a mode already listed (plan@50.0 after plan@50) is dropped."""
    names = [m.strip() for m in modes.split(",") if m.strip()]
    names = [n for m in names for n in (ALL_MODES if m == "all" else [m])] + (budget_sweep(sweep) if sweep else [])
    out: dict[Mode, str] = {}
    for name in names:
        out.setdefault(parse_mode(name), name)
    return list(out.values())


def _parse_opts(items: list[str]) -> dict[str, object]:
    """--hfo-opt values: key=value pairs, each value a Python literal or else a string."""
    out = {}
    for item in items or []:
        for kv in item.split(","):
            if not kv.strip():
                continue
            k, _, v = kv.partition("=")
            try:
                out[k.strip()] = ast.literal_eval(v.strip())
            except Exception:
                out[k.strip()] = v.strip()
    return out


if __name__ == "__main__":
    # run.py is also the entry point of the child processes that harness/runner.py starts; their modules are
    # imported only there, so that the parent never loads transformers or the offloaders.
    if len(sys.argv) == 3 and sys.argv[1] in ("--_worker", "--_bandwidth"):
        sys.path.insert(0, str(REPO))  # the working tree's hf_offload before any installed one
        if sys.argv[1] == "--_worker":
            from harness.worker import main as child_main
        else:
            from harness.environment import main as child_main
        sys.exit(child_main(json.loads(sys.argv[2])))
    sys.exit(main())
