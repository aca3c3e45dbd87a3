"""The memory-budget planner: per decoder layer, the cheapest way to keep the step's peak under a budget.

Pure Python, standard library only: a plan is a function of a measured profile and a budget, so that it can be
computed, tested and compared anywhere. The engine measures a `StepProfile` during the first steps, calls
`plan(profile, budget.resolve(device_total_bytes))`, and applies `Plan.layers` layer by layer with the windows the
plan names. `simulate` predicts any hand-written plan the same way.

Actions, one per decoder layer, each with a one-letter code:
  * keep (`K`): the layer's saved tensors stay on the GPU until its backward.
  * offload (`O`): everything the layer saves goes to the host after its forward and comes back for its backward.
  * selective checkpoint (`S` input offloaded, `s` input kept): the outputs of matmuls and attention stay on the
    GPU (the checkpoint keeps them in its own cache), the rest is recomputed in backward.
  * selective checkpoint, offloaded (`X`): as `S`, but the saved outputs go to the host with the input.
  * full checkpoint (`C` input offloaded, `c` input kept): only the input is saved; the whole forward is
    recomputed in backward.
  * full checkpoint with the MLP tiled (`T` input offloaded, `t` input kept): as `C`/`c`, and the layer's MLP runs
    over chunks of `StepProfile.tile_tokens` tokens (`hf_offload.tiled_mlp`), so that its intermediates exist for one
    chunk at a time, in the recompute and the backward too. The only action that is not bitwise exact (the weight
    gradients are summed chunk by chunk), so the planner chooses it only when no plan without it fits.

The model, which the GPU measurements must confirm (bytes, seconds; layer i's numbers from its `LayerProfile`):
  * Bytes. Between its forward and its backward a layer holds on the GPU: keep `saved_bytes`; offload and `X` 0;
    selective `selective_bytes` (+ `input_bytes` if it keeps its input); full 0 (+ `input_bytes` if kept). It sends
    to the host: offload `saved_bytes`; `X` `selective_bytes + input_bytes`; `S` and `C` `input_bytes`; the others
    nothing. `T`/`t` hold and send what `C`/`c` do.
  * Forward. Layers run in order. A layer's offloaded bytes are queued on one device-to-host stream when its
    forward ends (FIFO, at `d2h_bytes_per_s`) and leave the GPU when their copy finishes. Compute never waits for
    a copy except at the end of the forward, where every copy is drained before the head runs: that wait is
    exposed time. Memory while layer i computes = static + what the layers before it hold + their copies not
    finished when layer i starts + layer i's `saved_bytes` (all its activations exist while it computes, even
    when it is checkpointed). For `T`/`t` that is its `tiled_saved_bytes` + the step's `tile_chunk_bytes` (one
    chunk's MLP intermediates).
  * Reloads. The offloaded layers come back one after another, from the last to the first, on one host-to-device
    stream (FIFO, at `h2d_bytes_per_s`), as far ahead as the prefetch window allows: a layer's reload is issued
    when the head starts or a layer's backward starts, if the reloads issued and not yet used fit the window with
    it (or none are outstanding). The window is at least the largest layer's reload (one layer ahead); the planner
    widens it as far as the budget allows, which hides long reloads behind several layers' backward. While the
    head runs, the window stays at its narrowest: the loss's peak is then still close.
  * Head. Memory = static + what every layer holds + `head_bytes` + the reloads outstanding, counted as
    min(narrowest window, every reload): the engine fills its window copy by copy, not layer by layer.
  * Backward, layer i from the last to the first. Its backward starts when layer i+1's has ended and its reload
    has finished (the difference is a stall), and lasts `backward_s` + its recompute (full: `forward_s`,
    selective: `selective_recompute_s`, tiled: `forward_s` + `tiled_extra_s`). Memory = static + the gradients that
    exist by then (`gradient_bytes` less the `parameter_gradient_bytes` of the layers before it, whose backward is
    still to come) + what the layers before it hold + its `saved_bytes` (kept, reloaded or recomputed, all of it
    exists during its backward) + `backward_working_bytes` + min(window, the reloads of the layers before it). For
    `T`/`t`: its bytes in the forward above, and `tiled_backward_working_bytes` in place of `backward_working_bytes`.
  * Host. Every offloaded byte of a step is on the host when the forward ends: the sum must fit `host_cap_bytes`.
  * Step time = `other_s` + the layers' forwards + the drain + `head_s` + the layers' backwards, recomputes and
    stalls. Peak = the largest memory of all the points above.
Where the engine can do better than the model says, the model takes the worse: a copy could start when the tensor
is saved rather than when the layer ends, and memory inside a layer's forward only reaches `saved_bytes` at its end.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from numbers import Real
from typing import Any, NamedTuple

from ..units import GIB, format_bytes

__all__ = [
    "MemoryBudget",
    "parse_memory_budget",
    "LayerProfile",
    "StepProfile",
    "MeasuredStep",
    "LayerPlan",
    "Prediction",
    "Plan",
    "InfeasibleBudgetError",
    "plan",
    "simulate",
    "tiling_available",
    "in_proportion",
]

# "auto" leaves this much of the device outside the budget. The budget bounds `max_memory_allocated`, which does
# not count the CUDA context, NCCL's buffers or the memory the caching allocator reserves but cannot reuse
# (fragmentation), and the prediction itself is only trusted to within about 5%. Small devices still keep 2 GiB.
AUTO_MARGIN_FRACTION = 0.05
AUTO_MARGIN_MIN_BYTES = 2 * GIB

KEEP, OFFLOAD, SELECTIVE, SELECTIVE_OFFLOAD, FULL = "keep", "offload", "selective", "selective_offload", "full"
FULL_TILED = "full_tiled_mlp"

# Code letter -> (action, whether the layer's input leaves the GPU).
ACTION_CODES: dict[str, tuple[str, bool]] = {
    "K": (KEEP, False),
    "O": (OFFLOAD, True),
    "S": (SELECTIVE, True),
    "s": (SELECTIVE, False),
    "C": (FULL, True),
    "c": (FULL, False),
    "X": (SELECTIVE_OFFLOAD, True),
    "T": (FULL_TILED, True),
    "t": (FULL_TILED, False),
}
_CODE_OF_ACTION = {action: code for code, action in ACTION_CODES.items()}

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_BUDGET_TEXT = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]+|%)?", re.ASCII)
_ACCEPTED_FORMS = (
    "None (no planner), 'auto' (the device's memory less a safety margin), a number of bytes > 0 (an int or a "
    "string of digits), a size such as '24GiB', '20000MiB' or '24GB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, "
    "TiB), or a share of the device's memory in (0, 100] such as '60%'"
)


_gib = format_bytes  # one formatter for the library (units.py): a budget of 1,000 bytes reads '1000 B', not '0.00 GiB'


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to a user


def in_proportion(amount: int, measured_tokens: int, tokens: int) -> int:
    """An amount (bytes, tokens) measured at `measured_tokens`, in proportion at `tokens`, rounded up (exact integer
    arithmetic)."""
    return -(-amount * tokens // measured_tokens)


@dataclass(frozen=True)
class MemoryBudget:
    """A budget for the step's peak memory, in the form the user gave it: a size, a percentage, or "auto".

    Build one with `parse_memory_budget`. At most one of `nbytes` and `percent` is set; neither means "auto".

    Args:
        nbytes: the budget in bytes.
        percent: the budget as a percentage of the device's total memory, in (0, 100].
        text: the user's spelling, given back by `str()`; not part of equality.
    """

    nbytes: int | None = None
    percent: float | None = None
    text: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.nbytes is not None and self.percent is not None:
            raise ValueError("a memory budget is either a size or a percentage, not both")
        if self.nbytes is not None and (not _is_int(self.nbytes) or self.nbytes <= 0):
            raise ValueError(f"a memory budget in bytes must be an int > 0, got {self.nbytes!r}")
        if self.percent is not None and not 0 < self.percent <= 100:
            raise ValueError(f"a memory budget in percent must be in (0, 100], got {self.percent!r}")

    def __str__(self) -> str:
        if self.text:
            return self.text
        if self.nbytes is not None:
            return str(self.nbytes)
        return "auto" if self.percent is None else f"{self.percent:g}%"

    def resolve(self, device_total_bytes: int | None) -> int:
        """The budget in bytes.

        Args:
            device_total_bytes: the device's total memory, or None without a device (the CPU test mode).

        Returns:
            The budget in bytes.

        Raises:
            ValueError: for a percentage or "auto" without a device, or a device too small for "auto".

        Example:
            >>> parse_memory_budget("60%").resolve(80 * 10**9)
            48000000000
        """
        if self.nbytes is not None:
            return self.nbytes
        if device_total_bytes is None:
            raise ValueError(
                f"memory budget {str(self)!r} is relative to the device's memory, but there is no device to ask "
                "(e.g. the CPU test mode): give a size in bytes instead, such as '24GiB'"
            )
        if self.percent is not None:
            return math.floor(device_total_bytes * self.percent / 100)
        budget = device_total_bytes - max(math.ceil(device_total_bytes * AUTO_MARGIN_FRACTION), AUTO_MARGIN_MIN_BYTES)
        if budget <= 0:
            raise ValueError(
                f"memory budget 'auto' leaves nothing of a device of {_gib(device_total_bytes)} after its safety "
                f"margin of {_gib(AUTO_MARGIN_MIN_BYTES)}: give a size in bytes instead"
            )
        return budget


def parse_memory_budget(value: Any, option: str = "memory_budget") -> MemoryBudget | None:
    """Reads a memory budget as an option or a command-line string gives it.

    Args:
        value: None or "none" (no planner), "auto", an int number of bytes or a string of digits, a size string
            with a binary or decimal unit ("24GiB", "20000 MiB", "24GB", case-insensitive), a percentage of the
            device's memory ("60%"), or a `MemoryBudget` (returned as it is).
        option: the option's name as the user wrote it, for the error message.

    Returns:
        The budget, or None when the planner is off.

    Raises:
        ValueError: naming `option` and the accepted forms, for anything else (bools, floats, zero, negative or
            non-finite numbers, unknown units, percentages outside (0, 100]).

    Example:
        >>> parse_memory_budget("1.5 GiB").nbytes
        1610612736
        >>> str(parse_memory_budget("60%"))
        '60%'
    """
    if value is None or isinstance(value, MemoryBudget):
        return value
    try:  # every malformed value ends in the one message below, which lists the accepted forms
        if _is_int(value):
            return MemoryBudget(nbytes=value, text=str(value))
        if not isinstance(value, str):
            raise ValueError
        text = value.strip()
        if text.lower() == "none":
            return None
        if text.lower() == "auto":
            return MemoryBudget(text=text)
        match = _BUDGET_TEXT.fullmatch(text.lower())
        if match is None:
            raise ValueError
        number, unit = match["number"], match["unit"]
        if unit == "%":
            return MemoryBudget(percent=float(number), text=text)
        if unit is None:
            return MemoryBudget(nbytes=int(number), text=text)  # a fractional number of bytes is not an int
        # Exact decimal arithmetic, floored: a budget never exceeds what was written.
        return MemoryBudget(nbytes=math.floor(Fraction(number) * _UNITS[unit]), text=text)
    except (ValueError, KeyError):
        raise ValueError(f"{option} must be {_ACCEPTED_FORMS}; got {value!r}") from None


def _check_bytes(owner: str, name: str, value: Any) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{owner}.{name} must be an int number of bytes >= 0, got {value!r}")


def _check_seconds(owner: str, name: str, value: Any, positive: bool = False) -> None:
    number = not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value)
    if not number or value < 0 or (positive and value == 0):
        raise ValueError(f"{owner}.{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass(frozen=True)
class LayerProfile:
    """What one decoder layer costs, as measured at `StepProfile.tokens` tokens.

    Args:
        saved_bytes: bytes its saved tensors occupy between its forward and its backward when it keeps them,
            its input included.
        selective_bytes: bytes a selective checkpoint keeps (matmul and attention outputs), its input excluded.
        input_bytes: its input, all that a full checkpoint saves.
        forward_s: its forward; also what a full checkpoint recomputes.
        backward_s: its backward, without any recomputation.
        selective_recompute_s: what a selective checkpoint recomputes in backward.
        attention_forward_s: the part of `forward_s` that grows with the square of the tokens.
        attention_backward_s: the part of `backward_s` that grows with the square of the tokens.
        parameter_gradient_bytes: the gradients of its trainable parameters, which its backward creates.
        tiled_saved_bytes: what `saved_bytes` becomes with its MLP tiled: the MLP's intermediates are gone, its
            input stays (a chunk's intermediates are the step's `tile_chunk_bytes`). Used only when the step's
            `tile_tokens` is set.
        tiled_extra_s: what tiling its MLP adds to a full checkpoint's backward: one more forward of the MLP (the
            recompute runs the tiled forward just to save its input, the backward recomputes each chunk again) and
            the chunks' smaller matrix products.
    """

    saved_bytes: int
    selective_bytes: int
    input_bytes: int
    forward_s: float
    backward_s: float
    selective_recompute_s: float
    attention_forward_s: float = 0.0
    attention_backward_s: float = 0.0
    parameter_gradient_bytes: int = 0
    tiled_saved_bytes: int = 0
    tiled_extra_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("saved_bytes", "selective_bytes", "input_bytes", "parameter_gradient_bytes",
                     "tiled_saved_bytes"):  # fmt: skip
            _check_bytes("LayerProfile", name, getattr(self, name))
        for name in ("forward_s", "backward_s", "selective_recompute_s", "attention_forward_s",
                     "attention_backward_s", "tiled_extra_s"):  # fmt: skip
            _check_seconds("LayerProfile", name, getattr(self, name))
        for part, whole in (("attention_forward_s", "forward_s"), ("attention_backward_s", "backward_s")):
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(f"LayerProfile.{part} is part of {whole}, so it cannot exceed it: "
                                 f"{getattr(self, part)!r} > {getattr(self, whole)!r}")  # fmt: skip

    def scaled(self, measured_tokens: int, tokens: int) -> LayerProfile:
        """The same layer measured at `measured_tokens`, predicted at `tokens` (see `StepProfile.scaled`)."""
        ratio = tokens / measured_tokens

        def grow_time(total: float, attention: float) -> float:
            return (total - attention) * ratio + attention * ratio * ratio

        return dataclasses.replace(  # parameter gradients do not grow with the tokens
            self,
            saved_bytes=in_proportion(self.saved_bytes, measured_tokens, tokens),
            selective_bytes=in_proportion(self.selective_bytes, measured_tokens, tokens),
            input_bytes=in_proportion(self.input_bytes, measured_tokens, tokens),
            forward_s=grow_time(self.forward_s, self.attention_forward_s),
            backward_s=grow_time(self.backward_s, self.attention_backward_s),
            # What selective checkpointing drops is elementwise work, which grows with the tokens.
            selective_recompute_s=self.selective_recompute_s * ratio,
            attention_forward_s=self.attention_forward_s * ratio * ratio,
            attention_backward_s=self.attention_backward_s * ratio * ratio,
            tiled_saved_bytes=in_proportion(self.tiled_saved_bytes, measured_tokens, tokens),
            tiled_extra_s=self.tiled_extra_s * ratio,  # the MLP's work, per token
        )


@dataclass(frozen=True)
class StepProfile:
    """What one training step costs, as measured at `tokens` tokens: the planner's only input besides the budget.

    Args:
        layers: one `LayerProfile` per decoder layer, in forward order.
        static_bytes: memory held through the whole step: parameters, optimizer state (and gradients, when a
            gradient accumulation step starts with them).
        gradient_bytes: gradients that backward creates: absent in the forward and at the head's peak; at a layer's
            backward, all but those of the layers before it (`LayerProfile.parameter_gradient_bytes`).
        head_bytes: the head's and loss's peak on top of everything held when the forward ends.
        backward_working_bytes: transient gradient buffers of one layer's backward, on top of its activations.
        head_s: the head and loss, forward and backward.
        other_s: the rest of the step: embedding, optimizer step, and so on.
        d2h_bytes_per_s: device-to-host bandwidth.
        h2d_bytes_per_s: host-to-device bandwidth.
        host_cap_bytes: pinned host bytes the pool may hold.
        tokens: tokens per step when this was measured.
        tile_tokens: tokens per chunk of a tiled MLP; 0 when tiling is not an option (not measured, switched off,
            or a layer has no MLP that can be tiled). Tiling is offered only for steps of more tokens than this.
        tiled_backward_working_bytes: `backward_working_bytes` of a layer whose MLP is tiled, less one chunk's share.
        tile_chunk_bytes: one chunk's MLP intermediates and their gradients, at `tile_tokens` tokens: the part of
            a tiled layer's memory that does not grow with the step's tokens.
    """

    layers: tuple[LayerProfile, ...]
    static_bytes: int
    head_bytes: int
    backward_working_bytes: int
    head_s: float
    other_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    host_cap_bytes: int
    tokens: int
    gradient_bytes: int = 0
    tile_tokens: int = 0
    tiled_backward_working_bytes: int = 0
    tile_chunk_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers or not all(isinstance(layer, LayerProfile) for layer in self.layers):
            raise ValueError(f"StepProfile.layers must be one or more LayerProfile, got {self.layers!r}")
        for name in ("static_bytes", "gradient_bytes", "head_bytes", "backward_working_bytes", "host_cap_bytes",
                     "tile_tokens", "tiled_backward_working_bytes", "tile_chunk_bytes"):  # fmt: skip
            _check_bytes("StepProfile", name, getattr(self, name))
        for name in ("head_s", "other_s"):
            _check_seconds("StepProfile", name, getattr(self, name))
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            _check_seconds("StepProfile", name, getattr(self, name), positive=True)
        if not _is_int(self.tokens) or self.tokens <= 0:
            raise ValueError(f"StepProfile.tokens must be an int > 0, got {self.tokens!r}")

    def scaled(self, tokens: int) -> StepProfile:
        """The same step at another number of tokens.

        Activation bytes grow in proportion to the tokens (rounded up), static and gradient bytes do not, nor does a
        tiled MLP's chunk (`tile_tokens`, `tile_chunk_bytes`); times grow in proportion too, except the attention
        parts, which grow with the square.

        Args:
            tokens: the tokens per step to predict for.

        Returns:
            A new profile measured "as if" at `tokens`.

        Example:
            With `profile` as in `plan`'s example:

            >>> profile.scaled(2 * profile.tokens).layers[0].saved_bytes == 2 * profile.layers[0].saved_bytes
            True
        """
        if not _is_int(tokens) or tokens <= 0:
            raise ValueError(f"tokens must be an int > 0, got {tokens!r}")
        ratio = tokens / self.tokens

        def grow(nbytes: int) -> int:
            return in_proportion(nbytes, self.tokens, tokens)

        layers = tuple(layer.scaled(self.tokens, tokens) for layer in self.layers)
        return dataclasses.replace(
            self,
            layers=layers,
            head_bytes=grow(self.head_bytes),
            backward_working_bytes=grow(self.backward_working_bytes),
            tiled_backward_working_bytes=grow(self.tiled_backward_working_bytes),
            head_s=self.head_s * ratio,
            other_s=self.other_s * ratio,
            tokens=tokens,
        )


@dataclass(frozen=True)
class LayerPlan:
    """One layer's action and what the model predicts of it.

    Args:
        action: "keep", "offload", "selective" or "full".
        offload_input: whether the layer's input leaves the GPU (always for "offload", never for "keep").
        held_bytes: bytes it holds on the GPU between its forward and its backward.
        offloaded_bytes: bytes it sends to the host.
        recompute_s: recomputation in its backward.
        stall_s: time its backward waits for its reload.
    """

    action: str
    offload_input: bool
    held_bytes: int
    offloaded_bytes: int
    recompute_s: float
    stall_s: float

    def __post_init__(self) -> None:
        if (self.action, self.offload_input) not in _CODE_OF_ACTION:
            raise ValueError(f"no such layer action: {self.action!r} with offload_input={self.offload_input!r}; "
                             f"the actions are {sorted(set(ACTION_CODES.values()))}")  # fmt: skip

    @property
    def code(self) -> str:
        """The layer's letter in a plan code (see `ACTION_CODES`)."""
        return _CODE_OF_ACTION[(self.action, self.offload_input)]

    @property
    def added_s(self) -> float:
        """Time this layer adds to the step compared with keeping it."""
        return self.recompute_s + self.stall_s


