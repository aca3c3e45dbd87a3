"""The saved-tensor hooks that move activations to host memory and back.

Streams, per device:
  * the compute stream: whatever stream the forward (or, in backward, autograd) runs the model's kernels on.
    It is read from `current_stream()` at each pack and unpack, *before* any `with stream(...)` block: inside
    one, `current_stream()` answers the side stream, and a wait on it would silently order nothing.
  * a device-to-host (D2H) stream for the forward copies, and a host-to-device (H2D) stream for the reloads,
    so that both directions can run at once (the link is full duplex) and neither queues behind compute.

Lifetimes:
  * Each offloaded storage span is a `_HostCopy`, owned by the `_SavedTensor` handles that autograd keeps in
    its graph. The graph's lifetime is the copy's lifetime: when backward frees a node (or the whole graph is
    dropped because backward never ran), the copy dies and returns its pinned block to the pool. The engine
    holds only weak references to copies, so nothing outlives the graph that saved it.
  * The GPU original stays referenced until its D2H copy has finished (the *forward window*); the allocator
    could otherwise hand its memory to a new tensor while the copy still reads it. Finished copies are
    released by polling their events; the compute stream waits only when the window (bytes, and optionally
    a tensor count) is full.
  * Reloads go into memory allocated on the compute stream, so once the compute stream has waited on the
    reload's event the buffer follows ordinary compute-stream lifetime rules (no `record_stream`). Because
    that memory may have just been freed by compute-stream kernels still queued, the H2D stream first waits
    for the compute stream.
  * Pinned blocks are reused only by D2H copies; at the start of each step the D2H stream waits for the H2D
    stream, so a block is never overwritten while an earlier reload still reads it.

Standing aside (`standing_aside`): when offloading cannot help (a model compiled as a whole, a step whose peak it
cannot lower, a memory plan that keeps every layer), a region entered then does not push the saved-tensor hooks at
all, so autograd calls no Python per saved tensor (about 3 us each, 1,441 a step on a 36-layer model) and the step
costs what it costs without the library. If offloading rejoins inside such a region (a longer step, a new plan), the
hooks are pushed there and then, provided nothing else pushed saved-tensor hooks since the region was entered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from .host_memory import HostBlock, HostCaps, PinnedHostPool, host_memory_cap, host_reserve
from .options import DEFAULT_WINDOW_BYTES, MIB, OffloadOptions, check_option_names, current_accelerator_type
from .peak import DevicePeakCounter, PeakReport, StepPeakWatch, queue_after_backward
from .policy import TailPlanner, kept_reason, parameter_storages, storage_span
from .stats import STAND_ASIDE_REASONS, StatsRecorder

if TYPE_CHECKING:  # `memory_plan`'s annotation only
    from .memory_budget.simulate import Plan

__all__ = ["OffloadActivations", "NoOpManager", "default_prefetch_window_bytes", "top_saved_tensors_pack_hook"]

logger = logging.getLogger(__name__)

# The default prefetch window holds this many of the step's largest copies. Two keep the link busy while
# backward computes on the one before (a 128 MiB window held one 256 MiB MLP activation at a time, and the link
# idled through every node that computes longer than a copy). Four also cover the output head's backward at a
# large vocabulary (see `prefetch_hook`). It stays below one transformer block's saved activations (about six
# of the largest), in a backward whose memory is below the loss's peak.
_PREFETCH_WINDOW_COPIES = 4

_IDLE, _FORWARD, _BACKWARD = "idle", "forward", "backward"


def default_prefetch_window_bytes(largest_copy_bytes: int) -> int:
    """The prefetch window of a step whose window is not set (`prefetch_window_bytes=None`): four of its largest
    copies, and at least the default window."""
    return max(DEFAULT_WINDOW_BYTES, _PREFETCH_WINDOW_COPIES * largest_copy_bytes)


@dataclasses.dataclass
class _OpenRegion:
    """A `with` block of the engine not yet exited: the pack hook that was on top of the saved-tensor hooks stack
    when it was entered, whether this engine's hooks are pushed in it, and why not (the reason offloading stood
    aside at its entry)."""

    top_at_entry: Any
    hooks_pushed: bool
    stood_aside: str | None
    training: bool  # gradients enabled at entry: a region under no_grad (evaluation) is no training step
    step_at_entry: Any  # the step's counters at entry: other ones at exit if a step began inside


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """What a pack hook returns for a tensor that stays in place.

    Not the tensor itself: for a saved *output*, that tensor's grad_fn is the very node that saves it, and a
    hook's return value is held strongly, so node -> saved tensor -> grad_fn -> node would be a cycle that
    leaks the whole graph whenever its backward never runs. A detached alias shares storage and version
    counter, and autograd re-attaches the graph on unpack.
    """
    return tensor.detach()


class NoOpManager(saved_tensors_hooks):
    """Context manager that suspends offloading inside its region.

    Only the innermost `saved_tensors_hooks` context sees a saved tensor, so hooks that keep tensors in place,
    pushed inside an offloading context, keep that region's tensors where they are.

    Example:

    ```python
    with OffloadActivations():
        hidden = trunk(inputs)
        with NoOpManager():  # the head's activations stay on the device
            logits = head(hidden)
    ```
    """

    def __init__(self) -> None:
        # Functions, not this object's bound methods: a context whose hooks refer to it is a cycle, which only the
        # garbage collector frees, and an exempt region's holds its engine and, through the memory budget's
        # controller, the model's layers (a dropped model's GPU memory stayed allocated until a full collection).
        super().__init__(_kept, _unchanged)


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _ExemptRegion(NoOpManager):
    """A NoOp region that tells its engine what it kept, so the statistics account for every tensor."""

    def __init__(self, engine: OffloadActivations, ends_forward: bool, reason: str) -> None:
        super().__init__()
        self._engine = engine
        self._ends_forward = ends_forward

        def keep(tensor: torch.Tensor) -> torch.Tensor:  # a closure over the engine, not over the region (above)
            engine._keep(tensor, reason)
            return _kept(tensor)

        self.pack_hook = keep

    def __enter__(self) -> None:
        if self._ends_forward:
            self._engine._forward_ends()
        super().__enter__()


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
        self.inflight: deque[_HostCopy] = deque()  # forward copies whose GPU original is still held
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


class _HostCopy:
    """One storage span copied to the host, shared by every saved tensor that lies inside it."""

    __slots__ = (
        "engine", "lane", "pool", "block", "host", "dtype", "start", "numel", "nbytes", "position", "step",
        "source", "d2h_done", "reloaded", "reload_done", "prefetched", "consumed", "users", "unpacks_left",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, engine: OffloadActivations, lane: _Lane, pool: PinnedHostPool, block: HostBlock,
                 tensor: torch.Tensor, start: int, numel: int, position: int, step: _Step) -> None:  # fmt: skip
        self.engine = engine  # a graph that still holds copies keeps its engine alive for the backward
        self.lane = lane
        self.pool = pool
        self.block = block
        self.host = block.view(tensor.dtype, numel)  # the span's bytes on the host, as elements of its dtype
        self.dtype = tensor.dtype
        self.start = start  # first element of the span in the original storage
        self.numel = numel
        self.nbytes = numel * tensor.element_size()
        self.position = position  # index among the step's offload candidates (the tail planner's numbering)
        self.step = step
        self.source: torch.Tensor | None = None  # the GPU span, held while its copy may still read it
        self.d2h_done: Any = None
        self.reloaded: torch.Tensor | None = None  # the span back on the GPU
        self.reload_done: Any = None
        self.prefetched = False  # reloaded ahead of need: counts against the prefetch window until unpacked
        self.consumed = False  # every user has unpacked in the current backward
        self.users = 0
        self.unpacks_left = 0

    def __del__(self) -> None:
        # A reload nobody consumed may still be writing into its compute-stream buffer: keep the allocator from
        # reusing that memory until the H2D stream is past it.
        if self.reloaded is not None and self.reload_done is not None and not self.reload_done.query():
            self.reloaded.record_stream(self.lane.h2d.stream)
        self.pool.free(self.block)


class _SavedTensor:
    """What autograd stores in place of an offloaded tensor: its copy and its geometry within the copy."""

    __slots__ = ("copy", "size", "stride", "offset")

    def __init__(self, copy: _HostCopy, tensor: torch.Tensor) -> None:
        self.copy = copy
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset() - copy.start


class _Step:
    """One forward pass's offloaded copies, in save order, and the backward's prefetch cursor over them."""

    __slots__ = ("copies", "cursor", "backward_started", "prefetch_window_bytes", "end_of_forward", "prefetch_points",
                 "by_position", "burst_node", "burst", "__weakref__")  # fmt: skip

    def __init__(self) -> None:
        # Backward unpacks in roughly the reverse order of the saves, and a storage saved several times (a layer
        # norm's output read by q, k and v) is first unpacked by its last saver: a copy is listed again at each
        # later save, so that walking down the list reaches it when backward needs it first.
        self.copies: list[weakref.ref[_HostCopy]] = []
        self.cursor = -1  # next entry (walking down) that backward may prefetch
        self.backward_started = False
        self.prefetch_window_bytes = 0  # set when backward starts
        # Where the forward ended (the tail region or the first unpack): for each copy still in flight then,
        # (its position, a compute-stream marker, its completion event). Read at the next step, in GPU time.
        self.end_of_forward: list[tuple[int, Any, Any]] | None = None
        # Gradient hooks made by `prefetch_hook` for this step. With none, unpacks prefetch themselves; with some,
        # unpacks start only the reloads that no point started in time in an earlier step (`_unpack_reloads`).
        self.prefetch_points = 0
        self.by_position: dict[int, weakref.ref[_HostCopy]] | None = None  # made when a reload first needs it
        # The autograd node whose saved tensors backward is unpacking (its sequence number), and the copies (position,
        # users) unpacked for it so far: see `_note_burst`.
        self.burst_node: int | None = None
        self.burst: list[tuple[int, int]] = []


class OffloadActivations(saved_tensors_hooks):
    """Context manager under which tensors saved for backward move to (pinned) host memory and come back.

    Compatible with TRL's `OffloadActivations`: its four positional options mean the same thing. In the forward,
    each eligible saved tensor (on the accelerator, at least `min_offload_size` bytes, not a parameter, not
    saved already this step, not in the learned tail) is copied to a slice of a pinned host pool on a side
    stream; its GPU memory is released once the copy is done. In the backward, tensors come back on another
    side stream, prefetched in reverse pack order, so the copy for layer i-1 runs while layer i computes.

    The context may span only the forward (as when wrapping a Trainer's `compute_loss`) or forward and
    backward: everything is tied to autograd's saved tensors, not to the `with` block.

    Args:
        *args, **kwargs: the fields of [`OffloadOptions`] (`use_pin_memory`, `use_streams`, `min_offload_size`,
            `max_fwd_stash_size` may be positional, as in TRL; the others are keyword-only), validated there.
        options: an [`OffloadOptions`] instead of the individual values.

    Raises:
        ValueError: an option outside its rule, named with the values it accepts.
        TypeError: an unknown option, or `options` together with individual values.
    """

    def __init__(self, *args: Any, options: OffloadOptions | None = None, **kwargs: Any) -> None:
        if options is not None and (args or kwargs):
            raise TypeError(
                "OffloadActivations takes either options=OffloadOptions(...) or individual options, not both"
            )
        check_option_names(kwargs, "OffloadActivations")
        self.options = options if options is not None else OffloadOptions(*args, **kwargs)
        options = self.options
        self.device_type = options.device_type or current_accelerator_type()
        self.use_pin_memory = options.use_pin_memory and self.device_type not in (None, "cpu")
        # Whether each unpack starts the next reloads; a model layer whose `prefetch_hook`s time them turns it off.
        self.prefetch_on_unpack = True
        # What decides it from the model's layers (`set_prefetch_on_unpack_rule`), held weakly, or None.
        self._prefetch_on_unpack_rule: weakref.WeakMethod | None = None
        # Set by the model hooks of `get_act_offloading_ctx_manager` whenever one runs: a forward that saved tensors
        # while none ran was compiled as a whole, and the engine then stands aside (see `_begin_backward`).
        self.model_hooks_ran = False
        # Why offloading stands aside (one of `stats.STAND_ASIDE_REASONS`), or None: see `stand_aside`.
        self._standing_aside: str | None = None
        # The regions of this engine entered and not yet exited, innermost last (see the module docstring).
        self._regions: list[_OpenRegion] = []
        # The second step's phases, measured on the device's peak counter (`hf_offload.peak`); not under a memory
        # budget, whose controller resets that counter in its own profiled steps.
        self._peak_watch = StepPeakWatch(DevicePeakCounter(self.device_type).read_and_reset)
        # The memory budget's controller (`hf_offload.memory_budget.controller`), attached by
        # `get_act_offloading_ctx_manager` when `memory_budget` is set: its `plan` is the per-layer plan in force.
        self.budget_controller: Any = None
        self._set_aside = 0  # depth of `set_aside()` regions
        # The windows in force: the options', until a memory plan sizes them for its layers (`use_windows`).
        self.forward_window_bytes = options.forward_window_bytes
        self.prefetch_window_bytes = options.prefetch_window_bytes
        self.head_prefetch_window_bytes: int | None = None

        self._device_module = torch.get_device_module(self.device_type) if self.device_type else None
        self._lanes: dict[torch.device, _Lane] = {}
        self._pool: PinnedHostPool | None = None  # created at first use: the cap reads the memory available then
        self._planner = TailPlanner(options.keep_tail, max_tail_bytes=options.forward_window_bytes)
        self._stats = StatsRecorder()
        self._parameter_pointers: set[int] = set()
        self._parameters: list[weakref.ref[torch.Tensor]] = []
        self._module_hooks: list[RemovableHandle] = []
        self._phase = _IDLE
        self._step = _Step()
        self._dedup: dict[int, tuple[weakref.ref, weakref.ref[_HostCopy]]] = {}  # storage ptr -> (storage, copy)
        # Positions (the tail planner's numbering) of the copies whose reload no prefetch point started before its
        # unpack needed it, in any step so far: unpacks start those reloads from then on. Where points take over
        # from unpacks, some may never fire: the modules that place them were compiled (regional compilation traces
        # the attention's hook away, while the head's, outside the layers, still fires), or a block has no
        # attention (a hybrid model's state-space layers). Learned from the misses rather than guessed from the
        # model, and kept for the run: a stale position costs one reload started a block early, at most.
        self._unpack_reloads: set[int] = set()
        # Position -> the positions of the copies that an earlier step unpacked for the same autograd node: backward
        # needs them at the same moment (a checkpointed block's several inputs, a norm's input and statistics), so a
        # reload of one starts the others, past the one-block-ahead rule of checkpointing (`_note_burst`).
        self._burst_mates: dict[int, tuple[int, ...]] = {}
        self._warned: set[str] = set()
        # Whether `remove_hooks` ran: without its model's hooks the context would offload the head and the loss too,
        # so it offloads nothing from then on, and says so (`__enter__`).
        self._removed = False
        # pack runs on the forward's thread, unpack on autograd's device threads: one lock keeps the per-step
        # tables consistent if a user overlaps them.
        self._lock = threading.RLock()
        if self.device_type is None:
            self.warn_once("inactive", "activation offloading is inactive: no accelerator is available, so "
                            "saved tensors stay where they are and training proceeds without it")  # fmt: skip
        # Hooks that referenced `self` would form a cycle (self -> pack_hook -> self) that keeps the pinned pool
        # alive until a full garbage collection after the user drops the context. The pack hook refers to the
        # engine weakly; the unpack hook needs no engine at all: each copy holds its own.
        engine_ref = weakref.ref(self)

        def pack(tensor: torch.Tensor) -> Any:
            if torch.compiler.is_compiling():  # traced: nothing of the engine in compiled code (see compile_guard)
                return tensor
            engine = engine_ref()
            if engine is None or not tensor.numel():  # an empty tensor holds nothing to move or to count (below)
                return _kept(tensor)
            if engine._standing_aside is not None:
                return engine._keep_standing_aside(tensor)
            return engine._pack(tensor)

        pack.offloading_engine = engine_ref  # tells `__enter__` of another engine that this one is active
        super().__init__(pack, _unpack)

    # ------------------------------------------------------------------ public helpers

    @property
    def memory_plan(self) -> Plan | None:
        """The memory budget's plan in force (`hf_offload.memory_budget.simulate.Plan`); None without a budget or
        before the profiled steps are over."""
        return None if self.budget_controller is None else self.budget_controller.plan

    @property
    def budget(self) -> Any:
        """Deprecated: the memory budget's controller is `budget_controller`, and the plan in force `memory_plan`."""
        warnings.warn("OffloadActivations.budget is deprecated: the memory budget's controller is budget_controller, "
                      "and the plan in force memory_plan", DeprecationWarning, stacklevel=2)  # fmt: skip
        return self.budget_controller

    @property
    def peak_report(self) -> PeakReport | None:
        """The second step's peak, where it was set and what offloading took off it (`hf_offload.peak`); None
        before that step's end, without a device peak counter (the CPU test mode), or under a memory budget."""
        return self._peak_watch.report

    @property
    def standing_aside(self) -> str | None:
        """Why offloading stands aside (moves nothing), one of `stats.STAND_ASIDE_REASONS`, or None when it offloads.

        "compiled": the model was compiled as a whole; "cannot_lower_peak": the measured step showed that offloading
        lowers the peak by less than `min_peak_reduction`, until a longer step arrives; "planned": the memory
        budget's plan keeps every layer.
        """
        return self._standing_aside

    def stand_aside(self, reason: str) -> None:
        """Offloading moves nothing from now on: the regions entered from now on push no saved-tensor hooks, and in
        one already entered every saved tensor is kept (and counted).

        Args:
            reason: one of `stats.STAND_ASIDE_REASONS`.
        """
        if reason not in STAND_ASIDE_REASONS:
            raise ValueError(f"reason must be one of {STAND_ASIDE_REASONS}, got {reason!r}")
        self._standing_aside = reason

    def rejoin(self) -> None:
        """Offloading resumes, from the next saved tensor on.

        In a region entered while it stood aside, the hooks are pushed now, where the region's entry would have pushed
        them: under any saved-tensor hooks pushed since. Offloading may rejoin from a decoder layer's pre-hook (the
        memory budget re-plans there), which runs inside that layer's checkpoint: pushed on top, ours would take the
        tensors the checkpoint drops, and the checkpoint's exit would pop ours. So the hooks above are taken off and
        pushed back above ours, the same objects in the same order, and each context's exit still pops its own. Where
        the stack cannot be read or changed (an older torch, hooks disabled), offloading resumes from the next region
        on, with a warning.
        """
        if self._standing_aside is None:
            return
        self._standing_aside = None
        self._refresh_parameter_pointers()  # not refreshed while standing aside
        region = self._regions[-1] if self._regions else None
        if region is None or region.hooks_pushed:
            return
        if not self._push_hooks_under_later_ones(region.top_at_entry):
            self.warn_once("rejoin_late", "hf_offload: offloading resumes from the next step: it stood aside when "
                            "this step's region was entered, and the saved-tensor hooks entered since then cannot be "
                            "read or changed here (an older torch, or hooks disabled)")  # fmt: skip
            return
        region.hooks_pushed = True

    def _push_hooks_under_later_ones(self, top_at_entry: Any) -> bool:
        """Pushes this engine's hooks just above `top_at_entry`, below the hooks pushed since; False if it cannot."""
        autograd = torch._C._autograd
        enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", lambda: True)
        if top_at_entry is ... or not enabled():
            return False
        later: list[tuple[Any, Any]] = []
        while (top := top_saved_tensors_pack_hook()) is not top_at_entry:
            if top is None or top is ...:  # the entry's hooks are gone from the stack: put back what was taken
                for pack, unpack in reversed(later):
                    autograd._push_saved_tensors_default_hooks(pack, unpack)
                return False
            later.append(_top_saved_tensors_hooks())
            autograd._pop_saved_tensors_default_hooks()
        super().__enter__()
        for pack, unpack in reversed(later):
            autograd._push_saved_tensors_default_hooks(pack, unpack)
        return True

    @property
    def active(self) -> bool:
        """Whether the context offloads anything: False without an accelerator (saved tensors then stay put)."""
        return self.device_type is not None

    def update_model_params(self, model: torch.nn.Module) -> None:
        """Never offload the storages of this model's parameters and buffers.

        The parameters and buffers are listed here, once: walking the module tree costs milliseconds per step on a
        large model, a few percent of a short step. Their storages are re-read at every step, so that a model moved
        between devices, or parameters whose storage is freed and gathered again (FSDP), are recognised. Parameters
        are held weakly. Call again if modules are added to the model (FSDP2's gathered parameters need not: they
        are `nn.Parameter`s, recognised as such when saved).

        Args:
            model: the model (the outermost wrapper, which owns FSDP1's flat parameters).
        """
        self._parameters = [weakref.ref(tensor) for tensor in (*model.parameters(), *model.buffers())]
        self._refresh_parameter_pointers()

    def prefetch_hook(self, window_bytes: int | None = None) -> Callable[[torch.Tensor], None]:
        """Return a gradient hook that starts the next reloads when backward reaches a tensor of this forward.

        The hook is meant for a tensor of the forward being packed: when backward reaches it, it starts the next
        reloads of that forward's backward, as an unpack does, and also before the first unpack. It is for model
        layers, which know better than unpacks when reloads fit:
          * The output head's backward runs right after the loss's, the step's memory peak without checkpointing,
            and before the first unpack; the link would otherwise idle through it.
          * With checkpointing, backward unpacks one tensor per block, its input, just as the block's
            recomputation begins: a reload started there stays allocated through the recomputed activations, the
            step's peak. A model layer that knows the blocks sets `prefetch_on_unpack` to False and registers this
            hook in the middle of each block instead, once that peak has passed and enough of the block's backward
            is left to hide the copy.

        The hook holds its engine and step weakly: a graph that outlives either keeps neither alive. Inside
        `set_aside()` the hook does nothing: that backward is not the step's.

        Args:
            window_bytes: reloads outstanding that this hook may start, at most (never more than the step's prefetch
                window); None: the step's window. The output head's hook passes a narrow one when a memory plan
                prefetches far ahead, since the loss's peak is then still close.

        Returns:
            A function of the gradient, for `tensor.register_hook`.

        Example:

        ```python
        def attention_done(module, args, output):
            output[0].register_hook(engine.prefetch_hook())

        attention.register_forward_hook(attention_done)
        ```
        """
        if self._set_aside:
            return _no_prefetch
        self._step.prefetch_points += 1
        engine_ref, step_ref = weakref.ref(self), weakref.ref(self._step)

        def hook(grad: torch.Tensor) -> None:
            engine, step = engine_ref(), step_ref()
            if engine is not None and step is not None:
                engine._prefetch_from_hook(step, window_bytes)

        return hook

    def set_prefetch_on_unpack_rule(self, rule: Callable[[], bool]) -> None:
        """Give the engine what decides `prefetch_on_unpack` from the model's layers (a bound method, held weakly).

        The model's hooks decide it as each forward begins; `refresh_prefetch_on_unpack` decides it again when the
        layers change between that and the step's backward (a memory plan applied at the same forward's start).

        Args:
            rule: returns whether unpacks start the next reloads, from the layers' checkpointing now.
        """
        self._prefetch_on_unpack_rule = weakref.WeakMethod(rule)

    def refresh_prefetch_on_unpack(self) -> None:
        """Decide `prefetch_on_unpack` again by the rule the model's hooks gave (none given: unchanged)."""
        rule = None if self._prefetch_on_unpack_rule is None else self._prefetch_on_unpack_rule()
        if rule is not None:
            self.prefetch_on_unpack = rule()

    def exempt(self, ends_forward: bool = False, reason: str = "exempt") -> NoOpManager:
        """Return a region whose saved tensors stay in place and are counted as kept.

        Each call makes a new context object, so regions can nest. `ends_forward=True` marks the tail of the forward
        (final norm, head, loss): memory peaks there, so on entering it the compute stream waits for the copies
        still in flight (in GPU time they are usually done) and their originals are released for the loss to reuse.

        Args:
            ends_forward: whether the region is the tail of the forward.
            reason: the key of `stats.KEPT_REASONS` its tensors are counted under.

        Returns:
            The region, a [`NoOpManager`] that reports what it kept to this engine.

        Example:

        ```python
        with engine:
            hidden = trunk(inputs)
            with engine.exempt(ends_forward=True):
                loss = head(hidden, labels)
        ```
        """
        return _ExemptRegion(self, ends_forward, reason)

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Run a region outside the step: its saved tensors stay in place, uncounted.

        For running a layer on the side inside a forward, as the memory budget's profiler does. The gradient hooks
        that `prefetch_hook` returns inside the region start no reloads.

        Example:

        ```python
        with engine.set_aside():
            out = layer(hidden.detach().requires_grad_())
            torch.autograd.grad(out.sum(), list(layer.parameters()))
        ```
        """
        self._set_aside += 1
        try:
            with NoOpManager():
                yield
        finally:
            self._set_aside -= 1

    def use_windows(self, forward_window_bytes: int, prefetch_window_bytes: int | None,
                    head_prefetch_window_bytes: int | None = None) -> None:  # fmt: skip
        """Size the copy windows for the steps to come.

        Used by a memory plan, which knows how many bytes it lets leave and come back at once. The tail stays
        bounded by the option `forward_window_bytes`: it is held through the head's peak.

        Args:
            forward_window_bytes: the forward copies in flight, in bytes (> 0).
            prefetch_window_bytes: what backward reloads ahead of need, in bytes; `None` sizes it per step.
            head_prefetch_window_bytes: what the output head's backward may reload ahead, at most; None: as much as
                the prefetch window.

        Raises:
            ValueError: a value outside the rule of the option of the same name.
        """
        self.forward_window_bytes = OffloadOptions.rule("forward_window_bytes").check(
            forward_window_bytes, "forward_window_bytes"
        )
        self.prefetch_window_bytes = OffloadOptions.rule("prefetch_window_bytes").check(
            prefetch_window_bytes, "prefetch_window_bytes"
        )
        self.head_prefetch_window_bytes = OffloadOptions.rule("prefetch_window_bytes").check(
            head_prefetch_window_bytes, "head_prefetch_window_bytes"
        )

    def cap_tail(self, max_bytes: int | None) -> None:
        """Bound the tail (the last offload candidates of the forward, kept on the GPU) for the steps to come.

        Used by a memory plan chosen because its measured steps met the budget: its later steps must not keep more
        of the tail than those did, and the tail only grows.

        Args:
            max_bytes: the bound, in bytes; None (or anything above it) restores the option `forward_window_bytes`.
        """
        bound = self.options.forward_window_bytes
        self._planner.set_max_tail_bytes(bound if max_bytes is None else min(bound, max_bytes))

    def is_innermost(self) -> bool:
        """Whether a tensor saved here and now would reach this engine's pack hook.

        Only then does a region of this engine (an exempt module, a layer plan's selective offload) change anything:
        when another saved-tensor hook sits on top (non-reentrant checkpointing inside a decoder layer, another
        exempt region), pushing hooks of this engine would *bypass* that one, and under checkpointing make autograd
        keep the very activations checkpointing drops. False too where saved-tensor hooks are disabled (entering one
        would raise); True where this torch cannot tell.
        """
        enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
        if enabled is not None and not enabled():
            return False
        top = top_saved_tensors_pack_hook()
        if top is ... or top is self.pack_hook:
            return True
        engine_ref = getattr(top, "offloading_engine", None)  # the hook itself, if the attribute was wrapped since
        return engine_ref is not None and engine_ref() is self

    def track_hook(self, handle: RemovableHandle) -> None:
        """Keep a module hook's handle, so that `remove_hooks` takes the hook off with the others.

        Args:
            handle: what `register_forward_hook` (or another `register_*` method) returned.
        """
        self._module_hooks.append(handle)

    def remove_hooks(self) -> None:
        """Remove every module hook installed for this context (by `get_act_offloading_ctx_manager`), and what a memory
        plan or `tile_mlp`/`tile_layer` set on the layers (each gets its own checkpointing and forward back).
        Idempotent. The context offloads nothing afterwards (entering it says so once): without its hooks it would
        move the head's and the loss's tensors too.

        Example:

        ```python
        engine = get_act_offloading_ctx_manager(model)
        ...
        engine.remove_hooks()  # the context's module hooks are off the model again
        ```
        """
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks.clear()
        self._removed = True

    def get_stats(self) -> dict[str, int | float]:
        """Return the counters of the most recent step: its forward and, once run, its backward.

        Reading stall times waits for the step's outstanding timing events.

        Returns:
            `steps`, `tensors_offloaded`, `bytes_offloaded`, `tensors_kept_<reason>` / `bytes_kept_<reason>` for
            each reason of `stats.KEPT_REASONS`, `prefetch_hits`, `prefetch_misses`, `inflight_hits`,
            `compute_wait_s` and `pinned_bytes`.

        Example:

        ```python
        print(format_summary(engine.get_stats(), engine.device_type))
        ```
        """
        return self._stats.step.as_dict(self._pinned_bytes())

    def consume_stats(self) -> dict[str, int | float]:
        """Return the counters summed over the steps since the last call, and reset them.

        Returns:
            The same keys as `get_stats`; `pinned_bytes` is the pool's size now, not a sum.
        """
        return self._stats.consume_total(self._pinned_bytes())

    def __enter__(self) -> OffloadActivations:
        self._phase = _IDLE  # the next pack starts a new step
        top = top_saved_tensors_pack_hook()
        outer = getattr(top, "offloading_engine", None)
        if outer is not None and outer() not in (None, self):
            # Only the innermost saved-tensor hooks see a tensor: the outer engine's options, tail and statistics
            # silently stop applying inside this region.
            self.warn_once("nested", "an activation offloading context was entered inside another one: tensors "
                            "saved in the inner region are handled by the inner context only (its own pinned pool, "
                            "windows and statistics). Use one context, and NoOpManager() to exempt a "
                            "region.")  # fmt: skip
        if self._removed:
            self.warn_once("removed", "hf_offload: this offloading context's hooks were removed (remove_hooks(), or "
                           "get_act_offloading_ctx_manager called again on its model), so it offloads nothing: use the "
                           "context that get_act_offloading_ctx_manager returned last.")  # fmt: skip
        region = _OpenRegion(top, hooks_pushed=self._standing_aside is None and not self._removed,
                             stood_aside=self._standing_aside, training=torch.is_grad_enabled() and not self._removed,
                             step_at_entry=self._stats.step)  # fmt: skip
        self._regions.append(region)
        if region.hooks_pushed:
            super().__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        region = self._regions.pop()
        for lane in self._lanes.values():
            self._release_finished(lane)
        if region.hooks_pushed:
            super().__exit__(*exc_info)
        faulted = exc_info[0] is not None
        if faulted:
            if self._stats.step is not region.step_at_entry:
                self._stats.discard_step()  # a step that did not complete is no step, and its partial counts none
            if self.budget_controller is not None and region.training and not self._regions:
                self.budget_controller.step_faulted()  # nor is it a measurement
        elif not region.hooks_pushed and region.training:
            # Standing aside, no pack hook ran, so no step began: a training region's step is counted here.
            self._stats.begin_step(stood_aside=region.stood_aside)

    # ------------------------------------------------------------------ forward

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self.device_type is None:
            return _kept(tensor)
        with self._lock:
            in_backward = self._note_pack()
            reason = kept_reason(
                tensor,
                device_type=self.device_type,
                min_offload_size=self.options.min_offload_size,
                parameter_pointers=self._parameter_pointers,
                in_backward=in_backward,
            )
            if reason is None:
                return self._offload(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            if reason == "not_on_accelerator" and nbytes >= self.options.min_offload_size:
                self.warn_once(reason, f"tensors saved on {tensor.device.type} are not offloaded (offloading "
                                f"moves {self.device_type} tensors): is the model on the CPU?")  # fmt: skip
            self._stats.kept(reason, tensor.numel() * tensor.element_size())
            return _kept(tensor)

    def _keep_standing_aside(self, tensor: torch.Tensor) -> torch.Tensor:
        """The pack hook's whole work while offloading stands aside: keep the tensor, count it. Called for every
        saved tensor of a step that may be short, so the lock is taken only where a step may begin."""
        if self._phase != _FORWARD:
            with self._lock:
                self._note_pack()
        self._stats.kept(self._standing_aside, tensor.numel() * tensor.element_size())
        return _kept(tensor)

    def _keep(self, tensor: torch.Tensor, reason: str) -> None:
        """Counts a tensor that a region of this engine kept without asking it (an exempt module)."""
        with self._lock:
            self._note_pack()
            self._stats.kept(reason, tensor.numel() * tensor.element_size())

    def _forward_ends(self) -> None:
        """The tail region begins: drain the copies in flight so the loss can reuse their memory."""
        with self._lock:
            if self._phase == _FORWARD:
                self._mark_end_of_forward(self._step, drain=True)
                self._peak_watch.forward_ends(self._stats.step.bytes_offloaded)

    def _note_pack(self) -> bool:
        """Starts a new step if this pack opens a forward; True if it happens inside a backward pass."""
        in_backward = torch._C._current_graph_task_id() != -1
        if not in_backward and self._phase != _FORWARD:
            self._begin_step()
        return in_backward

    def _begin_step(self) -> None:
        """A forward begins: learn from the previous step, then forget it (its copies live on through their
        own graph)."""
        if self._step.end_of_forward is not None:  # a forward that never reached its end teaches nothing
            self._planner.end_forward(_first_unfinished(self._step.end_of_forward))
        if self.budget_controller is None and self._standing_aside is None:  # nothing to measure while it stands aside
            report = self._peak_watch.step_begins()
            if report is not None:
                self._peak_measured(report)
        self._phase = _FORWARD
        self._step = _Step()
        self._dedup.clear()
        self._stats.begin_step(stood_aside=self._standing_aside)
        self._planner.begin_step()
        if self._standing_aside is None:  # standing aside, nothing is eligible: walking the parameters costs ~1 ms
            self._refresh_parameter_pointers()
        for lane in self._lanes.values():
            self._drain_inflight(lane)
            if lane.d2h is not None:
                lane.d2h.wait_for(lane.h2d.stream)  # pinned blocks freed by the last backward may be reused now

    def _offload(self, tensor: torch.Tensor) -> Any:
        start, numel = storage_span(tensor)
        nbytes = numel * tensor.element_size()
        storage = tensor.untyped_storage()
        shared = self._dedup.get(storage.data_ptr())
        if shared is not None:
            shared_storage, shared_copy = shared[0](), shared[1]()
            if (shared_storage is storage and shared_copy is not None and shared_copy.dtype == tensor.dtype
                    and shared_copy.start <= start
                    and start + numel <= shared_copy.start + shared_copy.numel):  # fmt: skip
                self._stats.kept("duplicate", nbytes)
                self._step.copies.append(shared[1])
                return self._saved(shared_copy, tensor)
        position = self._planner.candidates_seen
        if self._planner.next_candidate(tensor.dtype, tensor.dim(), nbytes):
            self._stats.kept("tail", nbytes)
            return _kept(tensor)
        block = self._host_pool().allocate(nbytes)
        if block is None:
            self._host_refused(nbytes)
            return _kept(tensor)
        lane = self._lane(tensor.device)
        copy = _HostCopy(self, lane, self._pool, block, tensor, start, numel, position, self._step)
        # Detached: a differentiable view would tie the graph to the copy (see `_kept`).
        self._copy_out(lane, copy, tensor.detach().as_strided((numel,), (1,), start))
        self._step.copies.append(weakref.ref(copy))
        self._dedup[storage.data_ptr()] = (weakref.ref(storage), weakref.ref(copy))
        self._stats.offloaded(nbytes)
        return self._saved(copy, tensor)

    def _copy_out(self, lane: _Lane, copy: _HostCopy, span: torch.Tensor) -> None:
        if lane.d2h is None:
            copy.host.copy_(span, non_blocking=True)  # ordered on the compute stream: span may go now
            return
        compute = lane.compute_stream()  # before any stream switch: see the module docstring
        self._make_room(lane, copy.nbytes, compute)
        lane.d2h.wait_for(compute)  # the span's producer kernels first
        with lane.d2h.entered_from(compute):
            copy.host.copy_(span, non_blocking=True)
        copy.d2h_done = self._device_module.Event(enable_timing=True)  # timed: see `_first_unfinished`
        copy.d2h_done.record(lane.d2h.stream)
        copy.source = span
        lane.inflight.append(copy)
        lane.inflight_bytes += copy.nbytes

    def _make_room(self, lane: _Lane, nbytes: int, compute: Any) -> None:
        """Releases finished copies; if the window is still full, makes compute wait for the oldest ones."""
        self._release_finished(lane)
        while lane.inflight and (
            lane.inflight_bytes + nbytes > self.forward_window_bytes
            or (self.options.max_fwd_stash_size is not None and len(lane.inflight) >= self.options.max_fwd_stash_size)
        ):
            self._retire_oldest(lane, compute)

    def _release_finished(self, lane: _Lane) -> None:
        # One D2H stream per lane finishes its copies in order, so only the front can be done.
        while lane.inflight and lane.inflight[0].d2h_done.query():
            self._release(lane, lane.inflight.popleft())

    def _drain_inflight(self, lane: _Lane) -> None:
        compute = lane.compute_stream()
        while lane.inflight:
            self._retire_oldest(lane, compute)

    def _retire_oldest(self, lane: _Lane, compute: Any) -> None:
        """Makes compute wait for the oldest copy, then releases its original: later compute-stream reuse of that
        memory is ordered after the copy."""
        oldest = lane.inflight.popleft()
        self._wait(compute, oldest.d2h_done)
        self._release(lane, oldest)

    @staticmethod
    def _release(lane: _Lane, copy: _HostCopy) -> None:
        """Drops a GPU original whose copy is done, or that the compute stream already waits for."""
        lane.inflight_bytes -= copy.nbytes
        copy.source = None

    @staticmethod
    def _drop_source(copy: _HostCopy) -> None:
        """Drops a GPU original kept past backward's start; its copy may still be reading it, and the host copy
        must stay intact for a second backward (retain_graph)."""
        if copy.source is not None and not copy.d2h_done.query():
            copy.source.record_stream(copy.lane.d2h.stream)
        copy.source = None

    # ------------------------------------------------------------------ backward

    def _prefetch_from_hook(self, step: _Step, window_bytes: int | None) -> None:
        with self._lock:
            if not step.backward_started:
                self._begin_backward(step, prefetch=False)
            self._prefetch(step, window_bytes)

    def _unpack(self, saved: _SavedTensor) -> torch.Tensor:
        with self._lock:
            copy = saved.copy
            if not copy.step.backward_started:
                self._begin_backward(copy.step)
            if not self.prefetch_on_unpack:  # mates matter only one block ahead (see `_prefetch`)
                self._note_burst(copy)
            lane = copy.lane
            compute = lane.compute_stream() if lane.h2d is not None else None
            if copy.source is not None:
                span = copy.source  # its copy never finished before backward: it never left the GPU
                self._stats.reload("inflight_hits")
            elif copy.reloaded is not None:
                span = copy.reloaded
                self._wait(compute, copy.reload_done)
                self._stats.reload("prefetch_hits")
            else:
                self._reload_now(copy, compute)
                span = copy.reloaded
                self._stats.reload("prefetch_misses")
                if compute is not None and copy.step.prefetch_points and not self.prefetch_on_unpack:
                    self._learn_unpack_reload(copy.position)
            if copy.prefetched:
                copy.prefetched = False
                lane.prefetched_bytes -= copy.nbytes
                lane.prefetched_copies -= copy.users == 1
            copy.unpacks_left -= 1
            if copy.unpacks_left <= 0:  # every saved tensor in this span has been handed to autograd
                copy.consumed = True
                self._drop_source(copy)
                copy.reloaded = None
                copy.unpacks_left = copy.users  # a second backward (retain_graph) unpacks all of them again
            if self.prefetch_on_unpack or not copy.step.prefetch_points:
                self._prefetch(copy.step)
            elif self._unpack_reloads:
                self._prefetch(copy.step, only=self._unpack_reloads)
            # as_strided's offset counts from the start of the storage: the source span starts at `copy.start`
            # of the original storage, a reloaded buffer at 0.
            return torch.as_strided(span, saved.size, saved.stride, span.storage_offset() + saved.offset)

    def _note_burst(self, copy: _HostCopy) -> None:
        """Groups the copies unpacked for one autograd node (told by its sequence number): a later step's reload of
        one of them starts the others too. A copy that several blocks saved (a mask shared by every layer) is a mate
        of each block's input but has no mates of its own: reloaded once, it stays for all of them."""
        step = copy.step
        node = torch._C._current_autograd_node()
        key = None if node is None else node._sequence_nr()
        if key is None or key != step.burst_node:
            step.burst_node, step.burst = key, [(copy.position, copy.users)]
            return
        if any(position == copy.position for position, _ in step.burst):
            return
        step.burst.append((copy.position, copy.users))
        for position, users in step.burst:
            if users == 1:
                self._burst_mates[position] = tuple(mate for mate, _ in step.burst if mate != position)

    def _learn_unpack_reload(self, position: int) -> None:
        """A copy was needed before any prefetch point reloaded it: from the next step on, an unpack reloads it."""
        if not self._unpack_reloads:
            logger.info(
                "hf_offload: a reload that the prefetch points should have started was missed (their modules "
                "compiled, or a block without attention): unpacks start such reloads from the next step on"
            )
        self._unpack_reloads.add(position)

    def _begin_backward(self, step: _Step, prefetch: bool = True) -> None:
        """The first unpack or prefetch hook of a step: keep unfinished copies' originals, start prefetching."""
        step.backward_started = True
        self._phase = _BACKWARD
        self._note_whole_model_compile(step)
        self._mark_end_of_forward(step, drain=False)
        self._peak_watch.backward_begins(self._stats.step.bytes_offloaded)
        if self._peak_watch.measuring:
            queue_after_backward(self._peak_watch.backward_ends)
        for lane in self._lanes.values():
            # Copies still in flight (no tail region drained them) keep their GPU original until it is
            # unpacked: reloading it later would only cost, and the memory is held at this point anyway.
            lane.inflight.clear()
            lane.inflight_bytes = 0
            lane.prefetched_bytes = lane.prefetched_copies = 0
        step.cursor = len(step.copies) - 1
        step.prefetch_window_bytes = self.prefetch_window_bytes
        if step.prefetch_window_bytes is None:
            largest = max((copy.nbytes for copy in (ref() for ref in step.copies) if copy is not None), default=0)
            step.prefetch_window_bytes = default_prefetch_window_bytes(largest)
        if prefetch:
            self._prefetch(step)

    def _note_whole_model_compile(self, step: _Step) -> None:
        """Stands aside from the next step on if this one saved tensors while no model hook of ours ran: the model
        was compiled as a whole after the context was built (see `stand_aside_compiled_as_a_whole`)."""
        if self._module_hooks and step.copies and not self.model_hooks_ran and self._standing_aside is None:
            self.stand_aside_compiled_as_a_whole()
        self.model_hooks_ran = False

    def stand_aside_compiled_as_a_whole(self) -> None:
        """Stands aside for good, with one warning: the model's forward is compiled as a whole.

        `torch.compile(model)` (or the Trainer's `torch_compile=True`) traces the model's hooks away, and the compiled
        forward hands every tensor it saves to the pack hook at once, after its last kernel: the step's peak, at the
        loss, is behind it, so moving them could only cost (and the head's and the loss's, which backward needs first,
        would move too). Compiling the decoder layers instead (regional compilation) keeps the hooks and the overlap.
        Called when the context is built around such a model, or at the first backward of a model compiled later.
        """
        self.stand_aside("compiled")
        self.warn_once("compiled", "the model's forward is compiled as a whole (torch.compile(model) or "
                        "torch_compile=True): its saved tensors reach hf-offload only after the compiled forward "
                        "has ended, when moving them cannot lower the step's peak, so activation offloading "
                        "stands aside. Compile the decoder layers instead (regional compilation: "
                        "`hf_offload.compile_decoder_layers(model)`): hf-offload then moves their inputs as it "
                        "does without compilation.")  # fmt: skip

    def note_step_tokens(self, tokens: int) -> None:
        """Told by the model's hook at each forward: the tokens of the step that runs.

        Offloading that stands aside because it could not lower the measured step's peak resumes, for good, at a
        step with more tokens: its activations grow, and may set the peak where the measured step's did not.

        Args:
            tokens: the tokens of the model's input (batch x sequence).
        """
        self._peak_watch.note_tokens(tokens)
        if self._standing_aside is not None and torch._C._current_graph_task_id() == -1:
            # A forward begins. Standing aside, nothing is reloaded, so no backward ends the previous step for the
            # engine: without this a context entered once around many steps would count them as one.
            self._phase = _IDLE
        report = self._peak_watch.report
        if self._standing_aside == "cannot_lower_peak" and tokens > report.tokens:
            self.rejoin()
            logger.warning("hf_offload: a step of %d tokens, more than the %d of the step that showed offloading "
                           "could not lower the peak: offloading resumes, for the rest of the run", tokens,
                           report.tokens)  # fmt: skip

    def _peak_measured(self, report: PeakReport) -> None:
        """Says what the measured step's peak owes to offloading; stands aside if it owes less than the option asks."""
        logger.info("hf_offload: %s", report.describe())
        threshold = self.options.min_peak_reduction
        if threshold is None or report.most_reduction >= threshold:
            return
        if not report.tokens:
            self.warn_once("cannot_lower_peak", f"hf_offload: {report.describe()}, less than min_peak_reduction="
                            f"{threshold:g}, but offloading does not stand aside: the model's inputs (no input_ids "
                            "or inputs_embeds) did not say how many tokens the step had, so a longer step, which "
                            "offloading may help, would go unnoticed")  # fmt: skip
            return
        self.stand_aside("cannot_lower_peak")
        self.warn_once("cannot_lower_peak", f"hf_offload: {report.describe()}, less than min_peak_reduction="
                        f"{threshold:g}: offloading stands aside (moves nothing) from now on, until a step of "
                        f"more than {report.tokens} tokens. min_peak_reduction=None keeps it on")  # fmt: skip

    def _mark_end_of_forward(self, step: _Step, drain: bool) -> None:
        """Records, once per step, which copies were still in flight when the forward ended.

        The host runs ahead of the GPU, so "not finished yet" seen from the host says little; a compute-stream
        marker compared with each copy's completion event later says whether the copy really finished after
        the forward's compute did (and so stalled it, or had to stay on the GPU).
        """
        if step.end_of_forward is not None:
            return
        step.end_of_forward = []
        for lane in self._lanes.values():
            self._release_finished(lane)
            if not lane.inflight:
                continue
            compute = lane.compute_stream()
            marker = self._device_module.Event(enable_timing=True)
            marker.record(compute)
            step.end_of_forward += [(c.position, marker, c.d2h_done) for c in lane.inflight if c.step is step]
            if drain:
                self._drain_inflight(lane)

    def _prefetch(self, step: _Step, window_bytes: int | None = None, only: set[int] | None = None) -> None:
        """Reloads the next copies backward will need (walking down `step.copies`), up to the prefetch window
        (or `window_bytes`, if narrower); with `only`, stops at the first copy whose position is not in it (a
        prefetch point will start that one).

        Without checkpointing, as many as the window holds: a reload cannot start before the compute stream
        reaches the point where it was issued (see `_reload`), so with a single copy ahead the H2D stream idles
        whenever a backward node computes longer than its copy takes. With checkpointing (`prefetch_on_unpack` off), one
        copy: the next block's input, and nothing more on top of that block's recomputation."""
        window = step.prefetch_window_bytes if window_bytes is None else min(window_bytes, step.prefetch_window_bytes)
        while step.cursor >= 0:
            copy = step.copies[step.cursor]()
            if copy is None or not _reloadable(copy):
                step.cursor -= 1
                continue
            lane = copy.lane
            if lane.d2h is None or window == 0:
                return
            if not self.prefetch_on_unpack and lane.prefetched_copies:
                return
            if lane.prefetched_bytes and lane.prefetched_bytes + copy.nbytes > window:
                return  # full; a copy larger than the window still goes alone
            if only is not None and copy.position not in only:
                return
            self._start_prefetch(copy)
            # One block ahead (checkpointing): the rest of the block comes too. A window reaches a node's copies in
            # turn: they were saved one after another.
            if not self.prefetch_on_unpack and copy.position in self._burst_mates:
                self._start_mates(step, copy)
            step.cursor -= 1

    def _start_mates(self, step: _Step, copy: _HostCopy) -> None:
        """Starts the reloads of the copies an earlier step unpacked together with `copy` (`_note_burst`)."""
        if step.by_position is None:
            step.by_position = {c.position: ref for c, ref in ((ref(), ref) for ref in step.copies) if c is not None}
        for position in self._burst_mates[copy.position]:
            mate_ref = step.by_position.get(position)
            mate = None if mate_ref is None else mate_ref()
            if mate is not None and _reloadable(mate):
                self._start_prefetch(mate)

    def _start_prefetch(self, copy: _HostCopy) -> None:
        """Starts a copy's reload ahead of need and counts it against the prefetch window."""
        self._reload(copy, copy.lane.compute_stream())
        copy.prefetched = True
        copy.lane.prefetched_bytes += copy.nbytes
        copy.lane.prefetched_copies += copy.users == 1

    def _reload_now(self, copy: _HostCopy, compute: Any) -> None:
        """Reloads a copy that is needed right now (a prefetch miss) on the compute stream itself: compute has to
        wait for it anyway, and on the H2D stream it would queue behind the prefetches of later tensors."""
        lane = copy.lane
        buffer = torch.empty(copy.numel, dtype=copy.dtype, device=lane.device)
        if compute is None:  # no side streams: everything is ordered on the compute stream already
            buffer.copy_(copy.host, non_blocking=True)
        else:
            start = self._device_module.Event(enable_timing=True)
            end = self._device_module.Event(enable_timing=True)
            compute.wait_event(copy.d2h_done)
            start.record(compute)
            buffer.copy_(copy.host, non_blocking=True)
            end.record(compute)
            self._stats.wait(start, end)  # compute spends the copy's time waiting on the link
        copy.reloaded = buffer
        copy.reload_done = None

    def _reload(self, copy: _HostCopy, compute: Any) -> None:
        """Starts a prefetch on the H2D stream, into a buffer allocated on the compute stream."""
        lane = copy.lane
        buffer = torch.empty(copy.numel, dtype=copy.dtype, device=lane.device)  # on the compute stream
        # The buffer's memory may still be in use by queued compute kernels. This wait also orders the reload after
        # the copy's D2H: a copy is prefetched only once its GPU original is released, which happens when its event
        # was seen complete or once the compute stream waits for it (`_release_finished`, `_retire_oldest`).
        lane.h2d.wait_for(compute)
        with lane.h2d.entered_from(compute):
            buffer.copy_(copy.host, non_blocking=True)
        copy.reload_done = self._device_module.Event(enable_timing=True)  # timed: it ends a stall (see `_wait`)
        copy.reload_done.record(lane.h2d.stream)
        copy.reloaded = buffer

    # ------------------------------------------------------------------ shared

    def _saved(self, copy: _HostCopy, tensor: torch.Tensor) -> _SavedTensor:
        copy.users += 1
        copy.unpacks_left += 1
        return _SavedTensor(copy, tensor)

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

    def _lane(self, device: torch.device) -> _Lane:
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = _Lane(device, self._device_module, self.options.use_streams)
        return lane

    def _host_refused(self, nbytes: int) -> None:
        """Counts a tensor the pool had no room for, and says once why (its cap, the host's reserve, a failure)."""
        pool = self._pool
        if pool.refusal == "reserve":
            self.warn_once("host_reserve", "the host's available memory reached the reserve the pinned pool leaves "
                           f"({pool.reserve.reserve_bytes / MIB:.0f} MiB) with the pool at "
                           f"{pool.capacity / MIB:.0f} MiB: further activations stay on the GPU. Lower "
                           "host_memory_reserve_bytes (host_memory_reserve_mib) if the host has the room.")  # fmt: skip
            self._stats.kept("host_reserve", nbytes)
        elif pool.refusal == "failed":
            self.warn_once("pinned_alloc_failed", f"allocating pinned host memory failed ({pool.failure}) with the "
                           f"pool at {pool.capacity / MIB:.0f} MiB: the pool grows no more, and activations that do "
                           "not fit it stay on the GPU.")  # fmt: skip
            self._stats.kept("pinned_alloc_failed", nbytes)
        else:
            self.warn_once("over_host_cap", f"the pinned host pool reached its cap ({pool.cap_bytes / MIB:.0f} MiB): "
                           "further activations stay on the GPU. Raise max_pinned_memory_fraction or "
                           "max_pinned_bytes if the host has room.")  # fmt: skip
            self._stats.kept("over_host_cap", nbytes)

    def _host_pool(self) -> PinnedHostPool:
        if self._pool is None:
            cap = host_memory_cap(self.options.max_pinned_memory_fraction, self.options.max_pinned_bytes)
            reserve = host_reserve(self.options.host_memory_reserve_bytes, self.options.memory_budget is not None)
            self._pool = PinnedHostPool(cap, pin_memory=self.use_pin_memory, reserve=reserve)
        return self._pool

    def host_caps(self) -> HostCaps:
        """The pinned host memory a memory plan may count on now: the pool's cap, and how far it may grow past it (a
        default cap under a memory budget, down to the reserve; a cap the user set is kept)."""
        hard = self.options.max_pinned_memory_fraction is not None or self.options.max_pinned_bytes is not None
        return self._host_pool().caps(growable=not hard and self.options.memory_budget is not None)

    def set_host_cap(self, cap_bytes: int) -> None:
        """Makes `cap_bytes` the pool's cap (a memory plan's: at most `host_caps().most_bytes`); the reserve is still
        checked at each growth."""
        self._host_pool().cap_bytes = cap_bytes

    def _pinned_bytes(self) -> int:
        return 0 if self._pool is None else self._pool.capacity

    def _refresh_parameter_pointers(self) -> None:
        tensors = [tensor for tensor in (ref() for ref in self._parameters) if tensor is not None]
        self._parameter_pointers = parameter_storages(tensors)

    def warn_once(self, key: str, message: str) -> None:
        """Log `message` as a warning the first time this engine is asked to with `key`.

        Args:
            key: what the warning is about; later calls with the same key log nothing.
            message: the warning.
        """
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def _reloadable(copy: _HostCopy) -> bool:
    """Whether a copy can be reloaded ahead: its original has left the GPU, and it is neither back nor used up."""
    return copy.source is None and copy.reloaded is None and not copy.consumed


def _first_unfinished(end_of_forward: list[tuple[int, Any, Any]]) -> int | None:
    """Position of the first copy that completed after the forward's compute ended (in GPU time), if any."""
    unfinished = []
    for position, marker, done in end_of_forward:
        done.synchronize()  # the step is over on the host; on the GPU these finished long ago
        if marker.elapsed_time(done) > 0:
            unfinished.append(position)
    return min(unfinished, default=None)


def _top_saved_tensors_hooks() -> Any:
    """The (pack, unpack) hooks on top of this thread's saved-tensor hooks stack, None when empty, `...` when this
    torch cannot tell."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # older torch: cannot tell
        return ...
    try:
        return top(True)
    except TypeError:  # signature without `ignore_is_tracing`
        return top()


def top_saved_tensors_pack_hook() -> Any:
    """The pack hook on top of this thread's saved-tensor hooks stack, None when empty, `...` when unknown."""
    hooks = _top_saved_tensors_hooks()
    if hooks is ...:
        return ...
    return hooks[0] if hooks else None


def _no_prefetch(grad: torch.Tensor) -> None:
    """The gradient hook of a point inside `set_aside()`."""


def _unpack(saved: Any) -> torch.Tensor:
    """The unpack hook: kept tensors were saved as themselves; offloaded ones know their engine."""
    if isinstance(saved, _SavedTensor):
        return saved.copy.engine._unpack(saved)
    return saved
