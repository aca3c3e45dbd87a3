"""Checks a memory-budget run of train_distributed.py or sft_distributed.py across its ranks, and suggests budgets.

    python examples/distributed/check_budget.py check runs/budget_on.json
    python examples/distributed/check_budget.py suggest runs/budget_off.json [--fraction 0.6]

`check` reads every rank file of a run (`<stem>.rank<R>.json`) and verifies:
  - plans: every rank ran the same plan code at every step (the lists `plans`, one entry per optimizer step; None
    in the profiled steps), and a plan was made at all;
  - peaks: every rank's peak of every step is at most `budget_bytes`. The first two steps are profiled under full
    checkpointing (the planner probes the layers in the first); they are counted like the planned ones, and the
    report gives both groups apart. In the CPU test mode there are no peaks, and this part says so and passes;
  - tokens (reported, not judged): in how many steps the ranks trained on different numbers of tokens, and which
    rank had more.
It prints one line per part and a verdict line (`check_budget: PASS ...` / `check_budget: FAIL ...`); exit 0 on
PASS, 1 on FAIL.

`suggest` reads a run without offloading (no budget, no checkpointing) and prints a budget in bytes that forces a
plan: the memory held between steps (`allocated_at_step_begin` of the last step, the largest over the ranks: weights,
optimizer state) plus `--fraction` of what the step added on top of it at its peak (activations, gradients, the
optimizer's transients; the largest peak over ranks and steps).
"""

import argparse
import json
import sys
from pathlib import Path

PROFILED_STEPS = 2  # the memory budget's planner profiles the first two training steps under full checkpointing


def load_ranks(out: str) -> list[dict]:
    path = Path(out)
    files = sorted(path.parent.glob(f"{path.stem}.rank*.json"))
    records = sorted((json.loads(file.read_text()) for file in files), key=lambda record: record["rank"])
    if not records:
        sys.exit(f"check_budget: no rank files for {out} (looked for {path.parent}/{path.stem}.rank*.json)")
    return records


def runs_of(values: list) -> str:
    """`[None, None, 'cc', 'cc', 'cK']` -> "None x2, 'cc' x2, 'cK' x1": a plan sequence, compactly."""
    parts: list[list] = []
    for value in values:
        if parts and parts[-1][0] == value:
            parts[-1][1] += 1
        else:
            parts.append([value, 1])
    return ", ".join(f"{value!r} x{count}" for value, count in parts)


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


def check(records: list[dict]) -> tuple[bool, list[str]]:
    """The three parts of `check` (module doc): whether the run passes, and the report's lines."""
    lines, ok = [], True
    world = records[0]["world_size"]
    if len(records) != world:
        return False, [f"rank files: {[r['rank'] for r in records]} for world size {world}"]
    budget = records[0].get("budget_bytes")
    if budget is None:
        return False, ["the run had no memory budget (budget_bytes is null)"]

    # Plans: the same on every rank at every step.
    plans = [record["plans"] for record in records]
    steps = len(plans[0])
    differ = [step for step in range(steps) if len({str(p[step]) if step < len(p) else "<missing>" for p in plans}) > 1]
    if any(len(p) != steps for p in plans):
        ok = False
        lines.append(f"plans: FAIL the ranks recorded {[len(p) for p in plans]} steps")
    elif differ:
        ok = False
        first = differ[0]
        shown = ", ".join(f"rank {record['rank']} {per_rank[first]!r}" for record, per_rank in zip(records, plans))
        lines.append(f"plans: FAIL the ranks' plans differ in {len(differ)} of {steps} steps, first at step "
                     f"{first + 1}: {shown}")  # fmt: skip
    elif not any(code is not None for code in plans[0]):
        ok = False
        lines.append(f"plans: FAIL no plan in {steps} steps (the planner never planned)")
    else:
        forced_nothing = set(plans[0][-1] or "K") == {"K"}
        note = "; note: the last plan keeps every layer (the budget forced nothing)" if forced_nothing else ""
        lines.append(f"plans: PASS the same on all {len(records)} ranks at all {steps} steps: {runs_of(plans[0])}"
                     f"{note}")  # fmt: skip

    # Peaks: under the budget on every step of every rank.
    peaks = [record["peaks"] for record in records]
    if all(peak is None for per_rank in peaks for peak in per_rank):
        lines.append(f"peaks: n/a (no peak counter: CPU test mode); budget {budget} bytes")
    else:
        over = [(r["rank"], step, peak) for r, per_rank in zip(records, peaks) for step, peak in enumerate(per_rank)
                if peak is None or peak > budget]  # fmt: skip
        groups = []
        for name, selected in (("profiled", range(PROFILED_STEPS)), ("planned", range(PROFILED_STEPS, steps))):
            values = [per_rank[step] for per_rank in peaks for step in selected if step < len(per_rank)]
            values = [value for value in values if value is not None]
            if values:
                first, last = selected.start + 1, min(selected.stop, steps)
                groups.append(f"{name} steps {first}-{last} max {gib(max(values))} ({max(values) / budget:.1%})")
        if over:
            ok = False
            shown = ", ".join(f"rank {rank} step {step + 1}: {'none' if peak is None else gib(peak)}"
                              for rank, step, peak in over[:6])  # fmt: skip
            lines.append(f"peaks: FAIL {len(over)} rank-steps over the budget of {gib(budget)} ({budget} bytes): "
                         f"{shown}; {'; '.join(groups)}")  # fmt: skip
        else:
            lines.append(f"peaks: PASS all {steps} steps x {len(records)} ranks under the budget of {gib(budget)} "
                         f"({budget} bytes); {'; '.join(groups)}")  # fmt: skip

    # Tokens: reported.
    tokens = [record.get("step_tokens") or [] for record in records]
    if len(records) >= 2 and all(len(t) == steps for t in tokens):
        unequal = [step for step in range(steps) if len({t[step] for t in tokens}) > 1]
        longer = {r["rank"]: sum(1 for step in unequal if t[step] == max(u[step] for u in tokens))
                  for r, t in zip(records, tokens)}  # fmt: skip
        lines.append(f"tokens: the ranks differ in {len(unequal)} of {steps} steps (longest per step: "
                     + ", ".join(f"rank {rank} in {count}" for rank, count in longer.items())
                     + f"); first steps: {[t[:4] for t in tokens]}")  # fmt: skip
    return ok, lines


def suggest(records: list[dict], fraction: float) -> int:
    static = max(record["allocated_at_step_begin"][-1] or 0 for record in records)
    peak = max((peak for record in records for peak in record["peaks"] if peak is not None), default=None)
    if peak is None or not static:
        sys.exit("check_budget: the baseline recorded no peaks (CPU test mode?): no budget to suggest")
    return int(static + fraction * (peak - static))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check_parser = sub.add_parser("check", help="check a budget run's rank files")
    check_parser.add_argument("run")
    suggest_parser = sub.add_parser("suggest", help="print a budget in bytes from a run without offloading")
    suggest_parser.add_argument("baseline")
    suggest_parser.add_argument("--fraction", type=float, default=0.6, help="share of the step's activations")
    args = parser.parse_args(argv)
    if args.command == "suggest":
        print(suggest(load_ranks(args.baseline), args.fraction))
        return 0
    ok, lines = check(load_ranks(args.run))
    for line in lines:
        print(line)
    verdict = "; ".join(" ".join(line.split(" ", 2)[:2]) for line in lines if not line.startswith("tokens:"))
    print(f"check_budget: {'PASS' if ok else 'FAIL'} ({verdict})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
