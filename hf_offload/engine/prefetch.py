"""The backward: unpacks, reloads, and what starts a reload ahead of need.

Backward needs the saved tensors in roughly the reverse order of the forward's saves. When it unpacks one
(`_unpack`), the engine starts the reloads of the next ones, walking down the step's copies, up to the prefetch window
(`default_prefetch_window_bytes`). A reload runs on the H2D stream into memory allocated on the compute stream
(`_reload`); a copy needed before its reload started (a miss) is copied on the compute stream itself (`_reload_now`)
rather than queued behind the prefetches of later tensors.

Points of the backward that unpacks do not see start reloads too, through gradient hooks on module outputs
(`prefetch_hook`, placed by `model_hooks`): the output head's gradient, right after the loss's backward (the step's
peak without checkpointing), and, with checkpointing, each block's attention gradient (the MLP's recomputed
activations are freed by then, so the reload never sits on the step's peak). Where the points time the reloads, the
model's hooks turn `prefetch_on_unpack` off (`set_prefetch_on_unpack_rule`) and unpacks reload one block ahead only.
Two rules, learned from the steps and kept for the run (`_PrefetchLearner`), cover what the points do not:
  * copies unpacked for one autograd node (a checkpointed block's several inputs, a norm's input and statistics) are
    needed at once, so a reload of one starts the others (`burst_mates`);
  * a copy that was needed before any point reloaded it (the points compiled away with the layers, a block without
    attention) is reloaded by the unpack before it from the next step on (`unpack_reloads`).

A new rule for when a reload starts goes here: in `_prefetch` (what a start reaches), `_unpack` (what an unpack
starts) or the learner (what the steps teach).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..options import DEFAULT_WINDOW_BYTES
from .host_copies import _HostCopy, _SavedTensor, _Step

logger = logging.getLogger(__name__)

# The default prefetch window holds this many of the step's largest copies. Two keep the link busy while
# backward computes on the one before (a 128 MiB window held one 256 MiB MLP activation at a time, and the link
# idled through every node that computes longer than a copy). Four also cover the output head's backward at a
# large vocabulary (see `prefetch_hook`). It stays below one transformer block's saved activations (about six
# of the largest), in a backward whose memory is below the loss's peak.
_PREFETCH_WINDOW_COPIES = 4


def default_prefetch_window_bytes(largest_copy_bytes: int) -> int:
    """The prefetch window of a step whose window is not set (`prefetch_window_bytes=None`): four of its largest
    copies, and at least the default window."""
    return max(DEFAULT_WINDOW_BYTES, _PREFETCH_WINDOW_COPIES * largest_copy_bytes)


class _PrefetchLearner:
    """What the steps so far taught about the reloads that the prefetch points do not start in time, kept for the run.

    Both are keyed by a copy's position (the tail planner's numbering), the same for a copy from step to step.
    """

    def __init__(self) -> None:
        # Positions of the copies whose reload no prefetch point started before its unpack needed it, in any step so
        # far: unpacks start those reloads from then on. Where points take over from unpacks, some may never fire: the
        # modules that place them were compiled (regional compilation traces the attention's hook away, while the
        # head's, outside the layers, still fires), or a block has no attention (a hybrid model's state-space layers).
        # Learned from the misses rather than guessed from the model, and kept for the run: a stale position costs one
        # reload started a block early, at most.
        self.unpack_reloads: set[int] = set()
        # Position -> the positions of the copies that an earlier step unpacked for the same autograd node: backward
        # needs them at the same moment (a checkpointed block's several inputs, a norm's input and statistics), so a
        # reload of one starts the others, past the one-block-ahead rule of checkpointing (`note_burst`).
        self.burst_mates: dict[int, tuple[int, ...]] = {}

    def note_burst(self, copy: _HostCopy) -> None:
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
                self.burst_mates[position] = tuple(mate for mate, _ in step.burst if mate != position)

    def learn_unpack_reload(self, position: int) -> None:
        """A copy was needed before any prefetch point reloaded it: from the next step on, an unpack reloads it."""
        if not self.unpack_reloads:
            logger.info(
                "hf_offload: a reload that the prefetch points should have started was missed (their modules "
                "compiled, or a block without attention): unpacks start such reloads from the next step on"
            )
        self.unpack_reloads.add(position)


class _Prefetch:
    """The backward's unpacks and reloads, and when reloads start.

    A part of `OffloadActivations` (a mixin: `_unpack` runs for every saved tensor backward unpacks, under the
    engine's lock). It reads the engine's step (`_step`), lanes and statistics, and begins its backward
    (`_begin_backward`).
    """

    def _init_prefetch(self) -> None:
        # Whether each unpack starts the next reloads; a model layer whose `prefetch_hook`s time them turns it off.
        self.prefetch_on_unpack = True
        # What decides it from the model's layers (`set_prefetch_on_unpack_rule`), held weakly, or None.
        self._prefetch_on_unpack_rule: weakref.WeakMethod | None = None
        self._learner = _PrefetchLearner()

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

    @property
    def reloads_one_block_ahead(self) -> bool:
        """Whether the model's hooks time the reloads under checkpointing (`set_prefetch_on_unpack_rule`): where every
        checkpointed layer hands the engine its input alone, one block's input is then reloaded ahead, from the
        middle of the block's backward, whatever the prefetch window. Where the hooks found no attention to time them
        at, unpacks reload as far ahead as the window."""
        return self._prefetch_on_unpack_rule is not None

    def refresh_prefetch_on_unpack(self) -> None:
        """Decide `prefetch_on_unpack` again by the rule the model's hooks gave (none given: unchanged)."""
        rule = None if self._prefetch_on_unpack_rule is None else self._prefetch_on_unpack_rule()
        if rule is not None:
            self.prefetch_on_unpack = rule()

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
                self._learner.note_burst(copy)
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
                    self._learner.learn_unpack_reload(copy.position)
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
            elif self._learner.unpack_reloads:
                self._prefetch(copy.step, only=self._learner.unpack_reloads)
            # as_strided's offset counts from the start of the storage: the source span starts at `copy.start`
            # of the original storage, a reloaded buffer at 0.
            return torch.as_strided(span, saved.size, saved.stride, span.storage_offset() + saved.offset)

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
            if not self.prefetch_on_unpack and copy.position in self._learner.burst_mates:
                self._start_mates(step, copy)
            step.cursor -= 1

    def _start_mates(self, step: _Step, copy: _HostCopy) -> None:
        """Starts the reloads of the copies an earlier step unpacked together with `copy`
        (`_PrefetchLearner.note_burst`)."""
        if step.by_position is None:
            step.by_position = {c.position: ref for c, ref in ((ref(), ref) for ref in step.copies) if c is not None}
        for position in self._learner.burst_mates[copy.position]:
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


def _reloadable(copy: _HostCopy) -> bool:
    """Whether a copy can be reloaded ahead: its original has left the GPU, and it is neither back nor used up."""
    # A prefetched copy is back unless it is a spilled one whose read is still on its way (`disk_copies`).
    return copy.source is None and copy.reloaded is None and not copy.consumed and not copy.prefetched


def _no_prefetch(grad: torch.Tensor) -> None:
    """The gradient hook of a point inside `set_aside()`."""
