"""The random generators' state for a device: read, set back, or kept untouched around a region.

Recomputation must draw the random numbers the forward drew (the tiled MLP per chunk, a selective offload after an
attention it does not run again), and side computations must draw none of the training's (the memory budget's probes).
For a tensor on an accelerator both the CPU generator and that device's matter; on the CPU, the CPU's alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["RandomState", "random_state", "set_random_state", "random_state_untouched"]

RandomState = tuple[torch.Tensor, torch.Tensor | None]


def random_state(device: torch.device) -> RandomState:
    """The CPU generator's state and, for an accelerator, `device`'s (what dropout there draws from)."""
    device_state = None
    if device.type != "cpu":
        device_state = torch.get_device_module(device.type).get_rng_state(device)
    return torch.get_rng_state(), device_state


def set_random_state(device: torch.device, state: RandomState) -> None:
    """Put back what `random_state(device)` returned."""
    cpu_state, device_state = state
    torch.set_rng_state(cpu_state)
    if device_state is not None:
        torch.get_device_module(device.type).set_rng_state(device_state, device)


@contextlib.contextmanager
def random_state_untouched(device: torch.device) -> Iterator[None]:
    """Run a region whose random draws the generators forget afterwards."""
    state = random_state(device)
    try:
        yield
    finally:
        set_random_state(device, state)
