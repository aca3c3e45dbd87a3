"""Offloading changes no arithmetic: loss, every gradient and the parameters after the optimizer steps are
bitwise equal (torch.equal) with offloading on and off, over two steps (the second uses the learned tail plan
and the reused pinned pool), and every step really offloads bytes."""

from __future__ import annotations

import itertools

import pytest
from _gpu_models import ARCHS, CKPT_MODES, MORE_ARCHS, Case, reference_is_reproducible, run_case

# The full matrix: arch x dtype x checkpointing x full/LoRA x streams, context around the forward only (the
# Trainer.compute_loss path). 5 x 2 x 3 x 2 x 2 = 120 tiny cases.
MATRIX = [
    Case(arch=a, dtype=d, ckpt=c, lora=lora, use_streams=s, span="fwd")
    for a, d, c, lora, s in itertools.product(ARCHS, ("fp32", "bf16"), CKPT_MODES, (False, True), (True, False))
]


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: c.id)
def test_bitwise_matrix(case, device, record):
    record("", run_case(case, device))


# More architectures in a smaller matrix, to stay within the suite's time limit: dtype x checkpointing, full
# fine-tuning with streams, plus LoRA once per arch (bf16, non-reentrant: the usual TRL setup). 5 x 7 = 35 cases.
MORE = [Case(arch=a, dtype=d, ckpt=c) for a, d, c in itertools.product(MORE_ARCHS, ("fp32", "bf16"), CKPT_MODES)]
MORE += [Case(arch=a, dtype="bf16", ckpt="nonreentrant", lora=True) for a in MORE_ARCHS]


@pytest.mark.parametrize("case", MORE, ids=lambda c: c.id)
def test_bitwise_more_archs(case, device, record):
    record("", run_case(case, device))


# The context spanning forward only vs forward+backward (training_step path), every arch and checkpointing
# mode, bf16 full fine-tuning, with and without streams.
SPANS = [
    Case(arch=a, dtype="bf16", ckpt=c, lora=False, use_streams=s, span=sp)
    for a, c, s, sp in itertools.product(ARCHS, CKPT_MODES, (True, False), ("fwd", "fwd_bwd"))
    if sp == "fwd_bwd" or (a in ("llama", "t5") and s)  # "fwd" is the matrix's span; repeat a few here
]


@pytest.mark.parametrize("case", SPANS, ids=lambda c: c.id)
def test_bitwise_context_span(case, device, record):
    record("", run_case(case, device))


# Engine options that change how the moving is scheduled (not what is computed): tiny byte windows force the
# compute stream to wait and backward to reload in many small rounds; no tail; pageable host memory; TRL's
# max_fwd_stash_size.
KiB = 1024
OPTION_CASES = [
    Case(arch=a, dtype="bf16", ckpt=c, options=opts, span=sp)
    for a, c, sp in (("llama", "off", "fwd"), ("llama", "nonreentrant", "fwd_bwd"), ("t5", "reentrant", "fwd"))
    for opts in (
        (("forward_window_bytes", 64 * KiB), ("prefetch_window_bytes", 64 * KiB)),
        (("keep_tail", False),),
        (("use_pin_memory", False),),
        (("max_fwd_stash_size", 2),),
    )
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=lambda c: c.id)
def test_bitwise_engine_options(case, device, record):
    record("", run_case(case, device))


# SDPA attention (what users run) for the decoder-only archs: skipped where the reference itself is not
# reproducible under deterministic algorithms on this device.
SDPA_CASES = [
    Case(arch=a, dtype="bf16", ckpt=c, attn="sdpa") for a in ("llama", "qwen2") for c in ("off", "nonreentrant")
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: c.id)
def test_bitwise_sdpa(case, device, record):
    try:
        ok = reference_is_reproducible(case, device)
    except RuntimeError as e:  # e.g. "... does not have a deterministic implementation"
        if "determinis" in str(e):
            pytest.skip(f"SDPA kernel has no deterministic implementation here: {e}")
        raise
    if not ok:
        pytest.skip("two reference runs with SDPA differ on this device; nothing to compare against")
    record("", run_case(case, device))
