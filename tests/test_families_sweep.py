"""scripts/families_sweep.py (every causal-LM family of the installed transformers trained with hf-offload): the tool
run as a command on three families, which pass; then, in this process (its workers are forked from it, so that they
see what a test patches), a made-up defect of the library in each form the sweep must catch, an exception, a
gradient that differs without one, a hang and a crash, each a FAIL and a non-zero exit status, with the other
families still checked; and a family that does not build, or that does not train without hf-offload, which is not the
library's failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import families_sweep  # noqa: E402


def test_the_command_passes_three_families_and_writes_what_it_checked(tmp_path):
    """A dense decoder, a hybrid of linear and full attention (its plan once applied mid-forward raised a
    CheckpointError) and a mixture of experts that cannot checkpoint (its router once broke under a tiled MLP)."""
    out = tmp_path / "sweep.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "families_sweep.py"), "--families",
                           "llama,qwen3_5,jetmoe", "--jobs", "2", "--timeout", "50", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 60
    results = {result["family"]: result for result in json.loads(out.read_text())["families"]}
    assert list(results) == ["llama", "qwen3_5", "jetmoe"]
    for family, result in results.items():
        assert result["status"] == "pass" and result["failures"] == [], (family, result)
        assert result["built"] is True and result["baseline"] == "ok"
        assert result["bitwise"]["ok"] is True and result["bitwise"]["bytes_offloaded"] > 0
        for name in families_sweep.CASES:
            case = result["cases"][name]
            assert case["ok"] is True and case["plan"], (family, name, case)
            assert len(case["grad_diff_per_step"]) == (families_sweep.COLD_STEPS if name == "cold" else
                                                       families_sweep.STEPS)  # fmt: skip
        # The minimum is what the refusal named, below the halfway budget, below the roomy one.
        cases = result["cases"]
        assert cases["minimum"]["budget"] < cases["halfway"]["budget"] < cases["roomy"]["budget"]
    assert results["qwen3_5"]["layers"] == 4  # three linear-attention layers, then a full one
    assert results["jetmoe"]["bitwise"]["checkpointing"] is False  # JetMoE cannot checkpoint: offloading alone
    table = done.stdout.splitlines()
    assert table[0].startswith("| family | status |") and len([row for row in table if row.startswith("| ")]) == 5
    assert "3 families" in done.stdout and "3 pass, 0 FAIL" in done.stdout


def _sweep(tmp_path, families: str, timeout: float = 60) -> tuple[int, dict[str, dict]]:
    out = tmp_path / "sweep.json"
    status = families_sweep.main(["--families", families, "--jobs", "1", "--timeout", str(timeout),
                                  "--out", str(out)])  # fmt: skip
    return status, {result["family"]: result for result in json.loads(out.read_text())["families"]}


def _defect(monkeypatch, defect) -> None:
    """`defect(context, model)` runs as each context of the library is built, in the workers."""
    original = families_sweep.get_act_offloading_ctx_manager

    def built(model, **options):
        context = original(model, **options)
        defect(context, model)
        return context

    monkeypatch.setattr(families_sweep, "get_act_offloading_ctx_manager", built)


def test_an_exception_of_the_library_fails_the_family_and_the_sweep(tmp_path, monkeypatch):
    def defect(context, model):
        raise RuntimeError("a made-up defect")

    _defect(monkeypatch, defect)
    status, results = _sweep(tmp_path, "llama")
    assert status == 1
    result = results["llama"]
    assert result["status"] == "FAIL" and result["baseline"] == "ok"
    assert result["bitwise"] == {"ok": False, "error": "RuntimeError: a made-up defect",
                                 "traceback": result["bitwise"]["traceback"]}  # fmt: skip
    assert "a made-up defect" in result["bitwise"]["traceback"]
    assert all("a made-up defect" in result["cases"][name]["error"] for name in ("roomy", "minimum", "cold"))
    assert len(result["failures"]) == 4  # bitwise, roomy, minimum, cold (halfway has no budget without them)


def test_a_gradient_that_differs_without_an_exception_fails_the_family(tmp_path, monkeypatch):
    """A context whose region scales the logits by 1 + 1/64: every step trains, and none comes out as without it."""

    def defect(context, model):
        entered = []
        base = type(context)

        class Perturbing(base):
            def __enter__(self):
                entered.append(True)
                return base.__enter__(self)

            def __exit__(self, *exc):
                entered.clear()
                return base.__exit__(self, *exc)

        context.__class__ = Perturbing
        model.lm_head.register_forward_hook(lambda module, args, output: output * (1 + 2**-6) if entered else None)

    _defect(monkeypatch, defect)
    status, results = _sweep(tmp_path, "llama")
    assert status == 1
    result = results["llama"]
    assert result["status"] == "FAIL"
    assert result["bitwise"]["ok"] is False and result["bitwise"]["error"].startswith("not bitwise: step 1: ")
    # Under the budget, every step differs: those that tiled no layer bitwise, the tiled ones by more than tiling does.
    for name in families_sweep.CASES:
        assert result["cases"][name]["ok"] is False, name
    assert "not bitwise at step 1, which tiled no layer" in result["cases"]["roomy"]["error"]


def test_offloading_that_moves_nothing_fails_the_family(tmp_path, monkeypatch):
    """Equal, trivially, and nothing saved: as for NanoChat in transformers 5.25, whose final norm, which it also runs
    before its first layer, starts the tail that stays on the device at the step's start."""
    original = families_sweep.get_act_offloading_ctx_manager

    def nothing_moves(model, **options):
        return original(model, **options, **({} if "memory_budget" in options else {"min_offload_size": 2**40}))

    monkeypatch.setattr(families_sweep, "get_act_offloading_ctx_manager", nothing_moves)
    status, results = _sweep(tmp_path, "llama")
    assert status == 1
    bitwise = results["llama"]["bitwise"]
    assert bitwise["ok"] is False and bitwise["bytes_offloaded"] == 0
    assert bitwise["error"].startswith("offloading moved no bytes; the last step kept too_small ")
    assert results["llama"]["failures"] == [f"bitwise: {bitwise['error']}"]


