#!/usr/bin/env python3
"""The shape zoo: the memory budget swept over 1B-8B-class shapes, checked at every budget.

Per shape (``harness/scenarios.py``'s ZOO_SCENARIOS, and M36): the simple plans ``none``, ``ckpt`` and ``ckpt+hfo``;
then ``plan@1``, whose refusal names the smallest budget that works; then ``memory_budget`` at every 5% of none's peak
from that minimum to 95%, and at each simple plan's measured peak. Every budget runs 16 steps (2 profiled; 3 of the
closed loop's trial of plain checkpointing with every input kept, where it fits and the plan is another; the plan's
first; 3 that the closed loop measures, after which it may correct the plan at the 10th; then 6 timed), each simple
plan 8 (2 + 6 timed), and each budget is checked: (a) its step <= 1.02x the fastest simple plan's whose peak fits the
budget, step times being the lower quartile of the timed steps (``harness/zoo.py`` says why), (b) every step's peak
(profiled steps included) <= the budget, (c) not refused when a simple plan meets it. ``harness/zoo.py`` holds the
sweep's logic and the checks.

(a)'s re-check: after a shape's sweep, every budget that failed (a) runs again with the simple plan it was compared
with, alternately (--recheck-pairs times ref, plan: ABAB for 2, with the sweep's steps) on one model, built once for
the budget's re-check (``harness.worker.SharedModel``: each run sets its own checkpointing and takes its offload
context off when it ends), so that both sides see the same drift of the host (short steps' times drift with it by
more than 2% within minutes, and a model built afresh per run put minutes between them); (a) is judged again on each
side's pooled timed steps, and the report shows both ratios. Within --max-minutes: a budget the time leaves out keeps
its first verdict, "not re-checked (time)". A budget that fails (a) having run only its reference's own plan (every
layer `C` against ckpt+hfo, `c` against ckpt, `K` against none) is marked so: the planner chose nothing else there.

(c)'s re-check (also with --recheck-pairs > 0): a refused budget that a simple plan's measured peak fits runs that
simple plan once more, built afresh as in the sweep; (c) counts only the simple plans whose re-run met the budget too,
since a plan's peak moves between runs by the caching allocator's blocks (``harness/zoo.py`` gives the figures).

Speed: all modes of all shapes run one after the other in one child process (run.py's harness: ``harness.worker``
builds each of the sweep's modes its model afresh from the same seed; between modes the model is freed, the
allocator's cache emptied; each step's peak is reset and read, so ``max_memory_allocated`` is exact per step). A
process start (~10-15 s) is paid once, not per mode. If the child dies (a crash, a CUDA error), the parent records the
mode it was running and starts another child that goes on with the next mode. The parent stops the sweep at
--max-minutes, cleanly.

Outputs, in --out (default /tmp/hfo-zoo): per shape ``<date>-<device>-zoo-<shape>.json`` (run.py's format, rewritten
after every mode; the zoo's checks in ``meta.zoo``), ``.md`` (run.py's report plus the checks) and ``-pareto.png``
(``pareto.py``); ``<date>-<device>-zoo.md`` (the summary: one row per shape, then each shape's checks) and ``.log``.
With $OUT set (the GPU machine), ``$OUT/<stem>.tar.gz`` (all of them, rewritten after every mode), ``<stem>.md`` and
``<stem>.log``: three files, within what $OUT hands back. The archive holds the run's progress too: extracted into a
folder that a later call carries, ``--resume --out <stem>`` goes on where the last call stopped.

Usage:
  python benchmarks/zoo.py                                    # the default 8 shapes, ~12 minutes on an H100 (two runs)
  python benchmarks/zoo.py --shapes M36,mistral-7b-8l         # a subset (--shapes all: every zoo shape)
  python benchmarks/zoo.py --device cpu --out /tmp/zoo        # CPU smoke run: tiny shapes, hf-offload's CPU test mode
  python benchmarks/zoo.py --recheck-pairs 0                  # no re-check of (a)'s or (c)'s failures
  python benchmarks/zoo.py --gpus 2 --shapes all              # two sweeps at once, one a GPU; one summary
  python benchmarks/zoo.py --report-only --out DIR            # the reports and charts again, from DIR's JSON files
  python benchmarks/zoo.py --resume --out DIR                 # go on in DIR (a run's --out, or its extracted archive)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `harness` sits next to this file
from harness import GIB, REPO, child, library_source_hash, zoo  # noqa: E402
from harness.modes import budget_share, parse_mode  # noqa: E402
from harness.report import ReportFiles, Result, fmt, write_report  # noqa: E402
from harness.runner import slug  # noqa: E402
from harness.scenarios import SCENARIOS, ZOO_ALL, ZOO_CPU, ZOO_DEFAULT  # noqa: E402

if TYPE_CHECKING:  # the parent process imports no torch
    from harness.worker import SharedModel

PROGRESS = "zoo-progress.json"  # in --out: the child's state (environment, stem, the mode it runs), for the parent
LIVE_LOG = "zoo.log"  # in --out: every line of the run, as it comes; bundled as <stem>.log
# PROGRESS's name in the archive: an extracted archive holds no PROGRESS, so a run that is not a --resume never takes
# it for its own working folder and clears it (`main`).
BUNDLED_PROGRESS = "zoo-resume.json"
# Kept from --max-minutes for the parent's end (the summary, the charts, the bundle): this, or a tenth of a shorter run.
FINAL_RESERVE_S = 25.0
# A shape's first mode, before anything of it is measured (build, first steps), on the GPU and on CPU's tiny shapes.
FIRST_MODE_ESTIMATE_S = {"cuda": 25.0, "cpu": 3.0}
# For the tests: "SHAPE:MODE" makes the child die (exit 3) when it is about to run that mode.
CRASH_ENV = "HFO_ZOO_TEST_CRASH"
MAX_RESTARTS = 2  # children started again after one died
PROBE_WARMUP = 3  # plan@1: the library refuses the budget at its first planned step, the third
PLAN_SLOWDOWN = 1.3  # a plan's step against the slowest simple plan's, for the time estimate
PROCESSES = (
    "all modes of all shapes in one process, one after the other (the model freed, the allocator's cache emptied, "
    "the peak counter reset between modes)"
)


def parse_steps(text: str) -> tuple[int, int]:
    """'2+3' -> (2 warm-up, 3 timed)."""
    try:
        warmup, steps = (int(x) for x in text.split("+"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want WARMUP+TIMED, e.g. 2+3; got {text!r}") from None
    if warmup < 1 or steps < 1:
        raise argparse.ArgumentTypeError(f"want at least 1 warm-up and 1 timed step; got {text!r}")
    return warmup, steps


def parse_pairs(text: str) -> int:
    try:
        pairs = int(text)
    except ValueError:
        pairs = -1
    if pairs < 0:
        raise argparse.ArgumentTypeError(f"want a whole number >= 0 (0: no re-check); got {text!r}")
    return pairs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes",
        default=None,
        help=f"comma list, 'default' or 'all' (default: {','.join(ZOO_DEFAULT)}; with --device cpu "
        f"{','.join(ZOO_CPU)}); all: {','.join(ZOO_ALL)}",
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the CPU smoke run")
    ap.add_argument("--max-minutes", type=float, default=8.5, help="the whole run's time; the sweep stops cleanly")
    ap.add_argument("--out", default="/tmp/hfo-zoo", help="the results' folder")
    ap.add_argument("--simple-steps", type=parse_steps, default=(2, 6), help="none, ckpt, ckpt+hfo: WARMUP+TIMED")
    ap.add_argument(
        "--plan-steps",
        type=parse_steps,
        default=(10, 6),
        help="each budget: WARMUP+TIMED (the library profiles 2 steps, may run 3 of its trial of plain "
        "checkpointing, plans at the 6th, and its closed loop checks the plan after 3 more)",
    )
    ap.add_argument("--grid-step", type=float, default=zoo.GRID_STEP, help="percent of none's peak between budgets")
    ap.add_argument("--top", type=float, default=zoo.GRID_TOP, help="the highest budget, percent of none's peak")
    ap.add_argument(
        "--recheck-pairs",
        type=parse_pairs,
        metavar="N",
        default=zoo.RECHECK_PAIRS,
        help="after a shape's sweep, each budget that failed (a) and the simple plan it was compared with run again, "
        "alternately (ref, plan) this many times, with the sweep's steps; (a) is then judged on each side's pooled "
        "timed steps (default %(default)s: ABAB; 0: no re-check); with N > 0, each refused budget that a simple plan "
        "fitted also runs that simple plan once more, for (c)",
    )
    ap.add_argument(
        "--cpu-reference-bytes",
        type=int,
        default=2_500_000,
        help="on CPU (no peak counter), what plan@P budgets P%% of, in place of none's peak",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bw-bytes", type=int, default=256 * 2**20, help="size of the bandwidth probe's copies (0: none)")
    resume_help = "go on with the results in --out (a run's folder, or its extracted archive)"
    ap.add_argument("--resume", action="store_true", help=resume_help)
    ap.add_argument("--report-only", action="store_true", help="only the reports, charts and bundle, from --out's JSON")
    ap.add_argument("--no-charts", action="store_true", help="no Pareto charts (they need matplotlib)")
    ap.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="deal the shapes round-robin to this many sweeps at once, one a GPU (CUDA_VISIBLE_DEVICES 0..N-1), each "
        "in <out>/gpu<i>; then one summary of them all in --out",
    )
    args = ap.parse_args(argv)
    if args.gpus < 1:
        ap.error(f"--gpus: want at least 1; got {args.gpus}")
    if args.shapes in (None, "default"):
        args.shapes = ZOO_CPU if args.device == "cpu" else ZOO_DEFAULT
    elif args.shapes == "all":
        args.shapes = ZOO_ALL
    else:
        args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = [s for s in args.shapes if s not in SCENARIOS]
        if unknown:
            ap.error(f"unknown shape(s) {', '.join(unknown)}; the zoo: {', '.join(ZOO_ALL)}; CPU: {', '.join(ZOO_CPU)}")
        forced = [s for s in args.shapes if SCENARIOS[s].force_ckpt]
        if forced:
            ap.error(f"{', '.join(forced)} force checkpointing in every mode: the sweep needs none and plan modes")
    return args


def log(message: str, live_log: Path | None = None) -> None:
    """A line of the run's output, with the time; also appended to ``live_log`` (the parent's own lines, which no
    child's output carries into the log)."""
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    if live_log is not None:
        with open(live_log, "a") as log_file:
            log_file.write(line + "\n")


