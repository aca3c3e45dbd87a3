"""examples/distributed/ on the CPU: two processes over gloo, the engine in its CPU test mode.

The memory budget across ranks whose batches differ in length in one step (`train_distributed.py --varied-lengths`:
packed batches, sometimes longer on rank 0, sometimes on rank 1, the profiled first step not the longest): every rank
must run rank 0's plan at every step, made for at least the longest of the ranks' steps (the ranks agree on it before
each plan, `hf_offload/memory_budget/ranks.py`), and the losses must be bitwise those of the same run without
offloading. A rank that planned or re-planned alone would wait in the plan's broadcast while the other waits in DDP's
gradient all-reduce, so the runs are bounded by a timeout: a hang fails the test instead of stalling the suite.
"""

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "distributed" / "train_distributed.py"
# The same script, with what torch, accelerate and DeepSpeed lack to shard sequences over CPU processes.
SHARDING_SCRIPT = Path(__file__).resolve().parent / "sequence_sharding_on_cpu.py"
# Small enough for about 10-20 s a run on two CPU cores; 6 steps: 2 profiled, then the plan, made at step 2 for the
# longest step of the ranks so far (that step's on rank 0, the longest of VARIED_EIGHTHS).
MODEL = ["--hidden", "64", "--layers", "4", "--seq-len", "128", "--batch", "2", "--steps", "6"]
# In the CPU test mode the planner counts parameters, gradients and the bytes each layer saves (no peak counter).
# For this model at the profiled step's 176 tokens (checked with fixed lengths of 88 tokens a sample): 3 MiB is
# refused (the lowest plan peaks at 3.16 MiB), 6 MiB plans 'cccc' then 'OOOK', 8 MiB keeps every layer. With
# --varied-lengths, 6 MiB plans for 240 tokens: 'cccc', then 'cccK'.
BUDGET = "6MiB"
RUN_TIMEOUT_S = 90  # a run takes 10-20 s on two cores


# Context parallelism: each step's 2 sequences of 256 tokens, split over the two ranks. At 3.2 MiB the plan
# checkpoints every layer and offloads inputs (`CCCc`), 3.6 MiB keeps the inputs (`cccc`).
CP_MODEL = ["--hidden", "64", "--layers", "4", "--seq-len", "256", "--batch", "2", "--steps", "6", "--cp-size", "2"]
CP_BUDGET = "3.2MiB"


# DeepSpeed's Ulysses: the same model and steps, the sequences split by all-to-alls around attention. DeepSpeed lives in
# a folder of its own, on the path of these launches only: `HF_OFFLOAD_DEEPSPEED=1 bash scripts/setup.sh` (CI does).
# At 3.65 MiB every layer is checkpointed with its input offloaded (`CCCC`).
SP_MODEL = [*CP_MODEL[:-2], "--sp-size", "2"]
SP_BUDGET = "3.65MiB"
DEEPSPEED_SITE = Path(sys.prefix) / "deepspeed-site"


def launch(out: Path, *args: str, script: Path = SCRIPT, model: list[str] = MODEL,
           path: Path | None = None) -> subprocess.Popen:  # fmt: skip
    """`torchrun --standalone --nproc_per_node 2 train_distributed.py` (what `accelerate launch` runs), with `path`
    first on the ranks' module path."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
               "--device-type", "cpu", "--out", str(out), *model, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(process: subprocess.Popen, started: float) -> tuple[int | None, str]:
    """The launch's exit status and output; None as the status when it ran past RUN_TIMEOUT_S after `started` (its
    `time.monotonic()` at launch), and was then ended."""
    try:
        output, _ = process.communicate(timeout=max(1.0, started + RUN_TIMEOUT_S - time.monotonic()))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        # The launcher and its ranks, which this test started; the ranks run in sessions of their own (torchrun's), so
        # they are found as the launcher's children, and they hold the output pipe open until they end.
        launcher = psutil.Process(process.pid)
        for member in [*launcher.children(recursive=True), launcher]:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
        output, _ = process.communicate()
        return None, output


def launched(tmp_path: Path, runs: dict[str, list[str]], model: list[str], path: Path | None = None) -> list:
    """Each of `runs` (name: arguments) launched at once through `SHARDING_SCRIPT`, with `model`; once all have
    ended, each one's rank records, in the order of `runs`. Fails on a run that did not exit with 0."""
    started = time.monotonic()
    processes = {name: launch(tmp_path / f"{name}.json", *args, script=SHARDING_SCRIPT, model=model, path=path)
                 for name, args in runs.items()}  # fmt: skip
    for name, process in processes.items():
        status, output = finish(process, started)
        assert status == 0, f"the run {name!r} {outcome(status)}:\n{output[-3000:]}"
    return [ranks(tmp_path / f"{name}.json") for name in runs]


