"""The step model: what a plan, one action per decoder layer, costs a training step in peak memory and in time.

Pure Python, standard library only, like the rest of the planning (`spec`, `profile`, `search`): plans are computed,
tested and compared anywhere. A plan is data: a `Plan` holds its actions and what the model predicts of them (a
`Prediction`, per layer a `PlannedLayer`), and is printed as a table, logged, sent to other ranks as plain data and
compared; a `MeasuredStep` is a plan that ran. `simulate` predicts any plan, hand-written or chosen by `search`, from
a measured `StepProfile`.

Actions, one per decoder layer, each with a one-letter code:
  * keep (`K`): the layer's saved tensors stay on the GPU until its backward.
  * offload (`O`): everything the layer saves goes to the host after its forward and comes back for its backward.
  * selective checkpoint (`S` input offloaded, `s` input kept): the outputs of matmuls and attention stay on the
    GPU (the checkpoint keeps them in its own cache), the rest is recomputed in backward.
  * selective checkpoint, offloaded (`X`): as `S`, but the saved outputs go to the host with the input.
  * full checkpoint (`C` input offloaded, `c` input kept): only the input is saved; the whole forward is
    recomputed in backward.
  * full checkpoint with the MLP tiled (`T` input offloaded, `t` input kept): as `C`/`c`, and the layer's MLP runs
    over chunks of `StepProfile.tile_tokens` tokens (`tiled.mlp_op`), so that its intermediates exist for one
    chunk at a time, in the recompute and the backward too. The only action that is not bitwise exact (the weight
    gradients are summed chunk by chunk), so the planner chooses it only when no plan without it fits.
  * the whole layer tiled (`L` input offloaded, `l` input kept): the layer runs over chunks of
    `StepProfile.layer_tile_tokens` tokens, attention on the whole sequence one head group at a time (`tiled.layer_op`),
    in its forward and again in its backward, which recomputes it: a full checkpoint of its own, which saves only
    its input. Not exact either (sums over chunks), and slower than `T`: chosen only when no exact plan and no plan
    with tiled MLPs fits.

The model, which the GPU measurements must confirm (bytes, seconds; layer i's numbers from its `LayerProfile`):
  * Bytes. Between its forward and its backward a layer holds on the GPU: keep `saved_bytes`; offload and `X` 0;
    selective `selective_bytes` (+ `input_bytes` if it keeps its input); full 0 (+ `input_bytes` if kept). It sends
    to the host: offload `saved_bytes`; `X` `selective_bytes + input_bytes`; `S` and `C` `input_bytes`; the others
    nothing. `T`/`t` and `L`/`l` hold and send what `C`/`c` do.
  * Forward. Layers run in order. A layer's offloaded bytes are queued on one device-to-host stream when its
    forward ends (FIFO, at `d2h_bytes_per_s`) and leave the GPU when their copy finishes. Compute never waits for
    a copy except at the end of the forward, where every copy is drained before the head runs: that wait is
    exposed time. Memory while layer i computes = static + what the layers before it hold + their copies not
    finished when layer i starts + layer i's `forward_peak_bytes` (all its activations exist while it computes,
    even when it is checkpointed, and the temporaries among them; `saved_bytes` where the peak was not measured).
    For `T`/`t` that is its `tiled_saved_bytes` + the step's `tile_chunk_bytes` (one
    chunk's MLP intermediates); for `L`/`l` its `layer_tiled_saved_bytes` + the step's `layer_tile_chunk_bytes`.
    A layer that FSDP2 shards adds its `gathered_parameter_bytes` (zero otherwise).
  * Reloads. The offloaded layers come back one after another, from the last to the first, on one host-to-device
    stream (FIFO, at `h2d_bytes_per_s`), as far ahead as the prefetch window allows: a layer's reload is issued
    when the head starts or a layer's backward starts, if the reloads issued and not yet used fit the window with
    it (or none are outstanding). The window is at least the largest layer's reload (one layer ahead). Where some
    layer offloads its saved tensors (`O`, `X`: many copies per layer, each needing its reload ahead), the planner
    widens it as far as the budget allows, which hides long reloads behind several layers' backward. Where every
    layer hands the engine its input at most, the engine reloads one layer ahead, from the middle of a layer's
    backward (`model_hooks`' prefetch points, `StepProfile.reloads_one_layer_ahead`; a model without attention has
    none, and is widened too), and the window is the narrowest: a wider one would count reloads that never come
    early (an 8B shape's first long steps were predicted at their budget, 74.84 GiB, and peaked at 64.75-70.25).
    While the head runs, the window stays at its narrowest: the loss's peak is then still close.
  * Head. Memory = static + what every layer holds + `head_bytes` + the reloads outstanding, counted as
    min(narrowest window, every reload) less what of them the head's peak hides (`head_reload_hidden_bytes`,
    learned: the reloads start at the logits' gradient, after the loss's temporaries): the engine fills its window
    copy by copy, not layer by layer; + the engine's tail, the last offloaded bytes it keeps on the GPU instead: the
    copies still unfinished when the forward ends, as the engine learns its tail, at most `tail_bytes` (its bound),
    and with those reloads at most every offloaded byte. A plan that offloads nothing has no tail, nor does one whose
    copies all finish within the forward (a checkpoint's input takes 0.2 ms to leave at 4K tokens; a layer's forward,
    milliseconds); the controller caps the engine's tail at what the plan counted (`Prediction.tail_bytes`).
  * Backward, layer i from the last to the first. Its backward starts when layer i+1's has ended and its reload
    has finished (the difference is a stall), and lasts `backward_s` + its recompute (full: `forward_s`,
    selective: `selective_recompute_s`, tiled MLP: `forward_s` + `tiled_extra_s`, tiled layer: `forward_s` +
    `layer_tiled_extra_s`). Memory = static + the gradients that
    exist by then + what the layers before it hold + its `saved_bytes` (kept, reloaded or recomputed, all of it
    exists during its backward) + `backward_working_bytes` + min(window, the reloads of the layers before it) + the
    `gathered_parameter_bytes` of layer i and of layer i-1 (FSDP2 gathers the next layer to run backward ahead).
    A layer that recomputes untiled (`S`, `s`, `X`, `C`, `c`) counts, in place of its saved and working bytes, its
    recomputation's where that is more: its `forward_peak_bytes` + its output's gradient (`input_bytes`), which
    exists from before the recomputation starts (on an H200, SmolLM2-1.7B with LoRA at 8192 tokens: the step
    peaked 134 MB above the model in layer 22's recomputed MLP, a LoRA adapter's cast inputs alive). For
    `T`/`t`: its bytes in the forward above, and `tiled_backward_working_bytes` in place of `backward_working_bytes`,
    or as much as makes its bytes `tiled_backward_sequence_bytes` where that is more (the backward's phase over the
    whole sequence, which at long context holds more than a chunk's); for `L`/`l` likewise with the `layer_tiled_`
    fields. (A tiled layer's backward at the 8B shape holds
    3X + (Q + KV)(1 + 1/G) + 2A/G bytes per token, X a hidden state, Q a query, KV a key and a value, A attention's
    output, G head groups: about 40 KiB against about 127 for `T`; the probe measures it, see `tiled.layer_op`.)
    The gradients that exist are `gradient_bytes` less those still to come: the layers' before it
    (`parameter_gradient_bytes`), the late ones (`late_gradient_bytes`: the input embeddings', created after every
    layer's backward), and its own, which its backward creates and `backward_working_bytes` counts (the probe
    measures a layer's backward with its parameters' gradients).
  * After the layers' backward, two points (where the step's peak is when a large vocabulary's embedding gradient
    comes last, as on a 256K-vocabulary model at 2K tokens): the late gradients', static + every gradient + the
    gradient of the embeddings' output (the largest `input_bytes`; only where there are late gradients), then the
    optimizer's, static + every gradient + `optimizer_bytes`.
  * Arguments. Every point above but the last two is raised by `call_argument_bytes`: the masks and rotary tables
    the model gives its layers, held from before the first layer until the layers' backward.
  * Correction. Every point above is raised by `peak_correction_bytes`: the most a plan that ran peaked above this
    model's prediction of it, which the closed loop measures.
  * Host. Every offloaded byte of a step is on the host when the forward ends: each layer's must have a place
    (`offload_places`: the pinned pool's `host_cap_bytes`, or with a disk tier its `disk_cap_bytes`, each whole in
    one, as the engine places copies). A layer whose offloaded bytes the pinned pool has no room for goes to
    the disk (forward order, as the engine spills what the pool refuses), its copy out at the slower of the link and
    the disk's writes (`disk_write_bytes_per_s`: the engine waits for a staging buffer), its reload at the slower of
    the link and the disk's reads. Without a tier, or with room on the host, nothing goes there and nothing changes.
  * Step time = `other_s` + the layers' forwards + the drain + `head_s` + the layers' backwards, recomputes and
    stalls + the host's time per offloading layer (`input_offload_s` for `C`, `S`, `T`, `L`; `saved_offload_s` for `O`,
    `X`: what the engine's host work costs a short step that the host, not the GPU, paces; learned from measured
    steps by `calibrate`). Peak = the largest memory of all the points above.
Where the engine can do better than the model says, the model takes the worse: a copy could start when the tensor
is saved rather than when the layer ends, and a layer's forward reaches its peak at one point of it, where the model
counts it from the layer's start, with the copies of the layers before it still in flight then.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..units import byte_unit, format_bytes
from .actions import ACTIONS, FULL_TILED, SAVED_OFFLOAD_LETTERS, SELECTIVE_LETTERS, TILED_LAYER, action_named
from .checks import check_bytes, check_seconds
from .profile import LayerProfile, StepProfile, layer_tiling_available, tiling_available

__all__ = [
    "PlannedLayer",
    "Prediction",
    "MeasuredStep",
    "Plan",
    "late_gradients_bytes",
    "memory_order",
    "optimizer_step_bytes",
    "simulate",
    "simulated_step",
]


@dataclass(frozen=True)
class PlannedLayer:
    """One layer's action and what the model predicts of it.

    Args:
        action: the name of one of the actions (`actions.ACTIONS`: "keep", "offload", "selective", "full", ...).
        offload_input: whether the layer's input leaves the GPU (always for "offload", never for "keep").
        held_bytes: bytes it holds on the GPU between its forward and its backward.
        offloaded_bytes: bytes it sends to the host.
        recompute_s: recomputation in its backward.
        stall_s: time its backward waits for its reload.
        host_s: host time its offloading adds (`StepProfile.input_offload_s`, `saved_offload_s`).
    """

    action: str
    offload_input: bool
    held_bytes: int
    offloaded_bytes: int
    recompute_s: float
    stall_s: float
    host_s: float = 0.0

    def __post_init__(self) -> None:
        action_named(self.action, self.offload_input)  # a ValueError for no such action

    @property
    def code(self) -> str:
        """The layer's letter in a plan code (see `actions.ACTIONS`)."""
        return action_named(self.action, self.offload_input).letter

    @property
    def added_s(self) -> float:
        """Time this layer adds to the step compared with keeping it."""
        return self.recompute_s + self.stall_s + self.host_s


