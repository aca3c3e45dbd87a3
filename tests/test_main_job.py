"""The main job (`bash scripts/train.sh`, which runs `examples/with_and_without.py`): it trains with checkpointing
alone and with checkpointing plus hf-offload, says what it ran and where the models went, and, on a CPU, that the CPU
test mode saves no memory."""

from pathlib import Path

import torch
import with_and_without

ROOT = Path(__file__).resolve().parents[1]


def test_train_sh_runs_the_main_job():
    assert "python examples/with_and_without.py" in (ROOT / "scripts" / "train.sh").read_text()


def test_the_main_job_compares_checkpointing_with_and_without_offloading_and_says_what_it_ran(tmp_path, capsys):
    runs = with_and_without.main(["--output_dir", str(tmp_path), "--max_steps", "4"])
    out = capsys.readouterr().out
    report = out[out.index("hf-offload's main job") :]
    assert "layers, hidden size" in report and "examples/data/tiny_sft.jsonl" in report
    assert "4 optimizer steps" in report and "activation checkpointing in both" in report
    without, with_ = runs["checkpointing alone"], runs["checkpointing + hf-offload"]
    assert without["offloaded_bytes_per_step"] == 0 < with_["offloaded_bytes_per_step"]
    assert without["loss"] == with_["loss"]  # offloading copies bytes: the same training
    assert "Losses at every logged step and the trained weights of the two runs are bitwise equal." in report
    assert out.index("=== run 1 of 2: checkpointing alone ===") < out.index("=== run 2 of 2: checkpointing + hf-off")
    for run in (without, with_):
        assert (run["output_dir"] / "model.safetensors").is_file() and str(run["output_dir"]) in report
    if not torch.cuda.is_available():
        assert "saves no memory" in report and "peak GPU memory" not in report
