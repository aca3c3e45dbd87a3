"""Mode names: an offloader, with or without activation checkpointing ("ckpt+hfo" is checkpointing plus ours)."""

from __future__ import annotations

from typing import Any, NamedTuple, TypedDict

ALL_MODES = ["none", "ckpt", "ckpt+native", "trl", "trl-sync", "ckpt+trl", "hfo", "ckpt+hfo"]
# Execution order (the report keeps the order asked for): references first, then ours, so that a run that hits its
# time budget loses the slow third-party modes rather than the ones being tuned.
RUN_PRIORITY = ["none", "ckpt", "ckpt+hfo", "hfo", "ckpt+trl", "trl", "ckpt+native", "trl-sync", "ckpt+trl-sync"]
# "native" is transformers' own offload flag, "trl" / "trl-sync" TRL's offloader with / without streams, "hfo" ours.
OFFLOADERS = ("none", "native", "trl", "trl-sync", "hfo")


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
    deterministic: bool
    result_path: str  # where the worker writes its result
    profile_path: str | None  # after the timed steps, one more step traced into this .json.gz


class Mode(NamedTuple):
    checkpointing: bool
    offloader: str  # one of OFFLOADERS


def parse_mode(mode: str) -> Mode:
    """'ckpt+trl' -> (True, 'trl'); 'ckpt' -> (True, 'none'); 'hfo' -> (False, 'hfo')."""
    if mode == "ckpt":
        return Mode(True, "none")
    ckpt = mode.startswith("ckpt+")
    off = mode[len("ckpt+"):] if ckpt else mode
    if off not in OFFLOADERS or (off == "none" and ckpt):
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(ALL_MODES)} (and ckpt+trl-sync)")
    if off == "native" and not ckpt:
        raise ValueError("mode 'native' needs checkpointing: use 'ckpt+native'")
    return Mode(ckpt, off)


def run_order(modes: list[str]) -> list[str]:
    """``modes`` in execution order (RUN_PRIORITY; modes it does not list last, in the order given)."""
    return sorted(modes, key=lambda m: (RUN_PRIORITY.index(m) if m in RUN_PRIORITY else len(RUN_PRIORITY)))
