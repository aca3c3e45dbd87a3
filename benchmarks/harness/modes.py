"""Mode names: an offloader, with or without activation checkpointing ("ckpt+hfo" is checkpointing plus ours),
checkpointing on every K-th layer only ("ckpt-every-2+hfo"), or ours under a memory budget ("plan@50", "plan@auto");
any of them compiled: "/compile" compiles the whole model (`torch.compile(model)`), "/regional" each decoder layer
(`hf_offload.compile_decoder_layers`), e.g. "ckpt+hfo/regional"."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypedDict

ALL_MODES = ["none", "ckpt", "ckpt+native", "trl", "trl-sync", "ckpt+trl", "hfo", "ckpt+hfo"]
# "native" is transformers' own offload flag, "trl" / "trl-sync" TRL's offloader with / without streams, "hfo" ours.
OFFLOADERS = ("none", "native", "trl", "trl-sync", "hfo")
EVERY_PREFIX = "ckpt-every-"  # "ckpt-every-K": checkpointing on the decoder layers whose index % K == 0
# "plan@P": ours with memory_budget = P% of the `none` mode's peak in the same run; "plan@auto": memory_budget="auto"
PLAN_PREFIX = "plan@"
# "MODE/compile": torch.compile(model); "MODE/regional": each decoder layer compiled (regional compilation)
COMPILE_SUFFIXES = {"compile": "model", "regional": "layers"}
# The memory budget profiles the first two forwards and plans at the third; where plain checkpointing (every input
# kept) fits and the plan is another, the third to fifth steps run it as the closed loop's trial, and the sixth is the
# plan's first, which pays its one-off costs (new kernels, allocator growth): a plan mode's timed steps start after it.
PLAN_MIN_WARMUP = 6
# Execution order (the report keeps the order asked for): references first, then ours, so that a run that hits its
# time budget loses the slow third-party modes rather than the ones being tuned. Prefixes stand for their family.
RUN_PRIORITY = [
    "none",
    "ckpt",
    PLAN_PREFIX,
    "ckpt+hfo",
    "hfo",
    EVERY_PREFIX,
    "ckpt+trl",
    "trl",
    "ckpt+native",
    "trl-sync",
    "ckpt+trl-sync",
]


class MemoryBudget(TypedDict):
    """A plan mode's budget, fixed by the parent once the reference it is a share of is known."""

    option: int | str  # the library's memory_budget: bytes, or "auto"
    percent: float | None  # plan@P: P; plan@auto: None
    reference: str  # what the budget is a share of, for the report


def budget_share(reference: int, percent: float, what: str) -> MemoryBudget:
    """plan@P's budget: P% of ``reference`` bytes (floored: a budget never exceeds its share); ``what`` names the
    reference in the report."""
    return {
        "option": math.floor(reference * percent / 100),
        "percent": percent,
        "reference": f"{what}: {reference} bytes ({reference / 2**30:.2f} GiB)",
    }


class ModeSpec(TypedDict):
    """What the parent asks of the worker process that runs one mode (JSON on its command line)."""

    scenario: str
    mode: str
    device: str
    seed: int
    span: str  # "step" or "forward": what the offload context wraps
    warmup: int
    steps: int
    hfo_opts: dict[str, Any]  # engine options for our offloader
    memory_budget: MemoryBudget | None  # plan modes only
    deterministic: bool
    result_path: str  # where the worker writes its result
    profile_path: str | None  # after the timed steps, one more step traced into this .json.gz


class Mode(NamedTuple):
    ckpt_every: int  # 0: no checkpointing; 1: every decoder layer; K: the layers whose index % K == 0
    offloader: str  # one of OFFLOADERS
    budget: float | str | None = None  # plan modes: a percentage of `none`'s peak, or "auto"
    compiled: str | None = None  # "model" (torch.compile(model)), "layers" (each decoder layer compiled) or None

    @property
    def checkpointing(self) -> bool:
        return self.ckpt_every > 0

    @property
    def planned(self) -> bool:
        return self.budget is not None

    @property
    def budget_percent(self) -> float | None:
        return self.budget if isinstance(self.budget, float) else None


