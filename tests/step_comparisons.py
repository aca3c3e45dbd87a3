"""One training step's results and how two of them compare: shared by the tiled ops' tests (tests/tiled/) and the
budget's (tests/memory_budget/budget_runs.py), whose tolerances are stated in these terms."""

from __future__ import annotations

import torch
from torch import nn

StepResult = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def step(model: nn.Module, embeds: torch.Tensor, labels: torch.Tensor, seed: int = 2, **kwargs) -> StepResult:
    """One forward and backward: (loss, input gradient, {name: gradient} of the parameters that got one)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = embeds.clone().requires_grad_()
    loss = model(inputs_embeds=x, labels=labels, **{"use_cache": False, **kwargs}).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), x.grad, grads


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: relative to the tensor's scale, not elementwise (near-zero entries would dominate)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def max_difference(got: StepResult, ref: StepResult) -> tuple[float, str]:
    """The largest `relative_difference` over loss, input gradient and every parameter gradient, and where."""
    assert got[2].keys() == ref[2].keys(), "the tiled and untiled steps give gradients to different parameters"
    pairs = {"loss": (got[0], ref[0]), "input": (got[1], ref[1])}
    pairs.update({name: (got[2][name], ref[2][name]) for name in ref[2]})
    worst = max(pairs, key=lambda name: relative_difference(*pairs[name]))
    return relative_difference(*pairs[worst]), worst


def assert_bitwise(got: StepResult, ref: StepResult) -> None:
    assert torch.equal(got[0], ref[0]), "loss"
    assert torch.equal(got[1], ref[1]), "input gradient"
    assert got[2].keys() == ref[2].keys()
    assert all(torch.equal(got[2][name], ref[2][name]) for name in ref[2]), "parameter gradients"
