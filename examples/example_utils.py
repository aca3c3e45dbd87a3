"""What the examples share: their command-line options, the dataset, and a tiny model when none is named.

By default every example trains a tiny Llama (random weights, built from a config) with a word-level tokenizer
fitted on the small dataset shipped in `examples/data/`, so that it runs anywhere in seconds without downloads.
`--model_name_or_path` and `--dataset_name` switch to a real model and dataset.
"""

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

try:
    import datasets
except ModuleNotFoundError as error:  # `pip install -e .` installs the library alone
    raise SystemExit(f'{error}: the examples need the "examples" extra: pip install -e ".[examples]"') from error

# Long sequences fragment the CUDA allocator's fixed-size segments (memory freed by one layer is reserved in blocks
# the next cannot use); expandable segments avoid that. CUDA reads the setting when it first allocates, which no
# import does, so setting it here, before any model is built, is in time. A value the user set is kept.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

DEFAULT_DATASET = str(Path(__file__).resolve().parent / "data" / "tiny_sft.jsonl")
TEXT_COLUMN = "text"
_SPECIAL_TOKENS = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>"}


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub id or local path of a causal LM. Default: a tiny random Llama built from a config."},
    )


@dataclass
class DataArguments:
    dataset_name: str = field(
        default=DEFAULT_DATASET,
        metadata={"help": "Hub dataset id, or a local .json/.jsonl file, with a 'text' column."},
    )
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})


def load_text_dataset(data_args: DataArguments) -> datasets.Dataset:
    name = data_args.dataset_name
    if name.endswith((".json", ".jsonl")):
        return datasets.load_dataset("json", data_files=name, split=data_args.dataset_split)
    return datasets.load_dataset(name, split=data_args.dataset_split)


def fit_word_tokenizer(texts: Iterable[str]) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over `texts`: enough for a random tiny model, and built in milliseconds."""
    tokenizer = Tokenizer(models.WordLevel(unk_token=_SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=list(_SPECIAL_TOKENS.values())))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **_SPECIAL_TOKENS)


def tiny_llama(
    tokenizer: transformers.PreTrainedTokenizerBase, hidden_size: int = 64, num_layers: int = 2, max_length: int = 256
) -> transformers.LlamaForCausalLM:
    """A Llama with random weights, by default sized for CPU runs (hidden 64, 2 layers, 4 heads)."""
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_length,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return transformers.LlamaForCausalLM(config)


def load_model_and_tokenizer(
    model_args: ModelArguments, dataset: datasets.Dataset
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """The named model and its tokenizer, or a tiny Llama with a tokenizer fitted on `dataset`."""
    if model_args.model_name_or_path is None:
        tokenizer = fit_word_tokenizer(dataset[TEXT_COLUMN])
        return tiny_llama(tokenizer), tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype="auto")
    return model, tokenizer


def parse_arguments(parser: transformers.HfArgumentParser, argv: list[str] | None) -> tuple:
    """The parsed dataclasses; a value the dataclasses reject exits with the usage and the error (naming the
    argument), as argparse does for a malformed one, instead of a traceback."""
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:
        parser.error(str(error))
