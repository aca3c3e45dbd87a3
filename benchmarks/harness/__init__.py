"""The pieces of ``benchmarks/run.py``, one concern per module.

Parent process (the invocation, no torch needed to import):
  runner.py       runs the invocation: the environment probe, then one child process per mode, within the budget
  scenarios.py    the scenarios S1, S2, S3 and the CPU smoke tests: model shapes, tokens, default step counts
  modes.py        the mode names ("ckpt+hfo", "ckpt-every-2", "plan@50", ...) and what each one means
  report.py       derived figures (ratios, transfer floor, loss equality, the memory-budget plans' checks) and the
                  markdown, JSON and stdout tables

Child processes (``run.py --_worker SPEC`` and ``run.py --_bandwidth SPEC``):
  worker.py       one mode of one scenario, start to finish, its result written to a JSON file
  model.py        the model from a scenario's config (Liger, LoRA), its optimizer and its batch
  offloaders.py   checkpointing and the offload contexts (transformers' native, TRL's, ours) with byte counters
  measure.py      the timed training steps: step times, device memory, bytes offloaded, host side, fingerprints
  trace.py        one step under torch.profiler, and how busy each CUDA stream was in it
  environment.py  versions, the device and its host<->device copy bandwidth
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
# Both the command line and the entry point of the child processes.
RUN_SCRIPT = REPO / "benchmarks" / "run.py"
GIB = 1024**3