@dataclass(frozen=True)
class Prediction:
    """What the model predicts of one step under a sequence of layer actions (see the module docstring).

    Args:
        layers: per layer, its action and predicted bytes and time.
        peak_bytes: the step's peak memory.
        peak_at: where the peak occurs: "forward layer 3", "head" or "backward layer 0" (the earliest if tied).
        step_s: the step's time.
        drain_s: compute's wait for the copies at the end of the forward.
        host_bytes: bytes on the host at the end of the forward.
        forward_window_bytes: the most bytes in flight to the host at once, counting a copy from its queueing.
        prefetch_window_bytes: the reloads issued ahead of need, at most (0 when nothing is offloaded).
    """

    layers: tuple[LayerPlan, ...]
    peak_bytes: int
    peak_at: str
    step_s: float
    drain_s: float
    host_bytes: int
    forward_window_bytes: int
    prefetch_window_bytes: int

    @property
    def code(self) -> str:
        """One letter per layer, as `simulate` takes it."""
        return "".join(layer.code for layer in self.layers)


class _Option(NamedTuple):
    """One layer under one action: what the simulation needs of it, as a plain tuple to unpack fast."""

    held: int
    offloaded: int
    recompute_s: float
    saved: int
    forward_s: float
    backward_s: float
    working: int  # its backward's gradient buffers on top of `saved`


