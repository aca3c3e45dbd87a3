"""Probing a decoder layer: what it saves and how long it takes, measured on the arguments of its own call.

The controller probes one layer of each kind in the first training step, from the layer's forward pre-hook, on the
very arguments it receives (on the first `PROBE_MAX_TOKENS` of them at long context, `first_tokens`): `probe_layer`
runs it kept (once more timing its attention operators apart, `_TimeAttention`; and on a half and a quarter of its
tokens, for the part of its bytes that grows with their square, `_quadratic_part`), then selectively checkpointed, then
(when the planner may tile MLPs) kept with its MLP tiled, then (when it may tile whole layers) tiled whole, and
returns the bytes it saves (and, where memory is counted, the most its forward holds at once), the bytes a selective
checkpoint would keep, and the times of its forward, backward, attention and selective recompute (a `LayerProbe`,
whose `LayerProfile` the step's profile is made of).
`measure_link_bandwidth` times the copies between the device and the host. A `Meter` reads time and memory on the
engine's device, or the process's CPU time in the CPU test mode, which has no memory counters.

Probes leave no trace in the step: their saved tensors stay out of the engine (the controller sets it aside), the
random streams are restored, the cache is not passed, and transformers' output recorders (router logits, for the
auxiliary loss) do not see them.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import itertools
import time
import weakref
from collections import UserDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..model import CACHE_ARGUMENTS, first_tensor, is_cache
from ..policy import is_movable_type, is_parameter_or_view, local_shard, parameter_storages
from ..tiled.integration import layer_bytes_per_token
from .layer_actions import (
    StorageSet,
    checkpointing_as,
    saved_by_selective_checkpoint,
    selective_checkpoint_function,
    written_tensors,
)
from .profile import LayerProfile, in_proportion, in_square, with_square
from .sharding import gathered_for_probe

__all__ = [
    "PROBE_MAX_TOKENS",
    "Meter",
    "LayerProbe",
    "NOT_CALLED",
    "probe_layer",
    "layer_kind",
    "first_tokens",
    "call_argument_storages",
    "measure_link_bandwidth",
]

# The probes run on at most this many tokens, the first ones of the step's sequences: a layer run without a
# checkpoint at 256K tokens would not fit where the step itself does. Memory scales with the tokens from there.
PROBE_MAX_TOKENS = 32768
# Each measurement of a probe runs this many times: the first pays for kernel selection and allocator growth, and of
# the others the fastest is kept, as the host's stalls only ever add time. With one run kept, three probes of S1's
# layer read its selective recompute at 3.3, 6.1 and 2.8 ms (the plans' steps showed 2.8), and the planner chose
# full checkpoints where selective ones were faster.
_PROBE_RUNS = 3
# A tiled layer's backward peaks either while a chunk runs (its intermediates alive) or in the phase over the whole
# sequence (attention's backward), whichever is higher; at long context the second. Chunks of 1/64 of the probe's
# tokens make the chunks' share negligible, so that run measures the second (`benchmarks/long_context.py`, H100: an
# 8B QLoRA layer with its MLP tiled peaked at 144 KB per token from 16K tokens on, where the two chunked runs at 8K,
# which saw only the chunk phase, gave 120 KB per token and a constant; its 512K step ran out of memory).
SEQUENCE_PHASE_CHUNKS = 64
# The link probe times 64 MiB each way, in copies of a buffer from 1 MiB to 64 MiB (`link_probe_bytes`).
_BANDWIDTH_PROBE_BYTES = 64 * 2**20
_BANDWIDTH_PROBE_MIN_BYTES = 2**20
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Meter:
    """Time and memory on the engine's device, or, in the CPU test mode (no memory counters), the process's CPU time.

    The CPU test mode times the work the step does, not the wall clock: the wall clock of a host busy with other
    processes stretches every interval by how often the step was descheduled, and plans chosen from such times
    changed with the host's load. CPU time counts only this process's work (every thread's, so also operators that
    run on several threads).
    """

    def __init__(self, device_type: str) -> None:
        self.device = None if device_type == "cpu" else torch.get_device_module(device_type)

    def mark(self) -> Any:
        if self.device is None:
            return time.process_time()
        event = self.device.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if self.device is None:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def allocated(self) -> int | None:
        return None if self.device is None else self.device.memory_allocated()

    def peak(self) -> int | None:
        return None if self.device is None else self.device.max_memory_allocated()

    def reset_peak(self) -> None:
        if self.device is not None:
            self.device.reset_peak_memory_stats()

    def total(self) -> int | None:
        return None if self.device is None else self.device.get_device_properties().total_memory


class _CountSavedBytes(saved_tensors_hooks):
    """Keeps saved tensors in place and, when the forward ends, counts the distinct storages the ones still alive
    occupy (parameters aside, by type or by storage), and their bytes.

    Counting when the forward ends, not as tensors are saved: a layer may save tensors in a part of the graph it then
    drops (Qwen3-Next's linear attention does), and the allocator may give a dropped storage's address to the next
    one, so storages told apart by address as they came were counted once or twice by where the allocator put them,
    and the same step's plan changed from one process to the next. At the end the storages alive have distinct
    addresses, and they are what the layer holds for its backward."""

    def __init__(self, parameter_pointers: set[int],
                 on_save: Callable[[torch.Tensor], None] | None = None) -> None:  # fmt: skip
        self.nbytes = 0
        self.tensors = 0
        self.kept_type: str | None = None  # a type saved that offloading keeps in place (`is_movable_type`)
        self._parameter_pointers = parameter_pointers
        self._saved: list[weakref.ref[torch.Tensor]] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if on_save is not None:
                on_save(tensor)
            if not is_parameter_or_view(tensor):
                self._saved.append(weakref.ref(tensor))
                if not is_movable_type(tensor) and self.kept_type is None:
                    self.kept_type = type(tensor).__name__
            return tensor

        super().__init__(pack, lambda tensor: tensor)

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        storages = {}
        for ref in self._saved:
            tensor = ref()
            if tensor is not None:
                storage = local_shard(tensor).untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        for pointer in self._parameter_pointers:
            storages.pop(pointer, None)
        self.nbytes, self.tensors = sum(storages.values()), len(storages)
        self._saved.clear()


# Substrings of the names of the fused attention operators (sdpa's kernels, FlashAttention's): the part of a layer's
# time that grows with the square of the sequence. Eager attention's matrix products are not recognised and stay in the
# per-token part, as before this was measured (eager attention's memory, quadratic too, rules out long steps anyway).
_ATTENTION_OPERATORS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "flash_attn")


class _TimeAttention(TorchDispatchMode):
    """Times the fused attention operators a layer's forward and backward run, each direction on its own.

    A layer's time grows with its tokens except attention's, which grows with their square: a profile taken at 8K
    tokens and scaled in proportion predicted 380 s for a 512K-token step that took 945 s
    (`benchmarks/long_context.py`, H100). The probe's whole-layer times cannot separate the two, so this mode brackets
    each attention operator with the meter's marks (timing events on the device's current stream, where the
    operator's kernels run; the process's CPU time on CPU).
    Dispatch modes are thread-local state that autograd carries into its device threads, so backward's operators are
    seen too.
    """

    def __init__(self, meter: Meter) -> None:
        super().__init__()
        self.meter = meter
        self.marks: dict[str, list[tuple[Any, Any]]] = {"forward": [], "backward": []}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.name()
        if not any(part in name for part in _ATTENTION_OPERATORS):
            return func(*args, **(kwargs or {}))
        start = self.meter.mark()
        out = func(*args, **(kwargs or {}))
        self.marks["backward" if "backward" in name else "forward"].append((start, self.meter.mark()))
        return out

    def seconds(self, direction: str) -> float:
        return sum(self.meter.seconds(start, end) for start, end in self.marks[direction])


class _CountSelectiveOutputs(TorchDispatchMode):
    """Counts the bytes of the outputs a selective checkpoint would save (matmuls, attention), and finds where the
    layer's code would make such a checkpoint's gradients differ (`written`: the op that does it, None where none).

    A selective checkpoint hands its recomputation the saved outputs as they are at backward: an op that writes into
    one in place is applied a second time when it is recomputed, and whatever is computed from the result differs.
    torch's own check of its cache (the tensor's version counter) misses the write where the output is reached
    through an alias that autograd does not track: `matmul` and `linear` over more than two dimensions return an
    `_unsafe_view` of their `mm`/`bmm` output, with a version counter of its own (Gemma 3n's AltUp adds its input to
    such a product in place, `predictions += hidden_states`, then normalizes the sum).
    The write matters only if a tensor that autograd saves is computed from the written storage after the write (or
    is that storage): Falcon adds attention's output into its MLP's product in place, and only a dropout and an add,
    which save no values, follow, so its gradients are exact and the layer may still be checkpointed selectively.
    So the written storages are followed through the ops that read them (`saved` is the pack hook's check). Storages
    are compared, so views of any kind are seen; a weak reference to each tells a storage freed and reused (under the
    checkpoint the cache keeps the saved outputs alive, so no write could reach them through a new tensor).
    """

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.written: str | None = None
        self._outputs = StorageSet()  # the storages a selective checkpoint would keep
        self._tainted = StorageSet()  # those written into, and what was computed from them since
        self._writer: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        written = written_tensors(func, args, kwargs)
        into_output = any(tensor in self._outputs for tensor in written)
        reads_tainted = bool(self._tainted) and any(
            t in self._tainted for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        )
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if into_output and self._writer is None:
            self._writer = str(func)
        if into_output or reads_tainted:
            for tensor in (*written, *tensors):
                self._tainted.add(tensor)
        if saved_by_selective_checkpoint(func):
            self.nbytes += sum(t.nbytes for t in tensors)
            for tensor in tensors:
                self._outputs.add(tensor)
        return out

    def saved(self, tensor: torch.Tensor) -> None:
        """Autograd saves `tensor` (for the probe's pack hook)."""
        if self.written is None and tensor in self._tainted:
            self.written = self._writer


@dataclasses.dataclass
class _Kept:
    """One decoder layer run without a checkpoint, forward and backward, as `_run_kept` measured it."""

    saved_bytes: int
    saved_tensors: int
    selective_bytes: int
    forward_s: float
    backward_s: float
    working_bytes: int  # the backward's peak over what was allocated when it began
    forward_working_bytes: int | None  # the forward's peak over what was allocated when it began; None uncounted
    selective_written_by: str | None = None  # the op that writes into an output a selective checkpoint saves
    kept_type: str | None = None  # a tensor subclass the layer saves, which the engine does not offload


@dataclasses.dataclass
class LayerProbe:
    """What `probe_layer` measured of one decoder layer, at `tokens` tokens of a call that had `step_tokens`."""

    profile: LayerProfile
    working_bytes: int  # its backward's transient bytes on top of its saved tensors
    tokens: int
    step_tokens: int
    # With its MLP tiled (None when not measured): the same less one chunk's share, and that share per chunk token;
    # or why its MLP cannot be tiled (the error it raised).
    tiled_working_bytes: int | None = None
    chunk_bytes_per_token: float = 0.0
    mlp_tiling_error: str | None = None
    # Tiled whole (None when not measured): its backward's working bytes over `profile.layer_tiled_saved_bytes`, less
    # one chunk's share, and that share per chunk token; or why it cannot be tiled (the error it raised).
    layer_tiled_working_bytes: int | None = None
    layer_chunk_bytes_per_token: float = 0.0
    layer_tiling_error: str | None = None
    # The whole-sequence phase of each tiling's backward (attention's, where no chunk is alive), measured in chunks of
    # `tokens // SEQUENCE_PHASE_CHUNKS`: its saved tensors and its backward's peak over them; None where not measured
    # (no memory counter, or that tiling not probed).
    tiled_sequence_bytes: int | None = None
    layer_tiled_sequence_bytes: int | None = None

    # The part of `working_bytes` that grows with the square of the tokens (the gradient of eager attention's weights),
    # or why the quadratic parts were not measured (every byte then grows in proportion).
    quadratic_working_bytes: int = 0
    quadratic_error: str | None = None
    # The wall-clock seconds of each of the probe's measurements, in the order they ran (`_probe_outside_the_step`):
    # what a long first step's probe cost goes to, its first calls of the layer's kernels included (the first).
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # Why the probe ran on the call's whole length (its arguments cut to fewer tokens do not run), or None.
    uncut_error: str | None = None
    # Why this layer must not be checkpointed selectively (its gradients would differ), or None: its forward writes in
    # place into the output of a matrix product or attention, which the checkpoint keeps for its recomputation.
    selective_error: str | None = None
    # Why this layer's saved tensors must not be offloaded beyond its input (`O`, `X`), or None: it saves a tensor
    # subclass, which the engine keeps in place (torch's ring attention saves DTensors under context parallelism).
    offload_error: str | None = None

    def at_step(self, nbytes: int) -> int:
        """`nbytes` measured by this probe, grown to the call it was cut from."""
        return in_proportion(nbytes, self.tokens, self.step_tokens)

    def working_at_step(self) -> tuple[int, int]:
        """`working_bytes` grown to the call it was cut from, and its part that grows with the square of the tokens."""
        return (with_square(self.working_bytes, self.quadratic_working_bytes, self.tokens, self.step_tokens),
                in_square(self.quadratic_working_bytes, self.tokens, self.step_tokens))  # fmt: skip


# A kind of layer that did not run in the first step: it held and cost nothing there.
NOT_CALLED = LayerProbe(LayerProfile(saved_bytes=0, selective_bytes=0, input_bytes=0, forward_s=0.0, backward_s=0.0,
                                       selective_recompute_s=0.0),
                          working_bytes=0, tokens=1, step_tokens=1, tiled_working_bytes=0,
                          layer_tiled_working_bytes=0)  # fmt: skip


def _gradients(out: torch.Tensor, x: torch.Tensor, parameters: list[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients a layer's backward creates, taken with `torch.autograd.grad` so that nothing accumulates into
    the parameters' `.grad`. A trainable parameter this call does not use (an adapter on a branch it skips, a
    decoder's cross-attention in a call without encoder states) gets none."""
    grads = torch.autograd.grad(out, [x, *parameters], torch.ones_like(out), allow_unused=True)
    return [grad for grad in grads if grad is not None]


def _run_kept(layer: nn.Module, forward: Any, parameters: list[nn.Parameter], pointers: set[int],
              meter: Meter) -> _Kept:  # fmt: skip
    """Runs the layer once without a checkpoint and measures it."""
    selective = _CountSelectiveOutputs()
    counter = _CountSavedBytes(pointers, on_save=selective.saved)
    with checkpointing_as(layer, None):
        before_forward = meter.allocated()
        meter.reset_peak()
        start = meter.mark()
        with counter, selective:
            x, out = forward()
        forward_end = meter.mark()
        forward_peak = meter.peak()
    before_backward = meter.allocated()
    meter.reset_peak()
    backward_start = meter.mark()
    grads = _gradients(out, x, parameters)
    backward_end = meter.mark()
    peak = meter.peak()
    if peak is None:  # no peak counter: the gradients of its input and parameters
        working = sum(grad.numel() * grad.element_size() for grad in grads)
    else:
        working = peak - before_backward
    return _Kept(saved_bytes=counter.nbytes, saved_tensors=counter.tensors, selective_bytes=selective.nbytes,
                 forward_s=meter.seconds(start, forward_end), backward_s=meter.seconds(backward_start, backward_end),
                 working_bytes=working,
                 forward_working_bytes=None if forward_peak is None else forward_peak - before_forward,
                 selective_written_by=selective.written, kept_type=counter.kept_type)  # fmt: skip


def _time_attention(layer: nn.Module, forward: Any, parameters: list[nn.Parameter],
                    meter: Meter) -> tuple[float, float]:  # fmt: skip
    """The seconds of the layer's attention operators in one run without a checkpoint: forward, backward. Run after
    the kept runs, so kernel selection is done; its own run, as the dispatch mode slows the host for every operator."""
    timer = _TimeAttention(meter)
    with checkpointing_as(layer, None), timer:
        x, out = forward()
        _gradients(out, x, parameters)
    return timer.seconds("forward"), timer.seconds("backward")


def _quadratic_part(points: list[tuple[int, int]]) -> int:
    """The part of bytes measured at three lengths, `(tokens, bytes)` longest first, that grows with the square of the
    tokens, at the longest: the quadratic `a + b * t + c * t**2` through the three points (divided differences), and of
    it `c * t**2`. A constant or a part in proportion reads as none; bounded by the bytes themselves."""
    (t1, b1), (t2, b2), (t3, b3) = points
    c = ((b1 - b2) / (t1 - t2) - (b2 - b3) / (t2 - t3)) / (t1 - t3)
    return min(b1, max(0, round(c * t1 * t1)))


def _fastest(runs: list[_Kept]) -> _Kept:
    """The last of `runs` with the fastest forward and backward of those after the first."""
    return dataclasses.replace(runs[-1], forward_s=min(run.forward_s for run in runs[1:]),
                               backward_s=min(run.backward_s for run in runs[1:]))  # fmt: skip


def probe_layer(layer: nn.Module, args: tuple, kwargs: dict, meter: Meter, tile: Callable[[int], Any] | None = None,
                tile_layer: Callable[[int], Any] | None = None) -> LayerProbe:  # fmt: skip
    """Measures one decoder layer on the arguments it was called with (their first `PROBE_MAX_TOKENS` tokens):
    kept, then selectively checkpointed, then (with `tile`, which tiles this layer's MLP in chunks of the tokens it
    is given, as a context manager) kept with its MLP tiled in chunks of a half and a quarter of the tokens, then
    (with `tile_layer`, which tiles this layer whole likewise) tiled whole in the same chunks.

    Each measurement runs `_PROBE_RUNS` times and keeps the fastest run after the first (the first pays for kernel
    selection and allocator growth; the bytes are the last run's).
    The two tiled runs separate what a tiled layer's backward needs into a part that grows with the tokens and one
    that grows with the chunk (the chunk's intermediates and their gradients): their difference is the chunk's.
    Without a memory counter (the CPU test mode) a layer tiled whole is counted by `tiled.layer_op`'s formulas
    (`tiled.integration.layer_bytes_per_token`) instead. A layer that refuses to be tiled whole (a `ValueError`: an
    attention function with learned sinks, an argument it cannot cut) is probed without it, and the probe says why.

    The probe runs in an empty `contextvars` context. transformers (5.x) records router logits, attentions and
    hidden states with forward hooks that append to a collector held in a context variable while the model's
    forward runs; the probe's layer calls would be collected too, and an auxiliary loss built from them would
    backpropagate into graphs the probe has already freed. Outside that context the hooks see no collector.
    """
    with gathered_for_probe(layer) as gathered_bytes:
        probe = contextvars.Context().run(_probe_outside_the_step, layer, args, kwargs, meter, tile, tile_layer)
    probe.profile = dataclasses.replace(probe.profile, gathered_parameter_bytes=gathered_bytes)
    return probe


def _probe_outside_the_step(layer: nn.Module, args: tuple, kwargs: dict, meter: Meter,
                            tile: Callable[[int], Any] | None,
                            tile_layer: Callable[[int], Any] | None) -> LayerProbe:  # fmt: skip
    """`probe_layer`'s measurements, in order: kept and selectively checkpointed, its attention timed apart, its
    quadratic parts, then each tiling it is given."""
    seconds: dict[str, float] = {}
    began = time.perf_counter()

    def measured(what: str) -> None:  # each measurement ends waiting for the device (`Meter.seconds`)
        nonlocal began
        now = time.perf_counter()
        seconds[what], began = now - began, now

    call = _ProbedCall(layer, args, kwargs, meter)
    kept, checkpointed_s = call.kept_and_checkpointed()
    measured("kept and selectively checkpointed")
    attention_forward_s, attention_backward_s = _time_attention(layer, call.forward, call.parameters, meter)
    measured("attention")
    quadratic, quadratic_error = call.quadratic_parts(kept)
    measured("on fewer tokens")
    profile = LayerProfile(
        saved_bytes=kept.saved_bytes,
        selective_bytes=kept.selective_bytes,
        input_bytes=call.hidden.numel() * call.hidden.element_size(),
        forward_s=kept.forward_s,
        backward_s=kept.backward_s,
        selective_recompute_s=0.0 if checkpointed_s is None else max(0.0, checkpointed_s - kept.backward_s),
        attention_forward_s=min(attention_forward_s, kept.forward_s),
        attention_backward_s=min(attention_backward_s, kept.backward_s),
        parameter_gradient_bytes=sum(p.numel() * p.element_size() for p in call.parameters),
        quadratic_saved_bytes=quadratic["saved"],
        quadratic_selective_bytes=quadratic["selective"],
        saved_tensors=kept.saved_tensors,
        forward_peak_bytes=kept.forward_working_bytes or 0,
        quadratic_forward_peak_bytes=quadratic["forward_working"],
    )
    probe = LayerProbe(profile, kept.working_bytes, call.tokens, call.step_tokens, seconds=seconds,
                       quadratic_working_bytes=quadratic["working"], quadratic_error=quadratic_error,
                       uncut_error=call.uncut_error)  # fmt: skip
    if kept.selective_written_by is not None:
        probe.selective_error = (f"{kept.selective_written_by} writes in place into the output of a matrix product or "
                                 "attention, which a selective checkpoint keeps for its recomputation: the write "
                                 "would be applied twice and the gradients would differ")  # fmt: skip
    if kept.kept_type is not None:
        probe.offload_error = (f"it saves {kept.kept_type}s, which offloading keeps on the device (it moves plain "
                               "tensors only)")  # fmt: skip
    if call.tokens < 4:  # the tiled runs' smallest chunks are a quarter of the tokens
        return probe
    if tile is not None:
        call.probe_tiled_mlp(probe, kept, tile)
        measured("MLP tiled")
    if tile_layer is not None:
        call.probe_tiled_whole(probe, kept, tile_layer)
        measured("tiled whole")
    return probe


class _ProbedCall:
    """A decoder layer's call as the probes run it: on its first `PROBE_MAX_TOKENS` tokens, without the step's
    cache, taking the gradients of the layer's trainable parameters."""

    def __init__(self, layer: nn.Module, args: tuple, kwargs: dict, meter: Meter) -> None:
        self.layer, self.meter = layer, meter
        self.step_tokens = args[0].shape[:-1].numel()
        self._step_call = _without_the_cache(layer, args, kwargs)
        self.first_dim_only = False  # how the arguments are cut (`first_tokens`)
        self.uncut_error: str | None = None  # why the probe runs on the call's whole length, where it must
        self.parameters = [p for p in layer.parameters() if p.requires_grad]
        self.pointers = parameter_storages(layer.parameters())
        self._cut()

    def _cut(self) -> None:
        max_tokens = self.step_tokens if self.uncut_error else PROBE_MAX_TOKENS
        self.args, self.kwargs = first_tokens(*self._step_call, max_tokens, first_dim_only=self.first_dim_only)
        self.hidden = self.args[0]
        self.tokens = self.hidden.shape[:-1].numel()
        self.forward = self.forward_on(self.args, self.kwargs)

    def first_run(self) -> _Kept:
        """The first run of the layer kept. Where its arguments, cut to the probe's tokens, do not fit together (a
        dimension other than the sequence's as long as it, such as a rotary table's head size, was cut too), they
        are cut again along the first such dimension of each argument only (`first_tokens`). Where those do not run
        either, the layer's hidden states hold more than (batch, sequence, hidden), so that the cut takes the wrong
        dimension (DeepSeek-V4's hyper-connection streams after the sequence, ProphetNet's n-gram streams stacked
        along it), or the layer reads state of the step's length from elsewhere: it runs on the call's own
        arguments, uncut (`uncut_error` says why), as the step would run it kept. A device too small for that raises
        an out-of-memory error that says so, in the first step, before any plan was applied."""
        for first_dim_only in (False, True):
            if first_dim_only:
                self.first_dim_only = True
                self._cut()
            try:
                return self.run_kept(self.forward)
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, ValueError) as error:
                if self.tokens == self.step_tokens:  # not cut: the layer's own error
                    raise
                failed = error
        self.uncut_error = f"its arguments cut to fewer tokens do not run ({str(failed).splitlines()[0][:160]})"
        self._cut()
        try:
            return self.run_kept(self.forward)
        except torch.OutOfMemoryError as error:
            raise torch.OutOfMemoryError(
                f"hf_offload: memory_budget probes {type(self.layer).__name__} on its call's {self.step_tokens} "
                f"tokens, as {self.uncut_error}, and that does not fit on the device: no plan can be made for a "
                "first step this long. Start with shorter steps (the probes then run on those), or offload without "
                f"memory_budget. {error}"
            ) from error

    def forward_on(self, args: tuple, kwargs: dict) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The layer's forward on these arguments, from a fresh leaf copy of their hidden states: that leaf, and the
        output. It refers to the layer, not to this object, which holds it: a cycle would keep the step's arguments
        (and the hooks on them) alive until a garbage collection."""
        layer, hidden, rest = self.layer, args[0], args[1:]

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            x = hidden.detach().clone().requires_grad_(True)
            return x, first_tensor(layer(x, *rest, **kwargs))

        return forward

    def run_kept(self, forward: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> _Kept:
        return _run_kept(self.layer, forward, self.parameters, self.pointers, self.meter)

    def kept_and_checkpointed(self) -> tuple[_Kept, float | None]:
        """The layer kept (`_run_kept`), and its backward's seconds selectively checkpointed, which recomputes: each
        of the `_PROBE_RUNS`, the two interleaved, the fastest after the first.

        Where the first kept run found an op writing into an output a selective checkpoint keeps
        (`_Kept.selective_written_by`), the layer is never checkpointed selectively, and it is not run so either: its
        recomputation may fail torch's own check of the checkpoint's cache (peft 0.22's LoRA on a mixture's experts
        scales `B @ A` in place). Its seconds are then None."""
        kept_runs, checkpointed_s = [], []
        for run in range(_PROBE_RUNS):
            kept_runs.append(self.run_kept(self.forward) if run else self.first_run())
            if kept_runs[0].selective_written_by is not None:
                continue
            with checkpointing_as(self.layer, selective_checkpoint_function()):
                x, out = self.forward()
            checkpointed_start = self.meter.mark()
            _gradients(out, x, self.parameters)
            checkpointed_s.append(self.meter.seconds(checkpointed_start, self.meter.mark()))
            del x, out
        return _fastest(kept_runs), min(checkpointed_s[1:]) if checkpointed_s else None

    def quadratic_parts(self, kept: _Kept) -> tuple[dict[str, int], str | None]:
        """The parts of `kept`'s bytes that grow with the square of the tokens (`_quadratic_part`), by the name of
        their `_Kept` field less `_bytes`, or why they were not measured (every part then 0).

        Once more on the first half and the first quarter of the tokens: eager attention saves tokens x tokens
        weights a head, whose bytes a profile scaled in proportion misses at a longer step (2048 -> 4096 tokens:
        predicted 8.34 GB, peaked 10.35). Three lengths, as a part that does not grow (a constant) would blur two.
        """
        none = {"saved": 0, "selective": 0, "working": 0, "forward_working": 0}
        if self.hidden.dim() != 3 or self.hidden.shape[-2] < 4:  # packed sequences (2-d) cannot be cut
            return none, None
        runs = [(self.tokens, kept)]
        try:
            for fewer in (self.tokens // 2, self.tokens // 4):
                args, kwargs = first_tokens(self.args, self.kwargs, fewer, first_dim_only=self.first_dim_only)
                run = self.run_kept(self.forward_on(args, kwargs))
                runs.append((args[0].shape[:-1].numel(), run))
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError) as error:
            # `first_tokens` cuts every dimension as long as the sequence: where another has that size too (a
            # head size equal to a short step's length), the cut arguments do not fit together.
            return none, f"its arguments cut to fewer tokens do not run ({str(error).splitlines()[0][:160]})"
        return {name: _quadratic_part([(n, getattr(run, f"{name}_bytes") or 0) for n, run in runs])
                for name in none}, None  # fmt: skip

    def run_tiled(self, tiling: Callable[[int], Any]) -> tuple[_Kept, _Kept, float, int | None]:
        """The layer tiled in chunks of a half and of a quarter of the tokens, the backward's working bytes per
        chunk token (the difference of the two), and with a memory counter the whole-sequence phase's bytes (saved
        and the backward's peak, in chunks too small to matter).

        Raises whatever the layer's code raises on a chunk of its tokens (one that reads a full-length mask, one
        whose output is not its hidden states): the probe's finding that it cannot be tiled, said once in the log,
        never an error out of the step. The untiled runs have shown that the layer itself works on these arguments.
        """
        chunks = [self.tokens // 2, self.tokens // 4]
        if self.meter.device is not None:  # only a memory counter sees the whole-sequence phase
            chunks.append(max(1, self.tokens // SEQUENCE_PHASE_CHUNKS))
        runs = []
        for chunk in chunks:
            with tiling(chunk):
                runs.append(_fastest([self.run_kept(self.forward) for _ in range(_PROBE_RUNS)]))
        half, quarter, *smallest = runs
        per_token = max(0.0, (half.working_bytes - quarter.working_bytes) / (self.tokens // 2 - self.tokens // 4))
        return half, quarter, per_token, smallest[0].saved_bytes + smallest[0].working_bytes if smallest else None

    def less_a_chunk(self, run: _Kept, per_token: float) -> int:
        """`run`'s working bytes (in chunks of a quarter of the tokens) less its chunk's share."""
        return max(0, round(run.working_bytes - per_token * (self.tokens // 4)))

    def probe_tiled_mlp(self, probe: LayerProbe, kept: _Kept, tile: Callable[[int], Any]) -> None:
        """Sets in `probe` what the layer measured with its MLP tiled (`tile`), or why it cannot be tiled."""
        try:
            _, quarter, per_token, probe.tiled_sequence_bytes = self.run_tiled(tile)
        except Exception as error:  # noqa: BLE001 - whatever the model's code raises on a chunk
            probe.mlp_tiling_error = _tiling_error(error)
            return
        extra_s = max(0.0, quarter.backward_s - kept.backward_s)
        probe.profile = dataclasses.replace(probe.profile, tiled_saved_bytes=quarter.saved_bytes, tiled_extra_s=extra_s)
        probe.tiled_working_bytes, probe.chunk_bytes_per_token = self.less_a_chunk(quarter, per_token), per_token

    def probe_tiled_whole(self, probe: LayerProbe, kept: _Kept, tile_layer: Callable[[int], Any]) -> None:
        """Sets in `probe` what the layer measured tiled whole (`tile_layer`, `_tiled_whole`), or why it cannot be
        tiled."""
        if self.hidden.dim() != 3:  # packed sequences (a vision tower's): run untiled, not tiled
            probe.layer_tiling_error = (
                f"its calls' hidden states are {self.hidden.dim()}-d, not (batch, sequence, hidden)"
            )
            return
        if kept.kept_type is not None:
            # Decided from the kept run, which every rank ran alike, before a chunk runs: the ranks' layers may get
            # different masks (a mask on one rank, none on another), so a tiled run refused on one rank only would
            # leave the others waiting in the ring's exchange.
            probe.layer_tiling_error = (f"it saves {kept.kept_type}s, as torch's ring attention does under context "
                                        "parallelism, which a tiled layer's attention by head groups does not "
                                        "run")  # fmt: skip
            return
        try:
            half, quarter, per_token, probe.layer_tiled_sequence_bytes = self.run_tiled(tile_layer)
        except Exception as error:  # noqa: BLE001 - whatever the model's code raises on a chunk
            probe.layer_tiling_error = _tiling_error(error)
            return
        _tiled_whole(probe, kept, half, quarter, per_token, self.less_a_chunk(quarter, per_token), self.layer,
                     self.hidden)  # fmt: skip


def _tiling_error(error: Exception) -> str:
    """What a tiled probe's failure says in the log: the library's own refusals as they are, the model's errors with
    their type."""
    return (
        str(error)
        if isinstance(error, ValueError)
        else f"it fails on a chunk of its tokens ({type(error).__name__}: {error})"
    )


def _tiled_whole(probe: LayerProbe, kept: _Kept, half: _Kept, quarter: _Kept, per_token: float, working: int,
                 layer: nn.Module, hidden: torch.Tensor) -> None:  # fmt: skip
    """Sets in `probe` what the layer tiled whole measured (`probe_layer`), less a chunk's share: what its forward
    holds at its peak (its input, its output and attention's sequence-long tensors: `layer_tiled_saved_bytes`), what
    its backward needs on top of that (`working`, over its input and output, is measured on top of its input), and
    its time beyond a full checkpoint's, which runs the layer's forward twice. Without a memory counter (the CPU test
    mode), `layer_bytes_per_token`'s counts instead; where the config does not give attention's shape, nothing (the
    action is then not offered)."""
    tokens, input_bytes = probe.tokens, probe.profile.input_bytes
    if quarter.forward_working_bytes is not None and half.forward_working_bytes is not None:
        forward_per_token = max(0.0, (half.forward_working_bytes - quarter.forward_working_bytes)
                                / (tokens // 2 - tokens // 4))  # fmt: skip
        saved = max(input_bytes, round(quarter.forward_working_bytes - forward_per_token * (tokens // 4)))
        per_token = max(per_token, forward_per_token)
    else:
        counts = layer_bytes_per_token(layer, hidden.element_size())
        if counts is None:
            probe.layer_tiling_error = (f"{type(layer).__name__}'s attention module has no config that gives its "
                                        "shape, and nothing here measures memory")  # fmt: skip
            return
        saved = input_bytes + counts[0] * tokens
        # The backward's count holds the input, the output's gradient and the input's; here the working bytes are the
        # gradients of the input and of the weights.
        working = counts[1] * tokens - input_bytes + max(0, working - input_bytes)
    extra = quarter.forward_s + quarter.backward_s - 2 * kept.forward_s - kept.backward_s
    probe.profile = dataclasses.replace(probe.profile, layer_tiled_saved_bytes=saved,
                                        layer_tiled_extra_s=max(0.0, extra))  # fmt: skip
    probe.layer_tiled_working_bytes = max(0, input_bytes + working - saved)
    probe.layer_chunk_bytes_per_token = per_token


def layer_kind(layer: nn.Module) -> tuple:
    """Layers of one kind (class, parameter shapes, attention type) have one profile: probing each is enough."""
    shapes = tuple((name, tuple(p.shape), p.requires_grad) for name, p in layer.named_parameters())
    return type(layer), shapes, getattr(layer, "attention_type", None)


def measure_link_bandwidth(meter: Meter, device: torch.device, pin_memory: bool,
                           room_bytes: int | None = None) -> tuple[float, float]:  # fmt: skip
    """Measure the bandwidth between the device and the host, each way.

    Each direction is timed on 64 MiB of copies, after a warm-up copy. The probe runs inside the first profiled step,
    whose peak must stay under the budget too: with `room_bytes` (what the budget leaves above the memory allocated
    now) the device buffer takes at most half of it (the allocator rounds sizes up) and is copied as many times as
    64 MiB needs, back to back on one stream, so the launch gaps between copies stay small. A 64 MiB buffer under
    ZeRO-3's step, whose activations were a few tens of MiB over 2 GB of DeepSpeed's buffers, put the profiled
    step 0.6% over the budget on two H200s.

    Args:
        meter: the clock: timing events on the engine's device, or the process's CPU time in the CPU test mode.
        device: the device to copy from and to.
        pin_memory: whether the host buffer is pinned, as the engine's pool is.
        room_bytes: the device bytes the probe may allocate; None (no memory counter): 64 MiB.

    Returns:
        `(device_to_host, host_to_device)`, in bytes per second.
    """
    nbytes = link_probe_bytes(room_bytes)
    copies = _BANDWIDTH_PROBE_BYTES // nbytes
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    rates = []
    for destination, origin in ((host, on_device), (on_device, host)):
        destination.copy_(origin, non_blocking=True)
        start = meter.mark()
        for _ in range(copies):
            destination.copy_(origin, non_blocking=True)
        rates.append(copies * nbytes / max(meter.seconds(start, meter.mark()), 1e-9))
    return rates[0], rates[1]


def link_probe_bytes(room_bytes: int | None) -> int:
    """The size of the link probe's device buffer: half of `room_bytes`, from 1 MiB (smaller copies time their
    launches more than the link) to 64 MiB, a power of two so that whole copies make up the 64 MiB timed."""
    if room_bytes is None:
        return _BANDWIDTH_PROBE_BYTES
    fits = max(room_bytes // 2, _BANDWIDTH_PROBE_MIN_BYTES)
    return min(_BANDWIDTH_PROBE_BYTES, 1 << (fits.bit_length() - 1))


def call_argument_storages(args: tuple, kwargs: dict) -> dict[int, tuple[int, bool]]:
    """The tensors a decoder layer's call is given besides its hidden states (the attention mask, the rotary tables,
    position ids, an encoder's states), by storage: data pointer -> (bytes, whether they grow with the square of the
    step's tokens: an eager mask, `[batch, 1, tokens, tokens]`).

    The model makes them once a step before its layers and holds them until the layers' backward (a checkpoint keeps
    its call's arguments for the recomputation), shared by every layer: memory no layer's probe counts. On two H200s
    (8 layers, eager attention, 1920 tokens) the mask alone was 14.7 MB a plan's model missed. A tensor with two
    dimensions as long as the hidden states' sequence counts as quadratic (a head size as long as a short step's
    sequence reads so too, the larger count)."""
    hidden = args[0]
    sequence = hidden.shape[-2] if hidden.dim() >= 2 else hidden.shape[0]
    storages = {}
    for value in tree_flatten((args[1:], {name: v for name, v in kwargs.items() if not is_cache(v)}))[0]:
        if not isinstance(value, torch.Tensor) or is_parameter_or_view(value) or value.device != hidden.device:
            continue
        storage = value.untyped_storage()
        quadratic = sequence > 1 and sum(size == sequence for size in value.shape) >= 2
        storages[storage.data_ptr()] = (storage.nbytes(), quadratic)
    return storages


def _without_the_cache(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A layer call's arguments with the step's cache left out and `use_cache` off, by name or by position: the
    step's KV cache (transformers makes one even in training) must not grow by the probes' keys and values, and a
    model may pass them positionally (RecurrentGemma: `layer(hidden, position_ids, mask, use_cache, cache)`).

    `use_cache` is added only where the layer's forward takes it, by name or through `**kwargs`: xLSTM's block
    (`forward(x, state=None)`) has no cache argument, and the probe's call raised a TypeError. A forward whose
    signature inspect cannot read gets it only where the step's call passed it."""
    args = tuple(None if is_cache(value) else value for value in args)
    kwargs = {name: None if name in CACHE_ARGUMENTS or is_cache(value) else value for name, value in kwargs.items()}
    try:
        parameters = list(inspect.signature(layer.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature inspect reads: by name only
        parameters = []
    positional = [p.name for p in itertools.takewhile(lambda p: p.kind in _POSITIONAL, parameters)]
    if "use_cache" in positional[: len(args)]:
        position = positional.index("use_cache")
        return args[:position] + (False,) + args[position + 1 :], kwargs
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if "use_cache" in kwargs or any(
        p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == "use_cache" and p.kind in by_name) for p in parameters
    ):
        return args, {**kwargs, "use_cache": False}
    return args, kwargs


def first_tokens(args: tuple, kwargs: dict, max_tokens: int, first_dim_only: bool = False) -> tuple[tuple, dict]:
    """A decoder layer's arguments cut to the first tokens of each sequence, at most `max_tokens` in all.

    The first tokens of a causal sequence are a sequence of their own: the hidden states are cut along their
    sequence dimension, every other tensor argument along each dimension as long as the sequence (position ids and
    embeddings, cache positions, both sequence dimensions of a 4-d attention mask, the keys and values that Gemma 3n's
    layers share in a `UserDict`, which is copied, so that a layer storing its own there leaves the step's alone).
    Short calls are returned unchanged, and so are packed ones (a vision tower's 2-d hidden states, whose sequences'
    bounds other arguments such as `cu_seqlens` give: cutting would break them).

    With `first_dim_only`, an argument of fewer than 4 dimensions is cut along the first dimension as long as the
    sequence only: where another is as long (rotary tables of 32 values a head at a length of 32 tokens), cutting
    every such dimension makes arguments that do not fit together.
    """
    hidden = args[0]
    batch, length = hidden.shape[:-2].numel(), hidden.shape[-2]
    if batch * length <= max_tokens or hidden.dim() < 3:  # 2-d: packed sequences, their bounds in other arguments
        return args, kwargs
    keep = max(1, max_tokens // batch)

    def cut(value: Any) -> Any:
        if isinstance(value, UserDict):  # a pytree leaf, unlike a dict
            return type(value)({key: tree_map(cut, item) for key, item in value.items()})
        if not isinstance(value, torch.Tensor):
            return value
        dims = [dim for dim, size in enumerate(value.shape) if size == length]
        for dim in dims[:1] if first_dim_only and value.dim() < 4 else dims:
            value = value.narrow(dim, 0, keep)
        return value.contiguous()

    return (hidden[..., :keep, :].contiguous(), *tree_map(cut, args[1:])), tree_map(cut, kwargs)
