"""torch.compile with offloading on the GPU (docs/DESIGN.md, torch.compile): no crash in Inductor's code, the compiled
graphs and graph breaks of the run without hf-offload, losses and weights bitwise equal to it (its repeatability checked
first). Regional compilation moves the layers' inputs; a model compiled as a whole makes the engine stand aside; the
Trainer's `torch_compile=True` under offloading compiles the layers."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
import torch._dynamo
from compile_runs import bitwise_equal, train

SHAPE = {"hidden": 256, "layers": 4, "vocab": 1024}


@pytest.mark.parametrize("checkpointing", [True, False], ids=["ckpt", "no-ckpt"])
def test_regional_compilation_offloads_exactly(checkpointing, record):
    baseline = train("regional", checkpointing, offloading=False, device="cuda", **SHAPE)
    assert bitwise_equal(baseline, train("regional", checkpointing, offloading=False, device="cuda", **SHAPE))
    offloaded = train("regional", checkpointing, offloading=True, device="cuda", **SHAPE)
    last = offloaded["stats"][-1]
    record("", {"graphs": offloaded["graphs"], "breaks": offloaded["breaks"], "baseline_graphs": baseline["graphs"],
                "baseline_breaks": baseline["breaks"], "bytes_offloaded": last["bytes_offloaded"],
                "bytes_kept_exempt": last["bytes_kept_exempt"], "prefetch_hits": last["prefetch_hits"],
                "prefetch_misses": last["prefetch_misses"]}, show=True)  # fmt: skip
    assert bitwise_equal(baseline, offloaded)
    assert (offloaded["graphs"], offloaded["breaks"]) == (baseline["graphs"], baseline["breaks"])
    assert last["tensors_offloaded"] > 0 and last["bytes_kept_exempt"] > 0
    if checkpointing:  # the attention's prefetch points are compiled away: unpacks learn to start those reloads
        assert last["prefetch_misses"] == 0


@pytest.mark.parametrize("context_first", [False, True], ids=["compiled-then-context", "context-then-compiled"])
def test_whole_model_compilation_runs_and_stands_aside(context_first, record):
    baseline = train("whole", True, offloading=False, device="cuda", **SHAPE)
    assert bitwise_equal(baseline, train("whole", True, offloading=False, device="cuda", **SHAPE))
    offloaded = train("whole", True, offloading=True, device="cuda", context_first=context_first, **SHAPE)
    record("", {"graphs": offloaded["graphs"], "breaks": offloaded["breaks"], "baseline_graphs": baseline["graphs"],
                "baseline_breaks": baseline["breaks"]}, show=True)  # fmt: skip
    assert bitwise_equal(baseline, offloaded)
    assert (offloaded["graphs"], offloaded["breaks"]) == (baseline["graphs"], baseline["breaks"])
    assert all(stats["tensors_offloaded"] == 0 for stats in offloaded["stats"][1:])


def _train_with_trainer(output_dir: pathlib.Path, variant: str, deterministic: bool = True) -> dict:
    """`_trainer_compile_run.py`'s run `variant` in a process of its own (its docstring says why)."""
    output_dir.mkdir()
    subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("_trainer_compile_run.py")), str(output_dir),
                    variant, *(["--deterministic"] if deterministic else [])], check=True, timeout=300)  # fmt: skip
    return torch.load(output_dir / "result.pt", weights_only=False)


def test_trainer_torch_compile_under_offloading_exact_and_never_above_whole_compile(tmp_path, record):
    # Under offloading the Trainer compiles each decoder layer and the loss (callbacks/compile_layers.py): compared
    # bitwise with the same regional compilation without offloading, and for the peak with the Trainer's own
    # whole-model compile, which offloading must never exceed. In bf16: in fp32, torch_compile=True would also switch
    # TF32 on (accelerate), which the baseline without it would not.
    regional = _train_with_trainer(tmp_path / "a", "regional")
    again = _train_with_trainer(tmp_path / "b", "regional")
    offloaded = _train_with_trainer(tmp_path / "c", "offloaded")
    # The peaks against the whole-model compile come from runs as users start them, without deterministic algorithms:
    # the whole-compiled model runs no flash attention on torch < 2.14, and deterministic flash backward holds 9 x 16
    # MiB at this shape, the largest tensor at the deterministic regional runs' peak (docs/DESIGN.md, torch.compile).
    offloaded_as_users = _train_with_trainer(tmp_path / "d", "offloaded", deterministic=False)
    whole = _train_with_trainer(tmp_path / "e", "whole", deterministic=False)
    record("", {"peak_gib_regional": round(regional["peak_gib"], 3), "peak_gib_whole": round(whole["peak_gib"], 3),
                "peak_gib_offloaded": round(offloaded["peak_gib"], 3),
                "peak_gib_offloaded_as_users": round(offloaded_as_users["peak_gib"], 3),
                "graphs_regional": regional["graphs"], "graphs_offloaded": offloaded["graphs"],
                "bytes_offloaded": offloaded["stats"].get("bytes_offloaded"),
                "losses_equal": offloaded["losses"] == regional["losses"],
                **{f"phase_peaks_gib_{name}": run["phase_peaks_gib"] for name, run in
                   (("regional", regional), ("offloaded", offloaded), ("offloaded_as_users", offloaded_as_users),
                    ("whole", whole))}}, show=True)  # fmt: skip
    assert regional["losses"] == again["losses"]  # the comparison means something
    assert offloaded["losses"] == regional["losses"] and len(offloaded["losses"]) == 8
    assert all(torch.equal(a, b) for a, b in zip(offloaded["weights"], regional["weights"]))
    assert offloaded["graphs"] == regional["graphs"] and not offloaded["whole"] and whole["whole"]
    assert offloaded["stats"]["bytes_offloaded"] > 0 and not offloaded["stats"].get("steps_stood_aside_compiled")
    # At this shape the step peaks in the first layer's backward, every input reloaded by then: offloading holds
    # nothing away there, and the run peaks with the regional compile alone, give or take the engine's bookkeeping.
    assert offloaded["peak_gib"] <= regional["peak_gib"] + 2**-10
    assert not offloaded_as_users["whole"] and offloaded_as_users["stats"]["bytes_offloaded"] > 0
    assert offloaded_as_users["peak_gib"] <= whole["peak_gib"]