@dataclass(frozen=True)
class Prediction:
    """What the model predicts of one step under a sequence of layer actions (see the module docstring).

    Args:
        layers: per layer, its action and predicted bytes and time.
        peak_bytes: the step's peak memory.
        peak_at: where the peak occurs: "forward layer 3", "head" or "backward layer 0" (the earliest if tied).
        step_s: the step's time.
        drain_s: compute's wait for the copies at the end of the forward.
        host_bytes: bytes on the host at the end of the forward (the disk tier's included).
        forward_window_bytes: the most bytes in flight to the host at once, counting a copy from its queueing.
        prefetch_window_bytes: the reloads issued ahead of need, at most (0 when nothing is offloaded).
        tail_bytes: the engine's tail the head counts: the last offloaded bytes kept on the GPU, the most the engine
            may keep while the plan is in force.
        disk_bytes: of `host_bytes`, those the pinned pool has no room for, on the disk tier.
    """

    layers: tuple[PlannedLayer, ...]
    peak_bytes: int
    peak_at: str
    step_s: float
    drain_s: float
    host_bytes: int
    forward_window_bytes: int
    prefetch_window_bytes: int
    tail_bytes: int = 0
    disk_bytes: int = 0

    @property
    def code(self) -> str:
        """One letter per layer, as `simulate` takes it."""
        return "".join(layer.code for layer in self.layers)


