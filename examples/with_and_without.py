"""The main job (`bash scripts/train.sh`): the same fine-tune twice, with activation checkpointing alone and with
checkpointing plus hf-offload, and their peak memory and step time side by side.

    python examples/with_and_without.py --output_dir runs/main

It trains a Llama built from a config (random weights) on `examples/data/tiny_sft.jsonl`, repeated and packed into
sequences of equal length, with the plain `transformers.Trainer`; both runs start from the same weights and see the
same batches. It says what it ran and where the model trained with offloading was saved. On a GPU the model and the
sequences are large enough for the layer inputs that offloading moves to show in the peak. Without a GPU it runs a
tiny model with hf-offload in its CPU test mode, which exercises the bookkeeping but saves no memory, and says so.
"""

import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from example_utils import DEFAULT_DATASET, TEXT_COLUMN, DataArguments, fit_word_tokenizer, load_text_dataset, tiny_llama

from hf_offload import ActivationOffloadingCallback, TrainingArguments
from hf_offload.units import format_bytes

WARMUP_STEPS = 2  # the first steps fill the pinned pool and learn the tail: not the steady step time


@dataclass
class JobArguments:
    output_dir: str = field(default="runs/main", metadata={"help": "Where each run's trained model is saved."})
    max_steps: int = field(default=20, metadata={"help": "Optimizer steps of each run."})
    seed: int = field(default=42, metadata={"help": "Seed of the weights and the data order, the same for both runs."})


