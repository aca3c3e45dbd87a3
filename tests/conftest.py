"""Fixtures shared by the test files: the tiny model's data and tokenizer (see `helpers`), built once per module.

`helpers` is imported by the fixtures, not here: test files that need no model (the engine's) do not pay for
importing transformers and datasets.

Where a new test goes: next to the module it tests, in the file named after it.
- `hf_offload/<module>.py`: `test_<module>.py` (options, units, allocator, peak, versions; stats: its summary);
  the modules of `hf_offload/engine/` share `test_engine.py` (they are parts of one class, driven through it);
  `policy.py`, `host_memory.py` and `stats.py`'s counters share `test_policy.py`; `model.py`, `model_hooks.py` and
  `context.py` share `test_model.py`; `compile_guard.py` and `regional_compilation.py` are `test_compile.py`.
- `hf_offload/memory_budget/<module>.py`: `memory_budget/test_<module>.py` (spec, profile, simulate, search,
  calibrate, probes, measurements, controller and the objects it owns: profiled_steps, plan_checks, planning;
  layer_actions; `checks.py` through the modules that use it); the controller across families of models is
  `memory_budget/test_controller_families.py`, and what holds for the pure modules together (their imports, their
  doctests) is at the end of `memory_budget/test_search.py`.
- `hf_offload/tiled/`: an op's file, `tiled/test_mlp_op.py` or `tiled/test_layer_op.py`, tests it on its own and
  through its entry point on models (`apply.py`, and `integration.py` for that op: finding, cutting, refusing).
- `callbacks/<module>.py` (installed as `hf_offload.callbacks`): `callbacks/test_<module>.py` (arguments, callback,
  registration, compile_layers, stats_logs, trl: TRL's configurations, trl_takeover: TRL's trainers).
- `examples/`: `test_examples.py`; `examples/distributed/`: `test_distributed_examples.py` (two gloo processes in the
  CPU test mode).
- Across families of models: `test_architectures.py` (offloading), `memory_budget/test_controller_families.py` (the
  budget); `test_qlora.py` for 4-bit models; `test_reliability.py` for faults and leaks over many steps.
- The user's view: `test_readme.py`, `test_main_job.py`, `test_notebook.py`, `test_packaging.py`.
- The scripts of the repository's `benchmarks/`, their own logic on CPU: `benchmarks/test_long_context_bench.py`,
  `test_zoo_bench.py`, `test_dynamic_padding_bench.py`, `test_compile_native_bench.py` (compile_native_offload.py)
  and `test_soak_script.py` (soak_1b.py); each puts that folder on the path to import its script.
- The repository's `scripts/families_sweep.py` (every causal-LM family of the installed transformers):
  `test_families_sweep.py`, on three families and on made-up defects.
- GPU-only behaviour: `tests/gpu/test_gpu_<topic>.py`, run by `bash tests/gpu/run_all.sh` on a GPU machine.
Shared helpers live in one place per use: `helpers.py` (the tiny model and its data, Trainer runs), `compile_runs.py`,
`qlora_models.py`, `ranks.py`, `in_place_rope.py` (a stand-in for Liger's in-place rotary embedding),
`step_comparisons.py` (one step's loss and gradients, and how two steps compare:
the tiled ops' and the budget's tolerances), `memory_budget/step_profiles.py` (the step profiles of the pure modules'
tests), `memory_budget/budget_runs.py` (the tiny Llama's runs under a budget, shared by the controller's tests and
those of the objects it owns), and `gpu/_gpu_models.py` (the model families, shared with the CPU family tests).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

# The examples are imported by test files as modules (`import custom_loop`); `helpers` adds their folder too, but
# a test file's imports are sorted, and an example may come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

# The models here are tiny, so one thread computes them fastest; on a machine shared with other jobs, threads that
# wait for each other at every small operation made the TRL tests up to 20x slower.
torch.set_num_threads(1)

# Test runs are not usage: TRL's trainers would report each one built. Set before anything imports huggingface_hub,
# which reads it then.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="module")
def text_dataset():
    import helpers

    return helpers.load_text_dataset()


@pytest.fixture(scope="module")
def tokenizer(text_dataset):
    import helpers

    return helpers.fit_tokenizer(text_dataset)


@pytest.fixture(scope="module")
def lm_dataset(text_dataset, tokenizer):
    import helpers

    return helpers.tokenize_for_lm(text_dataset, tokenizer)