class LayerOption(NamedTuple):
    """One layer under one action: what the simulation needs of it, as a plain tuple to unpack fast."""

    held: int
    offloaded: int
    recompute_s: float
    saved: int
    forward_s: float
    backward_s: float
    working: int  # its backward's gradient buffers on top of `saved`, its own parameters' gradients included
    host_s: float = 0.0  # host time its offloading adds to the step (`StepProfile.input_offload_s`, `saved_offload_s`)
    forward_peak: int = 0  # its forward's bytes at their peak, where more than `saved`
    offloads_saved: bool = False  # it sends the engine its saved tensors beyond its input (`O`, `X`)


def gathered_parameters(profile: StepProfile) -> tuple[list[int], list[int]]:
    """Per layer, the parameters FSDP2 holds gathered while it runs forward, and while it runs backward: its own, and
    those of the layer before it, the next to run backward, which FSDP2 gathers ahead (zeros where nothing is
    sharded)."""
    forward = [layer.gathered_parameter_bytes for layer in profile.layers]
    return forward, [own + (forward[i - 1] if i else 0) for i, own in enumerate(forward)]


def gradients_at_backward(profile: StepProfile) -> list[int]:
    """Per layer, the gradient bytes that exist as its backward starts: all of the step's but those still to come,
    which are the late ones (the embeddings', after every layer), those of the layers before it, and its own: its
    backward creates them, and they are part of its working bytes (the probe measures its backward with them)."""
    existing, to_come = [], profile.late_gradient_bytes
    for layer in profile.layers:
        to_come += layer.parameter_gradient_bytes
        existing.append(profile.gradient_bytes - min(profile.gradient_bytes, to_come))
    return existing


def _after_the_layers_backward(profile: StepProfile) -> int:
    """What is held once every layer's backward is done, whatever the plan: the memory held (the layers' arguments
    gone with their backward) and the model's correction of it, and every gradient."""
    return profile.static_bytes + profile.peak_correction_bytes + profile.gradient_bytes


def optimizer_step_bytes(profile: StepProfile) -> int:
    """The step's point after backward, whatever the plan: every gradient, and the optimizer's temporaries."""
    return _after_the_layers_backward(profile) + profile.optimizer_bytes


def late_gradients_bytes(profile: StepProfile) -> int:
    """The step's point where the late gradients (the input embeddings') are made, after every layer's backward,
    whatever the plan: every gradient, and the gradient of the embeddings' output, as large as a layer's input (the
    largest, for a model of several stacks), which exists until they are made. 0 without late gradients. On a
    26-layer model with a 256K vocabulary (H200) it was the peak of every plan that offloads each layer's input, to
    17 KB: 1.1 GiB of embedding gradient on 6 GiB of others."""
    if not profile.late_gradient_bytes:
        return 0
    return _after_the_layers_backward(profile) + max(layer.input_bytes for layer in profile.layers)


class SimulatedStep(NamedTuple):
    """The step-level results of `simulate_step`, without per-layer objects, for the planner's inner loop."""

    peak_bytes: int
    peak_phase: str  # "forward", "head", "backward", "embeddings" (the late gradients) or "optimizer"
    peak_layer: int  # -1 for the points outside the layers (head, embeddings, optimizer)
    step_s: float
    drain_s: float
    host_bytes: int
    forward_window_bytes: int
    prefetch_window_bytes: int
    stall_s: list[float]
    head_base_bytes: int  # the head's point without its reloads
    head_reload_bytes: int  # the reloads the head starts, before `StepProfile.head_reload_hidden_bytes`
    tail_bytes: int  # the engine's tail the head counts (in `head_base_bytes`)
    disk_bytes: int = 0  # of `host_bytes`, those on the disk tier
    unplaced_bytes: int = 0  # of `host_bytes`, those neither the pinned pool nor the disk tier has room for


def layer_options(profile: StepProfile, layer: LayerProfile) -> dict[str, LayerOption]:
    """The layer under each action code (the selective ones only when `StepProfile.selective_checkpoint`, those that
    offload saved tensors beyond the input only when `StepProfile.offload_saved`, the tiled ones only when
    `tiling_available`, `layer_tiling_available`)."""
    saved, selective, inputs = layer.saved_bytes, layer.selective_bytes, layer.input_bytes
    working = profile.backward_working_bytes
    # A recomputation holds the forward's peak while the output's gradient waits for it.
    recomputing = max(working, layer.forward_peak_bytes + inputs - saved)
    times = (saved, layer.forward_s, layer.backward_s, working)
    recomputed = (saved, layer.forward_s, layer.backward_s, recomputing)
    sends_input, sends_saved = profile.input_offload_s, profile.saved_offload_s
    peak = {"forward_peak": layer.forward_peak_bytes}
    options = {
        "K": LayerOption(saved, 0, 0.0, *times, **peak),
        "C": LayerOption(0, inputs, layer.forward_s, *recomputed, sends_input, **peak),
        "c": LayerOption(inputs, 0, layer.forward_s, *recomputed, **peak),
    }
    if profile.offload_saved:
        options["O"] = LayerOption(0, saved, 0.0, *times, sends_saved, **peak, offloads_saved=True)
    if profile.selective_checkpoint:
        options["S"] = LayerOption(selective, inputs, layer.selective_recompute_s, *recomputed, sends_input, **peak)
        options["s"] = LayerOption(selective + inputs, 0, layer.selective_recompute_s, *recomputed, **peak)
    if profile.selective_checkpoint and profile.offload_saved:
        options["X"] = LayerOption(
            0, selective + inputs, layer.selective_recompute_s, *recomputed, sends_saved, **peak, offloads_saved=True
        )
    if tiling_available(profile):
        saved_tiled = layer.tiled_saved_bytes + profile.tile_chunk_bytes
        tiled_working = _backward_working(saved_tiled, profile.tiled_backward_working_bytes,
                                          profile.tiled_backward_sequence_bytes)  # fmt: skip
        tiled = (layer.forward_s + layer.tiled_extra_s, saved_tiled, layer.forward_s, layer.backward_s, tiled_working)
        options["T"] = LayerOption(0, inputs, *tiled, sends_input)
        options["t"] = LayerOption(inputs, 0, *tiled)
    if layer_tiling_available(profile):
        saved_tiled = layer.layer_tiled_saved_bytes + profile.layer_tile_chunk_bytes
        tiled_working = _backward_working(saved_tiled, profile.layer_tiled_backward_working_bytes,
                                          profile.layer_tiled_backward_sequence_bytes)  # fmt: skip
        tiled = (layer.forward_s + layer.layer_tiled_extra_s, saved_tiled, layer.forward_s, layer.backward_s,
                 tiled_working)  # fmt: skip
        options["L"] = LayerOption(0, inputs, *tiled, sends_input)
        options["l"] = LayerOption(inputs, 0, *tiled)
    return options


