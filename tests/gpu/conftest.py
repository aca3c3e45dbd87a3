"""GPU test suite configuration.

- Every test in tests/gpu is skipped when no CUDA device is available (CI has none).
- CUBLAS_WORKSPACE_CONFIG is set here, at import time, before anything can initialise cuBLAS: with
  torch.use_deterministic_algorithms(True) cuBLAS needs it to be deterministic.
- Deterministic algorithms are switched on around every test here (and restored after, so that CPU tests
  collected in the same session are unaffected); the fixture ``nondeterministic`` switches them off for the
  memory tests, which use SDPA kernels that have no deterministic backward.
- ``liger_patches_undone`` puts back what Liger's patches replace in transformers' Llama code, after a test that
  applies them.
- Tests report numbers through the ``record`` fixture; they are written to $OUT/gpu_test_numbers.json (or
  ./gpu_test_numbers.json when $OUT is unset) and the ones marked ``show=True`` are printed in the terminal
  summary.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # so that `import _gpu_models` works under any pytest import mode
    sys.path.insert(0, str(_HERE))

_NUMBERS: dict[str, object] = {}
_SHOWN: list[str] = []
_TESTS_SINCE_GC = 0


def _cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="GPU test: no CUDA device available")
    for item in items:
        if _HERE in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def pytest_report_header(config):
    lines = [
        f"tests/gpu: torch {torch.__version__}, cuda available: {_cuda()}, "
        f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}"
    ]
    try:
        import transformers

        import hf_offload

        lines.append(
            f"tests/gpu: hf_offload from {pathlib.Path(hf_offload.__file__).parent}, "
            f"transformers {transformers.__version__}"
        )
    except Exception as e:  # pragma: no cover - reported, not fatal
        lines.append(f"tests/gpu: could not import hf_offload/transformers: {e!r}")
    if _cuda():
        lines.append(f"tests/gpu: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    return lines


@pytest.fixture(autouse=True)
def _deterministic():
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
    # An engine whose hooks are bound methods of itself lives in a reference cycle, so a dropped context keeps
    # its pinned pool until a full collection, which is rare with transformers loaded. A full collection costs
    # ~0.5 s here, so run one every few tests to bound the pinned memory that piles up.
    global _TESTS_SINCE_GC
    _TESTS_SINCE_GC += 1
    if _TESTS_SINCE_GC >= 15:
        _TESTS_SINCE_GC = 0
        gc.collect()
    if _cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture
def nondeterministic():
    """Deterministic algorithms off for this test (memory measurements with SDPA)."""
    torch.use_deterministic_algorithms(False)
    yield


@pytest.fixture
def liger_patches_undone():
    """Liger's patch of the Llama family (`apply_liger_kernel_to_llama`, which the Trainer's `use_liger_kernel=True`
    calls) replaces transformers' Llama classes and functions for the whole process: they are put back after the
    test, so that the tests after it build transformers' own Llama (one test's Liger once made every later full
    fine-tune under a selective checkpoint differ)."""
    pytest.importorskip("liger_kernel", reason="carry liger-kernel's wheel in .whl/")
    from transformers.models.llama import modeling_llama

    attributes = dict(vars(modeling_llama))
    causal_lm_forward = modeling_llama.LlamaForCausalLM.forward
    cross_entropy = torch.nn.functional.cross_entropy
    yield
    for name, value in attributes.items():
        setattr(modeling_llama, name, value)
    modeling_llama.LlamaForCausalLM.forward = causal_lm_forward
    torch.nn.functional.cross_entropy = cross_entropy


@pytest.fixture
def device() -> str:
    return "cuda"


@pytest.fixture
def record(request):
    """record(key, value, show=False): a number for $OUT/gpu_test_numbers.json (and the terminal summary)."""

    def _record(key: str, value, show: bool = False):
        full = f"{request.node.name}::{key}" if key else request.node.name
        _NUMBERS[full] = value
        if show:
            _SHOWN.append(full)

    return _record


def pytest_sessionfinish(session, exitstatus):
    if not _NUMBERS:
        return
    out = pathlib.Path(os.environ.get("OUT") or ".")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_test_numbers.json").write_text(json.dumps(_NUMBERS, indent=1, default=str))
    except OSError:
        pass


def pytest_terminal_summary(terminalreporter):
    if not _SHOWN:
        return
    terminalreporter.section("hf-offload GPU numbers")
    for key in _SHOWN:
        terminalreporter.write_line(f"{key}: {json.dumps(_NUMBERS[key], default=str)}")
