"""benchmarks/soak_1b.py on CPU bookkeeping (its --device cpu dry run): a tiny Llama trains flat and passes, and a
leak of offloaded copies makes the script fail. Keeps the GPU soak's logic from rotting between GPU runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak_1b  # noqa: E402

TINY = [
    "--device",
    "cpu",
    "--hidden",
    "64",
    "--intermediate",
    "128",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--vocab",
    "128",
    "--seq",
    "64",
    "--steps",
    "15",
    "--every",
    "5",
    "--settle",
    "5",
]


@pytest.mark.parametrize("checkpointing", [[], ["--no-ckpt"]], ids=["ckpt", "no-ckpt"])
def test_flat_run_passes_and_writes_its_record(tmp_path, monkeypatch, checkpointing):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert soak_1b.main(TINY + checkpointing) == 0
    record = json.loads((tmp_path / "soak_1b.json").read_text())
    assert record["steps_done"] == 15 and not record["failures"] and not record["stopped_early"]
    assert [s["step"] for s in record["samples"]] == [5, 10, 15]
    assert all(s["last_step_offloaded"] > 0 and s["tables"]["pool_capacity"] > 0 for s in record["samples"])


def test_leaked_copies_fail_the_run(monkeypatch, capsys):
    leaked = []
    make_ctx = soak_1b.make_ctx

    def leaky_ctx(model, **options):
        ctx = make_ctx(model, **options)
        pack = ctx.pack_hook

        def leaky_pack(tensor):
            leaked.append(pack(tensor))  # keeps every offloaded copy, and its pool block, alive
            return leaked[-1]

        ctx.pack_hook = leaky_pack
        return ctx

    monkeypatch.setattr(soak_1b, "make_ctx", leaky_ctx)
    monkeypatch.delenv("OUT", raising=False)
    assert soak_1b.main(TINY) == 1
    assert "pinned bytes in use between steps" in capsys.readouterr().out
    assert leaked


def test_too_short_a_run_is_a_failure(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    assert soak_1b.main(TINY + ["--steps", "5"]) == 1  # one window, settling: nothing to compare
