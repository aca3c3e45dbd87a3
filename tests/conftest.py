"""Fixtures shared by the test files: the tiny model's data and tokenizer (see `helpers`), built once per module.

`helpers` is imported by the fixtures, not here: test files that need no model (the engine's) do not pay for
importing transformers and datasets.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

# The examples are imported by test files as modules (`import custom_loop`); `helpers` adds their folder too, but
# a test file's imports are sorted, and an example may come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

# The models here are tiny, so one thread computes them fastest; on a machine shared with other jobs, threads that
# wait for each other at every small operation made the TRL tests up to 20x slower.
torch.set_num_threads(1)

# Test runs are not usage: TRL's trainers would report each one built. Set before anything imports huggingface_hub,
# which reads it then.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="module")
def text_dataset():
    import helpers

    return helpers.load_text_dataset()


@pytest.fixture(scope="module")
def tokenizer(text_dataset):
    import helpers

    return helpers.fit_tokenizer(text_dataset)


@pytest.fixture(scope="module")
def lm_dataset(text_dataset, tokenizer):
    import helpers

    return helpers.tokenize_for_lm(text_dataset, tokenizer)
