"""The report: figures derived across modes (ratios to `none` and `ckpt`, the transfer floor, equality of the
first-step loss), written as markdown and JSON after every mode, and a short table on stdout at the end."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import GIB
from .modes import PLAN_PREFIX, parse_mode
from .scenarios import SCENARIOS

Result = dict[str, Any]  # one mode's result, as its worker wrote it (plus the parent's process_s)

# The step time at these budgets, (scenario, percent of none's peak or "auto") -> at most this many times none's:
# S1's frontier (near the bound of the planner's actions on an H100's link, docs/DESIGN.md, "The memory budget on S1"),
# and "auto" costing nothing where everything fits. Also the bounds on the predictions' error against the
# measurements.
TARGET_X_NONE = {("S1", 50.0): 1.18, ("S1", 66.0): 1.11, ("S1", 85.0): 1.05, ("S1", "auto"): 1.01}
PEAK_ERROR_TARGET = 0.05
TIME_ERROR_TARGET = 0.10


@dataclass(frozen=True)
class ReportFiles:
    """An invocation's outputs: ``<stem>.md``, ``.json`` and ``.log`` (its processes' output)."""

    md: Path
    json: Path
    log: Path

    @classmethod
    def at(cls, out_dir: Path, stem: str) -> ReportFiles:
        return cls(out_dir / f"{stem}.md", out_dir / f"{stem}.json", out_dir / f"{stem}.log")


def fmt(v: float | None, spec: str = "{:.3f}", none: str = "—") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return spec.format(v)


def derive(results: list[Result], bw: dict[str, Any]) -> dict[str, list[Result]]:
    """Adds to each finished result its ratios to none/ckpt and its transfer floor. Returns the results by
    scenario."""
    d2h = bw.get("d2h_GBps")
    h2d = bw.get("h2d_GBps")
    by_scen: dict[str, list[Result]] = {}
    for r in results:
        by_scen.setdefault(r["scenario"], []).append(r)
    for rs in by_scen.values():
        ref = {r["mode"]: r.get("median_s") for r in rs if r.get("status") == "ok"}
        for r in rs:
            if r.get("status") != "ok":
                continue
            m = r["median_s"]
            r["x_none"] = m / ref["none"] if ref.get("none") else None
            r["x_ckpt"] = m / ref["ckpt"] if ref.get("ckpt") else None
            b = r.get("bytes_out")
            if b is not None and d2h and h2d:
                # everything that goes out comes back once
                r["floor_s"] = b / (d2h * 1e9) + b / (h2d * 1e9)
            elif b == 0:
                r["floor_s"] = 0.0
            if "plan" in r:
                _derive_plan(r, ref.get("none"))
    return by_scen


def _derive_plan(r: Result, none_s: float | None) -> None:
    """A plan mode's checks: its peak against its budget on every step (warm-up and profiling included), and the
    plan's predictions against the measurements (error = predicted / measured - 1)."""
    plan = r["plan"]
    if all("peak_bytes" in step for step in r["per_step"]):  # not on CPU: no peak counter
        r["steps_over_budget"] = [step["step"] for step in r["per_step"] if step["peak_bytes"] > plan["budget_bytes"]]
        r["budget_held"] = not r["steps_over_budget"]
        r["peak_error"] = plan["predicted_peak_bytes"] / r["peak_bytes"] - 1
    r["time_error"] = plan["predicted_step_s"] / r["median_s"] - 1
    r["predicted_x_none"] = plan["predicted_step_s"] / none_s if none_s else None


