"""The engine's options: one frozen dataclass, validated in one place.

Every option of `OffloadActivations` is a field of `OffloadOptions`: its default, its help text, the rule its values
obey and, where the `TrainingArguments` spell it differently, the name and unit of the argument that sets it. The
`TrainingArguments` fields (`hf_offload.callbacks.arguments`) are generated from these fields, so a name, a default
or a rule is written once, here.

Values are checked in the units the user wrote them in, before any conversion: a window given in MiB is reported in
MiB, under the argument's name, and NaN or infinity never reach an integer conversion.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import textwrap
from dataclasses import dataclass, field
from typing import Any

import torch

from .host_memory import read_host_memory
from .memory_budget.spec import parse_memory_budget
from .units import MIB

__all__ = [
    "OffloadOptions",
    "Rule",
    "AUTO",
    "DEFAULT_WINDOW_BYTES",
    "current_accelerator_type",
    "check_budget_for_device",
    "check_host_memory_reserve",
    "format_option_doc",
]

# Enough for a copy stream never to idle; small, because when copies lag the window is on top of peak memory.
DEFAULT_WINDOW_BYTES = 128 * MIB
# Offloading that cannot take this share off a step's peak stands aside: it costs copies and hooks for a peak the
# user would not notice (a 1B-class shape at 2,048 tokens, its peak set by a 128,256-token vocabulary's loss: 1% lower
# for 1.06x checkpointing's time on an H100).
DEFAULT_MIN_PEAK_REDUCTION = 0.05

_FLAG, _BYTES, _COUNT, _FRACTION, _DEVICE, _BUDGET = "flag", "bytes", "count", "fraction", "device", "budget"
_PATH = "path"
_AUTO_FLAG = "auto_flag"
AUTO = "auto"


@dataclass(frozen=True)
class Rule:
    """What values an option accepts.

    Args:
        kind: `"flag"` (True or False), `"bytes"` (a size), `"count"` (a whole number), `"fraction"` (a number in
            `(0, maximum]`), `"device"` (a device type string) or `"budget"` (a memory budget, as
            `spec.parse_memory_budget` reads it), `"auto_flag"` (`"auto"`, True or False; from the command line
            also `true` and `false`) or `"path"` (a directory's path, a non-empty string or `os.PathLike`, kept as a
            string; whether it can hold files is checked where it is used).
        minimum: the smallest size or count allowed (bytes for sizes).
        maximum: the largest fraction allowed.
        optional: whether None is allowed (and, from the command line, the word `none`).
    """

    kind: str
    minimum: int = 0
    maximum: float = 1.0
    optional: bool = False

    def describe(self, unit: str, text: bool = False) -> str:
        """The allowed values, in the words and unit of the option as the user spells it.

        Args:
            unit: `"bytes"` or `"MiB"`.
            text: the user gave text (the command line's spelling): name the words it takes, `none`, `true`, ...
        """
        none = ("none or " if text else "None or ") if self.optional else ""
        if self.kind == _FLAG:
            return "True or False"
        if self.kind == _AUTO_FLAG:
            return "'auto', 'true' or 'false'" if text else "'auto', True or False"
        if self.kind == _DEVICE:
            return "None, 'cpu' or the available accelerator's type"
        if self.kind == _PATH:
            return f"{none}a directory's path (a non-empty string)"
        if self.kind == _FRACTION:
            return f"{none}a number in (0, {self.maximum:g}]"
        if unit == "MiB":
            return f"{none}a number of MiB {'>= 0' if self.minimum == 0 else '> 0'}"
        noun = "an int" if self.kind == _COUNT else "an int number of bytes"
        return f"{none}{noun} >= {self.minimum}"

    def type_text(self, unit: str) -> str:
        """The type of the option's values for its documentation, e.g. "`float`, MiB, or `None`"."""
        text = {_FLAG: "`bool`", _COUNT: "`int`", _FRACTION: "`float`", _DEVICE: "`str`",
                _BUDGET: "`str` or `int`", _AUTO_FLAG: "`str` or `bool`", _PATH: "`str`"}.get(self.kind)  # fmt: skip
        if text is None:
            text = "`float`, MiB" if unit == "MiB" else "`int`, bytes"
        return text + (", or `None`" if self.optional else "")

    def annotation(self, unit: str) -> Any:
        """The type annotation of an argument that takes the option in `unit`, as `HfArgumentParser` reads it.

        An optional number is annotated `float | str | None`: the parser then passes the command line's text through
        (a plain `float | None` could not take `none`, so the default could not be restored from the command line),
        and `check` parses it.
        """
        if self.kind == _FLAG:
            return bool
        if self.kind in (_DEVICE, _PATH):
            return str | None
        if self.kind == _BUDGET:
            return int | str | None  # the parser passes the text through (see above)
        if self.kind == _AUTO_FLAG:
            return str  # `check` reads the command line's `true` and `false`
        base = float if self.kind == _FRACTION or unit == "MiB" else int
        return base | str | None if self.optional else base

    def check(self, value: Any, name: str, unit: str = "bytes") -> Any:
        """Validate `value` given for the option called `name` in `unit`.

        Args:
            value: the value as the user gave it (a number, or the command line's text).
            name: the option's or argument's name, for the error message.
            unit: `"bytes"` or `"MiB"`, the unit `value` is in.

        Returns:
            The value in the engine's unit (bytes for sizes); None for an optional option left unset.

        Raises:
            ValueError: naming `name`, the allowed values in `unit`, and the value given.
        """
        value = self.read(value, name, unit)
        return round(value * MIB) if unit == "MiB" and value is not None else value

    def read(self, value: Any, name: str, unit: str = "bytes") -> Any:
        """As `check`, but the value stays in `unit`: the command line's text read as what it means.

        Returns:
            `None` for `none`, `True` for `true`, a number for digits (a float for MiB and fractions, an int for
            bytes and counts); a budget's text stays text.

        Raises:
            ValueError: as `check`.
        """

        def fail() -> ValueError:
            return ValueError(f"{name} must be {self.describe(unit, text=isinstance(value, str))}, got {value!r}")

        if value is None or (self.optional and isinstance(value, str) and value.strip().lower() == "none"):
            if self.optional:
                return None
            raise fail()
        if self.kind == _FLAG:
            if not isinstance(value, bool):
                raise fail()
            return value
        if self.kind == _DEVICE:
            if not isinstance(value, str) or not _device_type_available(value):
                raise fail()
            return value
        if self.kind == _PATH:
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
            if not isinstance(value, str) or not value.strip():
                raise fail()
            return value
        if self.kind == _BUDGET:
            parse_memory_budget(value, option=name)  # raises naming the option and the forms it accepts
            return value
        if self.kind == _AUTO_FLAG:
            if isinstance(value, bool):
                return value
            words = {AUTO: AUTO, "true": True, "false": False}
            if not isinstance(value, str) or value.strip().lower() not in words:
                raise fail()
            return words[value.strip().lower()]
        number = _number(value)
        if number is None:
            raise fail()
        if self.kind == _FRACTION:
            if not 0 < number <= self.maximum:
                raise fail()
            return number
        if unit == "MiB":
            if number < 0 or round(number * MIB) < self.minimum:
                raise fail()
            return float(number)
        if number != int(number) or (not isinstance(value, str) and not _is_int(value)):
            raise fail()  # bytes and counts given as such are whole numbers: 1.5 bytes is a mistake, not a rounding
        if number < self.minimum:
            raise fail()
        return int(number)


def _number(value: Any) -> float | None:
    """A finite real number from a number or a string (the command line), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def current_accelerator_type() -> str | None:
    """The type of this process's accelerator (`"cuda"`, `"xpu"`, ...), or None without one."""
    # torch 2.6's current_accelerator() raises where there is none (later versions return None).
    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None


def _device_type_available(device_type: str) -> bool:
    return device_type == "cpu" or device_type == current_accelerator_type()


def check_budget_for_device(memory_budget: Any, device_type: str | None, budget_name: str = "memory_budget",
                            device_name: str = "device_type") -> None:  # fmt: skip
    """Refuses a budget relative to the device's memory ('60%', 'auto') in the CPU test mode, which has no device
    memory to take a share of: at construction, not when the first planned step asks for the device's size.

    Args:
        memory_budget: the budget as given.
        device_type: the device type as given.
        budget_name, device_name: the two options' names as the user wrote them, for the message.

    Raises:
        ValueError: naming both options and the forms the CPU test mode takes.
    """
    budget = parse_memory_budget(memory_budget, option=budget_name)
    if device_type == "cpu" and budget is not None and budget.nbytes is None:
        raise ValueError(
            f"{budget_name} must be a size with {device_name}='cpu' (the CPU test mode has no device memory to take "
            f"a share of): an int number of bytes or a string such as '512MiB', got {memory_budget!r}"
        )


def check_host_memory_reserve(reserve_bytes: int | None, name: str = "host_memory_reserve_bytes",
                              unit: str = "bytes", total_bytes: int | None = None) -> None:  # fmt: skip
    """Refuses a reserve of all the host's memory or more: the pinned pool could then never hold a byte, and every
    activation would stay on the accelerator, which is a mistake in the unit (bytes for MiB) rather than a choice.

    Args:
        reserve_bytes: the reserve, in bytes (None: the default, always valid).
        name, unit: the option's name and unit as the user wrote it (`host_memory_reserve_mib`, `"MiB"`).
        total_bytes: the host's memory (`host_memory.read_host_memory`'s by default).

    Raises:
        ValueError: naming the option, the host's memory and the values allowed, in `unit`.
    """
    if reserve_bytes is None:
        return
    if total_bytes is None:
        total_bytes = read_host_memory().total_bytes
    if reserve_bytes >= total_bytes:

        def shown(nbytes: int) -> str:
            return f"{nbytes / MIB:.10g} MiB" if unit == "MiB" else f"{nbytes} bytes"

        raise ValueError(f"{name} must be None or less than this host's memory, {shown(total_bytes)} (it is the host "
                         "memory the pinned pool leaves available; 0 for no reserve), got "
                         f"{shown(reserve_bytes)}")  # fmt: skip


def format_option_doc(name: str, type_text: str, default: Any, help: str) -> str:
    """One entry of a Hugging Face style `Args:` / `Parameters:` list, indented for a class docstring."""
    default_text = f"{default:g}" if isinstance(default, float) else repr(default)
    body = textwrap.fill(help, width=116, initial_indent=" " * 12, subsequent_indent=" " * 12)
    return f"        {name} ({type_text}, *optional*, defaults to `{default_text}`):\n{body}"


def _option(
    default: Any,
    rule: Rule,
    help: str,
    *,
    argument: str | None = None,
    argument_unit: str = "bytes",
    positional: bool = False,
) -> Any:
    """A field of `OffloadOptions`.

    Args:
        default: the engine's default, in bytes for sizes.
        rule: the values it accepts.
        help: one sentence for the docs and the command line.
        argument: the `TrainingArguments` field that sets it is `activation_offloading_<argument>`; None when the
            option belongs to the engine API only.
        argument_unit: the unit of that argument: `"bytes"` or `"MiB"`.
        positional: one of TRL's four options, which may be given positionally.
    """
    metadata = {"help": help, "rule": rule, "argument": argument, "argument_unit": argument_unit}
    return field(default=default, kw_only=not positional, metadata=metadata)


@dataclass(frozen=True)
class OffloadOptions:
    """Options of the activation offloading engine (`OffloadActivations`), validated at construction.

    The first four are TRL's, in TRL's order and with TRL's meaning, so they may be given positionally; the others are
    keyword-only. Sizes are in bytes.

    Args:
    {args}

    Raises:
        ValueError: for a value outside an option's rule, naming the option and the values it accepts.
        TypeError: for an unknown option or too many positional values.

    Example:

    ```python
    >>> OffloadOptions(min_offload_size=4096).min_offload_size
    4096
    ```
    """

    use_pin_memory: bool = _option(
        True, Rule(_FLAG), "Keep offloaded tensors in pinned (page-locked) host memory. Pageable memory copies about "
        "4x slower and cannot overlap with compute.", argument="use_pin_memory", positional=True)  # fmt: skip
    use_streams: bool = _option(
        True, Rule(_FLAG), "Overlap the copies with compute on side streams. `False` copies on the compute stream "
        "(slower, same results).", argument="use_streams", positional=True)  # fmt: skip
    min_offload_size: int = _option(
        1024, Rule(_BYTES), "Bytes below which a saved tensor stays on the accelerator: not worth a copy.",
        argument="min_size", positional=True)  # fmt: skip
    max_fwd_stash_size: int | None = _option(
        None, Rule(_COUNT, minimum=1, optional=True), "TRL's option: also bound the forward copies in flight by "
        "count. By default only the forward window bounds them.", positional=True)  # fmt: skip
    forward_window_bytes: int = _option(
        DEFAULT_WINDOW_BYTES, Rule(_BYTES, minimum=1), "Forward copies in flight; when full, compute waits for the "
        "oldest. Also bounds the tail of the forward kept on the accelerator. Default 128 MiB.",
        argument="forward_window_mib", argument_unit="MiB")  # fmt: skip
    prefetch_window_bytes: int | None = _option(
        None, Rule(_BYTES, optional=True), "What the backward pass reloads ahead of need; `0` reloads each tensor only "
        "when it is needed; `None` (`none` on the command line) sizes it per step: four of the step's largest "
        "offloaded tensors, and at least 128 MiB.", argument="prefetch_window_mib", argument_unit="MiB")  # fmt: skip
    keep_tail: bool = _option(
        True, Rule(_FLAG), "Keep the end of the forward, which backward needs first, on the accelerator (learned "
        "from the first step).", argument="keep_tail")  # fmt: skip
    max_pinned_memory_fraction: float | None = _option(
        None, Rule(_FRACTION, maximum=0.9, optional=True), "Cap on pinned host memory, as a fraction (at most 0.9) of "
        "the host memory available, shared by the processes on one host. Past the cap activations stay on the "
        "accelerator (one warning). `None` (`none` on the command line): 0.5, which a memory_budget's plan may go "
        "past, down to host_memory_reserve, when no exact plan fits within it (or none without layers tiled whole); a "
        "fraction set here is a cap the plan keeps to.", argument="max_pinned_memory_fraction")  # fmt: skip
    max_pinned_bytes: int | None = _option(
        None, Rule(_BYTES, optional=True), "Explicit cap on pinned host memory; overrides the fraction, and a "
        "memory_budget's plan keeps to it.", argument="max_pinned_mib", argument_unit="MiB")  # fmt: skip
    host_memory_reserve_bytes: int | None = _option(
        None, Rule(_BYTES, optional=True), "Host memory the pinned pool always leaves available (MemAvailable, within "
        "a container's memory limit): a floor for the whole host, whose processes share what lies above it. Every "
        "growth of the pool checks it; past it activations stay on the accelerator (one warning). `None` (`none` on "
        "the command line): with a memory_budget, 10% of the host's memory, at least 8 GiB and at most a quarter of "
        "it; without one, no reserve (the cap alone). `0`: no reserve.", argument="host_memory_reserve_mib",
        argument_unit="MiB")  # fmt: skip
    disk_offload_dir: str | None = _option(
        None, Rule(_PATH, optional=True), "Experimental (bitwise on an H100; measured at long context on one disk "
        "only): a directory on a fast local disk (NVMe, not a network file system) where activations that the "
        "pinned host pool has no room for (past its cap or the host's reserve) are written to files and read back in "
        "backward, instead of staying on the accelerator. Bitwise the same training; each file goes once backward has "
        "used its tensor, and the run's directory (`hf_offload-<pid>-*` under this one) when the context is dropped "
        "or the process exits. A memory budget counts its room and measured bandwidth, and sends there only what the "
        "pool cannot hold. A directory that cannot hold files is an error when the context is built. `None`: no disk "
        "tier.", argument="disk_offload_dir")  # fmt: skip
    disk_reserve_bytes: int | None = _option(
        None, Rule(_BYTES, optional=True), "Free space the disk tier always leaves on disk_offload_dir's file system; "
        "past it activations stay on the accelerator (one warning). `None` (`none` on the command line): 10% of "
        "that file system's size, at least 8 GiB and at most a quarter of it, for the checkpoints, logs and caches "
        "that share the disk. `0`: no reserve. Only with disk_offload_dir.", argument="disk_reserve_mib",
        argument_unit="MiB")  # fmt: skip
    device_type: str | None = _option(
        None, Rule(_DEVICE, optional=True), "For testing. The device type whose tensors are offloaded; `None` means "
        "the current accelerator (with none, offloading is inactive and says so once). `'cpu'` moves CPU tensors "
        "through a separate host buffer, which exercises the bookkeeping and statistics without a GPU (CPU test "
        "mode).", argument="device_type")  # fmt: skip
    min_peak_reduction: float | None = _option(
        DEFAULT_MIN_PEAK_REDUCTION, Rule(_FRACTION, maximum=0.5, optional=True), "Let offloading stand aside where it "
        "cannot lower the step's peak by at least this share: the second step is measured, and when even the most "
        "offloading can take off its peak (set by the output head and loss, or the optimizer step) is less, nothing "
        "is moved from then on, at no cost, until a step with more tokens than the measured one arrives; one warning "
        "says so. `None` (`none` on the command line): offloading never stands aside; the measurement is reported "
        "either way. Not used under a memory_budget, whose plan decides what moves.",
        argument="min_peak_reduction")  # fmt: skip
    memory_budget: int | str | None = _option(
        None, Rule(_BUDGET, optional=True), "A budget for the step's peak memory (max_memory_allocated: parameters, "
        "gradients, optimizer state and activations). hf-offload profiles the first two steps, then chooses per "
        "decoder layer whether to keep, offload, or selectively or fully checkpoint it: the fastest plan whose "
        "predicted peak fits. `'auto'`: the device's memory less a safety margin; a size such as `'24GiB'`, "
        "`'20000MiB'` or a number of bytes; or a share of the device such as `'60%'`. It then decides checkpointing "
        "itself, whatever `activation_checkpointing` says. `None`: no planning.", argument="memory_budget")  # fmt: skip
    memory_budget_max_tokens: int | None = _option(
        None, Rule(_COUNT, minimum=1, optional=True), "The most tokens a training step of the run will hold, per "
        "device and micro-step (sequences x their padded length, e.g. per_device_train_batch_size x max_length; under "
        "context or sequence parallelism, a rank's shard of that), where the run knows it ahead: the memory budget's "
        "first plan then checks that a step that long fits, and raises its InfeasibleBudgetError there, before the "
        "run trains on, if no plan does. `None` (`none` on the command line): the plans follow the longest step seen, "
        "and a longer step that no plan fits runs over the budget with a warning; under the Trainer, a TRL config's "
        "`max_length` times the batch size (over the accelerator's cp_size or sp_size) is checked the same way, with "
        "a warning instead of the error. Only with a memory_budget.",
        argument="memory_budget_max_tokens")  # fmt: skip
    tile_mlp: str | bool = _option(
        AUTO, Rule(_AUTO_FLAG), "Run each decoder layer's MLP over chunks of as many tokens as the hidden size, so "
        "that its intermediates exist for one chunk at a time: what long sequences need. Not bitwise: weight "
        "gradients are summed chunk by chunk (equal within rounding), and dropout in the MLP draws its masks chunk by "
        "chunk (other masks than untiled). `'auto'`: only in the layers where the "
        "memory_budget planner finds that no plan without it fits (never without a memory_budget); `True`: every "
        "layer; `False`: never.", argument="tile_mlp")  # fmt: skip
    tile_layer: str | bool = _option(
        AUTO, Rule(_AUTO_FLAG), "Run each whole decoder layer over chunks of as many tokens as the hidden size, and "
        "its attention on the whole sequence one group of heads at a time, in forward and backward (a checkpoint of "
        "its own): about a third of the memory per token of a checkpointed layer with its MLP tiled, for one more "
        "attention forward. Not bitwise (weight gradients summed chunk by chunk; dropout in the layer draws its masks "
        "chunk by chunk, other masks than untiled). `'auto'`: only in the layers where "
        "the memory_budget planner finds that no plan fits without it, not even with tiled MLPs (never without a "
        "memory_budget, nor for models whose layers cannot be tiled, which the log says); `True`: every layer, "
        "without a memory_budget; `False`: never.", argument="tile_layer")  # fmt: skip

    def __post_init__(self) -> None:
        # Each value is stored as its rule reads it: the command line's spellings ("4096", "true") as what they mean.
        for option in dataclasses.fields(self):
            rule = option.metadata["rule"]
            object.__setattr__(self, option.name, rule.check(getattr(self, option.name), option.name))
        check_budget_for_device(self.memory_budget, self.device_type)
        check_host_memory_reserve(self.host_memory_reserve_bytes)
        if self.disk_reserve_bytes is not None and self.disk_offload_dir is None:
            raise ValueError(f"disk_reserve_bytes={self.disk_reserve_bytes} needs a disk_offload_dir: it is the free "
                             "space the disk tier leaves there. Set disk_offload_dir too, or leave disk_reserve_bytes "
                             "None.")  # fmt: skip
        if self.memory_budget_max_tokens is not None and self.memory_budget is None:
            raise ValueError(f"memory_budget_max_tokens={self.memory_budget_max_tokens} needs a memory_budget: it is "
                             "the longest step the budget's plans must fit. Set memory_budget too, or leave "
                             "memory_budget_max_tokens None.")  # fmt: skip
        if self.tile_layer is True and self.memory_budget is not None:
            raise ValueError(f"tile_layer=True and memory_budget={self.memory_budget!r} cannot be combined: a layer "
                             "tiled whole is its own checkpoint, so the plan's actions would not apply to it. Use "
                             "tile_layer='auto' (the default): it tiles layers where the plan needs it.")  # fmt: skip

    @classmethod
    def rule(cls, name: str) -> Rule:
        """Return the rule of one option.

        Args:
            name: the option's field name, e.g. `"forward_window_bytes"`.

        Returns:
            Its [`Rule`]; `rule(name).check(value, name)` validates a value as the constructor does.

        Raises:
            KeyError: `name` is not an option.
        """
        return cls.__dataclass_fields__[name].metadata["rule"]


OffloadOptions.__doc__ = OffloadOptions.__doc__.replace(
    "    {args}",
    "\n".join(
        format_option_doc(
            option.name, option.metadata["rule"].type_text("bytes"), option.default, option.metadata["help"]
        )
        for option in dataclasses.fields(OffloadOptions)
    ),
)


def check_option_names(names: Any, caller: str) -> None:
    """Raise a TypeError for the first of `names` that is no option of `OffloadOptions`, naming `caller` (the function
    the user called) and the closest option, rather than the dataclass's bare "unexpected keyword argument".

    Raises:
        TypeError: naming the function, the unknown option and the closest valid one.
    """
    options = [option.name for option in dataclasses.fields(OffloadOptions)]
    for name in names:
        if name not in options:
            close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{caller}() got an unknown option {name!r}{hint} (hf_offload.OffloadOptions lists every "
                            "option)")  # fmt: skip