class _Run(NamedTuple):
    """The step-level results of `_simulate`, without per-layer objects, for the planner's inner loop."""

    peak_bytes: int
    peak_phase: str  # "forward", "head" or "backward"
    peak_layer: int  # -1 for the head
    step_s: float
    drain_s: float
    host_bytes: int
    forward_window_bytes: int
    prefetch_window_bytes: int
    stall_s: list[float]


def tiling_available(profile: StepProfile) -> bool:
    """Whether the layers' MLPs can be tiled (`T`, `t`) in this step: tiling was measured, and the step has more
    tokens than one chunk (with fewer, a tiled MLP runs untiled)."""
    return 0 < profile.tile_tokens < profile.tokens


def _layer_options(profile: StepProfile, layer: LayerProfile) -> dict[str, _Option]:
    """The layer under each action code (the tiled ones only when `tiling_available`)."""
    saved, selective, inputs = layer.saved_bytes, layer.selective_bytes, layer.input_bytes
    times = (saved, layer.forward_s, layer.backward_s, profile.backward_working_bytes)
    options = {
        "K": _Option(saved, 0, 0.0, *times),
        "O": _Option(0, saved, 0.0, *times),
        "S": _Option(selective, inputs, layer.selective_recompute_s, *times),
        "s": _Option(selective + inputs, 0, layer.selective_recompute_s, *times),
        "X": _Option(0, selective + inputs, layer.selective_recompute_s, *times),
        "C": _Option(0, inputs, layer.forward_s, *times),
        "c": _Option(inputs, 0, layer.forward_s, *times),
    }
    if tiling_available(profile):
        tiled = (layer.forward_s + layer.tiled_extra_s, layer.tiled_saved_bytes + profile.tile_chunk_bytes,
                 layer.forward_s, layer.backward_s, profile.tiled_backward_working_bytes)  # fmt: skip
        options["T"] = _Option(0, inputs, *tiled)
        options["t"] = _Option(inputs, 0, *tiled)
    return options