def loss_check(rs: list[Result]) -> tuple[str, str]:
    """Whether a scenario's modes had bitwise the same first-step loss, and the same gradient fingerprint (empty
    when fewer than two modes have one)."""
    ok = [r for r in rs if r.get("status") == "ok" and r.get("loss1_bits")]
    if len(ok) < 2:
        loss_line = f"first-step loss: {len(ok)} mode(s) ran; nothing to compare"
    else:
        bits = {r["loss1_bits"] for r in ok}
        if len(bits) == 1:
            loss_line = (
                f"first-step loss: **equal** (bitwise) across {len(ok)} modes: "
                f"{ok[0]['loss1']!r} (0x{ok[0]['loss1_bits']})"
            )
        else:
            parts = ", ".join(f"{r['mode']}={r['loss1']!r} (0x{r['loss1_bits']})" for r in ok)
            loss_line = f"first-step loss: **NOT equal**: {parts}"
    g = [r for r in ok if r.get("grad1_fingerprint")]
    if len(g) < 2:
        grad_line = ""
    else:
        fps = {r["grad1_fingerprint"] for r in g}
        if len(fps) == 1:
            grad_line = f"first-step gradients: fingerprint equal across {len(g)} modes ({g[0]['grad1_fingerprint']})"
        else:
            groups: dict[str, list[str]] = {}
            for r in g:
                groups.setdefault(r["grad1_fingerprint"], []).append(r["mode"])
            grad_line = (
                "first-step gradients: fingerprints differ: "
                + "; ".join(f"{k}: {', '.join(v)}" for k, v in groups.items())
                + " (attention backward kernels need not be deterministic: informative only)"
            )
    return loss_line, grad_line


def _host_flat(r: Result) -> str:
    bits = []
    if "pinned_flat" in r:
        bits.append(
            f"pinned {r['pinned_bytes_step1'] / GIB:.2f}->{r['pinned_bytes_last'] / GIB:.2f} GiB "
            f"{'flat' if r['pinned_flat'] else 'GROWS'}"
        )
    if "host_allocs_flat" in r:
        bits.append(f"allocs {r['host_allocs_step1']}->{r['host_allocs_last']}")
    return "; ".join(bits) or "—"


TABLE_HEAD = (
    "| mode | status | median s/step | x none | x ckpt | peak GiB | static GiB | offloaded GiB/step | "
    "transfer floor s | floor/step | step-1 s | step-1 loss | host side (after step 1 -> last) |"
)


def table_rows(rs: list[Result]) -> list[str]:
    rows = [TABLE_HEAD, "|" + "---|" * TABLE_HEAD.count(" | ") + "---|"]
    for r in rs:
        st = r.get("status", "?")
        if st != "ok":
            why = r.get("error") or "; ".join(r.get("notes", [])) or ""
            rows.append(f"| {r['mode']} | {st} | {why[:160]} |" + " |" * 10)
            continue
        b = r.get("bytes_out")
        offl = fmt(b / GIB, "{:.3f}") if b is not None else "n/a"
        floor = r.get("floor_s")
        rows.append(
            f"| {r['mode']} | ok | {r['median_s']:.3f} | {fmt(r.get('x_none'), '{:.2f}')} | "
            f"{fmt(r.get('x_ckpt'), '{:.2f}')} | {fmt(r.get('peak_gib'), '{:.1f}')} | "
            f"{fmt(r.get('static_gib'), '{:.1f}')} | {offl} | {fmt(floor, '{:.3f}', 'n/a')} | "
            f"{fmt(floor / r['median_s'] if floor is not None else None, '{:.0%}', 'n/a')} | "
            f"{fmt(r.get('first_step_s'), '{:.2f}')} | {r.get('loss1', float('nan')):.6f} | {_host_flat(r)} |"
        )
    return rows


PLAN_HEAD = (
    "| mode | budget % | budget GiB | plan | predicted peak GiB | peak GiB, timed steps | peak GiB, all steps "
    "| peak <= budget, every step | predicted s/step | measured s/step | predicted x none | x none | x ckpt | "
    "peak error | time error | target |"
)


def _plans(rs: list[Result]) -> list[Result]:
    return [r for r in rs if parse_mode(r["mode"]).planned]


