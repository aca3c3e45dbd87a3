"""Activation offloading in a hand-written training loop: the context used directly, no Trainer.

Only the forward pass runs under the context; backward brings the tensors back whenever it runs.

    python examples/custom_loop.py --max_steps 20 --activation_offloading

The `--activation_offloading*` options are the same as the Trainer's (`ActivationOffloadingArguments`). Without
`--model_name_or_path` / `--dataset_name` it trains a tiny random Llama on `examples/data/tiny_sft.jsonl`.
"""

import contextlib
import sys
from dataclasses import dataclass, field

import torch
import transformers
from example_utils import (
    TEXT_COLUMN,
    DataArguments,
    ModelArguments,
    load_model_and_tokenizer,
    load_text_dataset,
    parse_arguments,
)

from hf_offload import ActivationOffloadingArguments, format_summary, get_act_offloading_ctx_manager


@dataclass
class LoopArguments:
    max_steps: int = field(default=20, metadata={"help": "Optimizer steps."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per step."})
    max_length: int = field(default=64, metadata={"help": "Truncate the examples to this many tokens."})
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate."})
    seed: int = field(default=42, metadata={"help": "Seed for the model's initialisation and the data order."})


def main(argv: list[str] | None = None) -> list[float]:
    """Trains and returns the loss of every step."""
    parser = transformers.HfArgumentParser(
        (ModelArguments, DataArguments, LoopArguments, ActivationOffloadingArguments)
    )
    model_args, data_args, loop_args, offload_args = parse_arguments(parser, argv)
    transformers.set_seed(loop_args.seed)

    dataset = load_text_dataset(data_args)
    model, tokenizer = load_model_and_tokenizer(model_args, dataset)
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    model.to(device).train()
    features = dataset.map(
        lambda batch: tokenizer(batch[TEXT_COLUMN], truncation=True, max_length=loop_args.max_length),
        batched=True,
        remove_columns=dataset.column_names,
    )
    loader = torch.utils.data.DataLoader(
        features,
        batch_size=loop_args.batch_size,
        shuffle=True,
        collate_fn=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=loop_args.learning_rate)

    offloading = (
        get_act_offloading_ctx_manager(model, options=offload_args.offload_options())
        if offload_args.activation_offloading
        else contextlib.nullcontext()
    )
    losses: list[float] = []
    batches = iter(loader)
    for step in range(loop_args.max_steps):
        batch = next(batches, None)
        if batch is None:  # a new epoch
            batches = iter(loader)
            batch = next(batches)
        batch = {key: value.to(device) for key, value in batch.items()}
        with offloading:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {step + 1}: loss {losses[-1]:.4f}")

    if offload_args.activation_offloading:
        if offloading.active:
            print(format_summary(offloading.consume_stats(), offloading.device_type, offloading.peak_report))
        offloading.remove_hooks()  # the exemption hooks on the output head
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
