"""The allocator at long context: reading the expandable-segments setting, the warning, and emptying the cache."""

import logging

import pytest
import torch

from hf_offload import allocator
from hf_offload.allocator import LongContextCheck, expandable_segments_enabled, release_unusable_cache


@pytest.mark.parametrize(
    ("cuda_conf", "conf", "enabled"),
    [
        ("", "", False),
        ("expandable_segments:True", "", True),
        ("max_split_size_mb:128, expandable_segments:true", "", True),
        ("", "expandable_segments:True", True),
        ("expandable_segments:True", "expandable_segments:False", False),  # the later name wins
        ("expandable_segments:False", "", False),
    ],
)
def test_the_setting_is_read_from_the_environment(monkeypatch, cuda_conf, conf, enabled):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", cuda_conf)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", conf)
    assert expandable_segments_enabled() is enabled


class FakeEngine:
    def __init__(self):
        self.warnings = []

    def warn_once(self, key, message):
        self.warnings.append((key, message))


class CudaLike(torch.Tensor):
    """A CPU tensor that says it lives on CUDA: the check reads nothing else of it."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_a_long_cuda_step_without_the_setting_warns_with_the_fix(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    engine = FakeEngine()
    check = LongContextCheck(engine)
    short = torch.empty(1, allocator.LONG_CONTEXT_TOKENS - 1, 1).as_subclass(CudaLike)
    long = torch.empty(1, allocator.LONG_CONTEXT_TOKENS, 1).as_subclass(CudaLike)
    check(None, (short,), {})
    check(None, (torch.empty(1, allocator.LONG_CONTEXT_TOKENS, 1),), {})  # on the CPU: no allocator to set
    assert engine.warnings == []
    check(None, (), {"hidden_states": long})
    [(key, message)] = engine.warnings
    assert key == "expandable_segments" and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in message
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    check(None, (long,), {})
    assert len(engine.warnings) == 1


def test_nothing_to_release_without_cuda(caplog):
    if torch.cuda.is_available():
        pytest.skip("tests/gpu covers the device")
    with caplog.at_level(logging.WARNING):
        assert release_unusable_cache(2**40) is False