def test_a_hang_or_a_crash_fails_its_family_and_the_sweep_goes_on(tmp_path, monkeypatch):
    def defect(context, model):
        if type(model).__name__ == "LlamaForCausalLM":
            time.sleep(3600)  # a hang
        if type(model).__name__ == "MistralForCausalLM":
            os.kill(os.getpid(), 9)  # a crash

    _defect(monkeypatch, defect)
    status, results = _sweep(tmp_path, "llama,mistral", timeout=8)
    assert status == 1
    assert results["llama"]["status"] == "FAIL" and results["llama"]["phase"] == "bitwise"
    assert results["llama"]["failures"] == ["bitwise: timed out after 8 s"]
    assert results["mistral"]["status"] == "FAIL"
    assert results["mistral"]["failures"] == ["bitwise: the worker crashed (signal 9)"]


def test_a_family_that_does_not_build_or_train_without_the_library_is_not_its_failure(tmp_path, monkeypatch):
    tiny_config, batches = families_sweep.tiny_config, families_sweep.batches

    def config(family):
        if family == "mistral":
            raise ValueError("a made-up config that does not build")
        return tiny_config(family)

    def inputs(config, seq, steps):  # token ids past the vocabulary: the embedding fails, with or without hf-offload
        out = batches(config, seq, steps)
        return [{**batch, "input_ids": batch["input_ids"] + 10**6} for batch in out] if config.model_type == "qwen2" \
            else out  # fmt: skip

    monkeypatch.setattr(families_sweep, "tiny_config", config)
    monkeypatch.setattr(families_sweep, "batches", inputs)
    status, results = _sweep(tmp_path, "mistral,qwen2")
    assert status == 0
    assert results["mistral"]["status"] == "no-config"
    assert results["mistral"]["built"] == "ValueError: a made-up config that does not build"
    assert results["qwen2"]["status"] == "transformers-fails" and results["qwen2"]["built"] is True
    assert results["qwen2"]["baseline"].startswith("IndexError")


def test_the_tiny_configs_shrink_every_kind_of_field():
    """Sizes, layers to hold every kind of layer (Qwen3.5: three linear-attention layers, then full attention), token
    ids inside the vocabulary, no dropout, the router's logits on; the tests' own configs where they have one."""
    config = families_sweep.tiny_config("qwen3_5_text")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 4, 256)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert all(0 <= token < 256 for token in families_sweep.special_token_ids(config))
    moe = families_sweep.tiny_config("qwen2_moe")
    assert moe.num_experts == 4 and moe.num_experts_per_tok == 2 and moe.output_router_logits is True
    gpt2 = families_sweep.tiny_config("gpt2")
    assert gpt2.n_embd == 64 and gpt2.resid_pdrop == gpt2.embd_pdrop == gpt2.attn_pdrop == 0.0
    bert = families_sweep.tiny_config("bert")
    assert bert.is_decoder is True and bert.hidden_dropout_prob == 0.0
    with pytest.raises(SystemExit):
        families_sweep.parse_args(["--families", "no_such_family"])