def plan_rows(rs: list[Result]) -> list[str]:
    """The table of a scenario's plan modes (empty when it has none)."""
    plans = _plans(rs)
    if not plans:
        return []
    rows = [PLAN_HEAD, "|" + "---|" * (PLAN_HEAD.count(" | ") + 1)]
    for r in plans:
        budget = budget_bytes(r)
        head = f"| {r['mode']} | {r['mode'][len(PLAN_PREFIX) :]} | {fmt(budget / GIB if budget else None, '{:.2f}')} |"
        if r.get("status") != "ok":
            why = r.get("error") or "; ".join(r.get("notes", [])) or ""
            rows.append(f"{head} {r.get('status')}: {why} |" + " |" * 12)
            continue
        plan = r["plan"]
        held = r.get("budget_held")
        rows.append(
            f"{head} `{plan['code']}` | {plan['predicted_peak_bytes'] / GIB:.2f} | "
            f"{fmt(r.get('peak_gib'), '{:.2f}')} | {fmt(r.get('peak_all_gib'), '{:.2f}')} | "
            f"{'n/a' if held is None else 'yes' if held else 'NO: steps ' + str(r['steps_over_budget'])} | "
            f"{plan['predicted_step_s']:.3f} | {r['median_s']:.3f} | {fmt(r.get('predicted_x_none'), '{:.2f}')} | "
            f"{fmt(r.get('x_none'), '{:.2f}')} | {fmt(r.get('x_ckpt'), '{:.2f}')} | "
            f"{fmt(r.get('peak_error'), '{:+.1%}')} | {fmt(r.get('time_error'), '{:+.1%}')} | {_target(r)} |"
        )
    return rows


def budget_bytes(r: Result) -> int | None:
    """A plan mode's budget in bytes: as the library resolved it where it planned, else as it was given."""
    if "plan" in r:
        return r["plan"]["budget_bytes"]
    option = (r.get("memory_budget") or {}).get("option")
    return option if isinstance(option, int) else None


def _target(r: Result) -> str:
    """The step-time target (`TARGET_X_NONE`) where this plan mode's budget is one it names."""
    target = TARGET_X_NONE.get((r["scenario"], parse_mode(r["mode"]).budget))
    if target is None:
        return ""
    x = r.get("x_none")
    return f"<= {target:.2f}x none: " + ("n/a" if x is None else "met" if x <= target else "MISSED")


def plan_checks(rs: list[Result]) -> list[str]:
    """The plan modes' checks over a scenario (budget held, infeasible budgets, prediction errors), one line each
    (empty without plan modes)."""
    plans = _plans(rs)
    if not plans:
        return []
    ok = [r for r in plans if r.get("status") == "ok"]
    measured = [r for r in ok if "budget_held" in r]
    over = [f"{r['mode']} (steps {r['steps_over_budget']})" for r in measured if not r["budget_held"]]
    failed = [f"{r['mode']} ({r.get('status')})" for r in plans if r.get("status") not in ("ok", "infeasible")]
    infeasible = [r["mode"] for r in plans if r.get("status") == "infeasible"]
    peak_ok = [r for r in measured if abs(r["peak_error"]) <= PEAK_ERROR_TARGET]
    time_ok = [r for r in ok if abs(r["time_error"]) <= TIME_ERROR_TARGET]
    if ok and not measured:
        held = "not measured (no peak counter on this device)"
    else:
        held = f"{len(measured) - len(over)} of {len(measured)} plan runs"
        held += f"; over: {', '.join(over)}" if over else ""
    return [
        f"peak <= budget on every step, warm-up and profiling included: {held}",
        f"infeasible (the planner's error): {', '.join(infeasible) or 'none'}; did not finish otherwise: "
        f"{', '.join(failed) or 'none'}",
        f"predicted peak within {PEAK_ERROR_TARGET:.0%} of the measured (timed steps): {len(peak_ok)} of "
        f"{len(measured)}; predicted step time within {TIME_ERROR_TARGET:.0%} of the median: {len(time_ok)} of "
        f"{len(ok)}",
    ]