def _backward_working(saved: int, chunk_phase_working: int, sequence_phase: int) -> int:
    """A tiled layer's working bytes in backward, on top of `saved`: the chunk phase's, or the whole-sequence phase's
    where that phase holds more in all (`StepProfile.tiled_backward_sequence_bytes`)."""
    return max(chunk_phase_working, sequence_phase - saved)


def simulate_step(profile: StepProfile, options: Sequence[LayerOption], window: int | None = None,
                  limit: int | None = None) -> SimulatedStep:  # fmt: skip
    """The model of the module docstring, walked through once in time order. The planner's hot loop.

    The prefetch window is the narrowest (the largest reload) where no layer offloads its saved tensors and the
    engine reloads one layer ahead (`StepProfile.reloads_one_layer_ahead`); else
    `window` (at least the narrowest), or with `limit` (a peak not to exceed) the widest that keeps the peak within
    it, or else the narrowest: the peak's points are computed before the reloads are timed, and each bounds the
    window by the room it leaves.
    """
    static = profile.static_bytes + profile.peak_correction_bytes + profile.call_argument_bytes
    gathered_in_forward, gathered_in_backward = gathered_parameters(profile)
    offloaded = [option.offloaded for option in options]
    places = offload_places(offloaded, profile.host_cap_bytes, profile.disk_cap_bytes)
    spilled = [place == ON_DISK for place in places] if profile.disk_cap_bytes else None
    forward = _forward(profile, options, static, gathered_in_forward, spilled)
    reloads_bytes = sum(offloaded)
    narrowest = max(offloaded)
    head = _head(profile, forward, static, reloads_bytes, narrowest)
    points: list[_Point] = [  # after the forward, in time order
        (head.base_bytes, max(0, head.reload_bytes - profile.head_reload_hidden_bytes), "head", -1),
        *_backward_points(profile, options, static, gathered_in_backward, forward.held_bytes, reloads_bytes),
        (late_gradients_bytes(profile), 0, "embeddings", -1),
        (optimizer_step_bytes(profile), 0, "optimizer", -1),
    ]
    one_ahead = profile.reloads_one_layer_ahead and not any(option.offloads_saved for option in options)
    window = narrowest if one_ahead else _prefetch_window(points, narrowest, reloads_bytes, window, limit)
    peak, peak_phase, peak_layer = forward.peak_bytes, "forward", forward.peak_layer
    for memory, to_come, phase, layer in points:
        memory += min(window, to_come)
        if memory > peak:
            peak, peak_phase, peak_layer = memory, phase, layer
    backward = _backward(profile, options, forward.end_s + forward.drain_s, window, narrowest, spilled)
    return SimulatedStep(
        peak_bytes=peak,
        peak_phase=peak_phase,
        peak_layer=peak_layer,
        step_s=profile.other_s + backward.end_s + backward.host_s,
        drain_s=forward.drain_s,
        host_bytes=reloads_bytes,
        forward_window_bytes=forward.window_bytes,
        prefetch_window_bytes=window if reloads_bytes else 0,
        stall_s=backward.stall_s,
        head_base_bytes=head.base_bytes,
        head_reload_bytes=head.reload_bytes,
        tail_bytes=head.tail_bytes,
        disk_bytes=sum(size for size, place in zip(offloaded, places) if place == ON_DISK),
        unplaced_bytes=sum(size for size, place in zip(offloaded, places) if place is None),
    )


ON_HOST, ON_DISK = "host", "disk"


def offload_places(sizes: Sequence[int], host_room: int, disk_room: int = 0) -> list[str | None]:
    """Where each of `sizes` (what each layer offloads, in forward order) goes, as the engine places its copies:
    first come first served, each whole in one place, the pinned pool (`ON_HOST`) where it fits what those before it
    left of `host_room`, else the disk tier (`ON_DISK`) where it fits what they left of `disk_room`, else nowhere
    (None: it stays on the device). Each tier's room counts apart: with 4 GiB inputs, a pool of 61.97 GiB holds 15 and
    a disk tier's 38.70 GiB 9, where their sum would have room for 25."""
    places: list[str | None] = []
    on_host = on_disk = 0
    for size in sizes:
        if on_host + size <= host_room:
            on_host += size
            places.append(ON_HOST)
        elif on_disk + size <= disk_room:
            on_disk += size
            places.append(ON_DISK)
        else:
            places.append(None)
    return places


def all_placed(profile: StepProfile, sizes: Sequence[int]) -> bool:
    """Whether the pinned pool and the disk tier have room for every one of `sizes` (`offload_places`)."""
    if sum(sizes) <= profile.host_cap_bytes:
        return True  # under the pool's cap, first come first served refuses none
    return None not in offload_places(sizes, profile.host_cap_bytes, profile.disk_cap_bytes)


# A point of the step after the forward, where the peak may be: (memory without the reloads, the reloads still to come
# there, phase, layer), as `SimulatedStep.peak_phase` and `peak_layer` name it.
_Point = tuple[int, int, str, int]


class _Forward(NamedTuple):
    """What the layers' forwards leave to the rest of the step (`_forward`)."""

    peak_bytes: int
    peak_layer: int  # the earliest if tied
    held_bytes: int  # what every layer holds until its backward
    end_s: float  # when the last layer's forward ends
    drain_s: float  # compute's wait from then for the copies to finish, before the head runs
    unfinished_bytes: int  # the copies still in flight when the last forward ends
    window_bytes: int  # the most bytes in flight to the host at once, counting a copy from its queueing