# ======================================================================================================= parent


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        return finish(out, args.shapes, charts=not args.no_charts, shape_reports=True)
    if args.resume:
        resume_in_archive(out)
        swept_with = _progress(out).get("env", {}).get("versions", {}).get("hf_offload-src")
        if swept_with and swept_with != (here := library_source_hash()):
            print(f"{out}'s sweep ran hf_offload-src {swept_with}, this working tree holds {here}: a sweep measures "
                  "one library throughout; give another --out to sweep this one", file=sys.stderr)  # fmt: skip
            return 2
    else:
        if not (out / PROGRESS).exists() and any(out.glob("*-zoo-*.json")):
            print(f"{out} holds zoo results that no run of this script is working on (committed results?): give "
                  "another --out, or --resume to go on with them", file=sys.stderr)  # fmt: skip
            return 2
        _clear(out)
    (out / LIVE_LOG).touch()
    if args.gpus > 1:
        return sweep_on_gpus(args, argv if argv is not None else sys.argv[1:], out, started)
    deadline = started + 60 * args.max_minutes
    spec: dict[str, Any] = {
        "out": str(out),
        "device": args.device,
        "seed": args.seed,
        "bw_bytes": args.bw_bytes,
        "simple_steps": args.simple_steps,
        "plan_steps": args.plan_steps,
        "grid_step": args.grid_step,
        "top": args.top,
        "recheck_pairs": args.recheck_pairs,
        "cpu_reference_bytes": args.cpu_reference_bytes if args.device == "cpu" else None,
        "deadline": deadline - min(FINAL_RESERVE_S, 6 * args.max_minutes),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": " ".join(
            shlex.quote(a) for a in ["python", os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]
        ),
    }
    for restart in range(MAX_RESTARTS + 1):
        shapes = [s for s in args.shapes if s not in _progress(out).get("done_shapes", [])]
        left = spec["deadline"] - time.time()
        if not shapes or left < 2:
            break
        if restart:
            log(f"starting the sweep again (restart {restart} of {MAX_RESTARTS}): {', '.join(shapes)}")
        rc, timed_out = child.run_child(
            Path(__file__).resolve(), ["--_child", json.dumps(spec | {"shapes": shapes})], out / LIVE_LOG, left + 5
        )
        progress = _progress(out)
        if "env" not in progress:  # it died before its sweep began (no CUDA device, an import): another would too
            break
        if progress.get("running"):  # the child died in a mode: record it, so that the next child goes on after it
            why = "timeout" if timed_out else "crashed"
            seconds = time.time() - progress["running"]["started"]
            record_interrupted(out, spec, progress, why, f"{why} (exit {rc}) after {seconds:.0f} s")
        if timed_out or rc == 0:
            break
    return finish(out, args.shapes, charts=not args.no_charts)