def _simulate(profile: StepProfile, options: Sequence[_Option], window: int | None = None,
              limit: int | None = None) -> _Run:  # fmt: skip
    """The model of the module docstring, walked through once in time order. The planner's hot loop.

    The prefetch window is `window` (at least the largest reload), or with `limit` (a peak not to exceed) the widest
    that keeps the peak within it, or else the narrowest: the peak's points are computed before the reloads are
    timed, and each bounds the window by the room it leaves.
    """
    static = profile.static_bytes
    peak, peak_phase, peak_layer = -1, "", -1

    held_before = 0  # held by the layers before the current one
    now = 0.0  # end of the last forward so far
    copies: deque[tuple[float, int]] = deque()  # (finish time, bytes) of copies to the host not yet finished
    copying_bytes = 0
    copies_done_at = 0.0
    forward_window = 0
    for i, (held, offloaded, _, saved, forward_s, _, _) in enumerate(options):
        memory = static + held_before + copying_bytes + saved
        if memory > peak:
            peak, peak_phase, peak_layer = memory, "forward", i
        now += forward_s
        while copies and copies[0][0] <= now:
            copying_bytes -= copies.popleft()[1]
        if offloaded:
            copies_done_at = (copies_done_at if copies_done_at > now else now) + offloaded / profile.d2h_bytes_per_s
            copies.append((copies_done_at, offloaded))
            copying_bytes += offloaded
            if copying_bytes > forward_window:
                forward_window = copying_bytes
        held_before += held

    # The points after the forward: memory without the reloads, and the reloads still to come there.
    reloads_total = sum(option.offloaded for option in options)
    narrowest = max(option.offloaded for option in options)
    # The head's reloads stay within the narrowest window (the engine widens it once the layers' backward begins),
    # so that they never pile onto the loss's peak.
    points = [(static + held_before + profile.head_bytes, min(narrowest, reloads_total), "head", -1)]
    below = reloads_total
    # Gradients still to come at layer i's backward: those of the layers before it, as far as they are pending.
    gradients_to_come = min(profile.gradient_bytes, sum(layer.parameter_gradient_bytes for layer in profile.layers))
    after_forward = static + profile.gradient_bytes
    for i in range(len(options) - 1, -1, -1):
        held, offloaded, _, saved, _, _, working = options[i]
        held_before -= held
        below -= offloaded
        gradients_to_come = max(0, gradients_to_come - profile.layers[i].parameter_gradient_bytes)
        points.append((after_forward - gradients_to_come + held_before + saved + working, below, "backward", i))
    if window is None:
        window = narrowest
        if limit is not None:
            widest = reloads_total
            for memory, to_come, _, _ in points:
                if limit - memory < to_come:
                    widest = min(widest, limit - memory)
            window = max(window, widest)
    window = max(window, narrowest)
    for memory, to_come, phase, layer in points:
        memory += min(window, to_come)
        if memory > peak:
            peak, peak_phase, peak_layer = memory, phase, layer

    drain = copies_done_at - now if copies_done_at > now else 0.0
    head_start = now + drain
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
            h2d_free_at = (h2d_free_at if h2d_free_at > at else at) + nbytes / profile.h2d_bytes_per_s
            reload_done[layer] = h2d_free_at
            outstanding += nbytes
            next_reload += 1

    issue(head_start, narrowest)
    previous_end = head_start + profile.head_s  # end of the backward after this layer's (the head's, first)
    for i in range(len(options) - 1, -1, -1):
        _, offloaded, recompute_s, _, _, backward_s, _ = options[i]
        start = previous_end
        if offloaded:
            issue(start, window)  # a no-op unless every earlier reload is used: then this one goes now
            if reload_done[i] > start:
                start = reload_done[i]
            outstanding -= offloaded
        stalls[i] = start - previous_end
        issue(start, window)
        previous_end = start + backward_s + recompute_s

    return _Run(
        peak_bytes=peak,
        peak_phase=peak_phase,
        peak_layer=peak_layer,
        step_s=profile.other_s + previous_end,
        drain_s=drain,
        host_bytes=reloads_total,
        forward_window_bytes=forward_window,
        prefetch_window_bytes=window if reloads_total else 0,
        stall_s=stalls,
    )


