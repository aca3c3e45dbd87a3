"""Streams, per device: where the engine's copies run, and what its hooks pay to put them there.

  * the compute stream: whatever stream the forward (or, in backward, autograd) runs the model's kernels on.
    It is read from `current_stream()` at each pack and unpack, *before* any `with stream(...)` block: inside
    one, `current_stream()` answers the side stream, and a wait on it would silently order nothing.
  * a device-to-host (D2H) stream for the forward copies, and a host-to-device (H2D) stream for the reloads,
    so that both directions can run at once (the link is full duplex) and neither queues behind compute.

A model split over several GPUs gets a `_Lane` per device: its two side streams (`_SideStream`) and the windows of
copies in flight and reloaded ahead that `host_copies` and `prefetch` count on it; every tensor returns to the device
it left. Without side streams (the CPU test mode, `use_streams=False`) a lane's copies are ordered on the compute
stream. `_Streams` is the engine's part: its lanes, made at a device's first copy, and the compute stream's wait for a
copy, timed where it stalls.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch


class _SideStream:
    """One side stream, and a cheap way to make it current for the few calls that issue a copy on it.

    `with torch.cuda.stream(side)` costs about 18 us of host time (H100 host, `benchmarks/hook_cost.py`), and a
    copy enters one each way: on a short step the host, not the GPU, sets the pace, so that is step time. Entering
    this object costs two `set_stream` calls: the engine already holds the stream it returns to, the compute stream
    of the same device, read before the switch (see the module docstring). `set_stream` also makes the stream's
    device current, so the device current before is put back when it was another one (a model split across GPUs).

    It also keeps one event for ordering this stream after another (`wait_for`), re-recorded each time: a wait
    enqueued on a stream holds the event's state at the time of the call, so the event can be recorded again at once.
    """

    def __init__(self, device: torch.device, device_module: Any) -> None:
        self.device_module = device_module
        self.stream = device_module.Stream(device=device)
        self._marker = device_module.Event()
        self._return_to: Any = None
        self._previous_device = 0

    def wait_for(self, stream: Any) -> None:
        """Order this stream's later work after what `stream` has queued so far (as `Stream.wait_stream`)."""
        self._marker.record(stream)
        self.stream.wait_event(self._marker)

    def entered_from(self, compute: Any) -> _SideStream:
        """`with side.entered_from(compute):` runs the block on this stream, then makes `compute` current again."""
        self._return_to = compute
        return self

    def __enter__(self) -> None:
        self._previous_device = self.device_module.current_device()
        self.device_module.set_stream(self.stream)

    def __exit__(self, *exc_info: Any) -> None:
        self.device_module.set_stream(self._return_to)
        if self._previous_device != self.stream.device_index:
            self.device_module.set_device(self._previous_device)
        self._return_to = None


class _Lane:
    """Per-device copy machinery: side streams and the windows of copies in flight."""

    def __init__(self, device: torch.device, device_module: Any, use_streams: bool) -> None:
        self.device = device
        self.device_module = device_module
        streamed = use_streams and device.type != "cpu"
        self.d2h = _SideStream(device, device_module) if streamed else None
        self.h2d = _SideStream(device, device_module) if streamed else None
        self.inflight: deque[Any] = deque()  # forward copies (`host_copies._HostCopy`) whose GPU original is still held
        self.inflight_bytes = 0
        self.prefetched_bytes = 0  # reloaded ahead of need and not yet unpacked
        # Of those, the copies saved by one block only: the one block input that checkpointing reloads ahead. A copy
        # that several blocks saved (a mask or rotary table shared by every layer) stays reloaded for all of them, and
        # is needed together with the first one's own input: it does not take that input's place.
        self.prefetched_copies = 0
        # The compute stream is read at every pack, unpack and prefetch, and `torch.cuda.current_stream` builds a new
        # Stream object each time (about 20 us in a step, on an H100 host): on CUDA its raw id is read instead, and
        # the Stream object of the last answer is reused while the id is the same.
        self._current_stream_id = getattr(torch._C, "_cuda_getCurrentStream", None) if device.type == "cuda" else None
        self._compute: Any = None

    def compute_stream(self) -> Any:
        if self._current_stream_id is None:
            return self.device_module.current_stream(self.device.index)
        stream_id = self._current_stream_id(self.device.index)[0]
        if self._compute is None or self._compute.stream_id != stream_id:
            self._compute = self.device_module.current_stream(self.device.index)
        return self._compute


class _Streams:
    """The engine's lanes, by device, and the compute stream's waits for copies.

    A part of `OffloadActivations` (a mixin: the hooks call it directly, for every copy): it reads the engine's
    `device_type`, `options` and statistics (`_stats`).
    """

    def _init_streams(self) -> None:
        self._device_module = torch.get_device_module(self.device_type) if self.device_type else None
        self._lanes: dict[torch.device, _Lane] = {}

    def _lane(self, device: torch.device) -> _Lane:
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = _Lane(device, self._device_module, self.options.use_streams)
        return lane

    def _wait(self, compute: Any, event: Any) -> None:
        """Makes the compute stream wait for a copy, timing the stall if the copy is not done yet.

        `event` is the copy's completion, a timing event: compute stalls from when it reaches the wait until the copy
        completes, if the copy completes later. So one more event, where compute reaches the wait, times the stall.
        """
        if event is None or event.query():
            return
        reached = self._device_module.Event(enable_timing=True)
        reached.record(compute)
        compute.wait_event(event)
        self._stats.wait(reached, event)
