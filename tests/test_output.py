"""What people read: the summary, the console log lines, and where the summary lands in a terminal."""

import re
import subprocess
import sys

import transformers
from helpers import COMMON_ARGS, CPU_TEST_MODE, EXAMPLES, tiny_model

from hf_offload import TrainingArguments, format_summary
from hf_offload.callbacks.stats_logs import HEADLINE_KEYS, log_entries
from hf_offload.stats import KEPT_REASONS

STATS = {
    "steps": 2, "tensors_offloaded": 80, "bytes_offloaded": 2 * 3 * 2**20, "prefetch_hits": 2, "prefetch_misses": 4,
    "tensors_kept_tail": 4, "bytes_kept_tail": 2 * 2**20, "tensors_kept_too_small": 2, "bytes_kept_too_small": 1024,
    "compute_wait_s": 0.004, "pinned_bytes": 4 * 2**20,
}  # fmt: skip


def test_the_summary_says_where_tensors_stayed_for_the_device():
    on_gpu, in_test_mode = format_summary(STATS, "cuda"), format_summary(STATS, "cpu")
    assert "kept on the GPU per step:" in on_gpu and "CPU test mode" not in on_gpu
    assert "GPU" not in in_test_mode.replace("no GPU involved", "") and "kept in place per step:" in in_test_mode
    assert "in CPU test mode" in in_test_mode.splitlines()[0]
    # No side streams in the CPU test mode: "0 of 6 ahead of need" would read as a failure.
    assert (
        "reloads in backward: 6 (2 started ahead by the prefetch bookkeeping; the CPU test mode copies" in in_test_mode
    )
    assert "ahead of need" not in in_test_mode


def test_every_figure_of_the_summary_is_explained():
    lines = format_summary(STATS, "cuda").splitlines()
    assert "  moved to host memory per step: 3.00 MiB (40 tensors)" in lines
    assert f"    tail: 1.00 MiB ({KEPT_REASONS['tail']})" in lines
    assert f"    too_small: 512 B ({KEPT_REASONS['too_small']})" in lines
    assert any("2 of 6 (33%) were copied back ahead of need; the others when backward reached them" in line
               for line in lines)  # fmt: skip
    assert "  compute waited for copies: 2.00 ms per step" in lines
    assert "  pinned host memory held (a pool reused every step): 4.00 MiB" in lines


def test_the_console_gets_the_headlines_and_the_history_gets_everything(tmp_path, tokenizer, lm_dataset, capsys):
    args = TrainingArguments(str(tmp_path), activation_offloading=True, **{**COMMON_ARGS, "eval_strategy": "no"},
                             **CPU_TEST_MODE)  # fmt: skip
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = transformers.Trainer(model=tiny_model(tokenizer), args=args, train_dataset=lm_dataset,
                                   data_collator=collator)  # fmt: skip
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if "'loss'" in line]
    assert len(printed) == COMMON_ARGS["max_steps"]
    for line in printed:  # PrinterCallback prints each log as a dict
        assert sorted(re.findall(r"'(offload/[^']+)'", line)) == sorted(HEADLINE_KEYS[:2])  # no peak in CPU test mode
    history = [record for record in trainer.state.log_history if "loss" in record]
    assert all({"offload/bytes_offloaded", "offload/steps", *HEADLINE_KEYS[:2]} <= record.keys() for record in history)


def test_the_console_shows_a_few_kib_offloaded_per_step_as_more_than_zero():
    # A tiny model offloads 28-52 KiB per step; the console prints each float with 4 significant digits.
    stats = {"steps": 2, "bytes_offloaded": 2 * 28 * 2**10, "compute_wait_s": 0.0}
    shown = f"{log_entries(stats)[HEADLINE_KEYS[0]]:.4g}"
    assert shown == "0.02734" and HEADLINE_KEYS[0].endswith("_mib_per_step")


def test_the_summary_starts_on_a_line_of_its_own_after_the_progress_bar(tmp_path):
    # stdout and stderr (where tqdm draws) merged, as in a terminal.
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "sft_trainer.py"), "--output_dir", str(tmp_path), "--max_steps", "2",
         "--report_to", "none", "--save_strategy", "no", "--activation_offloading",
         "--activation_offloading_device_type", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]
    start = result.stdout.index("activation offloading over 2 step(s)")
    assert start == 0 or result.stdout[start - 1] in "\r\n", repr(result.stdout[start - 80 : start + 40])


def test_the_trainer_integration_imports_without_ipython():
    # transformers' notebook progress callback needs IPython, which a plain training machine may not have.
    code = "import sys; sys.modules['IPython'] = None; import hf_offload.callbacks; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


def test_with_gradient_accumulation_the_summary_counts_micro_steps():
    """The engine's step is a forward and backward pass: 4 optimizer steps accumulating over 4 passes are 16 of
    them, which the summary calls micro-steps, with the optimizer steps they make."""
    stats = {"steps": 16, "tensors_offloaded": 32, "bytes_offloaded": 16 * 2**20}
    summary = format_summary(stats, "cuda", accumulation_steps=4)
    assert summary.startswith("activation offloading over 16 micro-step(s) (4 optimizer steps of 4):")
    assert "moved to host memory per micro-step: 1.00 MiB (2 tensors)" in summary and "per step" not in summary
    assert format_summary(stats, "cuda").startswith("activation offloading over 16 step(s):")
