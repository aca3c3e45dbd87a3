"""The timed training steps of one mode: step times, device memory, bytes offloaded, the host side (pinned bytes,
pinned allocations, RSS, the least host memory available during a step), and the first step's loss bits and gradient
fingerprint."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import GIB, lower_quartile
from .offloaders import Offload

# One training step (forward, backward, optimizer step); its argument asks for the gradient fingerprint, taken
# before the optimizer step. Returns the loss and the fingerprint (None when not asked for).
TrainStep = Callable[[bool], tuple[torch.Tensor, str | None]]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_train_step(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    context: Any | None,
    span: str,
) -> TrainStep:
    """``span`` "step": the offload context wraps forward and backward (as TRL's trainers do); "forward": the
    forward only (as Trainer.compute_loss does)."""
    fwd_ctx = context if (context is not None and span == "forward") else contextlib.nullcontext()
    step_ctx = context if (context is not None and span == "step") else contextlib.nullcontext()

    def train_step(fingerprint: bool) -> tuple[torch.Tensor, str | None]:
        with step_ctx:
            with fwd_ctx:
                loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
        fp = grad_fingerprint(params) if fingerprint else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), fp

    return train_step


class StepPeaks:
    """Peak device memory (allocated, reserved) of each step, read at its end; and the peak of the bytes requested.

    Something inside a step may reset the device's peak counters: the memory budget's profiler does, at the phase
    boundaries it measures (it calls ``torch.cuda.reset_peak_memory_stats``). While this is entered, every such
    reset first folds the counters into the step's running maximum, so that a step's peak is the whole step's.

    The allocated peak counts each tensor's whole block, which the caching allocator may hand out up to 1 MiB larger
    than asked for; the requested peak counts what was asked for. Two runs whose peaks ask for the same bytes can so
    peak apart by what their caches' histories left (which blocks were free to hand out): on gemma2-2b-2k (H200,
    in the zoo) the memory budget's plan `C` and ckpt+hfo both requested 25,708,949,440 bytes at their
    peaks, and peaked at 25,729,518,592 and 25,722,702,848 allocated."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._reset = torch.cuda.reset_peak_memory_stats
        self._folded = (0, 0)
        self._folded_requested = 0

    def __enter__(self) -> StepPeaks:
        torch.cuda.reset_peak_memory_stats = self._fold_then_reset
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.reset_peak_memory_stats = self._reset

    def _counters(self) -> tuple[int, int]:
        return torch.cuda.max_memory_allocated(self._device), torch.cuda.max_memory_reserved(self._device)

    def _requested(self) -> int | None:
        # None where the allocator does not count requests (torch before 2.1, other allocators)
        return torch.cuda.memory_stats(self._device).get("requested_bytes.all.peak")

    def _fold_then_reset(self, device: Any = None) -> None:
        self._folded = self.step_peak()
        self._folded_requested = self.requested_peak() or 0
        self._reset(device)

    def start_step(self) -> None:
        self._folded, self._folded_requested = (0, 0), 0
        self._reset(self._device)

    def step_peak(self) -> tuple[int, int]:
        allocated, reserved = self._counters()
        return max(self._folded[0], allocated), max(self._folded[1], reserved)

    def requested_peak(self) -> int | None:
        """The step's peak of the bytes requested, so far; None where the allocator does not count them."""
        requested = self._requested()
        return None if requested is None else max(self._folded_requested, requested)


def _library_host_available() -> int:
    # Imported here, not with the harness: its other offloaders' modes run where hf_offload does not import.
    from hf_offload.host_memory import read_host_memory

    return read_host_memory().available_bytes


