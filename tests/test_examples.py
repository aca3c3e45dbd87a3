"""The examples of `examples/` run as a user runs them, on CPU (the engine's CPU test mode, see `helpers`): with
offloading, exactly, with `--help`, without their extra installed, and under torchrun.

The Trainer integration they use is tested module by module in `callbacks/`; `examples/distributed/` in
`test_distributed_examples.py`.
"""

import subprocess
import sys

# The examples, importable because `conftest` put their folder on the path.
import custom_loop
import pytest
import sft_trainer
import trl_sft_lora
from helpers import EXAMPLES, MAX_LENGTH, offload_logs

EXAMPLE_ARGS = ["--max_steps", "2", "--activation_offloading", "--activation_offloading_device_type", "cpu"]
TRAINER_EXAMPLE_ARGS = ["--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--use_cpu", "true"]


@pytest.mark.parametrize("example", [sft_trainer, trl_sft_lora])
def test_trainer_examples_run_with_offloading(tmp_path, example, capsys):
    trainer = example.main(["--output_dir", str(tmp_path), *EXAMPLE_ARGS, *TRAINER_EXAMPLE_ARGS])
    assert all(record["offload/bytes_offloaded"] > 0 for record in offload_logs(trainer))
    assert "activation offloading over" in capsys.readouterr().out  # the end-of-training summary


@pytest.mark.parametrize("example", ["sft_trainer.py", "trl_sft_lora.py", "custom_loop.py"])
def test_each_example_prints_its_help(example):
    done = subprocess.run([sys.executable, str(EXAMPLES / example), "--help"], capture_output=True, text=True,
                          timeout=240, cwd=EXAMPLES)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--activation_offloading" in done.stdout


def test_without_the_examples_extra_an_example_says_which_extra_to_install():
    # `pip install -e .` installs no datasets library; run the example as if it were missing.
    code = (f"import runpy, sys; sys.modules['datasets'] = None; sys.argv = ['sft_trainer.py', '--help']; "
            f"runpy.run_path({str(EXAMPLES / 'sft_trainer.py')!r}, run_name='__main__')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=EXAMPLES)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().endswith('the examples need the "examples" extra: pip install -e ".[examples]"')


def test_custom_loop_example_is_exact(capsys):
    with_offloading = custom_loop.main([*EXAMPLE_ARGS, "--max_length", str(MAX_LENGTH)])
    summary = capsys.readouterr().out.split("activation offloading over 2 step(s)", 1)[1]
    # The summary speaks of the CPU test mode it ran in, not of a GPU and pinned memory.
    assert summary.startswith(" in CPU test mode") and "GPU" not in summary.replace("no GPU involved", "")
    assert "pinned" not in summary
    without = custom_loop.main(["--max_steps", "2", "--max_length", str(MAX_LENGTH)])
    assert with_offloading == without


def test_two_processes_each_offload_and_the_main_one_summarises(tmp_path):
    """torchrun (as `accelerate launch` does): every rank builds its own callback and engine; one summary."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(EXAMPLES / "sft_trainer.py"), "--output_dir", str(tmp_path), *EXAMPLE_ARGS, *TRAINER_EXAMPLE_ARGS,
        "--log_level", "info",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=EXAMPLES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Total train batch size (w. parallel, distributed & accumulation) = 16" in done.stdout + done.stderr
    assert done.stdout.count("activation offloading over 2 step(s)") == 1
    assert "'offload/offloaded_mib_per_step'" in done.stdout  # the console shows the headline entries