# The options `sweep_on_gpus` sets anew for each of its sweeps (all of them take a value).
_PER_GPU_OPTIONS = ("--gpus", "--shapes", "--out", "--max-minutes")


def sweep_on_gpus(args: argparse.Namespace, argv: list[str], out: Path, started: float) -> int:
    """--gpus N: the shapes dealt round-robin to N sweeps that run at once, each a run of this script on one GPU
    (CUDA_VISIBLE_DEVICES=i) in ``out/gpu<i>``, with the time left; then their shape files are gathered in ``out``
    and the summary, the charts and the bundle are made of them all. The sweeps share the host's CPU cores (a
    short step is paced by its host thread: give each GPU a few cores of its own); each shape is measured on one GPU
    throughout, so its checks compare modes run on the same device."""
    (out / PROGRESS).write_text("{}")  # a run of this script works in `out`: the next one may clear it
    groups = [shapes for shapes in (args.shapes[i :: args.gpus] for i in range(args.gpus)) if shapes]
    kept: list[str] = []
    rest = iter(argv)
    for arg in rest:
        if arg in _PER_GPU_OPTIONS:
            next(rest, None)  # its value
        elif not arg.startswith(tuple(f"{option}=" for option in _PER_GPU_OPTIONS)):
            kept.append(arg)
    minutes = args.max_minutes - (time.time() - started) / 60 - FINAL_RESERVE_S / 60
    outcomes: dict[int, tuple[int | None, bool]] = {}

    def sweep(index: int, shapes: list[str]) -> None:
        sweep_args = [*kept, "--shapes", ",".join(shapes), "--out", str(out / f"gpu{index}"),
                      "--max-minutes", f"{minutes:.3f}"]  # fmt: skip
        # OUT empty: the sweep bundles nothing; this run bundles them all.
        outcomes[index] = child.run_child(Path(__file__).resolve(), sweep_args, out / LIVE_LOG, 60 * minutes + 30,
                                          env={"CUDA_VISIBLE_DEVICES": str(index), "OUT": ""})  # fmt: skip

    log(
        f"{len(groups)} sweeps at once: " + "; ".join(f"GPU {i}: {', '.join(g)}" for i, g in enumerate(groups)),
        out / LIVE_LOG,
    )
    threads = [threading.Thread(target=sweep, args=(index, shapes)) for index, shapes in enumerate(groups)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(len(groups)):
        for path in (out / f"gpu{index}").glob("*-zoo-*"):
            if path.suffix in (".json", ".md"):
                shutil.copyfile(path, out / path.name)
    log("sweeps ended: " + "; ".join(f"GPU {i}: exit {rc}{' (time limit)' if late else ''}"
                                     for i, (rc, late) in sorted(outcomes.items())), out / LIVE_LOG)  # fmt: skip
    return finish(out, args.shapes, charts=not args.no_charts)


def _clear(out: Path) -> None:
    """Removes the files of the run that worked in ``out`` before (only the zoo's own)."""
    for path in out.iterdir():
        if path.is_file() and ("-zoo" in path.name or path.name in (PROGRESS, LIVE_LOG)):
            path.unlink()


def resume_in_archive(out: Path) -> None:
    """Makes an extracted archive (``<stem>/`` of ``<stem>.tar.gz``, brought to the GPU machine of a later call)
    a folder a run can go on in: its progress, bundled as BUNDLED_PROGRESS, and its log, bundled as
    ``<stem>.log``, are the live ones again. The progress keeps the stem (the first run's date), the environment and
    the shapes done, so the sweep goes on in the same files rather than starting the shapes again under another day's
    name."""
    if (out / BUNDLED_PROGRESS).exists() and not (out / PROGRESS).exists():
        (out / BUNDLED_PROGRESS).rename(out / PROGRESS)
    stem = _progress(out).get("stem")
    bundled_log = out / f"{stem}.log" if stem else None
    if bundled_log is not None and bundled_log.exists() and not (out / LIVE_LOG).exists():
        bundled_log.rename(out / LIVE_LOG)


def _progress(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / PROGRESS).read_text())
    except (OSError, ValueError):
        return {}


