"""One invocation of run.py, in the parent process: the environment probe, then every mode of every scenario in a
child process of its own (so that each mode starts from a fresh allocator and pinned cache, and an OOM or a hang
costs only that mode), within the time budget; the report is rewritten after each mode."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import REPO, RUN_SCRIPT
from .child import child_env
from .modes import PLAN_MIN_WARMUP, MemoryBudget, ModeSpec, budget_share, parse_mode, run_order
from .report import ReportFiles, Result, copy_to_out, fmt, print_summary, write_report
from .scenarios import SCENARIOS


@dataclass(frozen=True)
class RunConfig:
    """The command line, parsed and checked (see run.py's options)."""

    scenarios: list[str]
    modes: list[str]  # timed, in the report's order
    profile_modes: list[str]  # traced, one step each
    warmup: int | None  # None: the scenario's default
    steps: int | None
    out_dir: Path
    device: str  # "cpu" or "cuda:N"
    seed: int
    span: str
    hfo_opts: dict[str, Any]
    mode_timeout: float
    budget: float
    bw_bytes: int
    no_bandwidth: bool
    deterministic: bool
    plan_cpu_reference_bytes: int | None  # on CPU, what plan@P budgets P% of (no peak counter to measure none's)
    tag: str | None  # appended to the reports' names: one scenario's modes split across invocations
    command: str  # as recorded in the report


def run(config: RunConfig, started_at: float) -> int:
    """Runs the invocation; the budget counts from ``started_at``."""
    deadline = started_at + config.budget
    config.out_dir.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix="hfo-bench-"))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")

    t0 = time.time()
    probe_log = tmp_dir / "pre.log"  # the probe runs before the report's name, which has the device in it, is known
    bw = _probe_environment(config, tmp_dir / "bw.json", probe_log)
    device_name = _device_name(config.device, bw)
    stem = f"{date}-{slug(device_name)}-{'-'.join(config.scenarios)}"
    if config.modes == [] and config.profile_modes:
        stem += "-profile"
    if config.tag:
        stem += f"-{slug(config.tag)}"
    files = ReportFiles.at(config.out_dir, stem)
    files.log.write_text(probe_log.read_text() if probe_log.exists() else "")
    _print_probe(bw, time.time() - t0)

    # (warm-up, timed) steps per scenario
    steps_by_scenario = {
        s: (
            config.warmup if config.warmup is not None else SCENARIOS[s].warmup,
            config.steps if config.steps is not None else SCENARIOS[s].steps,
        )
        for s in config.scenarios
    }
    meta: dict[str, Any] = {
        "date": date,
        "device_name": device_name,
        "host": os.uname().nodename,
        "scenarios": config.scenarios,
        "modes": config.modes,
        "command": config.command,
        "seed": config.seed,
        "span": config.span,
        "deterministic": config.deterministic,
        "hfo_opts": config.hfo_opts,
        "steps": steps_by_scenario,
        "device": config.device,
    }
    results: list[Result] = []
    for scen in config.scenarios:
        for mode in run_order(config.modes):
            res = _run_mode(config, scen, mode, steps_by_scenario[scen], files.log, tmp_dir, deadline, results)
            results.append(res)
            st = res.get("status")
            if st == "ok":
                summary = (
                    f"{res['median_s']:.3f} s/step, peak {fmt(res.get('peak_gib'), '{:.1f}')} GiB, "
                    f"loss1 {res.get('loss1')!r}" + (f", plan {res['plan']['code']}" if "plan" in res else "")
                )
            else:
                summary = res.get("error") or "; ".join(res.get("notes", []))
            print(f"[{scen} {mode}] {st}: {summary} ({res.get('process_s', 0):.0f} s)", flush=True)
            results.sort(key=lambda r: (config.scenarios.index(r["scenario"]), config.modes.index(r["mode"])))
            write_report(files, meta, bw, results, final=False)
        for mode in config.profile_modes:
            trace_path = config.out_dir / f"{stem}-{scen}-{_file_part(mode)}-trace.json.gz"
            res = _run_mode(
                config, scen, mode, steps_by_scenario[scen], files.log, tmp_dir, deadline, results, trace_path
            )
            st = res.get("status")
            print(
                f"[{scen} {mode} profile] {st}: {res.get('profile_path') or res.get('error') or res.get('notes')}"
                f" streams: {json.dumps(res.get('profile_streams'))}",
                flush=True,
            )
            if st == "ok":
                copy_to_out(trace_path)
            meta.setdefault("profiles", []).append(
                {
                    "scenario": scen,
                    "mode": mode,
                    "status": st,
                    "path": str(trace_path) if st == "ok" else None,
                    "error": res.get("error"),
                    "streams": res.get("profile_streams"),
                }
            )

    write_report(files, meta, bw, results, final=True)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    print()
    if results:
        print_summary(results, config.scenarios)
    print(
        f"\nwrote {files.md} and {files.json} ({time.time() - started_at:.0f} s)"
        + (f"; copied to {os.environ['OUT']}" if os.environ.get("OUT") else "")
    )
    return 0


