#!/usr/bin/env python3
"""Dynamic padding under a tight memory budget: training steps whose sequence length varies over
a 2x range around the planned one, with ``memory_budget`` 1% above the smallest budget the library names.

The model: S1's layer shape (hidden 2048, intermediate 8192, 32/8 heads, vocab 32000; Llama layers, random bf16
weights, fused AdamW, labels = input_ids), 16 layers, batch 4. The first --first-steps steps (6: the library profiles
2, plans at the 3rd, and its closed loop checks the plan after 3 more) are at the middle length (1536 tokens a
sequence); every later step draws its length uniformly from 1024..2048, as a collator that pads each batch to its
longest sequence gives. About 0.1-0.2 s a step on an H100: 200 steps in about a minute.

1. The minimum: the model is trained at the middle length under a budget no plan meets (1 MiB); the library refuses
   it at its planned (third) step with an ``InfeasibleBudgetError``, whose ``minimum_bytes`` is the smallest budget
   that works (read from that attribute; parsed from the message's exact byte count only where the error lacks it).
2. The run: a fresh model (the same seed) trained --steps steps under ``memory_budget`` = that minimum x 1.01.
   Per step: its tokens, time, peak (``max_memory_allocated``, the counter reset before the step and read after it;
   resets inside the step, by the library's profiler, are folded in), the plan in force (``ctx.memory_plan``), and
   what the library said during it (``warnings`` and the ``hf_offload`` logger, every level).

The checks: no exception; every step's peak within the budget, or the library said that the step runs over it: a
warning (or, after the first, the log line) at that step, or at an earlier step at least as long ("and so do the
later steps up to that length", as the warning says). On CPU (--device cpu: a tiny model, hf-offload's CPU test mode)
nothing measures the peak, so only the first check and the notices are recorded.

Writes ``dynamic_padding[-cpu].json``, ``.md`` and ``.log`` into --out (default $OUT, else /tmp/hfo-dynamic-padding).

  python benchmarks/dynamic_padding.py                      # on the GPU machine, ~1 minute
  python benchmarks/dynamic_padding.py --device cpu --out /tmp/dp    # CPU smoke run (tiny model, 24 steps)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import random
import re
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `harness` sits next to this file
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the working tree's hf_offload
from harness import GIB  # noqa: E402
from harness.environment import versions  # noqa: E402
from harness.scenarios import SCENARIOS  # noqa: E402

# The GPU run and the CPU smoke run: shape (a scenario, its layers), batch, lengths, steps.
SETTINGS = {
    "cuda": {"scenario": "S1", "layers": 16, "batch": 4, "min_seq": 1024, "max_seq": 2048, "steps": 200,
             "too_small_budget": 2**20},
    "cpu": {"scenario": "tiny", "layers": 2, "batch": 2, "min_seq": 32, "max_seq": 64, "steps": 24,
            "too_small_budget": 1024},
}  # fmt: skip
OVER_BUDGET = "no plan fits"  # what the library's message says when a step runs over the budget
NAMED_FORWARD = re.compile(r"at training forward (\d+)")  # and the step it names
MiB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the CPU smoke run (tiny model)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (200; CPU 24)")
    ap.add_argument("--first-steps", type=int, default=6, help="steps at the middle length before lengths vary")
    ap.add_argument("--min-seq", type=int, default=None, help="shortest sequence (1024; CPU 32)")
    ap.add_argument("--max-seq", type=int, default=None, help="longest sequence (2048; CPU 64)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (4; CPU 2)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (16; CPU 2)")
    ap.add_argument("--margin", type=float, default=0.01, help="the budget is the named minimum x (1 + this)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/hfo-dynamic-padding")
    args = ap.parse_args(argv)
    for key, value in SETTINGS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if not (0 < args.min_seq <= args.max_seq):
        ap.error("need 0 < --min-seq <= --max-seq")
    return args


class Notices(logging.Handler):
    """Every record of the ``hf_offload`` loggers, echoed to stdout."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.records.append({"level": record.levelname, "logger": record.name, "message": message})
        print(f"[{record.levelname} {record.name}] {message}", flush=True)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.cuda = args.device == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on the GPU machine, or with --device cpu")
        self.device = torch.device("cuda:0" if self.cuda else "cpu")
        if not self.cuda:
            torch.set_num_threads(1)  # tiny models compute fastest on one thread
        self.scenario = dataclasses.replace(
            SCENARIOS[args.scenario], layers=args.layers, batch=args.batch, seq=args.max_seq
        )
        self.options: dict[str, Any] = {} if self.cuda else {"device_type": "cpu"}
        self.middle = (args.min_seq + args.max_seq) // 2
        rng = random.Random(args.seed)
        self.lengths = [self.middle] * min(args.first_steps, args.steps) + [
            rng.randint(args.min_seq, args.max_seq) for _ in range(args.steps - args.first_steps)
        ]

    def build(self) -> tuple[Any, list[Any], Any, Any]:
        """The model (the same weights every time), its optimizer and the token ids of the longest step."""
        from harness.model import build_model, make_input_ids, make_optimizer

        model = build_model(self.scenario, self.args.seed, self.device)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer, _ = make_optimizer(params, [])
        return model, params, optimizer, make_input_ids(self.scenario, self.args.seed, self.device)

    def free(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def find_minimum(self, budget: int) -> dict[str, Any] | None:
        """Trains at the middle length under `budget`; a refusal names the minimum. None: not refused."""
        from harness.measure import make_train_step

        import hf_offload

        model, params, optimizer, ids = self.build()
        ctx = hf_offload.get_act_offloading_ctx_manager(model, memory_budget=budget, **self.options)
        step = make_train_step(model, ids[:, : self.middle], params, optimizer, ctx, "step")
        found: dict[str, Any] = {"too_small_budget_bytes": budget}
        try:
            for i in range(4):  # refused at the third: the first planned step
                step(False)
                found["steps_before_refusal"] = i + 1
        except hf_offload.InfeasibleBudgetError as e:
            found["message"] = str(e)
            minimum = getattr(e, "minimum_bytes", None)
            if minimum is not None:
                found["minimum_bytes"], found["how"] = int(minimum), "InfeasibleBudgetError.minimum_bytes"
            else:  # the lowest plan's exact peak, which the message names in bytes
                match = re.search(r"can reach, [^(]*\((\d+) bytes", str(e))
                if match is None:
                    raise
                found["minimum_bytes"], found["how"] = int(match[1]), "parsed from the error's message"
        del model, params, optimizer, ids, ctx, step
        self.free()
        return found if "minimum_bytes" in found else None

    def train(self, budget: int, record: dict[str, Any]) -> None:
        """``--steps`` steps of varying length under ``budget``; each step's figures go into ``record["steps"]``."""
        import torch
        from harness.measure import StepPeaks, make_train_step, synchronize

        import hf_offload

        if self.cuda:
            record["allocated_before_bytes"] = torch.cuda.memory_allocated()  # what the minimum's run left: ~0
        model, params, optimizer, ids = self.build()
        ctx = hf_offload.get_act_offloading_ctx_manager(model, memory_budget=budget, **self.options)
        notices = Notices()
        library_logger = logging.getLogger("hf_offload")
        level = library_logger.level
        library_logger.addHandler(notices)
        library_logger.setLevel(logging.DEBUG)
        steps: list[dict[str, Any]] = record["steps"]
        try:
            peaks_context = StepPeaks(self.device) if self.cuda else contextlib.nullcontext()
            with warnings.catch_warnings(record=True) as caught, peaks_context as peaks:
                warnings.simplefilter("always")
                for index, seq in enumerate(self.lengths):
                    seen = len(caught), len(notices.records)
                    batch = ids[:, :seq].contiguous()
                    train_step = make_train_step(model, batch, params, optimizer, ctx, "step")
                    synchronize(self.device)
                    if peaks is not None:
                        peaks.start_step()
                    t0 = time.perf_counter()
                    try:
                        loss, _ = train_step(False)
                        synchronize(self.device)
                    except Exception as e:
                        record["exception"] = {"step": index + 1, "error": f"{type(e).__name__}: {e}",
                                               "traceback": traceback.format_exc()}  # fmt: skip
                        traceback.print_exc()
                        break
                    plan = ctx.memory_plan
                    said = [_warning(w) for w in caught[seen[0] :]] + notices.records[seen[1] :]
                    rec = {
                        "step": index + 1,
                        "seq": seq,
                        "tokens": seq * self.scenario.batch,
                        "s": time.perf_counter() - t0,
                        "loss": float(loss.float().item()),
                        "plan": plan.code if plan is not None else None,
                        "plan_tokens": plan.tokens if plan is not None else None,
                        "warned": any(m["level"] in ("WARNING", "ERROR", "CRITICAL") for m in said),
                        "over_budget_notice": any(OVER_BUDGET in m["message"] for m in said),
                        # the training forward the notice names: this step's (one forward a step)
                        "notice_forward": next(
                            (int(f[1]) for m in said if (f := NAMED_FORWARD.search(m["message"]))), None
                        ),
                        "said": said,
                    }
                    if peaks is not None:
                        rec["peak_bytes"] = peaks.step_peak()[0]
                    steps.append(rec)
                    print(
                        f"step {rec['step']}: {seq} x {self.scenario.batch} tokens, {rec['s']:.3f} s"
                        + (f", peak {rec['peak_bytes'] / GIB:.2f} GiB" if "peak_bytes" in rec else "")
                        + f", plan {rec['plan']}" + (" (over-budget notice)" if rec["over_budget_notice"] else ""),
                        flush=True,
                    )  # fmt: skip
        finally:
            library_logger.removeHandler(notices)
            library_logger.setLevel(level)
        del model, params, optimizer, ids, ctx
        if self.cuda:
            record["static_bytes_after"] = torch.cuda.memory_allocated()
        self.free()


class Tee:
    """Writes what is printed to stdout and to a log file too."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "w")  # noqa: SIM115 (closed by main)
        self.stdout = sys.stdout

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stdout.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stdout.flush()


def _warning(w: warnings.WarningMessage) -> dict[str, Any]:
    return {"level": "WARNING", "logger": f"warnings ({w.category.__name__})", "message": str(w.message)}


def check(record: dict[str, Any]) -> dict[str, Any]:
    """The checks: no exception; every step within the budget, or covered by the library's notice at that step or at
    an earlier step at least as long."""
    budget = record["budget_bytes"]
    steps = record["steps"]
    over = [s for s in steps if s.get("peak_bytes") is not None and s["peak_bytes"] > budget]
    notices = [s for s in steps if s["over_budget_notice"]]
    uncovered = [
        s["step"] for s in over if not any(n["step"] <= s["step"] and n["tokens"] >= s["tokens"] for n in notices)
    ]
    measured = bool(steps) and all(s.get("peak_bytes") is not None for s in steps)
    return {
        "no_exception": "exception" not in record and len(steps) == record["settings"]["steps"],
        "peaks_measured": measured,
        "steps_over_budget": [s["step"] for s in over],
        "steps_over_budget_without_notice": uncovered,
        "budget_held_or_announced": (not uncovered) if measured else None,
        "steps_with_over_budget_notice": [s["step"] for s in notices],
        "notices_naming_another_step": [s["step"] for s in notices if s.get("notice_forward") not in (None, s["step"])],
        "steps_with_a_warning": [s["step"] for s in steps if s["warned"]],
        "plans": list(dict.fromkeys(s["plan"] for s in steps if s["plan"])),
        "plans_by_tokens": sorted({(s["plan_tokens"], s["plan"]) for s in steps if s["plan"]}),
        "max_peak_bytes": max((s["peak_bytes"] for s in steps if s.get("peak_bytes") is not None), default=None),
        "step_s_by_length": _step_s_by_length(record),
    }


def _step_s_by_length(record: dict[str, Any]) -> dict[str, dict[str, float | int] | None]:
    """The median time of the steps after the first ones (at the middle length: profiled, then the first plan's),
    those at most the middle length a sequence and the longer ones apart: what a plan per length changes is the
    shorter steps' time."""
    later = record["steps"][record["settings"]["first_steps"] :]
    middle = record["middle_seq"]

    def median_of(steps: list[dict[str, Any]]) -> dict[str, float | int] | None:
        return {"median_s": statistics.median(s["s"] for s in steps), "steps": len(steps)} if steps else None

    return {"at_most_middle": median_of([s for s in later if s["seq"] <= middle]),
            "longer": median_of([s for s in later if s["seq"] > middle])}  # fmt: skip


def markdown(record: dict[str, Any]) -> str:
    c = record["checks"]
    s = record["settings"]
    steps = record["steps"]
    budget = record["budget_bytes"]

    def size(n: int | None) -> str:
        return "—" if n is None else f"{n / GIB:.3f} GiB" if n >= GIB / 10 else f"{n / MiB:.3f} MiB"

    verdict = c["no_exception"] and c["budget_held_or_announced"] is not False
    lines = [
        f"# Dynamic padding under a tight memory budget on {record['device_name']}",
        "",
        f"- command: `{record['command']}`; versions: "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items() if v),
        f"- model: {record['describe']}; lengths {s['min_seq']}..{s['max_seq']} a sequence (batch {s['batch']}), the "
        f"first {s['first_steps']} steps at {record['middle_seq']}, then uniform (seed {s['seed']})",
        f"- minimum the library named at {record['middle_seq']} tokens a sequence: "
        f"{size(record['minimum']['minimum_bytes'])} ({record['minimum']['minimum_bytes']} bytes; "
        f"{record['minimum']['how']}); budget = minimum x "
        f"{1 + s['margin']:g} = {size(budget)} ({budget} bytes)",
        "- budgets 1% above a named minimum that were refused first, naming a higher one: "
        + (", ".join(size(r["minimum_bytes"]) for r in record.get("refusals_near_the_minimum", [])) or "none"),
        f"- steps run: {len(steps)} of {s['steps']}"
        + (
            f"; **exception at step {record['exception']['step']}**: {record['exception']['error']}"
            if "exception" in record
            else "; no exception"
        ),  # fmt: skip
        f"- peak over all steps: {size(c['max_peak_bytes'])}; steps over the budget: {len(c['steps_over_budget'])}"
        f" {c['steps_over_budget'][:40]}; of them without the library's notice at that step or an earlier one at "
        f"least as long: {c['steps_over_budget_without_notice'] if c['peaks_measured'] else 'n/a (no peak counter)'}",
        f"- the library's over-budget notices at steps {c['steps_with_over_budget_notice'][:40]} (naming another "
        f"step than their own: {c['notices_naming_another_step'] or 'none'}); warnings at steps "
        f"{c['steps_with_a_warning'][:40]}",
        f"- plans in force, in order: {', '.join(f'`{p}`' for p in c['plans']) or 'none'}; by the tokens they were "
        f"made for: {', '.join(f'{t} `{p}`' for t, p in c['plans_by_tokens']) or 'none'}",
        "- step time after the first "
        f"{s['first_steps']} steps (median): "
        + "; ".join(
            f"{what} {record['middle_seq']} a sequence: "
            + ("—" if m is None else f"{m['median_s']:.3f} s ({m['steps']} steps)")
            for what, m in (
                ("at most", c["step_s_by_length"]["at_most_middle"]),
                ("longer than", c["step_s_by_length"]["longer"]),
            )
        ),
        f"- verdict: {'**pass**' if verdict else '**FAIL**'}",
        "",
        "| step | seq | tokens | s | peak | <= budget | plan | plan's tokens | notice |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for st in steps:
        peak = st.get("peak_bytes")
        within = "—" if peak is None else "yes" if peak <= budget else "**NO**"
        notice = "over budget" if st["over_budget_notice"] else "warning" if st["warned"] else ""
        lines.append(
            f"| {st['step']} | {st['seq']} | {st['tokens']} | {st['s']:.3f} | {size(peak)} | {within} | "
            f"`{st['plan'] or '(profiling)'}` | {st['plan_tokens'] or '—'} | {notice} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "dynamic_padding" + ("-cpu" if args.device == "cpu" else "")
    tee = Tee(out / f"{stem}.log")
    sys.stdout = tee
    try:
        return _main(args, argv, out, stem, started)
    finally:
        sys.stdout = tee.stdout
        tee.file.close()


def _main(args: argparse.Namespace, argv: list[str] | None, out: Path, stem: str, started: float) -> int:
    run = Run(args)
    settings = {k: getattr(args, k) for k in ("device", "steps", "first_steps", "min_seq", "max_seq", "batch",
                                               "layers", "margin", "seed", "scenario")}  # fmt: skip
    record: dict[str, Any] = {
        "benchmark": "dynamic padding",
        "command": "python " + " ".join([os.path.relpath(__file__), *(argv if argv is not None else sys.argv[1:])]),
        "settings": settings,
        "describe": run.scenario.describe().split("; seq")[0],
        "middle_seq": run.middle,
        "versions": versions(),
        "device_name": "cpu",
        "steps": [],
    }
    if run.cuda:
        import torch

        record["device_name"] = torch.cuda.get_device_name(run.device)
    print(f"finding the minimum at {run.middle} tokens a sequence ...", flush=True)
    record["minimum"] = run.find_minimum(args.too_small_budget)
    if record["minimum"] is None:
        raise RuntimeError(f"a budget of {args.too_small_budget} bytes was not refused: the minimum cannot be read")
    # The minimum a refusal names depends on the budget refused: under a tiny one the profiled steps tile every MLP
    # (so the tiled plan is measured), under one near the minimum they do not (it is predicted, about 1% high on the
    # H100). Until the budget 1% above the named minimum is accepted, the minimum its own refusal names is taken.
    record["refusals_near_the_minimum"] = []
    record["budget_bytes"] = math.ceil(record["minimum"]["minimum_bytes"] * (1 + args.margin))
    for _ in range(3):
        refusal = run.find_minimum(record["budget_bytes"])
        if refusal is None:
            break
        record["refusals_near_the_minimum"].append(refusal)
        record["minimum"] = refusal
        record["budget_bytes"] = math.ceil(refusal["minimum_bytes"] * (1 + args.margin))
    print(
        f"minimum {record['minimum']['minimum_bytes']} bytes ({record['minimum']['how']}); budget "
        f"{record['budget_bytes']} bytes; {args.steps} steps",
        flush=True,
    )
    try:
        run.train(record["budget_bytes"], record)
    finally:
        record["checks"] = check(record)
        record["wall_s"] = time.time() - started
        (out / f"{stem}.json").write_text(json.dumps(record, indent=1, default=str))
        (out / f"{stem}.md").write_text(markdown(record))
    c = record["checks"]
    print(
        f"wrote {out / stem}.json and .md ({record['wall_s']:.0f} s): exception: {'exception' in record}; steps over "
        f"the budget {len(c['steps_over_budget'])}, without notice {c['steps_over_budget_without_notice']}",
        flush=True,
    )
    return 0 if c["no_exception"] and c["budget_held_or_announced"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