def record_interrupted(out: Path, spec: dict[str, Any], progress: dict[str, Any], status: str, error: str) -> None:
    """Adds to a shape's results (or its re-check runs) the mode its child was running when it died or was
    stopped."""
    running = progress["running"]
    shape = running["shape"]
    files = ReportFiles.at(out, f"{progress['stem']}-{shape}")
    if files.json.exists():
        data = json.loads(files.json.read_text())
    else:  # it died in the shape's first mode
        data = {"meta": shape_meta(spec, progress["env"], shape), "bandwidth": progress["env"], "results": []}
    res = {"scenario": shape, "mode": running["mode"], "status": status, "error": error, "notes": []}
    rechecks = data.setdefault("rechecks", [])
    add_result(data["meta"], data["results"], rechecks, res, running.get("recheck"))
    write_shape(files, data["meta"], data["bandwidth"], data["results"], rechecks, final=False)
    log(f"{shape} {running['mode']}: {status}: {error}")


def add_result(
    meta: dict[str, Any], results: list[Result], rechecks: list[Result], res: Result, recheck: dict[str, Any] | None
) -> None:
    """Adds a finished mode to its shape: a run of the sweep to ``results`` (run.py's list, one run a mode), a
    re-check run (``recheck``: its budget and place in the ABAB) to ``rechecks``, a list of its own in the JSON, so
    that run.py's report and the Pareto chart, which read one result a mode, see the sweep's alone."""
    if recheck is None:
        results.append(res)
        meta["modes"].append(res["mode"])
    else:
        res["recheck"] = recheck
        rechecks.append(res)


