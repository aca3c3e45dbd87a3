"""The Trainer integration on a GPU: `Trainer` and TRL `SFTTrainer` + LoRA with `activation_offloading` off and on.

Over 10 optimizer steps, with the same seed and deterministic algorithms (conftest), the per-step losses and the final
weights must be bitwise equal, and the peak GPU memory of training must be lower with offloading. The numbers are
printed (also without `-s`) and recorded through conftest's `record` fixture.

Eager attention: SDPA's memory-efficient kernels have no deterministic backward.
"""

import gc
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import trl
from peft import LoraConfig

from hf_offload import ActivationOffloadingCallback, TrainingArguments
from hf_offload.callbacks.trl import SFTConfig

# The examples read their data through `datasets`, which the GPU image lacks unless its wheel is carried (.whl/):
# without it these tests skip instead of stopping the whole suite's collection (the examples exit naming the extra).
pytest.importorskip("datasets", reason="the Trainer tests need datasets (carry its wheels in .whl/)")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import example_utils  # noqa: E402

STEPS = 10
SHAPE = {"hidden_size": 1024, "num_layers": 8, "seq_len": 1024, "batch_size": 4}
LINES_PER_TEXT = 120  # ~1500 words: every text fills the sequence, so no padding
COMMON_ARGS: dict[str, Any] = {
    "max_steps": STEPS,
    "per_device_train_batch_size": SHAPE["batch_size"],
    "learning_rate": 1e-4,
    "bf16": True,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "dataloader_num_workers": 0,
    "disable_tqdm": True,
    "seed": 0,
}


@pytest.fixture(scope="module", autouse=True)
def cublas_workspaces():
    """cuBLAS allocates its workspaces at its first matmul and keeps them: do that before measuring, or whichever run
    comes first carries them in its peak."""
    for dtype in (torch.float32, torch.bfloat16):
        ones = torch.ones(64, 64, device="cuda", dtype=dtype)
        ones @ ones
    torch.cuda.synchronize()


@pytest.fixture(scope="module")
def corpus():
    lines = list(example_utils.load_text_dataset(example_utils.DataArguments())["text"])
    texts = [" ".join((lines * 2)[i : i + LINES_PER_TEXT]) for i in range(STEPS * SHAPE["batch_size"])]
    tokenizer = example_utils.fit_word_tokenizer(lines)
    return texts, tokenizer


def build_model(tokenizer) -> transformers.LlamaForCausalLM:
    transformers.set_seed(0)
    model = example_utils.tiny_llama(
        tokenizer, hidden_size=SHAPE["hidden_size"], num_layers=SHAPE["num_layers"], max_length=SHAPE["seq_len"]
    )
    model.set_attn_implementation("eager")
    return model


