"""TRL's SFTTrainer under `accelerate launch` (DDP), with hf-offload's activation offloading and a memory budget.

A TRL script switches hf-offload on by importing `SFTConfig` from `hf_offload.callbacks.trl` instead of `trl` and
setting `activation_offloading=True`; `activation_offloading_memory_budget` adds the planner. Run it twice, without and
with offloading, and compare (`compare.py`, `check_budget.py`):

    accelerate launch --config_file examples/distributed/ddp.yaml examples/distributed/sft_distributed.py \
        --no-offload --out runs/sft_off.json
    accelerate launch --config_file examples/distributed/ddp.yaml examples/distributed/sft_distributed.py \
        --offload --memory-budget 3GiB --out runs/sft_on.json
    python examples/distributed/compare.py runs/sft_off.json runs/sft_on.json
    python examples/distributed/check_budget.py check runs/sft_on.json

The model is a Llama built from a config (random weights, eager attention, fp32) with a word-level tokenizer fitted
on `examples/data/tiny_sft.jsonl`, as the other examples build theirs: nothing is downloaded. The dataset is that
file's texts, repeated until the steps have enough tokens, packed by TRL (`packing=True`; its default strategy,
best-fit decreasing, is padding-free, so the ranks' rows differ by a few tokens from step to step; `wrapped` makes
every row `--max-length` long). `full_determinism=True` and no checkpointing in either run unless
`--checkpointing` (the budget's plan decides checkpointing itself): the runs differ only by what offloading and the
plan change, which is no arithmetic (tiling stays off). Each rank writes `<out stem>.rank<R>.json` in the format of
train_distributed.py (exact losses, weight hash, plans, peaks, tokens per step). `--device-type cpu` runs in the
engine's CPU test mode on the CPU (gloo).
"""

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The shared pieces of train_distributed.py (this folder), examples/example_utils.py (the tokenizer the examples
# fit) and examples/gloo_exit.py; named explicitly, as run_multi_gpu.sh runs with PYTHONSAFEPATH=1 (no script folder
# on the path).
sys.path[:0] = [str(HERE), str(HERE.parent)]

import datasets  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from example_utils import DEFAULT_DATASET, TEXT_COLUMN, fit_word_tokenizer  # noqa: E402
from gloo_exit import exit_process  # noqa: E402
from train_distributed import StepMemory, offload_stats, rank_file, run_record, weights_hash  # noqa: E402

from hf_offload.callbacks.trl import SFTConfig  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=False,
                        help="activation_offloading=True (hf-offload)")  # fmt: skip
    parser.add_argument("--memory-budget", default=None, help="activation_offloading_memory_budget (with --offload)")
    parser.add_argument("--checkpointing", action="store_true", help="activation_checkpointing=True (non-reentrant)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="sft.json", help="each rank writes <stem>.rank<R>.json next to it")
    parser.add_argument("--device-type", default=None, help="'cpu': the engine's CPU test mode, training on the CPU")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per packed sequence")
    parser.add_argument("--batch", type=int, default=2, help="packed sequences per rank per step")
    parser.add_argument("--packing-strategy", default="bfd", choices=["bfd", "wrapped"])
    cli = parser.parse_args(argv)
    if cli.memory_budget is not None and not cli.offload:
        parser.error("--memory-budget needs --offload")
    return cli


class RecordingSFTTrainer(trl.SFTTrainer):
    """Keeps each step's exact loss on this rank and the tokens it trained on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses: list[float] = []
        self.step_tokens: list[int] = []

    def training_step(self, model, inputs, *args, **kwargs):
        self.step_tokens.append(int(inputs["input_ids"].numel()))
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.step_losses.append(loss.detach().float().item())
        return loss


def text_dataset(tokens_needed: int) -> tuple[datasets.Dataset, list[str]]:
    """The texts of examples/data/tiny_sft.jsonl, repeated to at least `tokens_needed` words, in memory (no cache
    files for the ranks to share), and the texts once."""
    texts = [json.loads(line)[TEXT_COLUMN] for line in Path(DEFAULT_DATASET).read_text().splitlines() if line]
    words = sum(len(text.split()) + 1 for text in texts)  # + the end-of-sequence token
    repeats = -(-tokens_needed // words)
    return datasets.Dataset.from_dict({TEXT_COLUMN: texts * repeats}), texts


def main(argv=None) -> int:
    cli = parse_args(argv)
    transformers.set_seed(cli.seed)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch; the arguments are built later
    # Enough for every rank's steps, with room for the packer's partly filled rows.
    dataset, texts = text_dataset(cli.steps * cli.batch * world_size * cli.max_length * 3 // 2)
    tokenizer = fit_word_tokenizer(texts)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cli.hidden, intermediate_size=2 * cli.hidden,
        num_hidden_layers=cli.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=cli.max_length, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        attn_implementation="eager",  # deterministic; packed rows are masked per sequence from their position_ids
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)

    extra = {}
    if cli.device_type:
        extra["activation_offloading_device_type"] = cli.device_type
    if cli.device_type == "cpu":
        extra["use_cpu"] = True
    if cli.memory_budget is not None:
        extra.update(activation_offloading_memory_budget=cli.memory_budget, activation_offloading_tile_mlp=False,
                     activation_offloading_tile_layer=False)  # fmt: skip
    ckpt = "activation_checkpointing" if hasattr(SFTConfig, "activation_checkpointing") else "gradient_checkpointing"
    args = SFTConfig(
        output_dir=str(Path(cli.out).with_suffix("")) + "_trainer",
        activation_offloading=cli.offload,
        **{ckpt: cli.checkpointing, f"{ckpt}_kwargs": {"use_reentrant": False}},
        **extra,
        max_length=cli.max_length,
        packing=True,
        packing_strategy=cli.packing_strategy,
        max_steps=cli.steps,
        per_device_train_batch_size=cli.batch,
        learning_rate=1e-3,
        optim="adamw_torch",
        bf16=False,
        seed=cli.seed,
        full_determinism=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    trainer = RecordingSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    memory = StepMemory(trainer)
    trainer.add_callback(memory)
    trainer.train()

    stats = offload_stats(trainer)
    sha, numel = weights_hash(trainer.model)
    problems = []
    if len(trainer.step_losses) != cli.steps:
        problems.append(f"recorded {len(trainer.step_losses)} losses for {cli.steps} steps")
    rank = args.process_index
    record = {
        "rank": rank,
        "world_size": args.world_size,
        "mode": "SFT " + str(trainer.accelerator.distributed_type).split(".")[-1],
        "offload": cli.offload,
        "lora": False,
        "checkpointing": cli.checkpointing,
        "device_type": cli.device_type,
        "steps": cli.steps,
        "model": {
            "hidden": cli.hidden,
            "layers": cli.layers,
            "max_length": cli.max_length,
            "batch": cli.batch,
            "vocab": len(tokenizer),
            "packing_strategy": cli.packing_strategy,
        },  # fmt: skip
        **run_record(trainer, memory, cli.memory_budget, args.device.type),
        "weights_sha256": sha,
        "trainable_numel_local": numel,
        "offload_stats": stats,
        "versions": {name: __import__(name).__version__ for name in ("torch", "transformers", "trl", "hf_offload")},
        "problems": problems,
    }
    path = rank_file(cli.out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    losses = trainer.step_losses or [float("nan")]
    peaks = [peak for peak in memory.peaks if peak is not None]
    print(f"[{record['mode']} rank {rank}/{args.world_size}] offload={'on' if cli.offload else 'off'} "
          f"budget={record['budget_bytes']} steps={len(trainer.step_losses)} loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"| tokens {trainer.step_tokens[:4]}... | plan {memory.plans[-1] if memory.plans else None}"
          f"{f' max peak {max(peaks)}' if peaks else ''} | offloaded {(stats or {}).get('tensors_offloaded', 0)} "
          f"tensors | weights {sha[:12]} | {'OK' if not problems else 'FAIL: ' + '; '.join(problems)} -> {path}",
          flush=True)  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    exit_process(main())  # destroys the process group, but a gloo one's rank leaves at once: gloo_exit.py says why
