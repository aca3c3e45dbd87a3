"""Stand-in accelerator streams and events, so that the CPU test mode takes the engine's streamed path.

The CPU has no streams: an engine in the CPU test mode copies on the compute stream and reloads on demand, so its
prefetch decisions (what starts a reload, when, hits and misses) never run. `use_stand_in_streams` gives an engine
side streams and events whose work is always done, as if every copy finished at once: the copies still run on the
CPU, synchronously, and everything the engine decides about them is real.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hf_offload import OffloadActivations
from hf_offload.engine import _SideStream


class DoneEvent:
    """An event whose work is always done."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: DoneEvent) -> float:
        return 0.0


class InOrderStream:
    """A stream on which every wait is already satisfied."""

    device_index = 0
    stream_id = 0

    def __init__(self, device: object = None) -> None:
        pass

    def wait_event(self, event: DoneEvent) -> None:
        pass


STAND_IN_ACCELERATOR = SimpleNamespace(
    Stream=InOrderStream,
    Event=DoneEvent,
    current_stream=lambda index=None: InOrderStream(),
    set_stream=lambda stream: None,
    current_device=lambda: 0,
    set_device=lambda index: None,
)


def use_stand_in_streams(engine: OffloadActivations) -> OffloadActivations:
    """Gives a CPU-test-mode engine (device_type="cpu") side streams for CPU tensors; call before its first step."""
    engine._device_module = STAND_IN_ACCELERATOR
    lane = engine._lane(torch.device("cpu"))
    lane.d2h = _SideStream(lane.device, STAND_IN_ACCELERATOR)
    lane.h2d = _SideStream(lane.device, STAND_IN_ACCELERATOR)
    return engine