def _forward(profile: StepProfile, options: Sequence[LayerOption], static: int, gathered: Sequence[int],
             spilled: Sequence[bool] | None) -> _Forward:  # fmt: skip
    """The layers' forwards in order: each layer's memory as it starts, and the copies of what it offloads, queued on
    one stream as its forward ends (those `spilled` to the disk tier at its pace where slower)."""
    to_disk_bytes_per_s = min(profile.d2h_bytes_per_s, profile.disk_write_bytes_per_s) if spilled else 0.0
    peak, peak_layer = -1, -1
    held_before = 0  # held by the layers before the current one
    now = 0.0  # end of the last forward so far
    copies: deque[tuple[float, int]] = deque()  # (finish time, bytes) of copies to the host not yet finished
    copying_bytes = 0
    copies_done_at = 0.0
    forward_window = 0
    for i, (held, offloaded, _, saved, forward_s, _, _, _, forward_peak, _) in enumerate(options):
        memory = static + held_before + copying_bytes + max(saved, forward_peak) + gathered[i]
        if memory > peak:
            peak, peak_layer = memory, i
        now += forward_s
        while copies and copies[0][0] <= now:
            copying_bytes -= copies.popleft()[1]
        if offloaded:
            bytes_per_s = to_disk_bytes_per_s if spilled and spilled[i] else profile.d2h_bytes_per_s
            copies_done_at = (copies_done_at if copies_done_at > now else now) + offloaded / bytes_per_s
            copies.append((copies_done_at, offloaded))
            copying_bytes += offloaded
            if copying_bytes > forward_window:
                forward_window = copying_bytes
        held_before += held
    return _Forward(
        peak_bytes=peak,
        peak_layer=peak_layer,
        held_bytes=held_before,
        end_s=now,
        drain_s=copies_done_at - now if copies_done_at > now else 0.0,
        unfinished_bytes=sum(nbytes for done_at, nbytes in copies if done_at > now),
        window_bytes=forward_window,
    )


class _Head(NamedTuple):
    """The head's point (`_head`)."""

    base_bytes: int  # its memory without its reloads
    reload_bytes: int  # the reloads it starts, before `StepProfile.head_reload_hidden_bytes`
    tail_bytes: int  # the engine's tail it counts (in `base_bytes`)


def _head(profile: StepProfile, forward: _Forward, static: int, reloads_bytes: int, narrowest: int) -> _Head:
    """The head's point: every layer's held bytes, the head's own, the engine's tail, and the reloads it starts.

    The head's reloads stay within the narrowest window (the engine widens it once the layers' backward begins), so
    that they never pile onto the loss's peak. The engine's tail keeps some of the last offloaded bytes instead:
    those are not reloaded, and with the reloads they are at most every offloaded byte. It learns them as the copies
    unfinished when the forward ended, so those are what it can hold: counting its bound whatever the copies did put
    128 MiB too many at the head of plans whose copies all finish (a 28-layer LoRA model at 4K tokens, H200: every
    `C` plan predicted 136-149 MB above its measured peak, the engine's tail empty).
    """
    tail = min(profile.tail_bytes, forward.unfinished_bytes, max(0, reloads_bytes - narrowest))
    return _Head(base_bytes=static + forward.held_bytes + profile.head_bytes + tail,
                 reload_bytes=min(narrowest, reloads_bytes), tail_bytes=tail)  # fmt: skip


def _backward_points(profile: StepProfile, options: Sequence[LayerOption], static: int, gathered: Sequence[int],
                     held_bytes: int, reloads_bytes: int) -> list[_Point]:  # fmt: skip
    """Each layer's backward point, from the last layer to the first: its memory without the reloads (`held_bytes`
    is what every layer holds after the forward), and the reloads still to come there, those of the layers before
    it."""
    gradients = gradients_at_backward(profile)
    points = []
    held_before, below = held_bytes, reloads_bytes
    for i in range(len(options) - 1, -1, -1):
        held, offloaded, _, saved, _, _, working, _, _, _ = options[i]
        held_before -= held
        below -= offloaded
        points.append((static + gradients[i] + held_before + saved + working + gathered[i], below, "backward", i))
    return points


def _prefetch_window(points: Sequence[_Point], narrowest: int, reloads_bytes: int,
                     window: int | None, limit: int | None) -> int:  # fmt: skip
    """`simulate_step`'s prefetch window: `window`, or with `limit` the widest that keeps every point within it, or
    else the narrowest; never narrower than that, one layer's reload."""
    if window is None:
        window = narrowest
        if limit is not None:
            window = reloads_bytes
            for memory, to_come, _, _ in points:
                if limit - memory < to_come:
                    window = min(window, limit - memory)
    return max(window, narrowest)


class _Backward(NamedTuple):
    """The backward in time (`_backward`)."""

    stall_s: list[float]  # per layer, its backward's wait for its reload
    end_s: float  # when the first layer's backward ends
    host_s: float  # the host's time for the offloading layers


