"""Not offloaded here: the regions whose saved tensors stay where they are, and the engine standing aside.

Five things keep saved tensors where they are, each with one scope and one way of being counted (the table in
docs/DESIGN.md, "Not offloaded here: one vocabulary"):
  * a kept tensor: what a pack hook returns for a tensor that stays in place (`_kept`); the engine's pack hook
    counts it under a reason of `stats.KEPT_REASONS` (too small, a parameter, the tail, the host full, ...).
  * `exempt(reason=...)`: a region inside the step, a `NoOpManager` that reports what it kept to its engine
    (`_ExemptRegion`): the head and the loss (`ends_forward=True`), a plan's kept input (`"planned"`).
  * `NoOpManager()` alone: a region of the user's own, as TRL's offloader has it; counted by no engine.
  * `set_aside()`: a region outside the step (a probe run on the side): not counted at all, and its gradient hooks
    start no reloads.
  * `stand_aside(reason)` / `rejoin()`: the whole engine, from now on (`stats.STAND_ASIDE_REASONS`).

Only the innermost saved-tensor hooks see a saved tensor, so a region's hooks act only where they are on top of the
stack (`is_innermost`), and each `with` block of the engine remembers what was on top when it was entered
(`_OpenRegion`).

Standing aside (`standing_aside`): when offloading cannot help (a model compiled as a whole, a step whose peak it
cannot lower, a memory plan that keeps every layer), a region entered then does not push the saved-tensor hooks at
all, so autograd calls no Python per saved tensor (about 3 us each, 1,441 a step on a 36-layer model) and the step
costs what it costs without the library. If offloading rejoins inside such a region (a longer step, a new plan), the
hooks are pushed there and then, provided nothing else pushed saved-tensor hooks since the region was entered.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from ..stats import STAND_ASIDE_REASONS


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

    def __init__(self, engine: _Regions, ends_forward: bool, reason: str) -> None:
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


class _Regions:
    """The engine's regions: exempt and set-aside regions inside its own, standing aside and rejoining.

    A part of `OffloadActivations` (a mixin: rejoining pushes the engine's own hooks, as its `__enter__` does). It
    reads the engine's `pack_hook` and refreshes its parameters' storages (`_refresh_parameter_pointers`).
    """

    def _init_regions(self) -> None:
        # Why offloading stands aside (one of `stats.STAND_ASIDE_REASONS`), or None: see `stand_aside`.
        self._standing_aside: str | None = None
        # The regions of this engine entered and not yet exited, innermost last (see the module docstring).
        self._regions: list[_OpenRegion] = []
        self._set_aside = 0  # depth of `set_aside()` regions

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
