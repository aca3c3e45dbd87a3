#!/usr/bin/env python3
"""Long context started as users start it: TRL's `SFTTrainer`, documents packed to `max_length`, so the first step is
already as long as every other, under `activation_offloading_memory_budget="auto"`.

    python benchmarks/long_context_sft.py --tokens 327680 --steps 2 --out $OUT
    python benchmarks/long_context_sft.py --family qwen3 --tokens 294912 --out $OUT               # Qwen3-8B's shape
    python benchmarks/long_context_sft.py --precision qlora --tokens 524288 --steps 1 --out $OUT  # 4-bit base
    python benchmarks/long_context_sft.py --max-pinned-gib 24 --disk-offload-dir /nvme/tmp --out $OUT  # a small host
    python benchmarks/long_context_sft.py --tiny --out /tmp/sft     # CPU smoke run: a tiny model, the CPU test mode

The model: an 8B-class shape (hidden 4096, intermediate 14336, 32 layers, 32/8 heads, vocabulary --vocab, 32,768 by
default: a family whose vocabulary the other long-context benchmarks do not use; with `--family qwen3`, Qwen3-8B's:
intermediate 12288, 36 layers, head dimension 128, vocabulary 151,936), random bf16 weights built from a config (with
`--precision qlora` the decoder's linear layers then quantized to 4-bit NF4, as `long_context.py` does), LoRA r=16 on
all linear layers (peft, through `SFTTrainer`'s `peft_config`), Liger's kernels with its fused linear cross-entropy,
batch 1. The data: random token documents of 1,024-65,536 tokens, already tokenized, packed by TRL
(`packing_strategy="wrapped"`: blocks of exactly `max_length`). hf-offload is configured through
`hf_offload.callbacks.trl.SFTConfig`, as a TRL script would be.

Every step is recorded as it ends, in <out>/long_context_sft[-<tag>].json (a run cut short keeps what it measured): its
time and tokens, the device's peak (`max_memory_allocated`, reset as the step begins: the budget's controller reads its
own counter, `measurements.OwnPeakCounter`), the least host memory available while it ran (read every 0.5 s) and what
psutil and hf-offload's pinned pool read as available at its end (as at the start: under a cgroup they can differ),
the pinned pool's bytes and what growing it took in the step (`pool_growth_s`, the training thread's time), the disk
tier's bytes (`--disk-offload-dir`) and the plan the layers ran (and the latest plan's table). A step that runs out
of memory is recorded with the allocator's figures. `--max-pinned-gib` caps the pinned pool: a host with less memory,
stood in for.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import datasets  # noqa: E402
import peft  # noqa: E402
import psutil  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.model import apply_liger, build_model  # noqa: E402
from harness.scenarios import Scenario  # noqa: E402

from hf_offload.callbacks.trl import SFTConfig  # noqa: E402
from hf_offload.host_memory import read_host_memory  # noqa: E402

GIB = 2**30
# The families' shapes: Llama-3-8B's layers with a vocabulary the other long-context benchmarks do not use, and
# Qwen3-8B's (head dimension 128 whatever the hidden size, as Qwen3's config has it).
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"hidden": 4096, "intermediate": 14336, "layers": 32, "vocab": 32768},
    "qwen3": {"hidden": 4096, "intermediate": 12288, "layers": 36, "vocab": 151936, "head_dim": 128, "family": "qwen3"},
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class _LeastAvailableHost:
    """The least host memory available since the last `take`, read every half second on a daemon thread."""

    def __init__(self) -> None:
        self._least = psutil.virtual_memory().available
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            available = psutil.virtual_memory().available
            with self._lock:
                self._least = min(self._least, available)
            time.sleep(0.5)

    def take(self) -> int:
        with self._lock:
            least, self._least = self._least, psutil.virtual_memory().available
        return least


class _StepRecorder(transformers.TrainerCallback):
    """Writes each step's figures to the result file as the step ends."""

    def __init__(self, result: dict[str, Any], save: Any, cuda: bool) -> None:
        self.result, self.save, self.cuda = result, save, cuda
        self.host = _LeastAvailableHost()
        self.trainer: transformers.Trainer | None = None
        self._start = 0.0
        self._tokens_seen = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.host.take()
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        record: dict[str, Any] = {"step": state.global_step, "seconds": time.perf_counter() - self._start,
                                  "tokens": state.num_input_tokens_seen - self._tokens_seen,
                                  "least_host_available_gib": self.host.take() / GIB,
                                  "host_available_gib_now": _host_available_gib()}  # fmt: skip
        self._tokens_seen = state.num_input_tokens_seen
        if self.cuda:
            record["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        context = _offloading_context(self.trainer)
        if context is not None:
            stats = context.get_stats()
            record.update(pinned_gib=stats.get("pinned_bytes", 0) / GIB,
                          offloaded_gib=stats.get("bytes_offloaded", 0) / GIB,
                          kept_over_host_cap=stats.get("tensors_kept_over_host_cap", 0),
                          spilled_to_disk_gib=stats.get("bytes_spilled_to_disk", 0) / GIB,
                          read_from_disk_gib=stats.get("bytes_read_from_disk", 0) / GIB,
                          disk_wait_s=stats.get("disk_wait_s", 0.0),
                          pool_grown_gib=stats.get("pool_grown_bytes", 0) / GIB,
                          pool_growth_s=stats.get("pool_growth_s", 0.0))  # fmt: skip
            controller = context.budget_controller
            if controller is not None:
                record["layers_ran"] = controller.plan.code if controller.plan is not None else controller.planner.code
                if controller.plan is not None:
                    self.result["plan_table"] = controller.plan.format_table()
        self.result["steps"].append(record)
        self.save()
        log(f"step {record}")


def _host_available_gib() -> dict[str, float]:
    """The host memory available now as psutil reads it (the kernel's `MemAvailable`) and as hf-offload's pinned pool
    does (lowered to the room under a cgroup's limit, whose page cache it counts as used unless inactive): where the
    two differ, the pool's cap and the plans' host were smaller than the host this benchmark's own figures show."""
    return {"psutil": psutil.virtual_memory().available / GIB, "hf_offload": read_host_memory().available_bytes / GIB}


def _offloading_context(trainer: transformers.Trainer | None) -> Any:
    """The offloading context hf-offload's callback built for the trainer (None before training begins)."""
    for callback in trainer.callback_handler.callbacks if trainer is not None else ():
        if hasattr(callback, "context"):
            return callback.context
    return None


def _packed_documents(tokens: int, steps: int, vocab: int, seed: int, shortest: int, longest: int) -> datasets.Dataset:
    """Random token documents that pack into exactly `steps` + 1 blocks of `tokens`.

    Exactly: a packed remainder would be a block shorter than the rest, and the Trainer's shuffled order may draw it
    first, which would make the first step short."""
    rng = random.Random(seed)
    documents, left = [], tokens * (steps + 1)
    while left:
        length = min(rng.randint(shortest, longest), left)
        documents.append([rng.randrange(3, vocab) for _ in range(length)])
        left -= length
    return datasets.Dataset.from_dict({"input_ids": documents})


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A tokenizer that only pads: the documents come tokenized."""
    vocabulary = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    model = tokenizers.models.WordLevel(vocabulary, unk_token="<unk>")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model), pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=327680, help="max_length: every step's tokens")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--family", choices=sorted(_FAMILIES), default="llama")
    parser.add_argument(
        "--precision",
        choices=["bf16", "qlora"],
        default="bf16",
        help="qlora: the decoder's linear layers in 4-bit NF4 (bitsandbytes), LoRA on top",
    )
    parser.add_argument("--layers", type=int, default=None, help="default: the family's")
    parser.add_argument("--vocab", type=int, default=None, help="default: the family's")
    parser.add_argument("--max-pinned-gib", type=float, default=None, help="activation_offloading_max_pinned_mib")
    parser.add_argument("--disk-offload-dir", default=None, help="activation_offloading_disk_offload_dir")
    parser.add_argument("--memory-budget", default="auto", help="activation_offloading_memory_budget (tiny: 256MiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model, hf-offload's CPU test mode")
    parser.add_argument("--tag", default=None, help="appended to the output file's name")
    parser.add_argument("--out", default="long_context_out")
    args = parser.parse_args()
    if args.tiny and args.precision == "qlora":
        parser.error("--precision qlora needs a GPU (bitsandbytes' 4-bit layers): leave out --tiny")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = not args.tiny
    shape = {key: value for key, value in _FAMILIES[args.family].items() if key not in ("layers", "vocab")}
    args.layers = args.layers or _FAMILIES[args.family]["layers"]
    args.vocab = args.vocab or _FAMILIES[args.family]["vocab"]
    if args.tiny:
        args.tokens, args.layers, args.vocab = min(args.tokens, 512), 2, 256
        if args.memory_budget == "auto":  # the CPU test mode has no device memory to take a share of
            args.memory_budget = "256MiB"
        scenario = Scenario(hidden=64, intermediate=128, layers=args.layers, heads=4, kv_heads=2, vocab=args.vocab,
                            seq=args.tokens, batch=1, lora=True, liger=False, force_ckpt=False, steps=args.steps,
                            warmup=0, family=shape.get("family", "llama"))  # fmt: skip
    else:
        scenario = Scenario(layers=args.layers, heads=32, kv_heads=8, vocab=args.vocab, seq=args.tokens, batch=1,
                            lora=True, liger=True, force_ckpt=False, steps=args.steps, warmup=0, **shape)  # fmt: skip
    path = out / f"long_context_sft{'-' + args.tag if args.tag else ''}.json"
    result: dict[str, Any] = {
        "argv": sys.argv, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "scenario": scenario.describe(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl.__version__, "precision": args.precision,
        "host_total_gib": psutil.virtual_memory().total / GIB, "host_available_gib_at_start": _host_available_gib(),
        "steps": [],
    }  # fmt: skip

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    # hf-offload's INFO lines say what the probes measured and which plan the first step runs, and why.
    library_log = logging.StreamHandler(sys.stdout)
    library_log.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
    logging.getLogger("hf_offload").addHandler(library_log)
    logging.getLogger("hf_offload").setLevel(logging.INFO)
    device = torch.device("cuda" if cuda else "cpu")
    notes: list[str] = []
    result["liger"] = apply_liger(device, notes, scenario.family) if scenario.liger else False
    model = build_model(scenario, args.seed, device)
    if args.precision == "qlora":
        from long_context import quantize_decoder_nf4

        result["quantization"] = quantize_decoder_nf4(model)
    result["forward"] = type(model).forward.__module__  # Liger's module where its fused loss is in force
    shortest = min(1024, args.tokens // 4)
    dataset = _packed_documents(args.tokens, args.steps, args.vocab, args.seed, shortest, min(65536, args.tokens))
    config = SFTConfig(
        output_dir=str(out / "sft_trainer"), max_steps=args.steps, per_device_train_batch_size=1, learning_rate=1e-4,
        max_length=args.tokens, packing=True, packing_strategy="wrapped", bf16=cuda, use_cpu=not cuda,
        activation_offloading=True, activation_offloading_memory_budget=args.memory_budget,
        activation_offloading_device_type=None if cuda else "cpu", save_strategy="no", report_to="none",
        activation_offloading_max_pinned_mib=None if args.max_pinned_gib is None else args.max_pinned_gib * 1024,
        activation_offloading_disk_offload_dir=args.disk_offload_dir,
        logging_steps=1, disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
        include_num_input_tokens_seen=True,  # each step's tokens, recorded: a short first step would be no cold start
    )  # fmt: skip
    recorder = _StepRecorder(result, save, cuda)
    trainer = trl.SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=_tokenizer(), callbacks=[recorder],
        peft_config=peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )  # fmt: skip
    recorder.trainer = trainer
    result["notes"] = notes
    result["static_gib"] = torch.cuda.memory_allocated() / GIB if cuda else None
    save()
    log(f"SFTTrainer built: {scenario.describe()}; first step of {args.tokens} tokens")
    try:
        trainer.train()
    except torch.OutOfMemoryError as error:
        result["out_of_memory"] = {"error": str(error).splitlines()[0][:300],
                                   "allocated_gib": torch.cuda.memory_allocated() / GIB,
                                   "reserved_gib": torch.cuda.memory_reserved() / GIB}  # fmt: skip
        save()
        log(f"out of memory: {result['out_of_memory']}")
        return 1
    save()
    log(f"done: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