def _backward(profile: StepProfile, options: Sequence[LayerOption], head_start: float, window: int,
              narrowest: int, spilled: Sequence[bool] | None) -> _Backward:  # fmt: skip
    """The head and the layers' backward in time, from the head's start: the reloads come back on one stream, from
    the last layer to the first, as far ahead as the window allows (the narrowest while the head runs; those
    `spilled` to the disk tier at its pace where slower), and a layer's backward waits for its own."""
    from_disk_bytes_per_s = min(profile.h2d_bytes_per_s, profile.disk_read_bytes_per_s) if spilled else 0.0
    stalls = [0.0] * len(options)
    reloads = [i for i in range(len(options) - 1, -1, -1) if options[i].offloaded]  # in the order they come back
    reload_done = [0.0] * len(options)
    next_reload, outstanding, h2d_free_at = 0, 0, 0.0

    def issue(at: float, ahead: int) -> None:
        """Issues the next reloads at time `at`, while those outstanding fit `ahead` bytes."""
        nonlocal next_reload, outstanding, h2d_free_at
        while next_reload < len(reloads):
            layer = reloads[next_reload]
            nbytes = options[layer].offloaded
            if outstanding and outstanding + nbytes > ahead:
                return
            bytes_per_s = from_disk_bytes_per_s if spilled and spilled[layer] else profile.h2d_bytes_per_s
            h2d_free_at = (h2d_free_at if h2d_free_at > at else at) + nbytes / bytes_per_s
            reload_done[layer] = h2d_free_at
            outstanding += nbytes
            next_reload += 1

    issue(head_start, narrowest)
    # The host's time per offloading layer is added to the step's, outside the GPU's timeline (where it would
    # overlap with the reloads it delays no less).
    host_total_s = 0.0
    previous_end = head_start + profile.head_s  # end of the backward after this layer's (the head's, first)
    for i in range(len(options) - 1, -1, -1):
        _, offloaded, recompute_s, _, _, backward_s, _, host_s, _, _ = options[i]
        start = previous_end
        if offloaded:
            issue(start, window)  # a no-op unless every earlier reload is used: then this one goes now
            if reload_done[i] > start:
                start = reload_done[i]
            outstanding -= offloaded
        stalls[i] = start - previous_end
        issue(start, window)
        previous_end = start + backward_s + recompute_s
        host_total_s += host_s
    return _Backward(stall_s=stalls, end_s=previous_end, host_s=host_total_s)


def describe_peak(run: SimulatedStep) -> str:
    steps = {"head": "head", "embeddings": "the input embeddings' gradient", "optimizer": "the optimizer step"}
    if run.peak_phase in steps:
        return steps[run.peak_phase]
    return f"{run.peak_phase} layer {run.peak_layer}"


def check_code(profile: StepProfile, code: str) -> None:
    if not isinstance(code, str) or len(code) != len(profile.layers) or not set(code) <= ACTIONS.keys():
        raise ValueError(f"a plan code has one letter per layer ({len(profile.layers)}) from "
                         f"{''.join(ACTIONS)}, got {code!r}")  # fmt: skip
    missing = unavailable_tiling(profile, code)
    if missing:
        raise ValueError(f"plan code {code!r} {missing}")
    if set(code) & set(SELECTIVE_LETTERS) and not profile.selective_checkpoint:
        raise ValueError(f"plan code {code!r} checkpoints selectively ({', '.join(SELECTIVE_LETTERS)}), which this "
                         "model's in-place kernels rule out (StepProfile.selective_checkpoint)")  # fmt: skip
    if set(code) & set(SAVED_OFFLOAD_LETTERS) and not profile.offload_saved:
        raise ValueError(f"plan code {code!r} offloads saved tensors beyond the input "
                         f"({', '.join(SAVED_OFFLOAD_LETTERS)}), which this model's layers save as tensors offloading "
                         "keeps in place (StepProfile.offload_saved)")  # fmt: skip


def unavailable_tiling(profile: StepProfile, code: str) -> str:
    """What `code` tiles that `profile` cannot (no tiled measurement, or a step of at most one chunk), in words;
    empty if nothing."""
    for letters, what, available, name in (
        ("Tt", "MLPs", tiling_available, "tile_tokens"),
        ("Ll", "whole layers", layer_tiling_available, "layer_tile_tokens"),
    ):
        if set(code) & set(letters) and not available(profile):
            return (
                f"tiles {what} ({', '.join(letters)}), but this profile has no tiled measurement for "
                f"{profile.tokens} tokens ({name}={getattr(profile, name)}: tiling needs 0 < {name} < tokens)"
            )
    return ""


def simulate(profile: StepProfile, code: str, prefetch_window_bytes: int | None = None) -> Prediction:
    """Predicts the peak memory and time of one step under the given layer actions.

    Args:
        profile: the measured step.
        code: one action letter per layer, in forward order (see `actions.ACTIONS`), e.g. "CCCCSSSSKKKK".
        prefetch_window_bytes: the reloads allowed ahead of need; None, or anything narrower than the largest
            layer's reload, means that reload (one layer ahead), as does a code without `O` or `X` where the engine
            reloads one layer ahead.

    Returns:
        The prediction.

    Raises:
        ValueError: if `code` does not have one valid letter per layer, or tiles MLPs or layers where the profile
            cannot.

    Example:
        With `profile` as in `choose_plan`'s example:

        >>> simulate(profile, "CCCC").peak_at
        'backward layer 3'
    """
    options, run = _simulated(profile, code, prefetch_window_bytes)
    return prediction_of(code, options, run)


def simulated_step(profile: StepProfile, code: str, prefetch_window_bytes: int | None = None) -> SimulatedStep:
    """`simulate`'s step-level results (`SimulatedStep`: the head's point and its reloads included), with the same
    arguments and errors."""
    return _simulated(profile, code, prefetch_window_bytes)[1]


def memory_order(profile: StepProfile, code: str) -> tuple[int, int]:
    """The key that orders plans by memory, lowest first: the predicted peak, then, where peaks tie, the peak with the
    head and loss costing nothing.

    A long step's head can set the peak of every plan (before the second step measures it, from an estimate of its
    logits), so that tiling leaves the peak where it was; the plan whose layers hold the least is still the lower
    one. Ordered by the peak alone, a first step of 229,376 tokens (Qwen3-8B's shape, H100) kept its layers untiled
    and ran out of memory in a layer's recomputation.
    """
    without_head = dataclasses.replace(profile, head_bytes=0)
    return simulated_step(profile, code).peak_bytes, simulated_step(without_head, code).peak_bytes


def _simulated(profile: StepProfile, code: str,
               prefetch_window_bytes: int | None) -> tuple[list[LayerOption], SimulatedStep]:  # fmt: skip
    check_code(profile, code)
    if prefetch_window_bytes is not None:
        check_bytes("simulate", "prefetch_window_bytes", prefetch_window_bytes)
    options = code_options(profile, code)
    return options, simulate_step(profile, options, window=prefetch_window_bytes)


def code_options(profile: StepProfile, code: str) -> list[LayerOption]:
    """Each layer's `LayerOption` under its letter of `code`, which `check_code` has accepted."""
    return [layer_options(profile, layer)[letter] for layer, letter in zip(profile.layers, code)]