def _peak_at(run: _Run) -> str:
    return "head" if run.peak_phase == "head" else f"{run.peak_phase} layer {run.peak_layer}"


def _check_code(profile: StepProfile, code: str) -> None:
    if not isinstance(code, str) or len(code) != len(profile.layers) or not set(code) <= ACTION_CODES.keys():
        raise ValueError(f"a plan code has one letter per layer ({len(profile.layers)}) from "
                         f"{''.join(ACTION_CODES)}, got {code!r}")  # fmt: skip
    if not tiling_available(profile) and set(code) & {"T", "t"}:
        raise ValueError(f"plan code {code!r} tiles MLPs (T, t), but this profile has no tiled measurement for "
                         f"{profile.tokens} tokens (tile_tokens={profile.tile_tokens}: tiling needs 0 < tile_tokens "
                         "< tokens)")  # fmt: skip


def simulate(profile: StepProfile, code: str, prefetch_window_bytes: int | None = None) -> Prediction:
    """Predicts the peak memory and time of one step under the given layer actions.

    Args:
        profile: the measured step.
        code: one action letter per layer, in forward order (see `ACTION_CODES`), e.g. "CCCCSSSSKKKK".
        prefetch_window_bytes: the reloads allowed ahead of need; None, or anything narrower than the largest
            layer's reload, means that reload (one layer ahead).

    Returns:
        The prediction.

    Raises:
        ValueError: if `code` does not have one valid letter per layer, or tiles MLPs where the profile cannot.

    Example:
        With `profile` as in `plan`'s example:

        >>> simulate(profile, "CCCC").peak_at
        'backward layer 3'
    """
    _check_code(profile, code)
    if prefetch_window_bytes is not None:
        _check_bytes("simulate", "prefetch_window_bytes", prefetch_window_bytes)
    options = [_layer_options(profile, layer)[letter] for layer, letter in zip(profile.layers, code)]
    return _prediction(code, options, _simulate(profile, options, window=prefetch_window_bytes))


def _prediction(code: str, options: Sequence[_Option], run: _Run) -> Prediction:
    layers = tuple(
        LayerPlan(
            *ACTION_CODES[letter],
            held_bytes=option.held,
            offloaded_bytes=option.offloaded,
            recompute_s=option.recompute_s,
            stall_s=stall,
        )  # fmt: skip
        for letter, option, stall in zip(code, options, run.stall_s)
    )
    return Prediction(
        layers=layers,
        peak_bytes=run.peak_bytes,
        peak_at=_peak_at(run),
        step_s=run.step_s,
        drain_s=run.drain_s,
        host_bytes=run.host_bytes,
        forward_window_bytes=run.forward_window_bytes,
        prefetch_window_bytes=run.prefetch_window_bytes,
    )


@dataclass(frozen=True)
class MeasuredStep:
    """A plan that ran: what its steps measured, at the tokens of the profile it is given to `plan` with.

    Args:
        code: the plan's code (see `ACTION_CODES`).
        step_s: its step's time, the median of its steps.
        peak_bytes: its steps' largest peak; None where nothing counts peaks (the CPU test mode): its predicted
            peak then stands for it.
    """

    code: str
    step_s: float
    peak_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_seconds("MeasuredStep", "step_s", self.step_s)
        if self.peak_bytes is not None:
            _check_bytes("MeasuredStep", "peak_bytes", self.peak_bytes)

    def scaled(self, measured_at: StepProfile, profile: StepProfile) -> MeasuredStep:
        """The same plan measured under `measured_at`, predicted under `profile` (another number of tokens, or
        more memory held): its time in the proportion of the two predictions, its peak grown by what the
        prediction's grows (what the model gets wrong of the measured step stays as it was)."""
        before, after = simulate(measured_at, self.code), simulate(profile, self.code)
        step_s = self.step_s * after.step_s / before.step_s if before.step_s > 0 else after.step_s
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
}


