"""`OffloadActivations`: the saved-tensor hooks that move activations to host memory and back, one class over the
engine's modules.

Autograd calls the pack hook for every tensor the forward saves for backward, and the unpack hook when backward needs
one. This module holds what every part shares: the options, the step's phases (a forward begins at its first pack,
its tail at the head's region, its backward at the first unpack or prefetch point: `_begin_step`, `_forward_ends`,
`_begin_backward`), the statistics, the peak watch (`hf_offload.peak`), a memory plan's settings (`apply_settings`)
and the public API. Each concern is a module of the package, and a part of the class:
  * `streams`: the compute stream and the side streams, per device;
  * `host_copies`: the host copies and their lifetimes, the forward window, the tail and the pinned pool;
  * `prefetch`: the backward: unpacks, reloads and what starts them ahead;
  * `disk_copies`: the disk tier, which takes what the pinned pool refuses (only with `disk_offload_dir`);
  * `regions`: what is not offloaded here: exempt regions, `NoOpManager`, `set_aside`, standing aside;
  * `settings`: `EngineSettings`, what a memory plan sets in the engine, in one call (`apply_settings`).

The parts are mixins rather than objects that this class calls: they share one step's state under one lock, and the
hooks that run for every saved tensor cost no call more than in one class. State that stands apart is an object of its
own, made here: a lane per device (`streams._Lane`), a host copy, the step (`host_copies`), what the steps taught the
prefetch (`prefetch._PrefetchLearner`).
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from ..options import OffloadOptions, check_option_names, current_accelerator_type
from ..peak import DevicePeakCounter, PeakReport, StepPeakWatch, queue_after_backward
from ..policy import kept_reason, parameter_storages
from ..stats import StatsRecorder
from .disk_copies import _DiskCopies
from .host_copies import _first_unfinished, _HostCopies, _SavedTensor, _Step
from .prefetch import _Prefetch, default_prefetch_window_bytes
from .regions import _kept, _OpenRegion, _Regions, top_saved_tensors_pack_hook
from .settings import EngineSettings
from .streams import _Streams

if TYPE_CHECKING:  # `memory_plan`'s annotation only
    from ..memory_budget.simulate import Plan

__all__ = ["OffloadActivations"]

logger = logging.getLogger(__name__)

_IDLE, _FORWARD, _BACKWARD = "idle", "forward", "backward"


class OffloadActivations(_Regions, _DiskCopies, _Prefetch, _HostCopies, _Streams, saved_tensors_hooks):
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
        ValueError: an option outside its rule, named with the values it accepts; `DiskOffloadDirError` (a
            ValueError) for a `disk_offload_dir` that cannot hold files.
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
        self._init_prefetch()
        # Set by the model hooks of `get_act_offloading_ctx_manager` whenever one runs: a forward that saved tensors
        # while none ran was compiled as a whole, and the engine then stands aside (see `_begin_backward`).
        self.model_hooks_ran = False
        self._init_regions()
        # The second step's phases, measured on the device's peak counter (`hf_offload.peak`); not under a memory
        # budget, whose controller resets that counter in its own profiled steps.
        self._peak_watch = StepPeakWatch(DevicePeakCounter(self.device_type).read_and_reset)
        # Under a memory budget (`attach_budget`): its controller, which `budget_controller` returns, and what is told
        # of a training step that did not complete. The engine calls nothing else of it.
        self._budget_controller: Any = None
        self._step_faulted: Callable[[], None] | None = None
        # The memory plan whose settings are in force (`apply_settings`), for `memory_plan`.
        self._plan: Any = None
        # The windows in force: the options', until a memory plan sizes them for its layers (`use_windows`).
        self.forward_window_bytes = options.forward_window_bytes
        self.prefetch_window_bytes = options.prefetch_window_bytes
        self.head_prefetch_window_bytes: int | None = None

        self._init_streams()
        self._init_host_copies()
        self._init_disk()  # raises for a disk_offload_dir that cannot hold files
        self._stats = StatsRecorder()
        self._parameter_pointers: set[int] = set()
        self._parameters: list[weakref.ref[torch.Tensor]] = []
        self._module_hooks: list[RemovableHandle] = []
        self._phase = _IDLE
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
        """The memory budget's plan in force (`hf_offload.memory_budget.simulate.Plan`): the plan of the settings the
        budget gave last (`apply_settings`); None without a budget or before the profiled steps are over."""
        return self._plan

    @property
    def budget_controller(self) -> Any:
        """The memory budget's controller (`hf_offload.memory_budget.controller`), attached by
        `get_act_offloading_ctx_manager` when `memory_budget` is set (`attach_budget`); None without a budget."""
        return self._budget_controller

    def attach_budget(self, controller: Any, step_faulted: Callable[[], None]) -> None:
        """Put the engine under a memory budget, whose side decides what moves (`apply_settings`).

        The engine's own peak watch (`min_peak_reduction`) measures nothing then: the budget's controller resets the
        device's peak counter in its own profiled steps.

        Args:
            controller: what `budget_controller` returns; the engine calls nothing of it.
            step_faulted: called when an exception leaves the outermost region of a training step: a step that did
                not complete is no measurement.
        """
        self._budget_controller = controller
        self._step_faulted = step_faulted

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

    def apply_settings(self, settings: EngineSettings) -> None:
        """Take a memory plan's settings, all at once: the pinned pool's cap, the tail's bound, the copy windows,
        whether offloading stands aside, and the plan they are of (`memory_plan`).

        The one call through which the memory budget sets the engine (`memory_budget.plan_application`): the engine
        knows nothing of plans or of the controller that makes them. A plan that moves nothing (every layer kept, or
        checkpointed with its input kept) has the engine stand aside (`"planned"`), unless it stands aside already for
        another reason; a plan that moves something has it rejoin, if a plan had it stand aside.

        Args:
            settings: the plan's [`EngineSettings`]; a setting it leaves None stays as it is.

        Raises:
            ValueError: a window outside the rule of the option of the same name.
        """
        if settings.host_cap_bytes is not None:
            self.set_host_cap(settings.host_cap_bytes)
        if settings.tail_cap_bytes is not None:
            self.cap_tail(settings.tail_cap_bytes)
        if settings.windows is not None:
            self.use_windows(*settings.windows)
        if settings.stand_aside:
            if self._standing_aside is None:
                self.stand_aside("planned")
        elif self._standing_aside == "planned":
            self.rejoin()
        self._plan = settings.plan

    def use_windows(self, forward_window_bytes: int, prefetch_window_bytes: int | None,
                    head_prefetch_window_bytes: int | None = None) -> None:  # fmt: skip
        """Size the copy windows for the steps to come.

        Used by a memory plan (`apply_settings`), which knows how many bytes it lets leave and come back at once. The
        tail stays bounded by the option `forward_window_bytes`: it is held through the head's peak.

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
        move the head's and the loss's tensors too. The disk tier (`disk_offload_dir`) closes, its files and directory
        removed, if no graph holds a spilled tensor; else when the last one does not.

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
        self.close_disk()

    def get_stats(self) -> dict[str, int | float]:
        """Return the counters of the most recent step: its forward and, once run, its backward.

        Reading stall times waits for the step's outstanding timing events.

        Returns:
            `steps`, `tensors_offloaded`, `bytes_offloaded`, `tensors_kept_<reason>` / `bytes_kept_<reason>` for
            each reason of `stats.KEPT_REASONS`, `prefetch_hits`, `prefetch_misses`, `inflight_hits`,
            `compute_wait_s`, `pinned_bytes`, the disk tier's `bytes_spilled_to_disk`, `bytes_read_from_disk`
            and `disk_wait_s` (the host's time blocked on it), and the pinned pool's growth in the step,
            `pool_grown_bytes` and `pool_growth_s` (the time it took, on the thread that ran the forward).

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
            if self._step_faulted is not None and region.training and not self._regions:
                self._step_faulted()  # nor is it a measurement
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
        if self._budget_controller is None and self._standing_aside is None:  # nothing to measure while it stands aside
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

    # ------------------------------------------------------------------ backward

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

    # ------------------------------------------------------------------ the peak watch

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

    # ------------------------------------------------------------------ shared

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


def _unpack(saved: Any) -> torch.Tensor:
    """The unpack hook: kept tensors were saved as themselves; offloaded ones know their engine."""
    if isinstance(saved, _SavedTensor):
        return saved.copy.engine._unpack(saved)
    return saved