def chunk_sizes(profile: StepProfile, code: str) -> dict[str, int]:
    """A plan's `tile_tokens` and `layer_tile_tokens` for `code`: the profile's, where the code tiles that way."""
    return {"tile_tokens": profile.tile_tokens if set(code) & set("Tt") else 0,
            "layer_tile_tokens": profile.layer_tile_tokens if set(code) & set("Ll") else 0}  # fmt: skip


def prediction_of(code: str, options: Sequence[LayerOption], run: SimulatedStep) -> Prediction:
    layers = tuple(
        PlannedLayer(
            ACTIONS[letter].action,
            ACTIONS[letter].offload_input,
            held_bytes=option.held,
            offloaded_bytes=option.offloaded,
            recompute_s=option.recompute_s,
            stall_s=stall,
            host_s=option.host_s,
        )  # fmt: skip
        for letter, option, stall in zip(code, options, run.stall_s)
    )
    return Prediction(
        layers=layers,
        peak_bytes=run.peak_bytes,
        peak_at=describe_peak(run),
        step_s=run.step_s,
        drain_s=run.drain_s,
        host_bytes=run.host_bytes,
        forward_window_bytes=run.forward_window_bytes,
        prefetch_window_bytes=run.prefetch_window_bytes,
        tail_bytes=run.tail_bytes,
        disk_bytes=run.disk_bytes,
    )


@dataclass(frozen=True)
class MeasuredStep:
    """A plan that ran: what its steps measured, at the tokens of the profile it is given to `choose_plan` with.

    Args:
        code: the plan's code (see `actions.ACTIONS`).
        step_s: its step's time, the fastest of its steps (the host's stalls only add to some); None where only its
            peak was measured (the first step's: the probes and the warm-up ran in it), its predicted time then
            standing for it.
        peak_bytes: its steps' largest peak; None where nothing counts peaks (the CPU test mode): its predicted
            peak then stands for it.
    """

    code: str
    step_s: float | None
    peak_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.step_s is not None:
            check_seconds("MeasuredStep", "step_s", self.step_s)
        if self.peak_bytes is not None:
            check_bytes("MeasuredStep", "peak_bytes", self.peak_bytes)

    def scaled(self, measured_at: StepProfile, profile: StepProfile) -> MeasuredStep:
        """The same plan measured under `measured_at`, predicted under `profile` (another number of tokens, or
        more memory held): its time in the proportion of the two predictions, its peak grown by what the
        prediction's grows (what the model gets wrong of the measured step stays as it was)."""
        before, after = simulate(measured_at, self.code), simulate(profile, self.code)
        step_s = self.step_s
        if step_s is not None:
            step_s = step_s * after.step_s / before.step_s if before.step_s > 0 else after.step_s
        peak = None if self.peak_bytes is None else max(0, self.peak_bytes + after.peak_bytes - before.peak_bytes)
        return MeasuredStep(self.code, step_s, peak)


_ACTION_NAMES = {
    "K": "keep",
    "O": "offload",
    "S": "selective, input offloaded",
    "s": "selective, input kept",
    "X": "selective, all offloaded",
    "C": "full, input offloaded",
    "c": "full, input kept",
    "T": "full, MLP tiled, input offloaded",
    "t": "full, MLP tiled, input kept",
    "L": "layer tiled, input offloaded",
    "l": "layer tiled, input kept",
}


