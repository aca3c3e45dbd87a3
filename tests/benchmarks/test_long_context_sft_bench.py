"""benchmarks/long_context_sft.py (long context through TRL's SFTTrainer, the first step at full length) on CPU in its
--tiny mode: a tiny Llama, hf-offload's CPU test mode under a budget in bytes. Every step is recorded with the plan its
layers ran and the host memory left; keeps the GPU benchmark's logic from rotting between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "long_context_sft.py"


def test_the_tiny_run_records_every_step_at_full_length(tmp_path):
    command = [sys.executable, str(SCRIPT), "--tiny", "--steps", "3", "--tag", "smoke", "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads((tmp_path / "long_context_sft-smoke.json").read_text())
    steps = result["steps"]
    assert [step["step"] for step in steps] == [1, 2, 3]
    # Packed to max_length: the first step is as long as the others; the profiled steps offloaded the layers' inputs.
    assert all(len(step["layers_ran"]) == 2 for step in steps) and all(step["offloaded_gib"] > 0 for step in steps[:2])
    assert all(step["kept_over_host_cap"] == 0 and step["least_host_available_gib"] > 0 for step in steps)
    readings = [result["host_available_gib_at_start"]] + [step["host_available_gib_now"] for step in steps]
    assert all(reading.keys() == {"psutil", "hf_offload"} and min(reading.values()) > 0 for reading in readings)
    assert "Memory plan for" in result["plan_table"]  # the third step ran the first plan
    assert "SFTTrainer built" in run.stdout and "first step of 512 tokens" in run.stdout


def test_a_capped_pool_spills_to_the_disk_tier_and_a_family_of_its_own_runs(tmp_path):
    """The small-host run (`--max-pinned-gib`, `--disk-offload-dir`) on Qwen3's model class: the profiled steps'
    inputs the pool has no room for go to the disk and are counted per step; no input stays for want of room."""
    disk = tmp_path / "disk"
    disk.mkdir()
    command = [sys.executable, str(SCRIPT), "--tiny", "--family", "qwen3", "--steps", "2", "--max-pinned-gib",
               str(64 / 2**20), "--disk-offload-dir", str(disk), "--out", str(tmp_path)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads((tmp_path / "long_context_sft.json").read_text())
    assert "qwen3 model class" in result["scenario"]
    steps = result["steps"]
    assert all(step["spilled_to_disk_gib"] > 0 and step["kept_over_host_cap"] == 0 for step in steps)
    assert all(step["read_from_disk_gib"] == step["spilled_to_disk_gib"] for step in steps)
    assert list(disk.iterdir()) == []  # the run's files and directory went with it