@dataclass(frozen=True)
class Plan:
    """The planner's answer: per layer an action, and what the model predicts of the step.

    Args:
        budget_bytes: the budget it was planned for.
        tokens: the tokens per step it was planned for; a longer step needs a new plan.
        predicted: the layers' actions and the predicted step.
        tile_tokens: tokens per chunk of the layers whose MLP the plan tiles (`T`, `t`).
        host_cap_bytes: the pinned host bytes the plan had (`StepProfile.host_cap_bytes`).
        measured: what this plan measured when it ran before (scaled to `tokens`); None if it never ran. Where
            the measurement and the prediction disagree, the measurement is what `plan` chose by.
        time_scale: the measured plans' median ratio of measured to predicted step time, by which `plan` scaled
            the predictions of the plans that never ran, to compare them with measured ones (1 without any).
    """

    budget_bytes: int
    tokens: int
    predicted: Prediction
    tile_tokens: int = 0
    host_cap_bytes: int = 0
    measured: MeasuredStep | None = None
    time_scale: float = 1.0

    @property
    def expected_step_s(self) -> float:
        """The step time `plan` chose this plan by: measured, or else predicted in the measurements' terms."""
        return self.predicted.step_s * self.time_scale if self.measured is None else self.measured.step_s

    @property
    def layers(self) -> tuple[LayerPlan, ...]:
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
    def inputs_kept_for_host(self) -> list[int]:
        """The checkpointed layers that keep their input on the GPU because the host's pinned cap is full: their
        input would have fit the budget's plan offloaded, but not the host."""
        kept = [i for i, layer in enumerate(self.layers) if layer.code in "sct"]
        smallest = min((self.layers[i].held_bytes for i in kept), default=0)
        full = self.host_cap_bytes and self.predicted.host_bytes + smallest > self.host_cap_bytes
        return kept if full else []

    def format_table(self) -> str:
        """The plan as a table for the log: a header line (and what limits it), then one line per layer."""
        predicted = self.predicted
        lines = [
            f"Memory plan for {self.tokens} tokens per step, budget {_gib(self.budget_bytes)}: predicted peak "
            f"{_gib(predicted.peak_bytes)} ({predicted.peak_at}), step {predicted.step_s * 1000:.1f} ms (copy "
            f"wait {predicted.drain_s * 1000:.1f} ms), {_gib(predicted.host_bytes)} on the host",
        ]
        if self.measured is not None:
            peak = self.measured.peak_bytes
            lines.append(
                f"Chosen by measurement: its steps ran in {self.measured.step_s * 1000:.1f} ms"
                + ("" if peak is None else f" at a peak of {_gib(peak)}")
            )
        if self.tiled_layers:
            lines.append(
                f"The MLPs of {len(self.tiled_layers)} layers run in chunks of {self.tile_tokens} tokens: "
                "no plan without tiling fits (gradients then agree within rounding, not bitwise)"
            )
        if self.inputs_kept_for_host:
            lines.append(f"{len(self.inputs_kept_for_host)} checkpointed layers keep their input on the GPU: the "
                         f"host's pinned cap of {_gib(self.host_cap_bytes)} is full (max_pinned_memory_fraction, "
                         "max_pinned_mib)")  # fmt: skip
        lines.append(f"{'layer':>5}  {'action':<32}  {'kept GiB':>8}  {'offloaded GiB':>13}  {'added ms':>8}")
        for i, layer in enumerate(predicted.layers):
            lines.append(f"{i:>5}  {_ACTION_NAMES[layer.code]:<32}  {layer.held_bytes / GIB:>8.2f}  "
                         f"{layer.offloaded_bytes / GIB:>13.2f}  {layer.added_s * 1000:>8.2f}")  # fmt: skip
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
        predicted["layers"] = tuple(LayerPlan(**layer) for layer in predicted["layers"])
        measured = data.get("measured")
        return cls(
            **{
                **data,
                "predicted": Prediction(**predicted),
                "measured": None if measured is None else MeasuredStep(**measured),
            }
        )


# The actions the planner chooses among: all but the selective offload (`X`). On S1 and S2 (H100) its layers cost
# about 2.5 ms each more than the model predicts from their recompute and copies (benchmarks/NOTES.md, 2026-11-23,
# session 2), which left plans with `X` slower than plans without; it stays an action for hand-written plans.
_PLANNED = "KOSsCc"


def _own_seconds(profile: StepProfile, options: list[dict[str, _Option]]) -> list[dict[str, float]]:
    """Per layer and action, the time it adds as if every other layer kept everything.

    Recompute, plus the part of its copy that the later layers' forwards cannot hide, plus the part of its reload
    that the next layer's backward (the head, for the last layer) cannot hide. The planner orders its changes by
    these; every candidate plan is then judged by `_simulate`, which also sees copies queueing behind each other.
    """
    layers = profile.layers
    later_forward_s = 0.0
    seconds: list[dict[str, float]] = [{} for _ in layers]
    for i in range(len(layers) - 1, -1, -1):
        reload_cover_s = layers[i + 1].backward_s if i + 1 < len(layers) else profile.head_s
        for letter, option in options[i].items():
            copy_exposed = max(0.0, option.offloaded / profile.d2h_bytes_per_s - later_forward_s)
            reload_exposed = max(0.0, option.offloaded / profile.h2d_bytes_per_s - reload_cover_s)
            seconds[i][letter] = option.recompute_s + copy_exposed + reload_exposed
        later_forward_s += layers[i].forward_s
    return seconds


def _next_option(
    current: str, candidates: Iterable[str], held: dict[str, int], seconds: dict[str, float]
) -> str | None:
    """The candidate holding less than `current` that frees the most bytes per second it adds.

    Ties go to the smaller step, so that no option on the way is skipped; None if no candidate holds less.
    """
    best, best_key = None, None
    for candidate in candidates:
        freed = held[current] - held[candidate]
        if freed <= 0:
            continue
        added = seconds[candidate] - seconds[current]
        key = (math.inf if added <= 0 else freed / added, -freed)
        if best_key is None or key > best_key:
            best, best_key = candidate, key
    return best


def _greedy_plans(
    profile: StepProfile, options: list[dict[str, _Option]], seconds: list[dict[str, float]]
) -> list[list[str]]:
    """The greedy's sequence of plans from keeping everything, each one layer change further than the last.

    Each layer's changes follow the lower convex hull of its (bytes held, seconds added) options among `_PLANNED`,
    e.g. keep -> selective -> full; all layers' changes are merged by bytes freed per second added, earlier layers
    first on ties (they free memory for more of the step). A change that would overflow the host cap becomes the
    layer's best change that fits in what the host has left.
    """
    held = [{letter: option.held for letter, option in layer.items()} for layer in options]
    offloaded = [{letter: option.offloaded for letter, option in layer.items()} for layer in options]
    changes = []  # (bytes freed per second added, layer, action code)
    for i in range(len(options)):
        current = "K"
        while (target := _next_option(current, _PLANNED, held[i], seconds[i])) is not None:
            added = seconds[i][target] - seconds[i][current]
            freed = held[i][current] - held[i][target]
            changes.append((math.inf if added <= 0 else freed / added, i, target))
            current = target
    changes.sort(key=lambda change: (-change[0], change[1]))  # stable: a layer's own changes stay in hull order

    letters, host_bytes, plans = ["K"] * len(options), 0, []
    for _, i, target in changes:
        current = letters[i]
        if held[i][target] >= held[i][current]:
            continue  # a fallback for the host cap already went past it
        room = profile.host_cap_bytes - host_bytes + offloaded[i][current]
        if offloaded[i][target] > room:
            fitting = [letter for letter in _PLANNED if offloaded[i][letter] <= room]
            target = _next_option(current, fitting, held[i], seconds[i])
            if target is None:
                continue
        host_bytes += offloaded[i][target] - offloaded[i][current]
        letters[i] = target
        plans.append(letters.copy())
    return plans