@dataclass(frozen=True)
class Plan:
    """The planner's answer: per layer an action, and what the model predicts of the step.

    Args:
        budget_bytes: the budget it was planned for.
        tokens: the tokens per step it was planned for; a longer step needs a new plan.
        predicted: the layers' actions and the predicted step.
        tile_tokens: tokens per chunk of the layers whose MLP the plan tiles (`T`, `t`).
        layer_tile_tokens: tokens per chunk of the layers the plan tiles whole (`L`, `l`).
        host_cap_bytes: the pinned host bytes the plan had (`StepProfile.host_cap_bytes`).
        host_default_cap_bytes: where the plan grew the pinned pool past its cap (`host_growth`), that cap; else 0.
        host_growth: why the plan grew the pinned pool past its cap, to `host_cap_bytes` (`host.choose_plan_with_host`);
            empty when it did not.
        disk_cap_bytes: the disk tier's room the plan had past the pinned pool (`StepProfile.disk_cap_bytes`).
        measured: what this plan measured when it ran before (scaled to `tokens`); None if it never ran. Where
            the measurement and the prediction disagree, the measurement is what `choose_plan` chose by.
        time_scale: the measured plans' median ratio of measured to predicted step time, by which `choose_plan` scaled
            the predictions of the plans that never ran, to compare them with measured ones (1 without any).
        trial: a simple plan run for a few steps to be measured, before the plan is chosen with what it measured
            (the controller's closed loop).
    """

    budget_bytes: int
    tokens: int
    predicted: Prediction
    tile_tokens: int = 0
    host_cap_bytes: int = 0
    layer_tile_tokens: int = 0
    host_default_cap_bytes: int = 0
    host_growth: str = ""
    measured: MeasuredStep | None = None
    time_scale: float = 1.0
    trial: bool = False
    disk_cap_bytes: int = 0

    @property
    def expected_step_s(self) -> float:
        """The step time `choose_plan` chose this plan by: measured, or else predicted in the measurements' terms."""
        return self.measured.step_s if self.time_measured else self.predicted.step_s * self.time_scale

    @property
    def time_measured(self) -> bool:
        """Whether `expected_step_s` is a measurement: the plan ran steps that were timed."""
        return self.measured is not None and self.measured.step_s is not None

    @property
    def layers(self) -> tuple[PlannedLayer, ...]:
        """Per layer, in forward order, its action and what is predicted of it."""
        return self.predicted.layers

    @property
    def code(self) -> str:
        """One letter per layer, e.g. "CCCCSSSSKKKK" (lowercase: a checkpoint that keeps its input)."""
        return self.predicted.code

    def fits(self, margin_bytes: int = 0) -> bool:
        """Whether the plan keeps under its budget: its measured peak if it has one, else its predicted peak with
        `margin_bytes` to spare (the prediction's error, which a measurement does not have)."""
        if self.measured is not None and self.measured.peak_bytes is not None:
            return self.measured.peak_bytes <= self.budget_bytes
        return self.predicted.peak_bytes <= self.budget_bytes - margin_bytes

    @property
    def forward_window_bytes(self) -> int:
        """The engine's forward window: the most bytes in flight to the host that the plan relies on."""
        return self.predicted.forward_window_bytes

    @property
    def prefetch_window_bytes(self) -> int:
        """The engine's prefetch window: the reloads it may issue ahead of need (see the module docstring)."""
        return self.predicted.prefetch_window_bytes

    @property
    def head_prefetch_window_bytes(self) -> int:
        """What the output head's backward may reload ahead: the largest layer's reload (see the module docstring)."""
        return max(layer.offloaded_bytes for layer in self.layers)

    @property
    def tiled_layers(self) -> list[int]:
        """The layers whose MLP the plan tiles, in forward order."""
        return [i for i, layer in enumerate(self.layers) if layer.action == FULL_TILED]

    @property
    def tiled_whole_layers(self) -> list[int]:
        """The layers the plan tiles whole (`L`, `l`), in forward order."""
        return [i for i, layer in enumerate(self.layers) if layer.action == TILED_LAYER]

    @property
    def inputs_kept_for_host(self) -> list[int]:
        """The checkpointed layers that keep their input on the GPU because the host's pinned cap (and the disk tier's
        room past it) is full: their input would have fit the budget's plan offloaded, but not the host."""
        kept = [i for i, layer in enumerate(self.layers) if layer.code in "sctl"]
        smallest = min((self.layers[i].held_bytes for i in kept), default=0)
        pinned = self.predicted.host_bytes - self.predicted.disk_bytes
        pool_full = smallest > self.host_cap_bytes - pinned
        disk_full = smallest > self.disk_cap_bytes - self.predicted.disk_bytes
        return kept if self.host_cap_bytes and pool_full and disk_full else []

    def format_table(self) -> str:
        """The plan as a table for the log: a header line (and what limits it), then one line per layer."""
        predicted = self.predicted
        lines = [
            f"Memory plan for {self.tokens} tokens per step, budget {format_bytes(self.budget_bytes)}: predicted peak "
            f"{format_bytes(predicted.peak_bytes)} ({predicted.peak_at}), step {predicted.step_s * 1000:.1f} ms (copy "
            f"wait {predicted.drain_s * 1000:.1f} ms), {format_bytes(predicted.host_bytes)} on the host",
        ]
        if self.trial:
            lines.append("A trial: measured for a few steps, then the plan is chosen with what it measured")
        if self.time_measured:
            peak = self.measured.peak_bytes
            lines.append(
                f"Chosen by measurement: its steps ran in {self.measured.step_s * 1000:.1f} ms"
                + ("" if peak is None else f" at a peak of {format_bytes(peak)}")
            )
        elif self.measured is not None and self.measured.peak_bytes is not None:
            lines.append(f"Its peak measured: {format_bytes(self.measured.peak_bytes)} (the first step's, with the "
                         "memory held since), its time predicted")  # fmt: skip
        if self.host_growth:
            lines.append(f"Host: {format_bytes(predicted.host_bytes)} pinned of a {format_bytes(self.host_cap_bytes)} "
                         f"cap (default {format_bytes(self.host_default_cap_bytes)}), grown because "
                         f"{self.host_growth}")  # fmt: skip
        if predicted.disk_bytes:
            lines.append(f"Disk: {format_bytes(predicted.disk_bytes)} of what the step offloads goes to the disk tier "
                         f"(room {format_bytes(self.disk_cap_bytes)}): the pinned pool's cap of "
                         f"{format_bytes(self.host_cap_bytes)} is full")  # fmt: skip
        if self.tiled_layers:
            lines.append(
                f"The MLPs of {len(self.tiled_layers)} layers run in chunks of {self.tile_tokens} tokens: "
                "no plan without tiling fits (gradients then agree within rounding, not bitwise)"
            )
        if self.tiled_whole_layers:
            lines.append(
                f"{len(self.tiled_whole_layers)} layers run whole in chunks of {self.layer_tile_tokens} tokens, "
                "attention by head groups: no plan without it fits, nor with tiled MLPs alone (gradients then agree "
                "within rounding, not bitwise)"
            )
        if self.inputs_kept_for_host:
            disk = f" and the disk tier's room of {format_bytes(self.disk_cap_bytes)}" if self.disk_cap_bytes else ""
            lines.append(f"{len(self.inputs_kept_for_host)} checkpointed layers keep their input on the GPU: the "
                         f"host's pinned cap of {format_bytes(self.host_cap_bytes)}{disk} is full "
                         "(max_pinned_memory_fraction, max_pinned_mib, host_memory_reserve_mib"
                         f"{', disk_offload_dir' if not disk else ', disk_reserve_mib'})")  # fmt: skip
        # One unit for both byte columns, the one their largest figure reads in (KiB for a tiny model, not 0.00 GiB).
        unit, scale = byte_unit(max((max(layer.held_bytes, layer.offloaded_bytes) for layer in predicted.layers),
                                    default=0))  # fmt: skip
        lines.append(f"{'layer':>5}  {'action':<32}  {'kept ' + unit:>8}  {'offloaded ' + unit:>13}  {'added ms':>8}")
        for i, layer in enumerate(predicted.layers):
            lines.append(f"{i:>5}  {_ACTION_NAMES[layer.code]:<32}  {layer.held_bytes / scale:>8.2f}  "
                         f"{layer.offloaded_bytes / scale:>13.2f}  {layer.added_s * 1000:>8.2f}")  # fmt: skip
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able, picklable) that `from_dict` turns back into an equal plan."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Return the plan that `to_dict` described.

        Args:
            data: what `to_dict` returned (after a JSON or pickle round trip, too).

        Returns:
            A plan equal to the one `data` was made from.
        """
        predicted = dict(data["predicted"])
        predicted["layers"] = tuple(PlannedLayer(**layer) for layer in predicted["layers"])
        measured = data.get("measured")
        return cls(
            **{
                **data,
                "predicted": Prediction(**predicted),
                "measured": None if measured is None else MeasuredStep(**measured),
            }
        )
