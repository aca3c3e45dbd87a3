"""benchmarks/long_context.py (the longest sequence each mode trains in one step) on CPU: the prediction's arithmetic
(benchmarks/harness/longest.py) on numbers worked out by hand, then the script end to end in its --tiny mode (a tiny
Llama on a pretend 16 MiB device, hf-offload in its CPU test mode): every mode is profiled, predicted and confirmed, and
the confirmed step's peak is the one predicted; the same for a tiny Qwen3 (--family qwen3-8b: the prediction on a second
8B family). Keeps the GPU benchmark's logic from rotting between GPU runs."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from harness import longest  # noqa: E402

SCRIPT = REPO / "benchmarks" / "long_context.py"
MIB = 2**20
GIB = 2**30
TINY_DEVICE = 16 * MIB  # --tiny's pretend device (--device-gib 1/64)
TINY_LIMIT = TINY_DEVICE - 2 * MIB  # less --margin-gib 1/512


# ------------------------------------------------------------------------------------------- the arithmetic


def test_fits_recover_the_lines_they_were_given():
    assert longest.fit_line([1, 2, 3], [5, 7, 9]) == pytest.approx((3.0, 2.0))
    with pytest.raises(ValueError, match="two distinct"):
        longest.fit_line([4, 4], [1, 2])
    tokens = [8192, 16384]
    seconds = [0.5 + 1e-4 * t + 2e-9 * t * t for t in tokens]
    probed = longest.fit_time(tokens, seconds, c=2e-9)  # c from the attention probe: a and b follow exactly
    assert (probed.a, probed.b, probed.c) == pytest.approx((0.5, 1e-4, 2e-9))
    assert probed(131072) == pytest.approx(0.5 + 13.1072 + 2e-9 * 131072**2)
    free = longest.fit_time([1000, 2000, 4000], [0.5 + 1e-4 * t + 2e-9 * t * t for t in (1000, 2000, 4000)])
    assert (free.a, free.b, free.c) == pytest.approx((0.5, 1e-4, 2e-9), rel=1e-6)
    two = longest.fit_time([1000, 1000, 2000], [1.0, 3.0, 6.0])  # no probe, two lengths: a = 0, means per length
    assert two.a == 0 and two(1000) == pytest.approx(2.0) and two(2000) == pytest.approx(6.0)


def test_attention_terms():
    # 32 layers, forward 0.1 s and backward 0.25 s per call at 65536 tokens; checkpointing runs the forward twice
    c = longest.attention_seconds_per_token2(32, 2, 0.1, 0.25, 65536)
    assert c * 65536**2 == pytest.approx(32 * 0.45)


def test_pinned_blocks_round_up_to_powers_of_two():
    assert [longest.pow2ceil(n) for n in (1, 3, 4, 5, 1000)] == [1, 4, 4, 8, 1024]
    # 32 layer inputs of 8 KiB per token: 1.5 GiB each at 196,608 tokens, pinned in 2 GiB blocks
    assert longest.pinned_pow2_bytes([64 * MIB] * 32, 8192, 196608) == 32 * 2 * 2**30


def test_static_bytes_grow_along_the_plans_made_at_two_lengths():
    assert longest.static_bytes_per_token({8192: 6 * GIB}) == 0.0  # one length: nothing to grow along
    plans = {8192: 6 * GIB + 8192 * 17432, 16384: 6 * GIB + 16384 * 17432}  # the 8B QLoRA run's 17,432 bytes/token
    assert longest.static_bytes_per_token(plans) == 17432
    assert longest.static_bytes_per_token({8192: 6 * GIB, 16384: 6 * GIB - 4096}) == 0.0  # noise never shrinks it


def test_largest_multiple_bisects_to_the_boundary():
    assert longest.largest_multiple(lambda n: n <= 100_000, 8192, 2**20) == 98304
    assert longest.largest_multiple(lambda n: n <= 5, 8192, 2**20) == 0
    assert longest.largest_multiple(lambda n: True, 8192, 50000) == 49152


def test_predictions_name_what_stops_them():
    gib = 2**30
    step, cap = 8192, 2**20
    # GPU memory: 20 GiB + 0.5 MiB per token under 77 GiB -> 116,736 tokens (57 GiB / 0.5 MiB = 116,736)
    gpu = longest.MemoryModel(peak0=20 * gib, peak1=MIB / 2)
    found = longest.predict_longest(gpu, None, 77 * gib, step, cap, 500)
    assert found["longest_tokens"] == 114688 and found["limit"] == longest.LIMIT_GPU
    assert found["predicted_peak_bytes"] == 20 * gib + 114688 * MIB // 2 and "predicted_host_bytes" not in found
    # the same GPU line with 256 KiB per token offloaded into a pool capped at 40 GiB: past 163,840 tokens the rest
    # stays on the GPU, which the prediction counts
    pooled = longest.MemoryModel(peak0=20 * gib, peak1=MIB / 8, offload1=MIB / 4, pool_cap_bytes=40 * gib)
    found = longest.predict_longest(pooled, None, 77 * gib, step, cap, 500)
    assert found["limit"] == longest.LIMIT_POOL_CAP and found["predicted_host_bytes"] == 40 * gib
    n = found["longest_tokens"]
    assert pooled.gpu_bytes(n) <= 77 * gib < pooled.gpu_bytes(n + step) and found["predicted_gpu_excess_bytes"] > 0
    # host RAM: 32 tensors of 64 MiB at 8192 tokens in power-of-two blocks, 100 GiB of room: 2 GiB blocks fit
    # (up to 262,144 tokens), 4 GiB blocks do not
    pinned = longest.MemoryModel(peak0=20 * gib, peak1=MIB / 8, sizes=(64 * MIB,) * 32, sizes_tokens=8192,
                                 host_room_bytes=100 * gib)  # fmt: skip
    found = longest.predict_longest(pinned, None, 77 * gib, step, cap, 500)
    assert (found["longest_tokens"], found["limit"]) == (262144, longest.LIMIT_HOST)
    # time: 1e-8 s per token^2 passes 500 s at 223,607 tokens, before the memory limit
    slow = longest.TimeModel(0.0, 0.0, 1e-8, "test")
    found = longest.predict_longest(gpu, slow, 77 * gib, step, cap, 500)
    assert (found["longest_tokens"], found["by_memory_tokens"], found["limit"]) == (114688, 114688, longest.LIMIT_GPU)
    found = longest.predict_longest(longest.MemoryModel(peak0=gib, peak1=1024), slow, 77 * gib, step, cap, 500)
    assert found["limit"] == longest.LIMIT_TIME and found["longest_tokens"] == 221184
    assert found["by_memory_tokens"] == cap and found["predicted_step_s"] <= 500
    # nothing stops it within the search
    found = longest.predict_longest(longest.MemoryModel(peak0=gib, peak1=1024), None, 77 * gib, step, cap, 500)
    assert (found["longest_tokens"], found["limit"]) == (cap, longest.LIMIT_SEARCH)


# ------------------------------------------------------------------------------------------- the script, on CPU


def _run(out: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--confirm", "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(REPO))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    precision = args[args.index("--precision") + 1] if "--precision" in args else "bf16"
    family = args[args.index("--family") + 1] if "--family" in args else "llama3-8b"
    stem = f"long_context-{precision}" if family == "llama3-8b" else f"long_context-{family}-{precision}"
    return json.loads((out / f"{stem}.json").read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context")
    return out, _run(out)


def _phases(record: dict) -> list[tuple[str, int]]:
    return [(step["phase"], step["tokens"]) for step in record["steps"]]


def test_every_mode_is_run_or_skipped_for_a_reason(tiny):
    _, results = tiny
    assert results["finished"] and results["order"] == ["ckpt", "ckpt+hfo", "ckpt+trl", "ckpt+native", "plan@auto"]
    status = {mode: record["status"] for mode, record in results["modes"].items()}
    assert status == {"ckpt": "ok", "ckpt+hfo": "ok", "ckpt+trl": "skipped", "ckpt+native": "skipped",
                      "plan@auto": "ok"}  # fmt: skip
    for mode in ("ckpt+trl", "ckpt+native"):  # both pin host memory for an accelerator
        assert "accelerator" in results["modes"][mode]["notes"][0]
    env = results["environment"]
    assert env["device_total_bytes"] == TINY_DEVICE and env["gpu_limit_bytes"] == TINY_LIMIT
    assert results["settings"]["alloc_conf"] == os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


@pytest.mark.parametrize("mode", ["ckpt", "ckpt+hfo"])
def test_fitted_modes_predict_the_peak_that_their_confirmation_measures(tiny, mode):
    _, results = tiny
    record = results["modes"][mode]
    prediction, confirm = record["prediction"], record["confirm"]
    longest_tokens = prediction["longest_tokens"]
    assert _phases(record) == [("warmup", 64), ("profile", 64), ("warmup", 128), ("profile", 128),
                               ("confirm", longest_tokens)]  # fmt: skip
    profiled = [s for s in record["steps"] if s["phase"] == "profile"]
    assert all(s["ok"] and s["s"] > 0 and s["rss_bytes"] > 0 for s in profiled)
    host_total = results["environment"]["host_total_bytes"]
    assert all(0 < s["host_available_min_bytes"] <= host_total for s in record["steps"])  # sampled during each step
    assert profiled[1]["peak_bytes"] > profiled[0]["peak_bytes"] > record["setup"]["static_bytes"] > 0
    if mode == "ckpt+hfo":
        assert all(s["bytes_offloaded"] > 0 and s["pinned_bytes"] > 0 for s in profiled)
        assert prediction["memory_model"]["pool_cap_bytes"] > 0 and "predicted_host_bytes" in prediction
    # the longest length is the line through the two profiled peaks, cut at the pretend device less the margin
    (t1, p1), (t2, p2) = ((s["tokens"], s["peak_bytes"]) for s in profiled)
    slope = (p2 - p1) / (t2 - t1)
    assert 128 < longest_tokens < results["settings"]["max_tokens"] and longest_tokens % 64 == 0
    assert p1 + slope * (longest_tokens - t1) <= TINY_LIMIT < p1 + slope * (longest_tokens + 64 - t1)
    assert prediction["limit"] == longest.LIMIT_GPU and str(longest_tokens + 64) in prediction["limit_detail"]
    # the time model goes through the profiled steps, with its quadratic term from the attention probe
    model = longest.TimeModel(prediction["time_model"]["a_s"], prediction["time_model"]["b_s_per_token"],
                              prediction["time_model"]["c_s_per_token2"], "")  # fmt: skip
    assert [model(s["tokens"]) for s in profiled] == pytest.approx([s["s"] for s in profiled])
    probe = record["attention_probe"]
    assert probe["tokens"] == 512 and probe["forward_s"] > 0 and probe["backward_s"] > 0
    assert model.c == pytest.approx(2 * (2 * probe["forward_s"] + probe["backward_s"]) / 512**2)
    assert prediction["predicted_step_s"] == pytest.approx(model(longest_tokens))
    # the confirmation ran at that length and its peak is the predicted one, within the device
    assert confirm["ok"] and confirm["tokens"] == longest_tokens and confirm["tokens_per_s"] > 0
    assert confirm["peak_bytes"] <= TINY_DEVICE
    assert confirm["peak_bytes"] == pytest.approx(prediction["predicted_peak_bytes"], rel=0.03)


def test_plan_auto_predicts_with_the_library_planner(tiny):
    _, results = tiny
    record = results["modes"]["plan@auto"]
    # the library's two profiling steps at the shortest length, then a warm-up and a measured step per length
    assert _phases(record)[:6] == [("library-profile", 64), ("library-profile", 64), ("warmup", 64),
                                   ("profile", 64), ("warmup", 128), ("profile", 128)]  # fmt: skip
    profiled = [s for s in record["steps"] if s["phase"] == "profile"]
    assert all(s["plan"] and s["plan_tokens"] == s["tokens"] for s in profiled)  # a plan in force, re-planned at 128
    prediction = record["prediction"]
    assert prediction["budget_bytes"] == TINY_LIMIT and prediction["profile_tokens"] == 128
    assert prediction["longest_tokens"] > 128 and prediction["longest_tokens"] % 64 == 0
    assert len(prediction["plan_code"]) == 2 and set(prediction["plan_code"]) <= set("KOSsXCcTt")
    assert prediction["predicted_peak_bytes"] <= prediction["budget_bytes"] - prediction["margin_bytes"]
    assert prediction["plan_table"].startswith(f"Memory plan for {prediction['longest_tokens']} tokens")
    # one length longer, the planner says why no plan fits
    assert (
        prediction["limit"] in (longest.LIMIT_GPU, longest.LIMIT_POOL_CAP)
        and "below the smallest peak" in (prediction["limit_detail"])
    )
    # the planner's own step time: its profile times attention apart and scales it with the square of the tokens
    assert prediction["predicted_step_s"] == prediction["planner_step_s"]
    assert all(layer["attention_forward_s"] > 0 for layer in prediction["profile"]["layers"])
    # the confirmation ran: the library re-planned for its length, or said why no plan fits before anything ran
    confirm = record["confirm"]
    assert confirm["tokens"] == prediction["longest_tokens"] and "ok" in confirm
    assert confirm.get("plan") or confirm["error_kind"] == "no plan"


def test_markdown_and_log_are_written(tiny):
    out, results = tiny
    markdown = (out / "long_context-bf16.md").read_text()
    for mode in results["order"]:
        assert f"| `{mode}` | {results['modes'][mode]['status']} |" in markdown
    assert "| reserved GiB | host avail. min GiB |" in markdown
    least_host = r"^Host memory available during the steps .*, at its least: [\d.]+ GiB, in `[^`]+`'s "
    assert re.search(least_host, markdown, re.M)
    assert "## How each prediction was made" in markdown and "attention probe" in markdown
    log = (out / "long_context-bf16.log").read_text()
    # timestamped progress, with the least host memory available during the step
    progress = r"^\[\d\d:\d\d:\d\d\] ckpt: confirm step, [\d,]+ tokens: .*, host available at least "
    assert re.search(progress, log, re.M)


@pytest.mark.parametrize("family", ["llama3-8b", "qwen3-8b"])
def test_qlora_quantizes_the_decoder_and_wraps_it_in_4bit_lora(tmp_path, family):
    pytest.importorskip("bitsandbytes")
    results = _run(tmp_path, "--precision", "qlora", "--modes", "ckpt+hfo", "--family", family)
    record = results["modes"]["ckpt+hfo"]
    assert record["status"] == "ok", record.get("error")
    quantization = record["setup"]["quantization"]
    # q, k, v, o, gate, up, down (Qwen3's q/k norms are not linear layers)
    assert quantization["linears"] == 2 * 7 and quantization["quant_type"] == "nf4"
    assert quantization["compute_dtype"] == "bfloat16" and record["setup"]["lora_4bit_layers"] == 2 * 7
    assert record["confirm"]["ok"] and record["confirm"]["tokens"] == record["prediction"]["longest_tokens"] > 128
    assert record["confirm"]["peak_bytes"] <= TINY_DEVICE


def test_a_failed_step_records_the_frames_it_was_raised_in():
    """A confirmation step that runs out of memory after 15 minutes cannot be re-run to find out where it did."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("long_context_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def backward_of_a_layer():
        raise MemoryError("out of memory")

    def step():
        backward_of_a_layer()

    try:
        step()
    except MemoryError as error:
        where = script._innermost_frames(error, frames=2)
    assert [frame.split()[1] for frame in where] == ["step", "backward_of_a_layer"]
    assert where[0].startswith("test_long_context_bench.py:")


