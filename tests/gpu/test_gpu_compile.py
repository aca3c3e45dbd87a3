"""torch.compile with offloading on the GPU (issue 21, item 1): no crash in Inductor's code, the compiled graphs and
graph breaks of the run without hf-offload, losses and weights bitwise equal to it (its repeatability checked first).
Regional compilation moves the layers' inputs; a model compiled as a whole makes the engine stand aside."""

from __future__ import annotations

import pytest
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
