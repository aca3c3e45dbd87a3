"""LoRA fine-tuning with TRL's `SFTTrainer`, with activation offloading from the command line.

A TRL script changes only the import of `SFTConfig` (from `hf_offload.callbacks.trl` instead of `trl`); then
`--activation_offloading` selects hf-offload's offloader instead of TRL's.

    python examples/trl_sft_lora.py --output_dir runs/trl-sft --max_steps 20 --activation_offloading

Without `--model_name_or_path` / `--dataset_name` it trains a tiny random Llama on `examples/data/tiny_sft.jsonl`.
SFTConfig's defaults apply (activation checkpointing on, bf16; fp32 on a machine without an accelerator):
offloading then moves the checkpointed layers' inputs.
"""

import sys
from dataclasses import dataclass, field

import peft
import torch
import transformers
import trl
from example_utils import DataArguments, ModelArguments, load_model_and_tokenizer, load_text_dataset, parse_arguments
from gloo_exit import exit_process

from hf_offload.callbacks.trl import SFTConfig


@dataclass
class LoraArguments:
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "Modules to adapt (peft syntax)."})


def main(argv: list[str] | None = None) -> trl.SFTTrainer:
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, LoraArguments, SFTConfig))
    if not torch.accelerator.is_available():
        parser.set_defaults(bf16=False)  # SFTConfig defaults to bf16, which transformers refuses without a GPU
    model_args, data_args, lora_args, training_args = parse_arguments(parser, argv)
    transformers.set_seed(training_args.seed)

    dataset = load_text_dataset(data_args)
    model, tokenizer = load_model_and_tokenizer(model_args, dataset)
    trainer = trl.SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(
            r=lora_args.lora_r,
            lora_alpha=lora_args.lora_alpha,
            lora_dropout=lora_args.lora_dropout,
            target_modules=lora_args.lora_target_modules,
            task_type="CAUSAL_LM",
        ),
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_process()  # a gloo rank without the interpreter's shutdown: gloo_exit.py says why