class HostAvailableMin:
    """The least host memory available while it is entered: read on entry, on exit and every ``interval_s`` between
    by a daemon thread, as ``hf_offload.host_memory.read_host_memory`` reads it (``MemAvailable``, lowered to a
    cgroup's room: what the library keeps its host reserve against). A reading after a step misses its pinned pool
    and host copies at their largest. Without ``/proc/meminfo`` it reads nothing: ``min_bytes`` stays None."""

    MEMINFO = Path("/proc/meminfo")  # Linux's (the GPU hosts'); elsewhere nothing is sampled

    def __init__(self, interval_s: float = 0.5, read: Callable[[], int] | None = None) -> None:
        """``read``: the bytes available now (for tests); None: the library's reading."""
        self.interval_s = interval_s
        self._available = read or _library_host_available
        self.min_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> None:
        available = self._available()
        self.min_bytes = available if self.min_bytes is None else min(self.min_bytes, available)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._read()

    def __enter__(self) -> HostAvailableMin:
        self.min_bytes = None
        if self.MEMINFO.is_file():
            self._read()
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="host-available-min", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._read()


def time_steps(
    train_step: TrainStep, offload: Offload, warmup: int, steps: int, device: torch.device, res: dict[str, Any]
) -> None:
    """``warmup`` then ``steps`` timed steps, each synchronised before and after; the figures go into ``res``.
    On CUDA each step's peak is recorded (``StepPeaks``), outside the timed span."""
    is_cuda = device.type == "cuda"
    res["warmup_steps"] = warmup
    per_step = []
    with StepPeaks(device) if is_cuda else contextlib.nullcontext() as peaks:
        for i in range(warmup + steps):
            if i == warmup and is_cuda:
                synchronize(device)
                res["static_gib"] = torch.cuda.memory_allocated(device) / GIB
            if offload.counter is not None:
                offload.counter.reset()
            synchronize(device)
            if peaks is not None:
                peaks.start_step()
            t0 = time.perf_counter()
            loss, fp = train_step(i == 0)
            synchronize(device)
            dt = time.perf_counter() - t0
            rec = {"step": i + 1, "s": dt, "loss": float(loss.float().item())}
            if peaks is not None:
                rec["peak_bytes"], rec["peak_reserved_bytes"] = peaks.step_peak()
                rec["peak_requested_bytes"] = peaks.requested_peak()
            if i == 0:
                res["first_step_s"] = dt  # includes the gradient fingerprint
                res["loss1"] = rec["loss"]
                res["loss1_bits"] = tensor_bits(loss)
                res["grad1_fingerprint"] = fp
            _record_offload(offload, rec, res)
            if is_cuda:
                rec["host_allocs"] = host_alloc_count()
            rec["rss_gib"] = rss_gib()
            per_step.append(rec)
            print(
                f"  step {i + 1}: {dt:.4f} s loss {rec['loss']:.6f}"
                + (f" out {rec['bytes_out'] / GIB:.3f} GiB" if "bytes_out" in rec else "")
                + (f" peak {rec['peak_bytes'] / GIB:.2f} GiB" if "peak_bytes" in rec else "")
                + (f" plan {rec['plan']}" if rec.get("plan") else ""),
                flush=True,
            )
    _summarise(per_step, warmup, offload.offloader, res)


def _record_offload(offload: Offload, rec: dict[str, Any], res: dict[str, Any]) -> None:
    """What the offloader moved in the step just ended, and for ours its statistics and the plan in force."""
    if offload.counter is not None:
        rec["bytes_out"] = offload.counter.bytes
        rec["tensors_out"] = offload.counter.tensors
    if offload.offloader == "hfo":
        st = dict(offload.context.get_stats())
        rec["bytes_out"] = int(st.get("bytes_offloaded", 0))
        rec["tensors_out"] = int(st.get("tensors_offloaded", 0))
        rec["pinned_bytes"] = st.get("pinned_bytes")
        rec["compute_wait_s"] = st.get("compute_wait_s")
        res["hfo_stats_last"] = st
        plan = offload.context.memory_plan  # None without a memory budget, and while the budget profiles
        if plan is not None:
            rec["plan"] = plan.code