def write_shape(
    files: ReportFiles,
    meta: dict[str, Any],
    bw: dict[str, Any],
    results: list[Result],
    rechecks: list[Result],
    final: bool,
) -> None:
    """A shape's JSON and markdown (run.py's report, then the zoo's checks), with the checks in ``meta["zoo"]`` and
    the re-check runs in ``rechecks``."""
    settings = meta["zoo_settings"]
    reference = zoo.reference_bytes(results, settings["cpu_reference_bytes"])
    # results written before the re-check existed have no pairs: they read as without it
    summary = zoo.shape_summary(results, reference, rechecks, settings.get("recheck_pairs", 0))
    meta["zoo"] = summary
    meta["zoo_complete"] = final
    markdown = zoo.shape_markdown(summary)
    write_report(
        files, meta, bw, results, final, copy=False, extra_markdown=markdown, extra_json={"rechecks": rechecks}
    )


def _device(spec: dict[str, Any]) -> str:
    return "cpu" if spec["device"] == "cpu" else "cuda:0"


def _hfo_opts(spec: dict[str, Any]) -> dict[str, Any]:
    """hf-offload's options in every mode that uses it: on CPU its test mode (else it would be inactive)."""
    return {"device_type": "cpu"} if spec["device"] == "cpu" else {}


def shape_meta(spec: dict[str, Any], env: dict[str, Any], shape: str) -> dict[str, Any]:
    """A shape's ``meta``, as run.py's report reads it, with the zoo's settings."""
    return {
        "date": spec["date"],
        "device_name": env.get("device_name") or _device(spec),
        "host": os.uname().nodename,
        "scenarios": [shape],
        "modes": [],
        "command": spec["command"],
        "seed": spec["seed"],
        "span": "step",
        "deterministic": False,
        "hfo_opts": _hfo_opts(spec),
        "steps": {shape: spec["simple_steps"]},
        "device": _device(spec),
        "processes": PROCESSES,
        "describe": SCENARIOS[shape].describe(),
        "zoo_settings": {
            k: spec[k]
            for k in ("simple_steps", "plan_steps", "grid_step", "top", "recheck_pairs", "cpu_reference_bytes")
        },
    }


def _shape_files(out: Path) -> dict[str, Path]:
    """The shapes' JSON files in ``out``, by shape."""
    found = {}
    for path in sorted(out.glob("*-zoo-*.json")):
        data = json.loads(path.read_text())
        found[data["meta"]["scenarios"][0]] = path
    return found


def finish(out: Path, shapes: list[str], charts: bool, shape_reports: bool = False) -> int:
    """The summary, a chart per shape, and the bundle in $OUT; with ``shape_reports`` (--report-only) each shape's
    report and checks again first, from its JSON file. Returns 0 when every shape that ran passed."""
    files = _shape_files(out)
    if not files:
        log(f"no results in {out}")
        return 1
    if shape_reports:
        for path in files.values():
            data = json.loads(path.read_text())
            write_shape(ReportFiles.at(out, path.stem), data["meta"], data["bandwidth"], data["results"],
                        data.get("rechecks", []), final=data["meta"].get("zoo_complete", False))  # fmt: skip
    stem = _progress(out).get("stem") or next(iter(files.values())).name.rsplit("-zoo-", 1)[0] + "-zoo"
    if charts:
        for path in files.values():
            draw_chart(path, path.with_name(path.stem + "-pareto.png"))
    passed = write_summary(out, stem, shapes)
    bundle(out, stem)
    log(f"wrote {out / (stem + '.md')}" + (f"; bundled into {os.environ['OUT']}" if os.environ.get("OUT") else ""))
    return 0 if passed else 1


def draw_chart(json_path: Path, png: Path) -> None:
    try:
        import pareto
    except ImportError as e:  # matplotlib missing: the charts can be drawn later, with --report-only
        log(f"no chart ({e}); draw it later: python benchmarks/pareto.py {json_path.name} --out {png.name}")
        return
    pareto.main([str(json_path), "--out", str(png)])