def test_qwen3_family_builds_a_qwen3_and_predicts(tmp_path):
    """The prediction on a second 8B family: the tiny shape of Qwen3's class, through the planner's mode (its
    confirmation short: at the predicted length it takes as long as the rest of the run on CPU)."""
    results = _run(tmp_path, "--family", "qwen3-8b", "--modes", "plan@auto", "--confirm-tokens", "192")
    settings = results["settings"]
    assert (settings["family"], settings["model_family"]) == ("qwen3-8b", "qwen3")
    assert settings["rope_parameters"]["rope_theta"] == 1e6 and settings["shape"].startswith("tiny: Qwen3 layers")
    record = results["modes"]["plan@auto"]
    assert record["status"] == "ok", record.get("error")
    assert record["setup"]["model_class"] == "Qwen3ForCausalLM"
    assert record["attention_probe"]["forward_s"] > 0
    prediction = record["prediction"]
    assert prediction["longest_tokens"] > 128 and prediction["plan_code"]
    assert record["confirm"]["ok"] and record["confirm"]["tokens"] == 192 and record["confirm"]["plan"]
    host_total = results["environment"]["host_total_bytes"]
    assert all(0 < step["host_available_min_bytes"] <= host_total for step in record["steps"])
    assert "(qwen3-8b, bf16" in (tmp_path / "long_context-qwen3-8b-bf16.md").read_text()  # the report's title