def _summarise(per_step: list[dict[str, Any]], warmup: int, offloader: str, res: dict[str, Any]) -> None:
    timed = per_step[warmup:]
    times = [r["s"] for r in timed]
    res["times"] = times
    res["per_step"] = per_step
    res["median_s"] = statistics.median(times)
    res["mean_s"] = statistics.fmean(times)
    res["min_s"] = min(times)
    res["p25_s"] = lower_quartile(times)
    if "peak_bytes" in per_step[0]:
        res["peak_bytes"] = max(r["peak_bytes"] for r in timed)
        res["peak_gib"] = res["peak_bytes"] / GIB
        res["peak_all_gib"] = max(r["peak_bytes"] for r in per_step) / GIB  # warm-up (and profiling) included
        res["peak_step1_gib"] = per_step[0]["peak_bytes"] / GIB
        res["peak_reserved_gib"] = max(r["peak_reserved_bytes"] for r in timed) / GIB
        requested = [r.get("peak_requested_bytes") for r in per_step]
        if all(value is not None for value in requested):
            res["peak_requested_all_bytes"] = max(requested)  # warm-up (and profiling) included, as peak_all_gib
    if "bytes_out" in per_step[-1]:
        res["bytes_out"] = per_step[-1]["bytes_out"]
        res["tensors_out"] = per_step[-1]["tensors_out"]
    elif offloader == "none":
        res["bytes_out"] = 0
    # host side: pinned bytes and pinned allocations from step 1 on; flat = the host side does not grow
    pins = [r.get("pinned_bytes") for r in per_step]
    if offloader == "hfo" and all(p is not None for p in pins):
        res["pinned_bytes_step1"] = pins[0]
        res["pinned_bytes_last"] = pins[-1]
        res["pinned_flat"] = len(set(pins)) == 1
    allocs = [r.get("host_allocs") for r in per_step]
    if allocs and all(a is not None for a in allocs):
        res["host_allocs_step1"] = allocs[0]
        res["host_allocs_last"] = allocs[-1]
        res["host_allocs_flat"] = allocs[0] == allocs[-1]
    rss = [r["rss_gib"] for r in per_step if r.get("rss_gib") is not None]
    if rss:
        res["rss_step1_gib"], res["rss_last_gib"] = rss[0], rss[-1]


def grad_fingerprint(params: list[torch.nn.Parameter]) -> str:
    """A cheap fingerprint of the gradient bits (int64 sums of the raw bit patterns).

    Summed on the host, a chunk at a time: the device holds nothing more than the step does, so the step's measured
    peak stays its own. On the device, each chunk's int64 sum made a 128 MiB temporary, right when every gradient is
    allocated: where the step's peak is that moment (a full fine-tune whose optimizer state already exists), step 1
    peaked 125 MiB above the others, over a memory budget the library met (the zoo's gemma2-2b-2k, 11-25)."""
    acc = 0
    for k, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        flat = g.detach().reshape(-1)
        idt = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        flat = flat.view(idt)
        s = 0
        for chunk in flat.split(1 << 24):
            s += int(chunk.cpu().sum(dtype=torch.int64))
        acc = (acc * 1000003 + (k + 1) * s) % (1 << 64)
    return f"{acc:016x}"


def tensor_bits(t: torch.Tensor) -> str:
    """The raw bytes of a one-element tensor, in hex: equal losses are equal bit for bit."""
    t = t.detach().to("cpu").contiguous().reshape(1)
    return bytes(t.view(torch.uint8).tolist()).hex()


def host_alloc_count() -> int | None:
    """How many pinned blocks PyTorch's host allocator has allocated (the key differs between torch versions)."""
    try:
        st = torch.cuda.host_memory_stats()
    except Exception:
        return None
    for key in ("num_host_alloc", "allocations.allocated", "allocations.all.allocated"):
        if key in st:
            return int(st[key])
    return None


def rss_gib() -> float | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss / GIB
    except Exception:
        return None