class _StepTimer(transformers.TrainerCallback):
    """Wall time of each optimizer step, the device's queue drained at both ends."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        _synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        _synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def packed_sequences(tokenizer: transformers.PreTrainedTokenizerBase, texts: list[str], length: int,
                     count: int) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """`count` sequences of `length` tokens: the texts, each ended by EOS, one stream repeated as often as needed."""
    stream = [token for text in texts for token in [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]]
    repeats = -(-length * count // len(stream))
    tokens = torch.tensor(stream * repeats)[: length * count].view(count, length)
    return [{"input_ids": row, "labels": row} for row in tokens]


@dataclass
class Shape:
    """The model's size and the batches'."""

    hidden_size: int
    layers: int
    tokens: int  # per sequence
    batch: int  # sequences per step


# On a GPU, layer inputs of 8 layers x 4 x 2048 tokens x 1024 x 4 bytes (the residual stream stays fp32 under bf16
# autocast): 256 MiB, which offloading takes off the peak. On a CPU, a model that trains in seconds.
GPU_SHAPE = Shape(hidden_size=1024, layers=8, tokens=2048, batch=4)
CPU_SHAPE = Shape(hidden_size=64, layers=2, tokens=64, batch=4)


def train_once(tokenizer: transformers.PreTrainedTokenizerBase, shape: Shape, train_dataset: list, job: JobArguments,
               offloading: bool, on_gpu: bool) -> dict[str, Any]:  # fmt: skip
    """One run; returns its figures (step time, peak memory or None without a GPU, bytes offloaded per step, final
    loss, every logged loss and the trained weights) and where its model was saved."""
    transformers.set_seed(job.seed)
    model = tiny_llama(tokenizer, hidden_size=shape.hidden_size, num_layers=shape.layers, max_length=shape.tokens)
    output_dir = Path(job.output_dir) / ("with_offloading" if offloading else "without_offloading")
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=job.max_steps, per_device_train_batch_size=shape.batch, seed=job.seed,
        learning_rate=1e-3, logging_steps=max(job.max_steps // 2, 1), save_strategy="no", report_to="none",
        disable_tqdm=True, bf16=on_gpu and torch.cuda.is_bf16_supported(), use_cpu=not on_gpu,
        activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False},
        activation_offloading=offloading, activation_offloading_device_type=None if on_gpu else "cpu",
    )  # fmt: skip
    timer = _StepTimer()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train_dataset, callbacks=[timer])
    if on_gpu:  # the previous run's memory is not this one's peak
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak_bytes = torch.cuda.max_memory_allocated() if on_gpu else None
    stats = next((callback.stats for callback in trainer.callback_handler.callbacks
                  if isinstance(callback, ActivationOffloadingCallback)), {})  # fmt: skip
    trainer.save_model()
    tokenizer.save_pretrained(output_dir)
    return {
        "step_s": statistics.median(timer.seconds[WARMUP_STEPS:] or timer.seconds),
        "peak_bytes": peak_bytes,
        "offloaded_bytes_per_step": stats.get("bytes_offloaded", 0) / max(stats.get("steps", 0), 1),
        "loss": next(record["loss"] for record in reversed(trainer.state.log_history) if "loss" in record),
        "losses": [record["loss"] for record in trainer.state.log_history if "loss" in record],
        "weights": {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()},
        "output_dir": output_dir,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
    }


def _moved(run: dict[str, Any]) -> str:
    return format_bytes(run["offloaded_bytes_per_step"]) if run["offloaded_bytes_per_step"] else "-"


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Runs both trainings, prints what ran and the comparison, and returns each run's figures by name."""
    (job,) = transformers.HfArgumentParser(JobArguments).parse_args_into_dataclasses(args=argv)
    on_gpu = torch.cuda.is_available()
    shape = GPU_SHAPE if on_gpu else CPU_SHAPE
    texts = load_text_dataset(DataArguments())[TEXT_COLUMN]
    tokenizer = fit_word_tokenizer(texts)
    train_dataset = packed_sequences(tokenizer, texts, shape.tokens, count=4 * shape.batch)
    runs = {}
    for number, (name, offloading) in enumerate((("checkpointing alone", False), ("checkpointing + hf-offload", True))):
        print(f"\n=== run {number + 1} of 2: {name} ===", flush=True)  # the Trainer's logs that follow are this run's
        runs[name] = train_once(tokenizer, shape, train_dataset, job, offloading, on_gpu)

    without, with_ = runs.values()
    device = f"a GPU ({torch.cuda.get_device_name()})" if on_gpu else "a CPU, hf-offload in its CPU test mode"
    print(f"\nhf-offload's main job, on {device}:")
    print(
        f"  model: a Llama built from a config (random weights): {shape.layers} layers, hidden size "
        f"{shape.hidden_size}, {with_['parameters'] / 1e6:.1f}M parameters{', bf16 autocast' if on_gpu else ''}"
    )
    print(f"  data:  {Path(DEFAULT_DATASET).relative_to(Path(__file__).resolve().parents[1])} ({len(texts)} lines), "
          f"repeated and packed into {len(train_dataset)} sequences of {shape.tokens} tokens")  # fmt: skip
    print(f"  steps: {job.max_steps} optimizer steps of {shape.batch} sequences per run, activation checkpointing in "
          "both\n")  # fmt: skip
    # Times on a CPU say nothing about offloading (the CPU test mode copies within host memory): a CPU run shows what
    # moved and that the losses agree.
    columns = {"moved to host per step": _moved}
    if on_gpu:
        columns["peak GPU memory"] = lambda run: format_bytes(run["peak_bytes"])
        columns["step time"] = lambda run: f"{run['step_s'] * 1000:.1f} ms"
    columns["final loss"] = lambda run: f"{run['loss']:.4f}"
    print("  " + " " * 28 + "".join(f"{title:>24}" for title in columns))
    for name, run in runs.items():
        print(f"  {name:<28}" + "".join(f"{cell(run):>24}" for cell in columns.values()))
    if on_gpu:
        saved = without["peak_bytes"] - with_["peak_bytes"]
        print(f"  (step time: the median from step {WARMUP_STEPS + 1} on; peak: torch.cuda.max_memory_allocated)\n")
        print(f"  hf-offload: {format_bytes(abs(saved))} {'less' if saved >= 0 else 'more'} at the peak, "
              f"{with_['step_s'] / without['step_s']:.2f}x the step time of checkpointing alone")  # fmt: skip
    else:
        print("\n  No GPU here, so nothing to offload: the CPU test mode copies the saved tensors to a second buffer "
              "in host memory.\n  That checks the bookkeeping and the statistics but saves no memory; on a GPU this "
              "command compares the peaks and step times.")  # fmt: skip
    # Offloading copies bytes: the same training, bit for bit, wherever the run without it repeats itself.
    same = without["losses"] == with_["losses"] and all(
        torch.equal(a, b) for a, b in zip(without["weights"].values(), with_["weights"].values())
    )
    print(f"\n  Losses at every logged step and the trained weights of the two runs are "
          f"{'bitwise equal' if same else 'NOT bitwise equal'}.")  # fmt: skip
    print(f"  The trained models (weights, config, tokenizer): {without['output_dir']} and {with_['output_dir']}")
    return runs


if __name__ == "__main__":
    main(sys.argv[1:])