def _probe_environment(config: RunConfig, result_path: Path, log_path: Path) -> dict[str, Any]:
    """Versions, device and copy bandwidth from a child process (on CPU, or with --no-bandwidth: versions only)."""
    bw_bytes = 0 if (config.no_bandwidth or config.device == "cpu") else config.bw_bytes
    spec = {"device": config.device if bw_bytes else "cpu", "bw_bytes": bw_bytes, "result_path": str(result_path)}
    bw, err = _run_child("--_bandwidth", spec, log_path, 120, "bandwidth probe")
    bw = bw or {"error": err}
    if config.device == "cpu":
        bw["skipped"] = "device is cpu"
        bw.setdefault("device_name", "cpu")
    elif config.no_bandwidth:
        bw["skipped"] = "--no-bandwidth"
    return bw


def _device_name(device: str, bw: dict[str, Any]) -> str:
    """The probe's name for the device; if the probe failed, CUDA's, read here."""
    name = bw.get("device_name") or (device if device == "cpu" else "cuda")
    if name == "cuda":
        try:
            import torch

            name = torch.cuda.get_device_name()
        except Exception:
            pass
    return name


def _print_probe(bw: dict[str, Any], seconds: float) -> None:
    if bw.get("h2d_GBps"):
        print(
            f"bandwidth ({seconds:.0f} s): H2D {bw['h2d_GBps']:.1f} GB/s, D2H {bw['d2h_GBps']:.1f} GB/s, "
            f"both {bw['both_GBps']:.1f} GB/s; pageable H2D {bw['pageable_h2d_GBps']:.1f} GB/s, "
            f"D2H {bw['pageable_d2h_GBps']:.1f} GB/s",
            flush=True,
        )
    else:
        print(f"bandwidth probe: {bw.get('skipped') or bw.get('error')}", flush=True)
    print("versions:", json.dumps(bw.get("versions", {})), flush=True)


def _run_mode(
    config: RunConfig,
    scen: str,
    mode: str,
    warmup_and_steps: tuple[int, int],
    log_path: Path,
    tmp_dir: Path,
    deadline: float,
    done: list[Result],
    trace_path: Path | None = None,
) -> Result:
    """One mode in its child process (with ``trace_path``: warm-up, one plain step, then the traced step). Modes
    the scenario does not run, plan modes without a budget (``done``: the results so far) and modes past the budget
    are skipped without starting a process."""
    parsed = parse_mode(mode)
    skipped: Result = {"scenario": scen, "mode": mode, "status": "skipped", "notes": []}
    if SCENARIOS[scen].force_ckpt and not parsed.checkpointing:
        return skipped | {"notes": [f"scenario {scen} runs with checkpointing on: only ckpt* modes"]}
    budget = None
    if parsed.planned:
        budget = _memory_budget(config, scen, parsed.budget, done)
        if isinstance(budget, str):
            return skipped | {"notes": [budget]}
    left = deadline - time.time()
    if left < 20:
        return skipped | {"notes": ["time budget spent"]}
    warmup, steps = warmup_and_steps
    spec: ModeSpec = {
        "scenario": scen,
        "mode": mode,
        "device": config.device,
        "seed": config.seed,
        "span": config.span,
        "warmup": max(warmup, PLAN_MIN_WARMUP) if parsed.planned else warmup,
        "steps": 1 if trace_path else steps,
        "hfo_opts": config.hfo_opts,
        "memory_budget": budget,
        "deterministic": config.deterministic,
        "result_path": str(tmp_dir / f"{scen}-{_file_part(mode)}.json"),
        "profile_path": str(trace_path) if trace_path else None,
    }
    if os.path.exists(spec["result_path"]):
        os.remove(spec["result_path"])
    t = time.time()
    res, err = _run_child(
        "--_worker",
        spec,
        log_path,
        min(config.mode_timeout, left - 5),
        f"{scen} {mode}{' (profile)' if trace_path else ''}",
    )
    if res is None:
        res = {
            "scenario": scen,
            "mode": mode,
            "status": "timeout" if err.startswith("timeout") else "error",
            "error": err,
            "notes": [],
        }
    res["process_s"] = time.time() - t
    if budget is not None:
        res["memory_budget"] = budget
    return res