def parse_mode(mode: str) -> Mode:
    """'ckpt+trl' -> (1, 'trl'); 'ckpt' -> (1, 'none'); 'hfo' -> (0, 'hfo'); 'ckpt-every-2+hfo' -> (2, 'hfo');
    'plan@50' -> (0, 'hfo', 50.0), 'plan@auto' -> (0, 'hfo', 'auto'): the budget decides what is checkpointed;
    'ckpt+hfo/regional' -> (1, 'hfo', None, 'layers')."""
    base, slash, how = mode.partition("/")
    if slash:
        if how not in COMPILE_SUFFIXES or not base:
            raise ValueError(_unknown(mode))
        return parse_mode(base)._replace(compiled=COMPILE_SUFFIXES[how])
    if mode == PLAN_PREFIX + "auto":
        return Mode(0, "hfo", "auto")
    if mode.startswith(PLAN_PREFIX):
        return Mode(0, "hfo", _budget_percent(mode))
    head, plus, off = mode.partition("+")
    if not plus:  # "ckpt", "ckpt-every-K" or a bare offloader
        head, off = (mode, "none") if mode.startswith("ckpt") else ("", mode)
    every = _ckpt_every(head, mode)
    if off not in OFFLOADERS or (off == "none" and plus):
        raise ValueError(_unknown(mode))
    if off == "native" and not every:
        raise ValueError("mode 'native' needs checkpointing: use 'ckpt+native'")
    return Mode(every, off)


def _ckpt_every(head: str, mode: str) -> int:
    if head == "":
        return 0
    if head == "ckpt":
        return 1
    k = head[len(EVERY_PREFIX) :] if head.startswith(EVERY_PREFIX) else ""
    if not k.isdigit() or int(k) < 2:
        raise ValueError(_unknown(mode))
    return int(k)


def _budget_percent(mode: str) -> float:
    try:
        percent = float(mode[len(PLAN_PREFIX) :])
    except ValueError:
        percent = math.nan
    if not (math.isfinite(percent) and percent > 0):
        raise ValueError(
            f"mode {mode!r}: {PLAN_PREFIX}P needs a percentage P > 0 of none's peak (e.g. plan@50), "
            f"or 'auto' ({PLAN_PREFIX}auto)"
        )
    return percent


def _unknown(mode: str) -> str:
    return (
        f"unknown mode {mode!r}; known: {', '.join(ALL_MODES)}, ckpt+trl-sync, {EVERY_PREFIX}K and "
        f"{EVERY_PREFIX}K+OFFLOADER (K >= 2), {PLAN_PREFIX}P (P% of none's peak), {PLAN_PREFIX}auto; any of them "
        f"followed by /compile or /regional"
    )


def budget_sweep(spec: str) -> list[str]:
    """'35:95:5' -> ['plan@35', 'plan@40', ..., 'plan@95']: start and stop in percent, both included."""
    try:
        start, stop, step = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--budget-sweep wants START:STOP:STEP in percent, e.g. 35:95:5; got {spec!r}") from None
    if not (0 < start <= stop and step > 0):
        raise ValueError(f"--budget-sweep {spec!r}: needs 0 < START <= STOP and STEP > 0")
    count = math.floor((stop - start) / step + 1e-9) + 1  # the tolerance keeps STOP when float steps land on it
    return [f"{PLAN_PREFIX}{round(start + i * step, 6):g}" for i in range(count)]


def run_order(modes: list[str]) -> list[str]:
    """``modes`` in execution order (RUN_PRIORITY; modes it does not list last; the order given within a family).
    `none` comes first: the plan modes' budgets are shares of its peak."""

    def family(mode: str) -> str:
        return next((prefix for prefix in (PLAN_PREFIX, EVERY_PREFIX) if mode.startswith(prefix)), mode)

    return sorted(
        modes, key=lambda m: RUN_PRIORITY.index(family(m)) if family(m) in RUN_PRIORITY else len(RUN_PRIORITY)
    )
