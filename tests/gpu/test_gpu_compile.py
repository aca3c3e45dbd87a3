"""torch.compile with offloading on the GPU (docs/DESIGN.md, torch.compile): no crash in Inductor's code, the compiled
graphs and graph breaks of the run without hf-offload, losses and weights bitwise equal to it (its repeatability checked
first). Regional compilation moves the layers' inputs; a model compiled as a whole makes the engine stand aside; the
Trainer's `torch_compile=True` under offloading compiles the layers."""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo
import transformers
from compile_runs import bitwise_equal, build, train
from torch._dynamo.utils import counters

import hf_offload

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


TRAINER_SHAPE = {"hidden": 1024, "layers": 8, "vocab": 1024}


def _train_with_trainer(output_dir: str, torch_compile: bool, offloading: bool, compile_layers: bool = False) -> dict:
    """8 AdamW steps of the Trainer (checkpointing on) on `build(...)`; the losses, weights, peak and Dynamo counts."""
    torch._dynamo.reset()
    counters.clear()
    # The previous run's trainer and model are garbage in reference cycles: collected in the middle of this run, they
    # would take their memory off this run's peak.
    gc.collect()
    torch.cuda.empty_cache()
    model = build(checkpointing=False, device="cuda", **TRAINER_SHAPE)
    if compile_layers:  # what torch_compile=True becomes under offloading
        hf_offload.compile_decoder_layers(model)
        hf_offload.compile_loss(model)
    tokens = torch.randint(0, TRAINER_SHAPE["vocab"], (32, 1024), generator=torch.Generator().manual_seed(2))
    features = [{"input_ids": row.tolist(), "labels": row.tolist()} for row in tokens]
    args = hf_offload.TrainingArguments(
        output_dir, torch_compile=torch_compile, activation_offloading=offloading, max_steps=8,
        per_device_train_batch_size=4, learning_rate=1e-4, gradient_checkpointing=True, bf16=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=features,
                                   data_collator=transformers.default_data_collator)  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    trainer.train()
    torch.cuda.synchronize()
    offloading_callback = trainer.callback_handler.callbacks[0]
    return {
        "losses": [record["loss"] for record in trainer.state.log_history if "loss" in record],
        "weights": [p.detach().cpu().clone() for p in trainer.model.parameters()],
        "peak_gib": (torch.cuda.max_memory_allocated() - resident) / 2**30,
        "graphs": (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())),
        "stats": getattr(offloading_callback, "stats", {}),
        "whole": isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule),
    }


@pytest.fixture
def tf32_restored():
    """accelerate turns TF32 matmuls on for the process when a compile backend is set without mixed precision."""
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.usefixtures("tf32_restored")
def test_the_trainers_torch_compile_with_offloading_compiles_the_layers_exactly_at_lower_memory(tmp_path, record):
    # Under offloading the Trainer compiles each decoder layer and the loss (callbacks/compile_layers.py): compared
    # with the same regional compilation without offloading, and with the Trainer's own whole-model compile for the
    # peak, which offloading must never exceed. In bf16:
    # in fp32, torch_compile=True would also switch TF32 on (accelerate), which the baseline without it would not.
    regional = _train_with_trainer(str(tmp_path / "a"), torch_compile=False, offloading=False, compile_layers=True)
    again = _train_with_trainer(str(tmp_path / "b"), torch_compile=False, offloading=False, compile_layers=True)
    offloaded = _train_with_trainer(str(tmp_path / "c"), torch_compile=True, offloading=True)
    whole = _train_with_trainer(str(tmp_path / "d"), torch_compile=True, offloading=False)
    record("", {"peak_gib_regional": round(regional["peak_gib"], 3), "peak_gib_whole": round(whole["peak_gib"], 3),
                "peak_gib_offloaded": round(offloaded["peak_gib"], 3), "graphs_regional": regional["graphs"],
                "graphs_offloaded": offloaded["graphs"], "bytes_offloaded": offloaded["stats"].get("bytes_offloaded"),
                "losses_equal": offloaded["losses"] == regional["losses"]}, show=True)  # fmt: skip
    assert regional["losses"] == again["losses"]  # the comparison means something
    assert offloaded["losses"] == regional["losses"] and len(offloaded["losses"]) == 8
    assert all(torch.equal(a, b) for a, b in zip(offloaded["weights"], regional["weights"]))
    assert offloaded["graphs"] == regional["graphs"] and not offloaded["whole"] and whole["whole"]
    assert offloaded["stats"]["bytes_offloaded"] > 0 and not offloaded["stats"].get("steps_stood_aside_compiled")
    assert offloaded["peak_gib"] < regional["peak_gib"] and offloaded["peak_gib"] <= whole["peak_gib"]