def _memory_budget(config: RunConfig, scen: str, budget: float | str, done: list[Result]) -> MemoryBudget | str:
    """A plan mode's budget: ``budget`` percent of the peak of `none` in this run (on CPU, of
    ``--plan-cpu-reference-bytes``), or "auto". Returns why there is none instead, when the reference is missing."""
    if budget == "auto":
        if config.device == "cpu":
            return "no budget: 'auto' is a share of the device's memory, and the CPU test mode has no device"
        return {"option": "auto", "percent": None, "reference": "the device's memory, less the library's margin"}
    if config.device == "cpu":
        if config.plan_cpu_reference_bytes is None:
            return (
                "no budget: on CPU there is no peak counter to measure none's peak; give "
                "--plan-cpu-reference-bytes N (plan@P then budgets P% of N) and --hfo-opt device_type=cpu"
            )
        reference, what = config.plan_cpu_reference_bytes, "--plan-cpu-reference-bytes"
    else:
        none = next((r for r in done if r["scenario"] == scen and r["mode"] == "none"), None)
        if none is None:
            return "no budget: plan@P budgets P% of none's peak, and `none` did not run first in this run: add it"
        if none.get("status") != "ok":
            return f"no budget: plan@P budgets P% of none's peak, and `none` did not finish ({none.get('status')})"
        reference, what = none["peak_bytes"], "none's peak (timed steps)"
    return budget_share(reference, budget, what)


def _run_child(
    kind: str, spec: ModeSpec | dict[str, Any], log_path: Path, timeout: float, header: str
) -> tuple[Result | None, str]:
    """Runs ``run.py KIND SPEC`` with the working tree first on its path, its output appended to ``log_path``.
    Returns what it wrote to ``spec["result_path"]``, or None and why there is nothing (timeout, crash)."""
    env = child_env()
    if spec.get("deterministic"):
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cmd = [sys.executable, str(RUN_SCRIPT), kind, json.dumps(spec)]
    with open(log_path, "a") as log:
        log.write(f"\n===== {header} =====\n")
        log.flush()
        try:
            proc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), timeout=max(1.0, timeout)
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            log.write(f"\n[timeout after {timeout:.0f} s]\n")
            return None, f"timeout ({timeout:.0f} s)"
    try:
        with open(spec["result_path"]) as f:
            return json.load(f), ""
    except Exception:
        sig = f"signal {-rc}" if rc < 0 else f"exit {rc}"
        hint = " (killed: host out of memory?)" if rc in (-9, 137) else ""
        return None, f"crashed, {sig}{hint}"


def _file_part(mode: str) -> str:
    """A mode's name in a file name: "ckpt+hfo" -> "ckpt_hfo", "plan@50" -> "plan-50" (what $OUT hands back)."""
    return mode.replace("+", "_").replace("@", "-").replace("/", "-")


def slug(s: str) -> str:
    """``s`` in a file name: lowercase letters, digits and dashes ("NVIDIA H100 80GB HBM3": "nvidia-h100-80gb-hbm3")."""
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "unknown"