def train_and_measure(trainer: transformers.Trainer) -> dict[str, Any]:
    """Trains; returns the losses, the final weights (on the CPU), the peak memory, and frees the GPU."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    torch.cuda.synchronize()
    callbacks = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ActivationOffloadingCallback)]
    result = {
        "losses": [record["loss"] for record in trainer.state.log_history if "loss" in record],
        "weights": {name: tensor.cpu() for name, tensor in trainer.model.state_dict().items()},
        "peak_gib": (torch.cuda.max_memory_allocated() - resident) / 2**30,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "log_history": list(trainer.state.log_history),
        "stats": callbacks[0].stats if callbacks else {},
    }
    del trainer, callbacks
    gc.collect()  # the engine's hooks are bound methods of itself: a cycle holding the pinned pool
    torch.cuda.empty_cache()
    return result


def train_with_trainer(output_dir: Path, tokenizer, features: list, **offloading: Any) -> dict[str, Any]:
    """`train_and_measure` of a plain `Trainer` on the tokenized `features`, with the offloading arguments given."""
    args = TrainingArguments(str(output_dir), **offloading, **COMMON_ARGS)
    return train_and_measure(
        transformers.Trainer(
            model=build_model(tokenizer),
            args=args,
            train_dataset=features,
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
        )
    )


def compare(name: str, off: dict[str, Any], on: dict[str, Any], record, capsys) -> None:
    steps = max(on["stats"].get("steps", 0), 1)
    numbers = {
        "peak_gib_off": round(off["peak_gib"], 3),
        "peak_gib_on": round(on["peak_gib"], 3),
        "offloaded_gib_per_step": round(on["stats"].get("bytes_offloaded", 0) / steps / 2**30, 3),
        "losses_equal": on["losses"] == off["losses"],
    }
    for key, value in numbers.items():
        record(key, value, show=True)
    with capsys.disabled():
        print(f"\n[{name}] peak training memory over resident: {numbers['peak_gib_off']:.3f} GiB without offloading, "
              f"{numbers['peak_gib_on']:.3f} GiB with; offloaded {numbers['offloaded_gib_per_step']:.3f} GiB per "
              f"step; losses bitwise equal: {numbers['losses_equal']}")  # fmt: skip
        print(f"[{name}] losses off: {off['losses']}\n[{name}] losses on:  {on['losses']}")

    assert len(on["losses"]) == STEPS
    assert on["losses"] == off["losses"]
    assert on["weights"].keys() == off["weights"].keys()
    differing = [key for key in on["weights"] if not torch.equal(on["weights"][key], off["weights"][key])]
    assert not differing, f"weights differ with offloading on: {differing[:5]}"
    assert on["stats"]["bytes_offloaded"] > 0
    assert on["peak_gib"] < off["peak_gib"]


def test_trainer_exact_and_lower_peak(tmp_path, corpus, record, capsys):
    texts, tokenizer = corpus
    features = [tokenizer(text, truncation=True, max_length=SHAPE["seq_len"]) for text in texts]
    assert all(len(f["input_ids"]) == SHAPE["seq_len"] for f in features)

    off = train_with_trainer(tmp_path / "off", tokenizer, features, activation_offloading=False)
    on = train_with_trainer(tmp_path / "on", tokenizer, features, activation_offloading=True)
    compare("Trainer", off, on, record, capsys)


def test_sft_trainer_lora_exact_and_lower_peak(tmp_path, corpus, record, capsys):
    import datasets

    texts, tokenizer = corpus
    dataset = datasets.Dataset.from_dict({"text": texts})

    def run(offloading: bool) -> dict[str, Any]:
        # SFTConfig's default activation checkpointing stays on: what moves are the checkpointed layers' inputs.
        args = SFTConfig(
            str(tmp_path / str(offloading)),
            activation_offloading=offloading,
            max_length=SHAPE["seq_len"],
            **COMMON_ARGS,
        )
        return train_and_measure(
            trl.SFTTrainer(
                model=build_model(tokenizer),
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
                peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
            )
        )

    compare("SFTTrainer+LoRA", run(False), run(True), record, capsys)


def test_trainer_with_a_memory_budget(tmp_path, corpus, record, capsys):
    """`activation_offloading_memory_budget` through the Trainer: the plan is made, printed and logged, no step goes
    over the budget (the whole run's peak, profiled steps included), and training is bitwise the same."""
    texts, tokenizer = corpus
    features = [tokenizer(text, truncation=True, max_length=SHAPE["seq_len"]) for text in texts]

    off = train_with_trainer(tmp_path / "off", tokenizer, features)
    budget = int(0.7 * off["peak_bytes"])
    on = train_with_trainer(tmp_path / "on", tokenizer, features, activation_offloading=True,
                            activation_offloading_memory_budget=str(budget))  # fmt: skip
    printed = capsys.readouterr()
    planned = [entry for entry in on["log_history"] if "offload/plan_predicted_peak_gib" in entry]
    record("budget_bytes", budget, show=True)
    record("peak_bytes_off", off["peak_bytes"], show=True)
    record("peak_bytes_on", on["peak_bytes"], show=True)
    record("plan_logged", planned[:1], show=True)
    assert on["peak_bytes"] <= budget
    assert on["losses"] == off["losses"]
    differing = [key for key in on["weights"] if not torch.equal(on["weights"][key], off["weights"][key])]
    assert not differing, f"weights differ under the memory budget: {differing[:5]}"
    assert planned and planned[0]["offload/plan_predicted_peak_gib"] <= budget / 2**30
    assert "Memory plan for" in printed.out + printed.err


def test_trainer_with_liger_kernels_exact(tmp_path, corpus, record, capsys, liger_patches_undone):
    """`use_liger_kernel=True`: the Trainer patches the model's instances with Liger's RMSNorm, SwiGLU MLP and fused
    linear cross-entropy, whose backwards write into their saved tensors; with offloading they get the reloaded copies,
    and training is bitwise the same."""
    texts, tokenizer = corpus
    features = [tokenizer(text, truncation=True, max_length=SHAPE["seq_len"]) for text in texts]

    off = train_with_trainer(tmp_path / "off", tokenizer, features, use_liger_kernel=True)
    on = train_with_trainer(tmp_path / "on", tokenizer, features, use_liger_kernel=True, activation_offloading=True)
    compare("Trainer+Liger", off, on, record, capsys)