def mode_details(r: Result) -> str | None:
    """The bullet under a scenario's table with what the table has no column for (None when there is nothing)."""
    bits = []
    if r.get("notes"):
        bits.append("; ".join(r["notes"]))
    if r.get("status") == "ok":
        if r.get("tensors_out") is not None:
            bits.append(f"tensors offloaded/step {r['tensors_out']}")
        st = r.get("hfo_stats_last")
        if st:
            keep = {k[len("bytes_kept_") :]: v for k, v in st.items() if k.startswith("bytes_kept_") and v}
            bits.append(
                "hfo: "
                + ", ".join(
                    [
                        f"compute_wait {st.get('compute_wait_s', 0):.4f} s",
                        f"prefetch hits/misses/inflight {st.get('prefetch_hits')}/{st.get('prefetch_misses')}/"
                        f"{st.get('inflight_hits')}",
                    ]
                    + [f"kept {k} {v / 2**20:.1f} MiB" for k, v in keep.items()]
                )
            )
        if r.get("rss_step1_gib") is not None:
            bits.append(f"host RSS {r['rss_step1_gib']:.1f}->{r['rss_last_gib']:.1f} GiB")
        if r.get("ckpt_call"):
            bits.append(r["ckpt_call"])
        if r.get("liger_call"):
            bits.append(r["liger_call"])
        codes = [step["plan"] for step in r["per_step"] if step.get("plan")]
        if len(set(codes)) > 1:
            bits.append("re-planned during the run: " + " -> ".join(dict.fromkeys(codes)))
        late = timed_plan_change(r)
        if late is not None:
            bits.append(
                f"**the timed steps ran more than one plan**: the closed loop, still checking its plans, changed it "
                f"at step {late}, after the {r['warmup_steps']} warm-up steps"
            )
        bits += closed_loop_details(r.get("plan") or {})
    return f"- `{r['mode']}`: " + "; ".join(bits) if bits else None


def timed_plan_change(r: Result) -> int | None:
    """The last step (1-based) at which the plan in force changed within the timed steps (after their first), or None.
    A memory budget's closed loop may still be checking its plans when the warm-up ends: after two profiled steps and
    three of its trial it plans at step 6, and checks each plan four steps after its first, changing plans at most
    three times, so as late as step 18."""
    steps = r.get("per_step") or []
    warmup = r.get("warmup_steps") or 0
    changes = [i + 1 for i in range(warmup + 1, len(steps)) if steps[i].get("plan") != steps[i - 1].get("plan")]
    return changes[-1] if changes else None


def closed_loop_details(plan: dict[str, Any]) -> list[str]:
    """What a memory budget's closed loop measured (each plan's fastest timed step, in the order they ran: the
    profiled safe plan, the trial of plain checkpointing, the plans it checked) and the corrections it made of the
    step model: its times (`learned`, the library's `Calibration.describe()`) and its peak."""
    bits = []
    timed = {code: [s for s in seconds if s is not None] for code, seconds in (plan.get("measured_s") or {}).items()}
    if any(timed.values()):
        bits.append("the closed loop measured " + ", ".join(
            f"`{code}` {min(seconds):.3f} s ({len(seconds)} step{'s' * (len(seconds) > 1)})"
            for code, seconds in timed.items()
            if seconds
        ))  # fmt: skip
    if plan.get("learned"):
        bits.append(f"it learned {plan['learned']}")
    profile = plan.get("profile") or {}
    corrections = [
        what.format(profile[key])
        for key, what in (
            ("peak_correction_bytes", "every point raised by {:,} bytes (the most a plan peaked above its prediction)"),
            ("head_reload_hidden_bytes", "the head's point lowered by {:,} bytes (reloads that stay under its peak)"),
        )
        if profile.get(key)
    ]
    if corrections:
        bits.append("of the step model's peaks: " + ", ".join(corrections))
    return bits