def write_summary(out: Path, stem: str, shapes: list[str]) -> bool:
    """``<stem>.md``: a row per shape, then each shape's checks. Returns whether every shape that ran passed."""
    files = _shape_files(out)
    order = {s: i for i, s in enumerate(list(dict.fromkeys(shapes + ZOO_ALL)))}
    ran = sorted(files, key=lambda s: order.get(s, len(order)))
    data = [(s, json.loads(files[s].read_text())) for s in ran]
    meta, bw = data[0][1]["meta"], data[0][1]["bandwidth"]
    versions = bw.get("versions", {})
    settings = meta["zoo_settings"]
    header = [
        f"# hf-offload shape zoo on {meta['device_name']}",
        "",
        f"- date (UTC): {meta['date']}; host: {meta['host']}; command: "
        + "; ".join(f"`{command}`" for command in dict.fromkeys(d["meta"]["command"] for _, d in data)),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        f"- CUDA allocator: {bw.get('allocator', 'not recorded')}",
        f"- method: {PROCESSES}; bf16 weights from a config (seed {meta['seed']}), sdpa, fused AdamW, labels = "
        f"input_ids. none, ckpt, ckpt+hfo: {settings['simple_steps'][0]} warm-up + {settings['simple_steps'][1]} "
        f"timed steps; each budget: {settings['plan_steps'][0]} + {settings['plan_steps'][1]}; budgets every "
        f"{settings['grid_step']:g}% of none's peak (timed steps) from the minimum the library names (refusing "
        f"{zoo.PROBE_MODE}) to {settings['top']:g}%, and at each simple plan's peak (every step's)"
        + (f"; CPU: budgets are shares of {settings['cpu_reference_bytes']} bytes" if meta["device"] == "cpu" else ""),
        "- checks per budget: (a) step <= "
        f"{zoo.TIME_TOLERANCE:.2f}x the fastest simple plan's whose peak fits (each the lower quartile of the mode's "
        "timed steps); (b) every step's peak <= the budget, the "
        "library's profiled steps included (the counter is reset before each step and read after it); (c) no "
        "budget refused that a simple plan's peak fits",
    ]
    if settings.get("recheck_pairs"):  # none in results written before the re-check existed
        header.append(f"- {zoo.recheck_method(settings['recheck_pairs'])}")
    header.append("- per shape: `<stem>-<shape>.md` (run.py's report and the checks), `.json`, `-pareto.png`")
    not_run = [s for s in shapes if s not in files]
    partial = [s for s, d in data if not d["meta"].get("zoo_complete")]
    if partial:
        header.append(f"- **partial** (the sweep stopped in them): {', '.join(partial)}")
    text = zoo.summary_markdown(data, header, not_run)
    (out / f"{stem}.md").write_text(text)
    return all(d["meta"].get("zoo", {}).get("passed") for _, d in data)


def bundle(out: Path, stem: str) -> None:
    """Into $OUT (when set): ``<stem>.tar.gz`` with every result file, ``<stem>.md`` and ``<stem>.log``; the
    archive is replaced at once, so a run killed while writing it keeps the previous one."""
    dest = os.environ.get("OUT")
    if not dest:
        return
    dest_dir = Path(dest)
    dest_dir.mkdir(parents=True, exist_ok=True)
    part = dest_dir / f"{stem}.tar.gz.part"
    with tarfile.open(part, "w:gz") as tar:
        for path in sorted(out.glob(f"{stem}*")):
            if path.suffix in (".json", ".md", ".png"):
                tar.add(path, arcname=f"{stem}/{path.name}")
        if (out / LIVE_LOG).exists():
            tar.add(out / LIVE_LOG, arcname=f"{stem}/{stem}.log")
        if (out / PROGRESS).exists():  # what a --resume in the extracted archive goes on from (`resume_in_archive`)
            tar.add(out / PROGRESS, arcname=f"{stem}/{BUNDLED_PROGRESS}")
    os.replace(part, dest_dir / f"{stem}.tar.gz")
    for source, name in ((out / f"{stem}.md", f"{stem}.md"), (out / LIVE_LOG, f"{stem}.log")):
        if source.exists() and source.resolve() != (dest_dir / name).resolve():
            shutil.copyfile(source, dest_dir / name)


# ======================================================================================================= child


