"""Every architecture of the GPU bitwise suite, on CPU bookkeeping: loss, gradients and weights after two AdamW
steps are bitwise equal with offloading on and off, every step offloads bytes, and every unpacked tensor has the
geometry it was packed with.

The case body is the GPU suite's own (`tests/gpu/_gpu_models.run_case`), run with the engine's CPU test mode
(device_type="cpu"), so CI covers each architecture's pack/unpack paths, head detection and checkpointing modes.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from _gpu_models import (  # noqa: E402
    ARCHS,
    CKPT_MODES,
    HYBRIDS,
    MOES,
    MORE_ARCHS,
    VLMS,
    Case,
    build_model,
    run_case,
    run_reload_case,
)
from stand_in_streams import use_stand_in_streams  # noqa: E402

from hf_offload.model import find_output_head  # noqa: E402

transformers.logging.set_verbosity_error()

# Every checkpointing mode in fp32, and LoRA in bf16 (Case's default dtype): 10 x 4 cases, about 20 s. The dtype
# matters less here than on a GPU, where bf16 and fp32 take different kernels; the GPU suite runs both.
CASES = [Case(arch=a, dtype="fp32", ckpt=c) for a, c in itertools.product(ARCHS + MORE_ARCHS, CKPT_MODES)]
CASES += [Case(arch=a, lora=True, ckpt="nonreentrant") for a in ARCHS + MORE_ARCHS]
SMALL = dict(
    hidden=32, layers=2, vocab=128, seq=24
)  # the reload cases: every family, two layers (Qwen3-Next pairs them)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bitwise_on_cpu_bookkeeping(case):
    run_case(case, device="cpu", device_type="cpu")


# The head the tail region starts from (kept on the device: backward needs it first), then the final norm if one
# is found; tests/test_model.py checks the older archs.
HEADS = {
    "mistral": ["lm_head", "model.norm"],
    "gemma2": ["lm_head", "model.norm"],
    "phi": ["lm_head", "model.final_layernorm"],
    "bert": ["classifier"],  # post-norm encoder: no final norm
    "vit": ["classifier", "vit.layernorm"],
}


@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_tail_found(arch):
    assert [name for name, _ in find_output_head(build_model(arch, device="cpu"))] == HEADS[arch]


@pytest.mark.parametrize("arch", ARCHS + MORE_ARCHS + VLMS + MOES + HYBRIDS)
def test_from_the_second_step_every_reload_is_started_ahead(arch):
    """With checkpointing, what backward unpacks is reloaded ahead of need: from the head's or an attention's
    prefetch point; together with the copies an earlier step unpacked for the same autograd node (a block's several
    inputs: T5's masks and position bias, BART's encoder states); and, where no point serves a copy (a block without
    attention, the embeddings' tensors after the last block), from the unpack before it, once a step has missed it.
    So from the second step on no reload waits on demand, on any family, and training stays exact. On stand-in
    streams (the CPU has none: `stand_in_streams`)."""
    run_reload_case(arch, device="cpu", size=SMALL, prepare=use_stand_in_streams, device_type="cpu")