def outcome(status: int | None) -> str:
    return f"did not finish in {RUN_TIMEOUT_S} s" if status is None else f"exited with {status}"


def ranks(out: Path) -> list[dict]:
    return [json.loads(out.with_name(f"{out.stem}.rank{rank}.json").read_text()) for rank in (0, 1)]


def test_memory_budget_with_varied_lengths_runs_one_plan_on_both_ranks_and_changes_no_loss(tmp_path):
    # Both runs at once: they share nothing but the CPU.
    started = time.monotonic()
    baseline = launch(tmp_path / "off.json", "--no-offload", "--varied-lengths")
    budgeted = launch(tmp_path / "on.json", "--offload", "--memory-budget", BUDGET, "--varied-lengths")
    base_status, base_output = finish(baseline, started)
    status, output = finish(budgeted, started)
    assert base_status == 0, f"the run without offloading {outcome(base_status)}:\n{base_output[-3000:]}"
    assert status == 0, f"the budgeted run {outcome(status)}:\n{output[-3000:]}"

    off, on = ranks(tmp_path / "off.json"), ranks(tmp_path / "on.json")
    tokens = [record["step_tokens"] for record in on]
    assert tokens == [record["step_tokens"] for record in off]
    # The premise: in some steps rank 0 trained on more tokens, in others rank 1, and a later step is longer than the
    # profiled first one.
    assert any(a > b for a, b in zip(*tokens)) and any(a < b for a, b in zip(*tokens))
    assert max(tokens[0][2:]) > tokens[0][0] or max(tokens[1][2:]) > tokens[1][0]

    plans = [record["plans"] for record in on]
    assert plans[0] == plans[1], f"the ranks ran different plans: {plans}"
    assert plans[0][:2] == [None, None]  # the profiled steps
    assert all(plans[0][2:]), plans[0]
    assert set(plans[0][-1]) != {"K"}, f"the budget forced nothing: {plans[0]}"
    plan_tokens = [record["plan_tokens"] for record in on]
    assert plan_tokens[0] == plan_tokens[1], plan_tokens
    for step in range(2, len(tokens[0])):  # each plan fits the longer rank's step (one packed row: tokens = elements)
        assert plan_tokens[0][step] >= max(tokens[0][step], tokens[1][step]), (step, plan_tokens[0], tokens)
    assert on[0]["budget_bytes"] == on[1]["budget_bytes"] == 6 * 2**20

    for record_off, record_on in zip(off, on):
        assert record_on["losses_hex"] == record_off["losses_hex"], f"rank {record_on['rank']}"
        assert record_on["weights_sha256"] == record_off["weights_sha256"]
        assert record_on["problems"] == [] and record_on["param_audit"]["violations"] == 0