def write_report(
    files: ReportFiles,
    meta: dict[str, Any],
    bw: dict[str, Any],
    results: list[Result],
    final: bool,
    copy: bool = True,
    extra_markdown: list[str] | None = None,
    extra_json: dict[str, Any] | None = None,
) -> None:
    """Writes the markdown (``extra_markdown``'s lines at its end) and the JSON (rewritten after every mode, so a run
    cut short still leaves its finished modes; ``extra_json``'s keys beside its own), and with ``copy`` copies them
    and the log into $OUT."""
    by_scen = derive(results, bw)
    files.md.write_text(_markdown(meta, bw, by_scen, final) + "\n".join(extra_markdown or []))
    tmp = files.json.with_name(files.json.name + ".tmp")  # replaced at once: a run killed while writing keeps the last
    data = {"meta": meta, "bandwidth": bw, "results": results, **(extra_json or {})}
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, files.json)
    if copy:
        for path in (files.md, files.json, files.log):
            copy_to_out(path)


def copy_to_out(path: Path) -> None:
    """Copies ``path`` into $OUT, when that is set, and is not where ``path`` already is: what the GPU machine
    hands back."""
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    target = Path(out) / path.name
    if path.exists() and target.resolve() != path.resolve():
        shutil.copy2(path, target)


def _markdown(meta: dict[str, Any], bw: dict[str, Any], by_scen: dict[str, list[Result]], final: bool) -> str:
    v = bw.get("versions", {})
    lines = [f"# hf-offload benchmark: {', '.join(meta['scenarios'])} on {meta['device_name']}", ""]
    if not final:
        lines += ["**Partial: the run had not finished when this was written.**", ""]
    lines += [
        f"- date (UTC): {meta['date']}; host: {meta['host']}",
        f"- command: `{meta['command']}`",
        f"- device: {meta['device_name']}" + (f" ({bw['device_mem_gib']:.0f} GiB)" if bw.get("device_mem_gib") else ""),
        "- versions: "
        + ", ".join(
            f"{k} {v[k]}"
            for k in (
                "python",
                "torch",
                "cuda",
                "transformers",
                "accelerate",
                "peft",
                "trl",
                "liger-kernel",
                "triton",
                "hf-offload",
                "hf_offload-src",
            )
            if k in v
        ),
        f"- CUDA allocator: {bw.get('allocator', 'not recorded')}",
        f"- method: {meta.get('processes', 'one process per mode')}; bf16 weights from a config (seed "
        f"{meta['seed']}), sdpa attention, fused "
        f"AdamW on the trainable parameters, labels = input_ids; offload context spans the "
        f"{'forward and backward' if meta['span'] == 'step' else 'forward only'}; "
        f"median of the timed steps after warm-up, torch.cuda.synchronize around each step (optimizer step "
        f"included); peak = "
        f"torch.cuda.max_memory_allocated over the timed steps (read per step); static = allocated between steps "
        f"(weights, optimizer state)",
    ]
    if meta.get("hfo_opts"):
        lines.append(f"- hf_offload options: `{meta['hfo_opts']}`")
    if bw.get("h2d_GBps"):
        lines.append(
            f"- pinned bandwidth ({bw['bytes'] / GIB:.0f} GiB copies, median): H2D {bw['h2d_GBps']:.1f} GB/s, "
            f"D2H {bw['d2h_GBps']:.1f} GB/s, both at once {bw['both_GBps']:.1f} GB/s (sum); pageable: H2D "
            f"{bw['pageable_h2d_GBps']:.1f} GB/s, D2H {bw['pageable_d2h_GBps']:.1f} GB/s"
        )
        lines.append(
            "- transfer floor = bytes offloaded / D2H + the same bytes back / H2D (serial copies, "
            "no overlap with compute)"
        )
    else:
        lines.append(f"- bandwidth probe: {bw.get('skipped') or bw.get('error') or 'not run'}")
    for scen in meta["scenarios"]:
        rs = by_scen.get(scen, [])
        if not rs:
            continue
        lines += ["", f"## {scen}: {SCENARIOS[scen].describe()}", ""]
        lines += [f"steps: {meta['steps'][scen][1]} timed after {meta['steps'][scen][0]} warm-up", ""]
        lines += table_rows(rs)
        loss_line, grad_line = loss_check(rs)
        lines += ["", f"- {loss_line}"] + ([f"- {grad_line}"] if grad_line else [])
        lines += [d for d in (mode_details(r) for r in rs) if d]
        lines += _plan_section(rs)
    if meta.get("profiles"):
        lines += [
            "",
            "## Profiles (torch.profiler chrome traces of one step after warm-up; open in "
            "chrome://tracing or ui.perfetto.dev)",
            "",
        ]
        for p in meta["profiles"]:
            where = Path(p["path"]).name if p.get("path") else (p.get("error") or p.get("status"))
            lines.append(f"- {p['scenario']} `{p['mode']}`: {where}")
            busy = p.get("streams") or {}
            for stream, st in sorted(busy.get("streams", {}).items(), key=lambda kv: -kv[1]["busy_ms"]):
                lines.append(
                    f"  - stream {stream} ({st['work']}): busy {st['busy_ms']:.1f} ms of the "
                    f"{busy['gpu_span_ms']:.1f} ms GPU span ({st['busy_ms'] / busy['gpu_span_ms']:.0%})"
                )
    lines.append("")
    return "\n".join(lines)


