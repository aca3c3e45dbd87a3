"""Child processes of the benchmark scripts: the environment they run in (the working tree's hf_offload first), and
a child whose output goes to the parent's stdout and log as it comes, killed at a time limit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from . import REPO


def child_env() -> dict[str, str]:
    """The parent's environment with the working tree first on PYTHONPATH, unbuffered output, no hub access."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_child(script: Path, args: list[str], log_path: Path, timeout: float,
              env: dict[str, str] | None = None) -> tuple[int | None, bool]:  # fmt: skip
    """Runs ``python SCRIPT ARGS`` in the repository's root (``env``: variables set for it on top of `child_env`);
    its output goes to stdout and is appended to ``log_path`` as it comes. Returns its exit code and whether it was
    killed at ``timeout`` seconds."""
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env() | (env or {}),
        cwd=str(REPO),
    )

    def pump() -> None:
        with open(log_path, "a") as log_file:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log_file.write(line)
                log_file.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        return proc.wait(timeout=max(1.0, timeout)), False
    except subprocess.TimeoutExpired:
        proc.kill()  # the child started above
        proc.wait()
        return proc.returncode, True
    finally:
        reader.join(timeout=10)