def test_under_context_parallelism_offloading_and_a_budget_change_no_loss_and_plan_for_a_ranks_shard(tmp_path):
    """accelerate's context parallelism (`ParallelismConfig(cp_size=2)`, FSDP2, sdpa run as torch's ring attention)
    through the Trainer: each rank trains on its half of every sequence. Offloading, and a memory budget whose plan
    checkpoints and offloads, give every rank its losses and weights of the same run without offloading, bitwise; the
    ranks agree on one plan, made for a rank's shard (256 of each step's 512 tokens). Ring attention saves DTensors,
    which offloading keeps in place (it moves plain tensors): the plans never count them as moved (no `O`, no `X`)."""
    runs = {"off": ["--no-offload"], "on": ["--offload"], "budget": ["--offload", "--memory-budget", CP_BUDGET]}
    off, on, budget = launched(tmp_path, runs, CP_MODEL)

    for rank in (0, 1):
        assert off[rank]["mode"] == "FSDP2" and off[rank]["cp_size"] == 2
        for record in (on[rank], budget[rank]):
            assert record["losses_hex"] == off[rank]["losses_hex"], f"rank {rank}"
            assert record["weights_sha256"] == off[rank]["weights_sha256"], f"rank {rank}"
            assert record["problems"] == [] and record["param_audit"]["violations"] == 0
    assert off[0]["losses_hex"] != off[1]["losses_hex"]  # each rank's loss is its own shard's
    stats = on[0]["offload_stats"]
    assert stats["tensors_offloaded"] > 0 and stats["tensors_kept_unsupported_type"] > 0, stats

    plans = [record["plans"] for record in budget]
    assert plans[0] == plans[1] and plans[0][:2] == [None, None], plans
    assert all(plans[0][2:]) and not set("".join(plans[0][2:])) & set("KOX"), plans[0]
    assert budget[0]["offload_stats"]["tensors_offloaded"] > 0
    assert [record["plan_tokens"][2:] for record in budget] == [[256] * 4] * 2


def test_under_context_parallelism_a_budget_only_tiling_meets_tiles_mlps_on_every_rank(tmp_path):
    """Under a budget below every exact plan (a larger model, whose layers outweigh the head) the planner tiles the
    MLPs, on both ranks alike, and no whole layer (`L`, `l`: the probe leaves it out where ring attention saves
    DTensors, `test_probes.py`); the losses agree with the run without offloading within rounding."""
    model = [*CP_MODEL, "--hidden", "256", "--seq-len", "512"]  # the later of a repeated option wins
    runs = {"off": ["--no-offload"], "tiled": ["--offload", "--memory-budget", "21.5MiB", "--tiling"]}
    off, tiled = launched(tmp_path, runs, model)
    plans = [record["plans"] for record in tiled]
    assert plans[0] == plans[1] and all(plans[0][2:]), plans
    assert set("".join(plans[0][2:])) <= set("CcTt") and set("".join(plans[0][2:])) & set("Tt"), plans[0]
    for rank in (0, 1):
        for a, b in zip(off[rank]["losses"], tiled[rank]["losses"]):
            assert abs(a - b) <= 1e-4 * abs(a), (rank, off[rank]["losses"], tiled[rank]["losses"])


@pytest.mark.skipif(not (DEEPSPEED_SITE / "deepspeed").is_dir(),
                    reason="DeepSpeed is not installed for these tests: HF_OFFLOAD_DEEPSPEED=1 bash scripts/setup.sh "
                    "(CI does)")  # fmt: skip
def test_under_ulysses_offloading_and_a_budget_change_no_loss_and_plan_for_a_ranks_shard(tmp_path):
    """DeepSpeed's Ulysses sequence parallelism through the Trainer (`ParallelismConfig(sp_size=2,
    sp_backend="deepspeed")`, ZeRO-1): each rank trains on its half of every sequence, attention between all-to-alls.
    Offloading, and a budget whose plan checkpoints every layer and offloads its input, give every rank its losses and
    weights of the same run without offloading, bitwise; the ranks agree on one plan, made for a rank's shard."""
    runs = {"off": ["--no-offload"], "on": ["--offload"], "budget": ["--offload", "--memory-budget", SP_BUDGET]}
    off, on, budget = launched(tmp_path, runs, SP_MODEL, path=DEEPSPEED_SITE)
    for rank in (0, 1):
        assert off[rank]["mode"] == "DEEPSPEED" and off[rank]["sp_size"] == 2 and off[rank]["zero_stage"] == 1
        for record in (on[rank], budget[rank]):
            assert record["losses_hex"] == off[rank]["losses_hex"], f"rank {rank}"
            assert record["weights_sha256"] == off[rank]["weights_sha256"], f"rank {rank}"
            assert record["problems"] == [] and record["param_audit"]["violations"] == 0
    assert on[0]["offload_stats"]["tensors_offloaded"] > 0
    plans = [record["plans"] for record in budget]
    assert plans[0] == plans[1] and plans[0][:2] == [None, None] and all(plans[0][2:]), plans
    assert set("".join(plans[0][2:])) & set("COSXT"), f"the budget offloaded nothing: {plans[0]}"
    assert [record["plan_tokens"][2:] for record in budget] == [[256] * 4] * 2
