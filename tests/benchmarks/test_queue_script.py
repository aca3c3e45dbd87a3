"""benchmarks/queue.sh: commands run one after another in the background, outlive the call that started them, and
what they wrote is collected, also while they still run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "queue.sh"


def queue(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_commands_run_in_order_and_their_files_and_statuses_are_collected(tmp_path):
    runs, collected = tmp_path / "runs", tmp_path / "collected"
    started = queue("start", runs, f"printf '{{\"step\": 1}}' > {runs}/result.json; echo first",
                    "sleep 2; echo second; exit 3", "echo third")  # fmt: skip
    assert started.returncode == 0, started.stderr

    refused = queue("start", runs, "echo again")
    assert refused.returncode == 1 and "still runs" in refused.stderr

    while_running = queue("wait", runs, 0, collected)
    assert while_running.returncode == 3

    finished = queue("wait", runs, 30, collected)
    assert finished.returncode == 1  # the second command ended with 3
    progress = (collected / "progress").read_text().splitlines()
    ends = [line.split() for line in progress if line.startswith("end")]
    assert [(end[1], end[-1]) for end in ends] == [("1", "rc=0"), ("2", "rc=3"), ("3", "rc=0")]
    assert progress[-1].startswith("done")
    assert json.loads((collected / "result.json").read_text()) == {"step": 1}
    assert [(collected / f"{n}.log").read_text().strip() for n in (1, 2, 3)] == ["first", "second", "third"]


def test_a_queue_whose_commands_all_succeed_waits_with_status_0_and_progress_bars_are_left_out(tmp_path):
    runs = tmp_path / "runs"
    assert queue("start", runs, r"printf 'step 1\r 50%% 1.2it/s]\rstep 2\n'").returncode == 0
    finished = queue("wait", runs, 30, tmp_path / "collected")
    assert finished.returncode == 0, finished.stdout
    assert (tmp_path / "collected" / "1.log").read_text().splitlines() == ["step 1", "step 2"]
