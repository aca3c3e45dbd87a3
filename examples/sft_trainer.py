"""Supervised fine-tuning with the plain `transformers.Trainer`, with activation offloading from the command line.

The only hf-offload-specific line is the import of `TrainingArguments`; `--activation_offloading` does the rest.

    python examples/sft_trainer.py --output_dir runs/sft --max_steps 20 --activation_offloading

Without `--model_name_or_path` / `--dataset_name` it trains a tiny random Llama on `examples/data/tiny_sft.jsonl`.
On a machine without an accelerator it still runs, and says once that offloading is inactive.
"""

import sys
from dataclasses import dataclass, field

import transformers
from example_utils import (
    TEXT_COLUMN,
    DataArguments,
    ModelArguments,
    load_model_and_tokenizer,
    load_text_dataset,
    parse_arguments,
)
from gloo_exit import exit_process

from hf_offload import TrainingArguments


@dataclass
class TokenizationArguments:
    max_length: int = field(default=64, metadata={"help": "Truncate the examples to this many tokens."})


def main(argv: list[str] | None = None) -> transformers.Trainer:
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TokenizationArguments, TrainingArguments))
    model_args, data_args, tokenization_args, training_args = parse_arguments(parser, argv)
    transformers.set_seed(training_args.seed)

    dataset = load_text_dataset(data_args)
    model, tokenizer = load_model_and_tokenizer(model_args, dataset)
    train_dataset = dataset.map(
        lambda batch: tokenizer(batch[TEXT_COLUMN], truncation=True, max_length=tokenization_args.max_length),
        batched=True,
        remove_columns=dataset.column_names,
    )
    trainer = transformers.Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_process()  # a gloo rank without the interpreter's shutdown: gloo_exit.py says why
