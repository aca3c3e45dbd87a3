"""The profile's assembly: what the first two training steps measure, and the step's profile made from it.

First step: when the first layer of each kind is called, it is probed on the very arguments it receives
(`probes.probe_layer`, which leaves no trace in the step): the bytes it saves, the bytes a selective checkpoint would
keep, the times of its forward, backward and selective recompute, and with `tile_mlp="auto"` the same with its MLP
tiled, and with `tile_layer="auto"` the layer tiled whole. Every stack of layers is probed so, each kind in its own
call: a vision tower's blocks on theirs, a language model's or a decoder's layers on theirs (with the encoder's
states). Once every kind is probed the link's bandwidth is measured (`ProfiledSteps.finish_probes`), and the disk
tier's where there is one (`disk_offload_dir`: its room past the pinned pool then counts in every plan), and the order
the step called the layers in becomes the plan's (`take_call_order`). The first step's peak, read as its backward
ends, measures the plan its layers ran (`record_first_step`).

Second step: memory held before it starts, the head and loss's peak over what the forward leaves, the head's time,
and the whole step's time (the rest of the step, embedding and optimizer, is what the model of the safe step does not
explain): the safe plan's first measurement (`measured_step_ends`).

`ProfiledSteps.profile_now` assembles the measured step, scaled to a step's tokens, with the memory held now: what
every plan is made from. In the CPU test mode nothing on the host has a peak counter: static memory is counted from
the parameters (`measurements.HeldMemory`), the head's peak from the tensors it saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..disk_tier import DiskTierError, measure_disk_bandwidth
from ..engine import OffloadActivations, default_prefetch_window_bytes
from ..model import find_liger_functions
from ..options import OffloadOptions
from ..peak import queue_after_backward
from ..random_state import random_state_untouched
from ..tiled.apply import apply_tiled_layer, apply_tiled_mlp
from ..tiled.integration import default_tokens_per_chunk, recorded_outputs
from ..units import format_bytes
from .closed_loop import Sample, head_reload_hidden, peak_correction
from .measurements import HeldMemory, OwnPeakCounter, StepMeasurements, first_steps_head_bytes, tail_kept
from .plan_checks import PlanChecks
from .probes import (
    NOT_CALLED,
    LayerProbe,
    Meter,
    call_argument_storages,
    layer_kind,
    measure_link_bandwidth,
    probe_layer,
)
from .profile import StepProfile
from .ranks import AgreedHostCaps, runs_alone
from .sharding import gradient_shard_nbytes
from .simulate import simulate, simulated_step, unavailable_tiling

__all__ = ["ProfiledSteps"]

logger = logging.getLogger(__name__)

# What the host spends on each layer that offloads, at least, before anything is measured: the engine's hooks take
# about 4 us more per tensor offloaded than kept (6 against 2 us, docs/DESIGN.md), a checkpoint sends one tensor and a
# whole layer 15-25. Enough that a plan keeping an input rather than offloading it for nothing is the faster.
_INPUT_OFFLOAD_HOST_S = 1e-5
_SAVED_OFFLOAD_HOST_S = 1e-4

# A tiling's fields of the step's profile (its chunk's tokens, its backward's working bytes, one chunk's bytes, its
# backward's whole-sequence phase) and the probe's fields they come from (the working bytes, the chunk's bytes per
# token, the whole-sequence phase's bytes).
_MLP_TILING = ("tile_tokens", "tiled_backward_working_bytes", "tile_chunk_bytes", "tiled_backward_sequence_bytes",
               "tiled_working_bytes", "chunk_bytes_per_token", "tiled_sequence_bytes")  # fmt: skip
_LAYER_TILING = ("layer_tile_tokens", "layer_tiled_backward_working_bytes", "layer_tile_chunk_bytes",
                 "layer_tiled_backward_sequence_bytes", "layer_tiled_working_bytes", "layer_chunk_bytes_per_token",
                 "layer_tiled_sequence_bytes")  # fmt: skip


class ProfiledSteps:
    """What the profiled steps measure (`measured`, `StepMeasurements`), the plan's order of the layers, and the
    step's profile assembled from them (`profile_now`).

    Args:
        model: the unwrapped model, held weakly as the controller holds it.
        engine: the offloading context, held weakly.
        names: the decoder layers' names, in registration order.
        layers: the decoder layers, in registration order.
        options: the context's options: the tilings allowed, the tail and window.
        meter: the device's meter.
        held_memory: the memory held between steps.
        peak_counter: the device's peak counter as the controller reads it.
        plan_checks: the closed loop, whose samples the profiled steps add to and the profile is corrected with.
        host_caps: the pinned host memory a plan may count on.
        budget_bytes: the user's budget in bytes, on this device.
    """

    def __init__(self, model: nn.Module, engine: OffloadActivations, names: list[str], layers: list[nn.Module],
                 options: OffloadOptions, meter: Meter, held_memory: HeldMemory, peak_counter: OwnPeakCounter,
                 plan_checks: PlanChecks, host_caps: AgreedHostCaps,
                 budget_bytes: Callable[[], int]) -> None:  # fmt: skip
        self._model = weakref.ref(model)
        self._engine = weakref.ref(engine)
        self._names = names
        self._layers = layers
        self.stacks = [name.rpartition(".")[0] for name in names]
        self._options = options
        self._meter = meter
        self._held_memory = held_memory
        self._peak_counter = peak_counter
        self._plan_checks = plan_checks
        self._host_caps = host_caps
        self._budget_bytes = budget_bytes
        self.measured = StepMeasurements()
        # Probed once per kind and stack: layers of one class in two stacks see different tokens and arguments.
        self._kinds = [(stack, *layer_kind(layer)) for stack, layer in zip(self.stacks, layers)]
        # The plan's and the profile's layer i is `layers[order[i]]`: the first step's call order, the layers it did
        # not call last. Until that step is over, the registration order.
        self.order = list(range(len(layers)))
        self.called: list[int] = []
        self.stack_starts: set[int] = set()  # each stack's first layer called
        self.probing = False  # the probes call the layers too
        self.probes_finished = False
        # The codes the first step's layers ran, and the memory held as it began (`record_first_step`).
        self._first_step_codes: set[str] = set()
        self._first_step_static = 0
        self._first_step_read = False  # whether the first step's backward will read the counter as it ends
        # Tokens per chunk of a tiled MLP and of a layer tiled whole; 0 where the planner may not tile so.
        self._tile_tokens = _tile_tokens(model, options.tile_mlp, apply_tiled_mlp, "the MLPs")
        self._layer_tile_tokens = _tile_tokens(model, options.tile_layer, apply_tiled_layer, "whole layers")
        self._selective_checkpoint = _selective_checkpoint(model)
        self._offload_saved = True  # `StepProfile.offload_saved`

    # ------------------------------------------------------------------ the first step

    def first_step_begins(self) -> None:
        """The first step begins: the memory held now is what its peak is measured over, from the counter's reset."""
        self._first_step_static = self._held_memory.at_step_start
        self._peak_counter.reset()

    def layer_called(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> bool:
        """In the first step, from layer `index`'s pre-hook: its tokens, its call's other arguments and its place in
        the call order, and its kind probed if not yet. Whether this call's probe was the last kind's: the caller then
        finishes the profiled steps' set-up (`finish_probes`)."""
        tokens = args[0].shape[:-1].numel()
        measured = self.measured
        if not measured.step_tokens:
            measured.step_tokens, measured.device = tokens, args[0].device
        measured.stack_tokens.setdefault(self.stacks[index], tokens)
        measured.call_arguments.update(call_argument_storages(args, kwargs))
        if index not in self.called:
            self.called.append(index)
        if not self.probes_finished and self._kinds[index] not in measured.probes:
            return self._probe(index, layer, args, kwargs)
        return False

    def layer_runs(self, code: str, hidden_states: torch.Tensor) -> None:
        """In the first step, as a layer runs plan `code` (the probes may have tiled the safe plan) on `hidden_states`:
        the codes the step ran, and the counter read as the step's backward ends."""
        self._first_step_codes.add(code)
        if not self._first_step_read and hidden_states.requires_grad:  # read as the step's backward ends
            self._first_step_read = True
            hidden_states.register_hook(self._first_step_backward_reached)

    def _probe(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Probes the kind of layer `index` on the arguments of its call, from its pre-hook; whether every kind is
        probed now."""
        engine, model = self._engine(), self._model()
        tile = tile_layer = None
        if self._tile_tokens and model is not None:
            tile = functools.partial(apply_tiled_mlp, model, layers=[index])
        if self._layer_tile_tokens and model is not None:
            # The probe runs outside the step's output recorders; a tiled layer refuses to run inside them.
            recorded = recorded_outputs()
            if recorded:
                self._no_layer_tiling(f"this forward records {', '.join(recorded)} inside its layers")
            else:
                tile_layer = functools.partial(apply_tiled_layer, model, layers=[index])
        self.probing = True
        start = time.perf_counter()
        try:
            with random_state_untouched(args[0].device), engine.set_aside() if engine else contextlib.nullcontext():
                probe = probe_layer(layer, args, kwargs, self._meter, tile, tile_layer)
        finally:
            self.probing = False
        self.measured.probes[self._kinds[index]] = probe
        # What a long first step's plan rests on, said where the step's own time would dwarf the probe's.
        at_step = probe.profile.scaled(probe.tokens, probe.step_tokens) if probe.tokens else probe.profile
        logger.info("hf_offload: probed %s on %d of its call's %d tokens in %.2f s (%s): at that call it saves %s "
                    "(input %s), its backward works in %s more; forward %.1f ms, backward %.1f ms", self._names[index],
                    probe.tokens, probe.step_tokens, time.perf_counter() - start,
                    ", ".join(f"{what} {s:.2f} s" for what, s in probe.seconds.items()),
                    format_bytes(at_step.saved_bytes), format_bytes(at_step.input_bytes),
                    format_bytes(probe.working_at_step()[0]), at_step.forward_s * 1e3,
                    at_step.backward_s * 1e3)  # fmt: skip
        if probe.uncut_error is not None:
            logger.info("hf_offload: %s was probed on its call's whole length: %s", self._names[index],
                        probe.uncut_error)  # fmt: skip
        if probe.mlp_tiling_error is not None:
            logger.info("hf_offload: the planner cannot tile the MLPs: %s: %s", self._names[index],
                        probe.mlp_tiling_error)  # fmt: skip
            self._tile_tokens = 0
        if probe.layer_tiling_error is not None:
            self._no_layer_tiling(f"{self._names[index]}: {probe.layer_tiling_error}")
        if probe.selective_error is not None and self._selective_checkpoint:
            logger.info("hf_offload: the planner does not checkpoint layers selectively: %s: %s", self._names[index],
                        probe.selective_error)  # fmt: skip
            self._selective_checkpoint = False
        if probe.offload_error is not None and self._offload_saved:
            logger.info("hf_offload: the planner offloads no layer's saved tensors beyond its input: %s: %s",
                        self._names[index], probe.offload_error)  # fmt: skip
            self._offload_saved = False
        if probe.quadratic_error is not None:
            logger.info("hf_offload: %s was probed at one length only, so all its bytes are scaled in proportion to "
                        "the tokens (eager attention's grow with their square): %s", self._names[index],
                        probe.quadratic_error)  # fmt: skip
        return self.measured.probes.keys() >= set(self._kinds)

    def _no_layer_tiling(self, reason: str) -> None:
        """The planner does not tile whole layers in this run, and says why in the log."""
        logger.info("hf_offload: the planner cannot tile whole layers: %s", reason)
        self._layer_tile_tokens = 0

    def finish_probes(self) -> None:
        """Once every kind of layer is probed, or the first step is over: the kinds that did not run get an empty
        profile, and the link and the disk tier are measured (the caller then decides the profiled steps' plan)."""
        measured, engine = self.measured, self._engine()
        self.probes_finished = True
        idle = [index for index, kind in enumerate(self._kinds) if kind not in measured.probes]
        if idle:
            logger.info(
                "hf_offload: %s did not run in the first step: the plan counts nothing for them",
                ", ".join(self._names[index] for index in idle),
            )
            measured.probes.update({self._kinds[index]: NOT_CALLED for index in idle})
        pin_memory = engine is not None and engine.use_pin_memory
        allocated = self._meter.allocated()
        room = None if allocated is None else self._budget_bytes() - allocated
        with engine.set_aside() if engine is not None else contextlib.nullcontext():
            measured.d2h_bytes_per_s, measured.h2d_bytes_per_s = measure_link_bandwidth(self._meter, measured.device,
                                                                                         pin_memory, room)  # fmt: skip
        self._measure_disk()

    def _measure_disk(self) -> None:
        """The disk tier's bandwidths, where there is one and this process trains alone: under torch.distributed each
        rank's disk is its own, and rank 0's plan would count rank 0's room on every rank (a rank whose disk is full
        would keep on its GPU what the plan counted on disk), so the plans there count the pinned pools only."""
        engine = self._engine()
        tier = engine.disk_tier if engine is not None else None
        if tier is None or not runs_alone():
            return
        try:
            write, read = measure_disk_bandwidth(tier)
        except (DiskTierError, OSError) as error:
            logger.info("hf_offload: the disk tier in %s could not be measured (%s): plans count no disk",
                        tier.directory, error)  # fmt: skip
            return
        self.measured.disk_write_bytes_per_s, self.measured.disk_read_bytes_per_s = write, read
        logger.info("hf_offload: the disk tier in %s writes %.2f GB/s and reads %.2f GB/s: plans may offload past the "
                    "pinned pool into its %s of room", tier.directory, write / 1e9, read / 1e9,
                    format_bytes(tier.room_bytes()))  # fmt: skip

    def _disk_room_bytes(self) -> int:
        """What the disk tier may take of a step's offloaded bytes now, where it was measured; else 0."""
        engine = self._engine()
        tier = engine.disk_tier if engine is not None else None
        return tier.room_bytes() if tier is not None and self.measured.disk_read_bytes_per_s else 0

    def _first_step_backward_reached(self, grad: torch.Tensor) -> None:
        """Backward reached a layer's input in the first step: the counter is read as that backward ends."""
        queue_after_backward(self._peak_counter.read_at_backward_end)

    def record_first_step(self) -> None:
        """The first step's peak as its backward ended, as a measurement of the plan its layers ran (where they all
        ran one: `C` on every layer, unless the budget had it tiled already). The second step's plan is decided again
        with the optimizer's state and may tile where plain checkpointing is predicted not to fit, so no later step
        need run `C`: on a 7B shape the tiled plan then stayed at 1.87x plain checkpointing under a budget at plain
        checkpointing's measured peak, which the model put within its margin. The first step had run it."""
        peak = self._peak_counter.take_at_backward_end()
        if peak is None or len(self._first_step_codes) != 1:
            return
        (code,) = self._first_step_codes
        self._plan_checks.record(code, Sample(self.measured.step_tokens, None, peak,
                                              tail_bytes=tail_kept(self._engine()), peak_exact=True,
                                              static_bytes=self._first_step_static, through_backward=True))  # fmt: skip

    def take_call_order(self) -> None:
        """After the first step: the plan's order becomes the order it called the layers in (the caller times the
        head's phase from the end of the last layer it called)."""
        self.order = self.called + [index for index in range(len(self._layers)) if index not in self.called]
        if self.order != sorted(self.order):
            logger.info("hf_offload: the model calls its decoder layers in another order than it registers them: "
                        "the plan follows the calls (%s)", self.order)  # fmt: skip
        self.stack_starts = {next(i for i in self.order if self.stacks[i] == stack) for stack in set(self.stacks)}

    # ------------------------------------------------------------------ the measured step

    def start_measured_step(self) -> None:
        """The second profiled step, which the profile is measured from, begins."""
        measured = self.measured
        measured.held_at_step_start = self._meter.allocated()
        measured.static_at_step_start = self._held_memory.at_step_start
        measured.step_start = self._meter.mark()
        self._peak_counter.reset()

    def head_starts(self) -> None:
        """The head's phase of the measured step begins: the forward's peak, and the counter reset for the head's."""
        self.measured.forward_peak = self._meter.peak()
        self._peak_counter.reset()
        self.measured.head_start = self._meter.mark()

    def head_done(self) -> None:
        """Backward reaches the last layer in the measured step: the head's part is over. Where its start was not
        marked (a head the search found that the forward did not call), its time is not known and counts 0."""
        measured = self.measured
        if measured.head_start is not None:
            measured.head_s = self._meter.seconds(measured.head_start, self._meter.mark())
        peak = self._meter.peak()
        # Over the memory held between steps and the tail the engine kept, not over what was allocated as the head
        # began: the forward leaves more than the plan's layers hold (the last hidden states, about two layer inputs
        # on every zoo shape), and a plan that keeps every input measured that much above the model that counted the
        # head from there.
        measured.head_bytes = None if peak is None else peak - measured.held_at_step_start - tail_kept(self._engine())
        self._peak_counter.floor = peak or 0
        queue_after_backward(self._profiled_backward_ends)

    def _profiled_backward_ends(self) -> None:
        measured = self.measured
        measured.backward_end_peak, measured.backward_end_allocated = self._meter.peak(), self._meter.allocated()

    def first_layer_reached(self, grad: torch.Tensor) -> None:
        """In the second profiled step: when backward reaches the first layer called, the gradients that do not exist
        yet, other than the layers' own, come after every layer's backward (the input embeddings')."""
        model = self._model()
        if model is None:
            return
        in_layers = {id(p) for decoder_layer in self._layers for p in decoder_layer.parameters()}
        self.measured.late_gradient_bytes = sum(
            p.numel() * p.element_size()
            for p in model.parameters()
            if p.requires_grad and p.grad is None and id(p) not in in_layers
        )

    def measured_step_ends(self, code: str) -> None:
        """The measured step, which ran plan `code`, is over: its time, and in the CPU test mode the head's saved
        bytes (the last step's statistics), then the step recorded as the safe plan's first measurement."""
        measured = self.measured
        measured.step_s = self._meter.seconds(measured.step_start, self._meter.mark())
        measured.safe_code = code
        engine = self._engine()
        # The last step's statistics: the second's. An engine that stood aside (a plan that moves nothing) saw none.
        if self._meter.device is None and engine is not None and engine.standing_aside is None:
            measured.head_saved_bytes = int(engine.get_stats()["bytes_kept_exempt"])
        self._record_profiled_step()

    def _record_profiled_step(self) -> None:
        """The second profiled step is the safe plan's first measurement. Its peak, where counted, is the larger of
        the two phases' counters (reset at the head), with the tail the engine kept in it: the plan, chosen by this
        measurement, keeps no more of it (`Planner.use`), so its later steps peak where this one did.

        What the step needed after backward is measured where the counter shows it: when the step's peak rose after
        the end of backward, it is the optimizer step's; else at least what backward left allocated."""
        measured = self.measured
        counter_at_backward_end = measured.backward_end_peak
        peak = self._peak_counter.since_own_reset()
        static_bytes, gradient_bytes = self._held_memory.static_bytes()
        after_backward = [measured.backward_end_allocated or 0]
        if peak is not None and counter_at_backward_end is not None and peak > counter_at_backward_end:
            after_backward.append(peak)
        measured.optimizer_bytes = max(0, max(after_backward) - static_bytes - gradient_bytes)
        if peak is not None:
            peak = max(peak, measured.forward_peak or 0)
        # The safe plan ran with the engine's own prefetch window, sized per step from its largest copy.
        inputs = [layer.input_bytes for layer in self.profile_now(measured.step_tokens).layers]
        engine = self._engine()
        window = engine.prefetch_window_bytes if engine is not None else None
        predicted = self.model_prediction(
            measured.step_tokens, measured.safe_code,
            default_prefetch_window_bytes(max(inputs)) if window is None else window
        )  # fmt: skip
        sample = Sample(measured.step_tokens, measured.step_s, peak, profiled=True,
                        tail_bytes=tail_kept(self._engine()), peak_exact=peak is not None,
                        static_bytes=measured.static_at_step_start, **predicted)  # fmt: skip
        self._plan_checks.record(measured.safe_code, sample)

    # ------------------------------------------------------------------ the profile

    def profile_now(self, tokens: int) -> StepProfile:
        """The measured step, scaled to `tokens`: each probe grown to the call it was cut from first, where the
        step's own measurements (head, step time) were taken."""
        measured = self.measured
        engine = self._engine()
        probes = [measured.probes[self._kinds[index]] for index in self.order]
        head_bytes = measured.head_bytes
        if head_bytes is None and self._meter.device is None:  # CPU test mode: what the head and loss saved
            head_bytes = measured.head_saved_bytes
        if head_bytes is None and (self._meter.device is not None or measured.step_s is not None):
            # Not measured: before the measured step, where the profiled steps' plan leaves the head room; in the CPU
            # test mode, a measured step whose plan moved nothing, so that no saved tensor reached the engine.
            model = self._model()
            head_bytes = 0 if model is None else first_steps_head_bytes(model, measured.step_tokens)
        static_bytes, gradient_bytes = self._held_memory.static_bytes()
        if self._held_memory.gradients_accumulate:
            # Every micro-step of a cycle but the first holds all the gradients from its start, where a step without
            # them creates them layer by layer in backward. A plan made at a cycle's first micro-step (the first after
            # the optimizer's step) for the gradients it creates ran the others over the budget by the gradients'
            # part at the peak: 143 MB of 1.53 GB (H200, a medium Llama, four micro-steps).
            static_bytes, gradient_bytes = static_bytes + gradient_bytes, 0
        working_bytes, quadratic_working_bytes = max(probe.working_at_step() for probe in probes)
        layers = []
        for index, probe in zip(self.order, probes):
            layer = probe.profile.scaled(probe.tokens, probe.step_tokens)
            shard = gradient_shard_nbytes(self._layers[index])
            layers.append(layer if shard is None else dataclasses.replace(layer, parameter_gradient_bytes=shard))
        profile = StepProfile(
            layers=tuple(layers),
            static_bytes=static_bytes,
            gradient_bytes=gradient_bytes,
            head_bytes=max(head_bytes or 0, 0),
            backward_working_bytes=working_bytes,
            quadratic_backward_working_bytes=quadratic_working_bytes,
            head_s=measured.head_s or 0.0,
            other_s=0.0,
            d2h_bytes_per_s=measured.d2h_bytes_per_s,
            h2d_bytes_per_s=measured.h2d_bytes_per_s,
            host_cap_bytes=self._host_caps.caps().default_bytes if engine is not None else 0,
            disk_cap_bytes=self._disk_room_bytes(),
            disk_write_bytes_per_s=measured.disk_write_bytes_per_s,
            disk_read_bytes_per_s=measured.disk_read_bytes_per_s,
            tokens=measured.step_tokens,
            **_tiled_fields(probes, self._tile_tokens, *_MLP_TILING),
            **_tiled_fields(probes, self._layer_tile_tokens, *_LAYER_TILING),
            late_gradient_bytes=min(measured.late_gradient_bytes, gradient_bytes),
            call_argument_bytes=sum(nbytes for nbytes, _ in measured.call_arguments.values()),
            quadratic_call_argument_bytes=sum(nbytes for nbytes, square in measured.call_arguments.values() if square),
            optimizer_bytes=measured.optimizer_bytes,
            tail_bytes=self._tail_bound_bytes(),
            input_offload_s=_INPUT_OFFLOAD_HOST_S,
            saved_offload_s=_SAVED_OFFLOAD_HOST_S,
            selective_checkpoint=self._selective_checkpoint,
            offload_saved=self._offload_saved,
            reloads_one_layer_ahead=engine is not None and engine.reloads_one_block_ahead,
        )  # fmt: skip
        if measured.step_s is not None:  # the rest of the step: what the model of the safe step does not explain
            # Of the plan that step ran: on a 7B shape whose profiled steps tiled every layer whole, the tiling's time
            # taken for the rest of the step (229 ms of a 459 ms step against `C`'s model) made plain checkpointing
            # look as slow as the tiled plan, which stayed (1.87x plain checkpointing, at a budget that fits it).
            code = measured.safe_code
            safe = simulate(profile, "C" * len(self._layers) if unavailable_tiling(profile, code) else code)
            profile = dataclasses.replace(profile, other_s=max(0.0, measured.step_s - safe.step_s))
        samples = self._plan_checks.samples
        profile = dataclasses.replace(profile, peak_correction_bytes=peak_correction(samples, tokens)[0],
                                      head_reload_hidden_bytes=head_reload_hidden(samples, tokens))  # fmt: skip
        return profile if tokens == profile.tokens else profile.scaled(tokens)

    def model_prediction(self, tokens: int, code: str, window: int | None) -> dict[str, int | None]:
        """The model's prediction of plan `code` at `tokens`, with prefetch window `window`, as `Sample`'s fields:
        its peak and its head's point without reloads, both without the peak's correction, and the reloads the head
        counts; only a None peak for a code the profile cannot run (a tiled MLP in a step of one chunk)."""
        profile = self.profile_now(tokens)
        try:
            run = simulated_step(profile, code, window)
        except ValueError:
            return {"predicted_peak_bytes": None}
        return {
            "predicted_peak_bytes": run.peak_bytes - profile.peak_correction_bytes,
            "head_base_bytes": run.head_base_bytes - profile.peak_correction_bytes,
            "head_reload_bytes": run.head_reload_bytes,
        }

    def _tail_bound_bytes(self) -> int:
        """The most the engine's tail keeps through the head's peak: a forward window of the last offloaded bytes
        (the head's bytes were measured over what the profiled step kept of it). In the CPU test mode copies finish
        at once, and nothing is ever left to keep."""
        if self._engine() is not None and self._options.keep_tail and self.measured.head_bytes is not None:
            return self._options.forward_window_bytes
        return 0


def _tiled_fields(
    probes: list[LayerProbe],
    tile_tokens: int,
    tokens_field: str,
    working_field: str,
    chunk_field: str,
    sequence_field: str,
    probe_working: str,
    probe_per_token: str,
    probe_sequence: str,
) -> dict[str, int]:
    """A tiling's four fields of the step's profile (`StepProfile.tile_tokens`, `tiled_backward_working_bytes`,
    `tile_chunk_bytes`, `tiled_backward_sequence_bytes`, or those of a layer tiled whole) from the probes: zeros
    unless every probe measured it (the whole-sequence phase: zero unless one did)."""
    if not tile_tokens or any(getattr(probe, probe_working) is None for probe in probes):
        return {tokens_field: 0, working_field: 0, chunk_field: 0, sequence_field: 0}
    return {tokens_field: tile_tokens,
            working_field: max(probe.at_step(getattr(probe, probe_working)) for probe in probes),
            chunk_field: math.ceil(max(getattr(probe, probe_per_token) for probe in probes) * tile_tokens),
            sequence_field: max(probe.at_step(getattr(probe, probe_sequence) or 0) for probe in probes)}  # fmt: skip


def _selective_checkpoint(model: nn.Module) -> bool:
    """Whether the planner may checkpoint layers selectively (`StepProfile.selective_checkpoint`): not where Liger's
    in-place functions run in the model's code (`find_liger_functions`), and the log says so. The probes may rule it
    out later too (`LayerProbe.selective_error`: a layer's own code writes into such outputs)."""
    in_place = find_liger_functions(model)
    if in_place:
        logger.info("hf_offload: the planner does not checkpoint layers selectively: Liger's functions in the model's "
                    "code (%s) write into the outputs of matrix products in place, unseen by autograd, which a "
                    "selective checkpoint keeps for its recomputation", ", ".join(in_place))  # fmt: skip
    return not in_place


def _tile_tokens(model: nn.Module, option: str | bool, apply: Callable[..., Any], what: str) -> int:
    """Tokens per chunk for the planner's tiling of one kind (`apply_tiled_mlp`, `apply_tiled_layer`): the model's
    hidden size under the option's "auto", where every decoder layer can be tiled so (checked by tiling and untiling
    them, which changes nothing when one cannot); else 0, and the log says why."""
    if option != "auto":
        return 0
    tokens = default_tokens_per_chunk(model)
    try:
        apply(model, tokens).remove()
    except ValueError as error:
        logger.info("hf_offload: the planner cannot tile %s: %s", what, error)
        return 0
    return tokens
