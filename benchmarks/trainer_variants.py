#!/usr/bin/env python3
"""Step time and peak memory of one shape under the `transformers.Trainer`, started as a user starts it.

Each variant is a `Trainer` built with `hf_offload.TrainingArguments` on a model built afresh from the same seed
(random weights, bf16, AdamW), on random tokens of one length: the library is driven exactly as a user's script
drives it, defaults included. The variants run one after the other in one process, in rounds (ABC ABC), so that
each sees the same GPU clocks and host; a variant's step time is the median of its timed steps over every round,
its peak the highest `max_memory_allocated` of any of its steps, above the model's parameters.

With --fresh-processes each variant of each round runs in a Python process of its own instead, as a user's script
trains one Trainer: in one process that trains several Trainers one after the other, what the earlier ones left in
the allocator and Dynamo's caches moves a later one's peak by tens of MiB (tests/gpu/_trainer_compile_run.py), which
decides a comparison of peaks that close.

Variants (--variants, separated by spaces):
  none                     no checkpointing, no offloading
  ckpt                     gradient checkpointing alone
  ckpt+hfo                 checkpointing and `activation_offloading=True`, every option at its default
  ckpt+hfo:KEY=VALUE,...   the same with `activation_offloading_KEY=VALUE` (e.g. `min_peak_reduction=none`,
                           `memory_budget=auto`)
  compile:...              any of the above with the Trainer's `torch_compile=True`
  layers:...               any of the above with `hf_offload.compile_decoder_layers(model)` called by hand and the
                           Trainer's `torch_compile` off

Usage (GPU machine):
  python benchmarks/trainer_variants.py --layers 16 --vocab 128256 --batch 1 --seq 2048 \\
      --variants ckpt ckpt+hfo ckpt+hfo:min_peak_reduction=none ckpt+hfo:memory_budget=auto none
  python benchmarks/trainer_variants.py --layers 8 --vocab 32000 --batch 2 --seq 4096 --fresh-processes \\
      --variants compile:ckpt compile:ckpt+hfo layers:ckpt+hfo
Writes one JSON line per variant and round to --out/trainer_variants.jsonl as it goes, and a table at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import hf_offload

GIB = 2**30
SHAPE = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "seq", "batch")  # the arguments of a shape


class _StepClock(transformers.TrainerCallback):
    """Each step's time (synchronised at its start and end) and peak memory."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.peaks: list[int] = []
        self._start = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)
        self.peaks.append(torch.cuda.max_memory_allocated())


def _parse(variant: str) -> tuple[str, bool, bool, dict[str, str]]:
    """'compile:ckpt+hfo:min_peak_reduction=none' -> (compile kind, checkpointing, offloading, options)."""
    compile_kind = "none"
    head, _, rest = variant.partition(":")
    if head in ("compile", "layers"):
        compile_kind, variant = head, rest
    name, _, options_text = variant.partition(":")
    if name not in ("none", "ckpt", "ckpt+hfo", "hfo"):
        raise SystemExit(f"unknown variant {variant!r}: see --help")
    options = dict(item.split("=", 1) for item in filter(None, options_text.split(",")))
    return compile_kind, name.startswith("ckpt"), "hfo" in name, options


def run_variant(variant: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    compile_kind, checkpointing, offloading, options = _parse(variant)
    torch._dynamo.reset()
    # The previous variant's trainer and model are garbage in reference cycles: collected during this variant, they
    # would take their memory off its peak above the parameters.
    gc.collect()
    torch.cuda.empty_cache()
    transformers.set_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, args.seq), attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    if compile_kind == "layers":
        hf_offload.compile_decoder_layers(model)
    resident = torch.cuda.memory_allocated()
    tokens = torch.randint(0, args.vocab, (args.batch * (args.steps + 1), args.seq),
                           generator=torch.Generator().manual_seed(args.seed))  # fmt: skip
    dataset = [{"input_ids": row, "labels": row} for row in tokens]
    training_args = hf_offload.TrainingArguments(
        output_dir=str(work / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-5, optim="adamw_torch", gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, torch_compile=compile_kind == "compile",
        activation_offloading=offloading, save_strategy="no", report_to="none", disable_tqdm=True,
        logging_steps=args.steps, seed=args.seed, dataloader_num_workers=0,
        **{f"activation_offloading_{key}": value for key, value in options.items()},
    )  # fmt: skip
    clock = _StepClock()
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[clock],
                                   data_collator=transformers.default_data_collator)  # fmt: skip
    trainer.train()
    timed = clock.seconds[args.warmup :]
    result = {
        "variant": variant,
        "step_s": statistics.median(timed),
        "steps_s": clock.seconds,
        "peak_gib": (max(clock.peaks) - resident) / GIB,
        "timed_peak_gib": (max(clock.peaks[args.warmup :]) - resident) / GIB,
        "peaks_gib": [(peak - resident) / GIB for peak in clock.peaks],
        "resident_gib": resident / GIB,
    }
    del trainer, model
    torch.cuda.empty_cache()
    return result


def run_in_fresh_process(variant: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """`run_variant` in a new Python process: this script again, one variant, one round, its own output folder."""
    child_out = out / f"process-{len(list(out.glob('process-*')))}"
    options = {key: getattr(args, key) for key in (*SHAPE, "steps", "warmup", "seed")}
    command = [sys.executable, __file__, "--variants", variant, "--rounds", "1", "--out", str(child_out)]
    command += [item for key, value in options.items() for item in (f"--{key.replace('_', '-')}", str(value))]
    subprocess.run(command, check=True)
    return json.loads((child_out / "trainer_variants.jsonl").read_text().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12, help="steps per variant and round")
    ap.add_argument("--warmup", type=int, default=6, help="of them, untimed (a budget profiles, then checks its plan)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["ckpt", "ckpt+hfo"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh-processes", action="store_true", help="each variant of each round in its own process")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = args.variants
    shape = {key: getattr(args, key) for key in SHAPE}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"shape {shape}", flush=True)  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    for round_index in range(args.rounds):
        for variant in variants:
            run = run_in_fresh_process if args.fresh_processes else run_variant
            result = run(variant, args, out)
            result.update(shape=shape, round=round_index, device=torch.cuda.get_device_name())
            results[variant].append(result)
            with open(out / "trainer_variants.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"round {round_index} {variant}: {result['step_s'] * 1000:.1f} ms, peak {result['peak_gib']:.2f} "
                  "GiB", flush=True)  # fmt: skip
    reference = variants[0]
    reference_s = statistics.median(s for r in results[reference] for s in r["steps_s"][args.warmup :])
    print(
        f"\n| variant | step (ms) | vs {reference} | peak above the parameters, any step / timed steps (GiB) |\n"
        "| --- | --- | --- | --- |"
    )
    for variant in variants:
        step_s = statistics.median(s for r in results[variant] for s in r["steps_s"][args.warmup :])
        peak = max(r["peak_gib"] for r in results[variant])
        timed_peak = max(r["timed_peak_gib"] for r in results[variant])
        print(f"| {variant} | {step_s * 1000:.1f} | {step_s / reference_s:.3f}x | {peak:.2f} / {timed_peak:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
