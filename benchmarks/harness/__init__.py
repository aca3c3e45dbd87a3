"""The pieces of ``benchmarks/run.py``, one concern per module.

Parent process (the invocation, no torch needed to import):
  runner.py       runs the invocation: the environment probe, then one child process per mode, within the budget
  child.py        child processes: their environment; one whose output goes to stdout and a log, with a time limit
  scenarios.py    the scenarios S1, S2, S3, M36, the shape zoo and the CPU smoke tests: shapes, tokens, step counts
  modes.py        the mode names ("ckpt+hfo", "ckpt-every-2", "plan@50", ...) and what each one means
  report.py       derived figures (ratios, transfer floor, loss equality, the memory-budget plans' checks) and the
                  markdown, JSON and stdout tables
  zoo.py          the shape zoo's sweep (benchmarks/zoo.py): which mode runs next, the checks per budget, the summary

Here, for both sides: GIB, and ``lower_quartile``, the step time of check (a) (the child's summary of a mode's timed
steps; the zoo's re-check pools several runs' steps with it, without torch).

Child processes (``run.py --_worker SPEC`` and ``run.py --_bandwidth SPEC``; zoo.py's child runs many modes):
  worker.py       one mode of one scenario, start to finish: its result written to a JSON file, or returned
  model.py        the model from a scenario's config (Liger, LoRA), its optimizer and its batch
  offloaders.py   checkpointing and the offload contexts (transformers' native, TRL's, ours) with byte counters
  measure.py      the timed training steps: step times, device memory, bytes offloaded, host side, fingerprints
  trace.py        one step under torch.profiler, and how busy each CUDA stream was in it
  environment.py  versions, the device and its host<->device copy bandwidth
"""

import hashlib
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
# Both the command line and the entry point of the child processes.
RUN_SCRIPT = REPO / "benchmarks" / "run.py"
GIB = 1024**3


def lower_quartile(times: list[float]) -> float:
    """The lower quartile of step times (the time itself for one step): where the host paces a short step, its
    stalls only ever add time, to some steps and not others, so a low quantile measures the plan and a median the
    host as well (docs/DESIGN.md, "Host time")."""
    return statistics.quantiles(times, n=4, method="inclusive")[0] if len(times) > 1 else times[0]


def library_source_hash() -> str:
    """hf-offload's source by content, as the results name it (``hf_offload-src``): the benchmarks run the library
    from the working tree, not installed, so its version says nothing of the code that ran. The first 12 hex digits of
    the SHA-256 of every ``hf_offload/**/*.py``, path and bytes, sub-packages included."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "hf_offload").rglob("*.py")):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]