# ------------------------------------------------------------------------------------------- the harness


def test_the_harness_builds_each_family_and_refuses_others():
    import dataclasses

    import torch
    from harness.model import apply_liger, build_model
    from harness.scenarios import SCENARIOS

    cpu = torch.device("cpu")
    tiny = SCENARIOS["tiny"]
    assert tiny.family == "llama"  # run.py's and the zoo's scenarios build what they built
    for family, model_class in (("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
        model = build_model(dataclasses.replace(tiny, family=family), 0, cpu)
        assert type(model).__name__ == model_class and model.config.head_dim == tiny.hidden // tiny.heads
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (tiny.hidden // tiny.heads,)
    assert "qwen3 model class" in dataclasses.replace(tiny, family="qwen3").describe()
    # The zoo's other families, with the fields of their config that the scenario adds.
    moe = dataclasses.replace(tiny, family="qwen3_moe", config=(("num_experts", 4), ("num_experts_per_tok", 2),
                                                                ("output_router_logits", True)))  # fmt: skip
    model = build_model(moe, 0, cpu)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 4
    assert "num_experts=4" in moe.describe()
    input_ids = torch.randint(0, tiny.vocab, (1, 16))
    out = model(input_ids=input_ids, labels=input_ids)
    assert out.aux_loss is not None and out.loss.requires_grad  # the router's loss is part of the step's
    gemma = dataclasses.replace(tiny, family="gemma3_text", config=(("sliding_window", 8),))
    model = build_model(gemma, 0, cpu)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.sliding_window == 8
    notes: list[str] = []
    assert apply_liger(cpu, notes, "qwen3") is False and "needs an accelerator" in notes[0]
    with pytest.raises(ValueError, match="'gemma': the harness builds llama, qwen3, qwen3_moe, gemma3_text"):
        build_model(dataclasses.replace(tiny, family="gemma"), 0, cpu)
    with pytest.raises(ValueError, match="'gemma'"):
        apply_liger(cpu, [], "gemma")


def test_host_available_min_is_the_least_read_while_entered(monkeypatch):
    """A dip between the readings on entry and on exit is what a reading after the step misses."""
    from harness import measure

    readings = itertools.chain([100, 10], itertools.repeat(100))
    with measure.HostAvailableMin(interval_s=0.01, read=lambda: next(readings)) as host:
        assert host.min_bytes == 100  # read on entry
        deadline = time.monotonic() + 10
        while host.min_bytes != 10 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert host.min_bytes == 10 and host._thread is None  # the thread's reading, kept past the one on exit
    monkeypatch.setattr(measure.HostAvailableMin, "MEMINFO", Path("/nonexistent/meminfo"))
    with measure.HostAvailableMin(interval_s=0.01) as host:
        pass
    assert host.min_bytes is None