def _plan_section(rs: list[Result]) -> list[str]:
    """The memory-budget plans of a scenario: how they were run, their table and the targets' checks."""
    rows = plan_rows(rs)
    if not rows:
        return []
    reference = next(
        (
            r["memory_budget"]["reference"]
            for r in rs
            if r.get("memory_budget") and r["memory_budget"]["percent"] is not None
        ),
        "none's peak",
    )
    warmups = "/".join(str(w) for w in sorted({r["warmup_steps"] for r in rs if "plan" in r})) or "—"
    return (
        [
            "",
            "### Memory-budget plans",
            "",
            f"plan@P budgets P% of {reference}. Plan modes run {warmups} warm-up steps: the library profiles two under "
            "full checkpointing and plans at the third, or runs three of plain checkpointing (every input kept) as "
            "its closed loop's trial first where that fits and plans at the sixth. Peaks are each step's "
            "`max_memory_allocated`, also where the profiler resets the counter inside a step; error = predicted / "
            "measured - 1 (peak: the timed steps'; time: the median).",
            "",
        ]
        + rows
        + [""]
        + [f"- {line}" for line in plan_checks(rs)]
    )


def short_table(results: list[Result]) -> str:
    hdr = (
        f"{'scenario':9} {'mode':18} {'status':10} {'s/step':>8} {'x none':>7} {'x ckpt':>7} {'peak GiB':>9} "
        f"{'out GiB':>8} {'floor s':>8} {'loss1':>12}"
    )
    out = [hdr, "-" * len(hdr)]
    for r in results:
        ok = r.get("status") == "ok"
        b = r.get("bytes_out")
        out.append(
            f"{r['scenario']:9} {r['mode']:18} {r.get('status', '?'):10} "
            f"{fmt(r.get('median_s') if ok else None, '{:8.3f}'):>8} {fmt(r.get('x_none'), '{:7.2f}'):>7} "
            f"{fmt(r.get('x_ckpt'), '{:7.2f}'):>7} {fmt(r.get('peak_gib'), '{:9.1f}'):>9} "
            f"{fmt(b / GIB if b is not None else None, '{:8.2f}', 'n/a'):>8} "
            f"{fmt(r.get('floor_s'), '{:8.3f}', 'n/a'):>8} {fmt(r.get('loss1'), '{:12.6f}'):>12}"
        )
    return "\n".join(out)


def print_summary(results: list[Result], scenarios: list[str]) -> None:
    """The short table and each scenario's loss check, on stdout."""
    print(short_table(results))
    for scen in scenarios:
        rs = [r for r in results if r["scenario"] == scen]
        loss_line, grad_line = loss_check(rs)
        print(f"{scen}: {loss_line}")
        if grad_line:
            print(f"{scen}: {grad_line}")
        rows = plan_rows(rs)
        if rows:
            print("\n".join([f"{scen} memory-budget plans:"] + rows + plan_checks(rs)))