class Sweep:
    """The child: every shape's modes in turn, in this process, each written as soon as it ends."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        from harness.environment import probe

        self.spec = spec
        self.out = Path(spec["out"])
        self.cpu = spec["device"] == "cpu"
        if self.cpu:
            torch.set_num_threads(1)  # tiny models compute fastest on one thread
        elif not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on the GPU machine, or with --device cpu for the CPU smoke run")
        self.device = _device(spec)
        self.progress = _progress(self.out)
        if "env" not in self.progress:  # a restarted child keeps the first one's
            env = probe(self.device, 0 if self.cpu else spec["bw_bytes"])
            name = env.get("device_name") or ("cpu" if self.cpu else "cuda")
            self.progress = {"env": env, "stem": f"{spec['date']}-{slug(name)}-zoo", "done_shapes": []}
        self.env = self.progress["env"]
        self.hfo_opts = _hfo_opts(spec)
        self.step_s = 0.0  # the slowest simple plan's step of the shape running, for the time estimates
        self._save_progress(running=None)

    def _save_progress(self, running: dict[str, Any] | None) -> None:
        self.progress["running"] = running
        tmp = self.out / (PROGRESS + ".tmp")
        tmp.write_text(json.dumps(self.progress, indent=1, default=str))
        os.replace(tmp, self.out / PROGRESS)

    def run(self) -> None:
        for shape in self.spec["shapes"]:
            if not self.run_shape(shape):
                log("time budget spent: the sweep stops here")
                break
        self._save_progress(running=None)

    def run_shape(self, shape: str) -> bool:
        """Runs the shape's sweep on from where its results end, then (a)'s re-check of the budgets that failed it.
        Returns False when the time budget stopped it."""
        files = ReportFiles.at(self.out, f"{self.progress['stem']}-{shape}")
        data = json.loads(files.json.read_text()) if files.json.exists() else None
        meta = data["meta"] if data else shape_meta(self.spec, self.env, shape)
        results: list[Result] = data["results"] if data else []
        rechecks: list[Result] = data.get("rechecks", []) if data else []
        s = self.spec
        meta["zoo_settings"]["recheck_pairs"] = s["recheck_pairs"]  # a --resume's decides what runs and is judged

        def run_and_write(mode: str, recheck: dict[str, Any] | None = None, shared: SharedModel | None = None) -> None:
            """Runs a mode (a run of the sweep, or with ``recheck`` of a re-check, on its budget's ``shared`` model),
            adds it to the shape, and writes the shape's files, the summary and the bundle."""
            self._save_progress(running={"shape": shape, "mode": mode, "started": time.time(), "recheck": recheck})
            res = self.run_mode(shape, mode, reference, shared)
            add_result(meta, results, rechecks, res, recheck)
            write_shape(files, meta, self.env, results, rechecks, final=False)
            self._save_progress(running=None)
            self._report(shape, res, meta["zoo"])
            write_summary(self.out, self.progress["stem"], s["shapes"])
            bundle(self.out, self.progress["stem"])

        while True:
            reference = zoo.reference_bytes(results, s["cpu_reference_bytes"])
            mode = zoo.next_mode(results, reference, s["grid_step"], s["top"])
            if mode is None:
                break
            if not self._time_for(shape, mode, [mode], results):
                write_shape(files, meta, self.env, results, rechecks, final=False)
                return False
            run_and_write(mode)
        # (a)'s re-checks come after the sweep, so that every budget has its first measurement before the time
        # limit is spent on them. A budget's re-check runs on one model, built by its first run.
        from harness.worker import SharedModel

        shared: tuple[str, SharedModel] | None = None
        while (task := zoo.next_recheck(results, rechecks, s["recheck_pairs"])) is not None:
            # a whole ABAB or nothing: a part of one cannot be judged
            if not self._time_for(shape, f"re-check of {task.budget}", task.modes_left, results):
                write_shape(files, meta, self.env, results, rechecks, final=False)
                return False
            if task.check == "c":  # each simple plan as the sweep ran it: on a model of its own
                if task.run == 1:
                    log(f"{shape} {task.budget}: (c) failed: re-run {', '.join(task.modes_left)}")
                shared = None
                self._free_memory()
                run_and_write(task.modes_left[0], task.tag)
                continue
            if task.run == 1:
                log(f"{shape} {task.budget}: (a) failed: re-check {', '.join(task.modes_left)} on one model")
            if shared is None or shared[0] != task.budget:
                shared = None  # the last budget's model goes before the next one is built
                self._free_memory()
                shared = (task.budget, SharedModel())
            run_and_write(task.modes_left[0], task.tag, shared[1])
        shared = None
        self._free_memory()
        write_shape(files, meta, self.env, results, rechecks, final=True)
        self.progress["done_shapes"].append(shape)
        self._save_progress(running=None)
        write_summary(self.out, self.progress["stem"], s["shapes"])
        bundle(self.out, self.progress["stem"])
        return True

    def _time_for(self, shape: str, what: str, modes: list[str], results: list[Result]) -> bool:
        """Whether ``modes`` are expected to end before the deadline (logged when not)."""
        left = self.spec["deadline"] - time.time()
        estimate = sum(self._estimate(mode, results) for mode in modes)
        if estimate > left:
            log(f"{shape} {what}: not started: estimated {estimate:.0f} s, {left:.0f} s left")
        return estimate <= left

    def _steps(self, mode: str) -> tuple[int, int]:
        if mode == zoo.PROBE_MODE:
            return PROBE_WARMUP, 1  # refused at the planned step, the third
        return tuple(self.spec["plan_steps"] if parse_mode(mode).planned else self.spec["simple_steps"])

    def _estimate(self, mode: str, results: list[Result]) -> float:
        """Seconds the mode is expected to take: its steps at the shape's slowest simple step (a plan's at
        PLAN_SLOWDOWN times that), plus the most that the last modes of the shape spent outside their steps."""
        step_times = [r["median_s"] for r in results if r.get("status") == "ok" and r["mode"] in zoo.SIMPLE_MODES]
        if not step_times:
            return FIRST_MODE_ESTIMATE_S[self.spec["device"]] if not results else 10.0
        recent = [r for r in results[1:] if "wall_s" in r][-3:]  # the shape's first mode pays one-off costs
        overheads = [r["wall_s"] - sum(st["s"] for st in r.get("per_step", [])) for r in recent]
        warmup, steps = self._steps(mode)
        step_s = max(step_times) * (PLAN_SLOWDOWN if parse_mode(mode).planned else 1.0)
        return max(overheads, default=5.0) + (warmup + steps) * step_s

    def run_mode(self, shape: str, mode: str, reference: int | None, shared: SharedModel | None = None) -> Result:
        import torch
        from harness.worker import run_mode_safely

        parsed = parse_mode(mode)
        budget = None
        if parsed.planned:
            what = "--cpu-reference-bytes" if self.cpu else "none's peak (timed steps)"
            budget = budget_share(reference, parsed.budget_percent, what)
        warmup, steps = self._steps(mode)
        if os.environ.get(CRASH_ENV) == f"{shape}:{mode}":
            log(f"{shape} {mode}: dying, as {CRASH_ENV} asks")
            os._exit(3)
        # what earlier modes left allocated (0 when freeing works), unless this one runs on their model
        on_shared_model = shared is not None and shared.built is not None
        residual = None if self.cpu or on_shared_model else torch.cuda.memory_allocated()
        log(f"{shape} {mode}: {warmup} + {steps} steps" + (f", budget {zoo.size(budget['option'])}" if budget else ""))
        res = run_mode_safely({
            "scenario": shape, "mode": mode, "device": self.device, "seed": self.spec["seed"], "span": "step",
            "warmup": warmup, "steps": steps, "hfo_opts": self.hfo_opts, "memory_budget": budget,
            "deterministic": False, "result_path": "", "profile_path": None,
        }, shared)  # fmt: skip
        if budget is not None:
            res["memory_budget"] = budget
        if residual is not None:
            res["allocated_at_start_bytes"] = residual  # what an earlier mode left: 0 when freeing works
            if residual > 64 * 2**20:
                res["notes"].append(f"{residual / GIB:.2f} GiB still allocated from earlier modes when it started")
        if shared is None:
            self._free_memory()
        return res

    def _free_memory(self) -> None:
        """Frees what the last mode (or re-check) built, and gives the allocator's cache back."""
        import gc

        import torch

        gc.collect()
        if not self.cpu:
            torch.cuda.empty_cache()

    def _report(self, shape: str, res: Result, summary: dict[str, Any]) -> None:
        recheck = res.get("recheck")
        budget = recheck["budget"] if recheck else res["mode"]
        row = next((r for r in summary["rows"] if r["mode"] == budget), None)
        if res.get("status") == "ok":
            text = f"ok {res['median_s']:.3f} s/step, peak {fmt(res.get('peak_all_gib'), '{:.2f}')} GiB (every step)"
            if "plan" in res:
                text += f", plan {res['plan']['code']}"
        else:
            text = f"{res.get('status')}: {(res.get('error') or '; '.join(res.get('notes', [])))[:300]}"
        if row is not None:
            text += f"; (a) {zoo.mark(row['a'])} (b) {zoo.mark(row['b'])} (c) {zoo.mark(row['c'])}"
        if recheck and row is not None:
            text += f"; re-check run {recheck['run']} of {budget}"
            if recheck.get("check", "a") == "c":
                text += f": {zoo.c_recheck_text(row)}"
            elif row["recheck"]["state"] != "time":  # its runs are over: what it found
                text += f": {zoo.recheck_text(row['recheck'])}"
        log(f"{shape} {res['mode']}: {text} ({res.get('wall_s', 0):.1f} s)")


def child_main(spec: dict[str, Any]) -> int:
    sys.path.insert(0, str(REPO))  # the working tree's hf_offload before any installed one
    Sweep(spec).run()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_child":
        sys.exit(child_main(json.loads(sys.argv[2])))
    sys.exit(main())