def _lowest_memory_code(profile: StepProfile, tiled: bool = False) -> str:
    """Every layer fully checkpointed (its MLP tiled if `tiled`), inputs offloaded from the first layer on while the
    host has room."""
    letters, host_bytes = [], 0
    offloaded, kept = ("T", "t") if tiled else ("C", "c")
    for layer in profile.layers:
        offload = host_bytes + layer.input_bytes <= profile.host_cap_bytes
        host_bytes += layer.input_bytes if offload else 0
        letters.append(offloaded if offload else kept)
    return "".join(letters)


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget: even the lowest-memory plan is predicted to peak above it.

    The message names the budget, that peak and what dominates it.

    Attributes:
        budget_bytes: the budget that was asked for.
        minimum_bytes: the smallest budget that works for this step (the lowest plan's peak, plus the margin plans
            keep for the prediction's error).
        lowest_plan: that lowest-memory plan, for a caller that must run the step anyway (it exceeds the budget).
    """

    def __init__(self, message: str, budget_bytes: int, minimum_bytes: int, lowest_plan: Plan) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.lowest_plan = lowest_plan


def _infeasible(profile: StepProfile, budget_bytes: int, margin_bytes: int, lowest_plan: Plan,
                chosen: Sequence[_Option], run: _Run) -> InfeasibleBudgetError:  # fmt: skip
    """The error for a budget below the lowest-memory plan's peak, with what that peak is made of."""
    code = lowest_plan.code
    static = profile.static_bytes + (profile.gradient_bytes if run.peak_phase == "backward" else 0)
    if run.peak_phase == "head":
        at_peak = ("the head and loss", profile.head_bytes)
    else:
        layer = chosen[run.peak_layer]
        working = layer.saved + (layer.working if run.peak_phase == "backward" else 0)
        at_peak = (f"layer {run.peak_layer}'s working set (its activations and gradient buffers)", working)
    parts = [
        ("static memory (parameters, gradients, optimizer state)", static),
        at_peak,
        ("the layers' held inputs, reloads and copies in flight", run.peak_bytes - static - at_peak[1]),
    ]
    parts.sort(key=lambda part: -part[1])
    (largest_name, largest_bytes), *others = parts
    rest = " and ".join(f"{name} {_gib(nbytes)}" for name, nbytes in others)
    message = (
        f"the memory budget of {_gib(budget_bytes)} ({budget_bytes} bytes) is below the smallest peak this step "
        f"can reach, {_gib(run.peak_bytes)} ({run.peak_bytes} bytes; plan {code!r}, peak at {_peak_at(run)}), "
        f"dominated by {largest_name} {_gib(largest_bytes)}, then {rest}"
        + (", with every layer's MLP tiled" if "T" in code or "t" in code else "")
        + (
            f"; plans keep {_gib(margin_bytes)} below the budget for the prediction's error, so the smallest budget "
            f"that works is {_gib(run.peak_bytes + margin_bytes)}"
            if margin_bytes
            else ""
        )
        + ". Raise the budget, or shorten the sequences or the batch."
    )
    return InfeasibleBudgetError(message, budget_bytes, run.peak_bytes + margin_bytes, lowest_plan)


def _first_fitting(plans: list[list[str]], run_of: Callable[[Sequence[str]], _Run],
                   fits: Callable[[_Run], bool]) -> tuple[list[str], _Run] | None:  # fmt: skip
    """The first of the greedy's plans that fits, by binary search: their peak falls from one to the next (all
    but always monotonically; whatever the search returns was checked by the simulation)."""
    low, high, found = 0, len(plans) - 1, None
    while low <= high:
        middle = (low + high) // 2
        run = run_of(plans[middle])
        if fits(run):
            found, high = (plans[middle], run), middle - 1
        else:
            low = middle + 1
    return found


def _polish(letters: list[str], run: _Run, seconds: list[dict[str, float]], run_of: Callable[[Sequence[str]], _Run],
            fits: Callable[[_Run], bool], planned: str = _PLANNED) -> tuple[list[str], _Run]:  # fmt: skip
    """Moves each layer, once, to the first action that still fits and makes the step faster.

    A layer tries the actions of `planned` no dearer on their own than its current one, cheapest first (ties
    included: an input kept rather than offloaded costs the same recompute and no copy). The layers that could save
    the most go first; on ties the last first, whose changes freed memory for the fewest points of the step.
    """
    order = sorted(
        range(len(letters)), key=lambda i: (min(seconds[i][letter] for letter in planned) - seconds[i][letters[i]], -i)
    )
    for i in order:
        current_s = seconds[i][letters[i]]
        alternatives = sorted(
            (letter for letter in planned if letter != letters[i] and seconds[i][letter] <= current_s),
            key=lambda letter: seconds[i][letter],
        )
        for letter in alternatives:
            trial = letters.copy()
            trial[i] = letter
            trial_run = run_of(trial)
            if fits(trial_run) and trial_run.step_s < run.step_s:
                letters, run = trial, trial_run
                break
    return letters, run


def plan(profile: StepProfile, budget_bytes: int, margin_bytes: int = 0, measured: Sequence[MeasuredStep] = (),
         measured_only: bool = False) -> Plan:  # fmt: skip
    """The per-layer actions with the shortest predicted step whose predicted peak fits the budget.

    Greedy, then polished. The greedy changes one layer at a time from keeping everything, taking first the
    changes that free the most bytes per second they add (see `_greedy_plans`); a binary search finds the first of
    its plans that fits. Polishing moves each layer, one at a time, to the cheapest action that still fits if that
    makes the step faster, which undoes changes the peak did not need (a change frees memory only for the points
    of the step after its layer). Both the greedy's plan and the lowest-memory plan are polished, and the faster
    wins: the result is never slower than the lowest-memory plan. Every candidate is judged by `_simulate` with the
    widest prefetch window that fits, so the plan never exceeds the budget. About 10 simulations per layer at most,
    each linear in the layers. The selective offload (`X`) is not chosen (see `_PLANNED`).

    Tiled MLPs (`T`, `t`) are not exact, so they are chosen only when no plan without them fits (and the profile
    measured them, see `tiling_available`): then every layer starts fully checkpointed with its MLP tiled, and
    polishing moves each layer that can do without back to a faster action.

    A heuristic: on uniform layers it matches an exhaustive search (see the tests); with layers of different
    sizes and slow links, where copies queue behind each other, it can miss the fastest plan by a few percent.

    Plans that ran (`measured`) are measurements, and a measurement beats the model: a measured plan fits if its
    measured peak is within the budget (the margin is for predictions), and is as fast as it measured. So the
    result is never slower than the fastest measured plan that fits, and a budget that a measured plan met is
    never refused (a plan without tiling that fits by measurement beats tiling). The plans that never ran are
    compared with them by their predictions scaled by the model's error in time (`Plan.time_scale`).

    Args:
        profile: the measured step.
        budget_bytes: the budget for the step's peak, in bytes.
        margin_bytes: how far below the budget the predicted peak must stay (for the prediction's error).
        measured: plans that ran, with their measurements at `profile`'s tokens (see `MeasuredStep.scaled`).
        measured_only: the fastest of the measured exact plans that fit, if any fits: for a closed loop's last
            correction, after which a plan the model proposes would never be measured.

    Returns:
        The plan. When keeping everything fits, every layer keeps.

    Raises:
        InfeasibleBudgetError: if even the lowest-memory plan (every layer fully checkpointed, its MLP tiled where
            tiling is available, inputs offloaded as far as the host cap allows) does not fit, nor does any measured
            plan: the message names its peak, what dominates it, and the budget; the error carries that plan.
        ValueError: `budget_bytes` is not an int > 0.

    Example:
        >>> layer = LayerProfile(saved_bytes=2 * GIB, selective_bytes=GIB, input_bytes=GIB // 16, forward_s=0.005,
        ...                      backward_s=0.010, selective_recompute_s=0.002)
        >>> profile = StepProfile(layers=[layer] * 4, static_bytes=8 * GIB, head_bytes=GIB,
        ...                       backward_working_bytes=2 * GIB, head_s=0.04, other_s=0.03, d2h_bytes_per_s=55e9,
        ...                       h2d_bytes_per_s=55e9, host_cap_bytes=64 * GIB, tokens=16384)
        >>> simulate(profile, "KKKK").peak_bytes / GIB
        18.0
        >>> plan(profile, 16 * GIB).code
        'SSSK'
        >>> round(plan(profile, 16 * GIB).predicted.step_s, 3)
        0.136
    """
    if not _is_int(budget_bytes) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be an int > 0, got {budget_bytes!r}")
    for step in measured:
        _check_code(profile, step.code)
    by_code = {step.code: step for step in measured}
    options = [_layer_options(profile, layer) for layer in profile.layers]
    limit = budget_bytes - margin_bytes

    def run_of(letters: Sequence[str]) -> _Run:
        return _simulate(profile, [layer[letter] for layer, letter in zip(options, letters)], limit=limit)

    # The model's error in time, as the measured plans show it: a prediction compared with a measurement is scaled
    # by it (a model that over-predicts every step would otherwise lose every comparison to a measurement).
    ratios = [step.step_s / run.step_s for step in by_code.values() if (run := run_of(step.code)).step_s > 0]
    time_scale = statistics.median(ratios) if ratios else 1.0

    def fits(run: _Run) -> bool:
        return run.peak_bytes <= limit and run.host_bytes <= profile.host_cap_bytes

    def finish(letters: Sequence[str], run: _Run) -> Plan:
        code = "".join(letters)
        predicted = _prediction(code, [layer[letter] for layer, letter in zip(options, code)], run)
        return Plan(
            budget_bytes=budget_bytes,
            tokens=profile.tokens,
            predicted=predicted,
            tile_tokens=profile.tile_tokens if "T" in code or "t" in code else 0,
            host_cap_bytes=profile.host_cap_bytes,
            measured=by_code.get(code),
            time_scale=time_scale,
        )

    def fastest(candidates: list[tuple[list[str], _Run]]) -> Plan:
        return min((finish(*candidate) for candidate in candidates), key=lambda plan: plan.expected_step_s)

    def admissible(candidate: tuple[list[str], _Run]) -> bool:
        return finish(*candidate).fits(margin_bytes) and candidate[1].host_bytes <= profile.host_cap_bytes

    measured_fitting = [candidate for candidate in ((list(code), run_of(code)) for code in by_code)
                        if admissible(candidate)]  # fmt: skip
    # Tiling is not exact: a measured plan that tiles is a candidate only where no exact plan fits.
    exact_measured = [candidate for candidate in measured_fitting if not {"T", "t"} & set(candidate[0])]
    if measured_only and exact_measured:
        return fastest(exact_measured)
    keep_all = ["K"] * len(options)
    keep_all_run = run_of(keep_all)
    if admissible((keep_all, keep_all_run)):  # nothing is faster, unless it measured slower than a measured plan
        return fastest([(keep_all, keep_all_run), *exact_measured])
    lowest = list(_lowest_memory_code(profile))
    lowest_run = run_of(lowest)
    seconds = _own_seconds(profile, options)
    if not fits(lowest_run) and measured_fitting:  # the model over-predicts a peak that a measurement met
        return fastest(exact_measured or measured_fitting)
    if not fits(lowest_run) and tiling_available(profile):
        lowest = list(_lowest_memory_code(profile, tiled=True))
        lowest_run = run_of(lowest)
        if fits(lowest_run):
            return finish(*_polish(lowest, lowest_run, seconds, run_of, fits, planned=_PLANNED + "Tt"))
    if not fits(lowest_run):
        chosen = [layer[letter] for layer, letter in zip(options, lowest)]
        error = _infeasible(profile, budget_bytes, margin_bytes, finish(lowest, lowest_run), chosen, lowest_run)
        # A measured plan that peaked below the predicted minimum (over this budget, or it would have been chosen)
        # is the smallest budget known to work.
        met = min((step for step in by_code.values() if step.peak_bytes is not None),
                  key=lambda step: step.peak_bytes, default=None)  # fmt: skip
        if met is not None and met.peak_bytes < error.minimum_bytes:
            raise InfeasibleBudgetError(f"{error} Measured, plan {met.code!r} peaked at {_gib(met.peak_bytes)} "
                                        f"({met.peak_bytes} bytes): the smallest budget known to work.",
                                        budget_bytes, met.peak_bytes, error.lowest_plan)  # fmt: skip
        raise error

    others = [*exact_measured]
    greedy = _first_fitting(_greedy_plans(profile, options, seconds), run_of, fits)
    if greedy is not None:
        others.append(_polish(*greedy, seconds, run_of, fits))
    # A plan the model fits that measured over the budget is no candidate; the polished lowest-memory plan stays
    # one whatever it measured, the last resort.
    return fastest([_polish(lowest, lowest_run, seconds, run_of, fits), *filter(admissible, others)])
