"""Training arguments that switch activation offloading on and carry its options.

`ActivationOffloadingArguments` is a dataclass mixin: put it first in the bases of any `TrainingArguments`
subclass (TRL's `SFTConfig`, `DPOConfig`, ...) and decorate the result with `@dataclass`; on its own it is also an
argument group for custom training loops. Its field `activation_offloading` has the same name as TRL's, so mixed
into a TRL config it replaces TRL's field (same flag, hf-offload's meaning) instead of adding a second one.
"""

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import transformers

from hf_offload.options import OffloadOptions, check_budget_for_device, check_host_memory_reserve, format_option_doc
from hf_offload.units import MIB

__all__ = [
    "ActivationOffloadingArguments",
    "TrainingArguments",
    "ARGUMENT_PREFIX",
    "CHECKPOINTING_RENAMES",
    "command_line_help",
    "with_offloading_doc",
]

ARGUMENT_PREFIX = "activation_offloading_"
_NATIVE_OFFLOAD_KEY = "offload"
_FLAG_HELP = (
    "Move the activations saved for backward to host memory during the forward pass and bring them back before the "
    "backward pass needs them (hf-offload). Losses and gradients are bitwise the same as without it. With "
    "`activation_checkpointing`, only the checkpointed layers' inputs are saved, and those are what moves. If "
    "transformers' native checkpoint offload is also asked for (`activation_checkpointing_kwargs={'offload': True}`, "
    "or the deprecated `gradient_checkpointing_kwargs`), a warning says so and the native offload is turned off: "
    "hf-offload moves those inputs itself, overlapped with compute."
)


def _argument_options() -> list[tuple[str, dataclasses.Field]]:
    """`(argument name, engine option)` for every engine option that has a `TrainingArguments` field."""
    return [(ARGUMENT_PREFIX + option.metadata["argument"], option)
            for option in dataclasses.fields(OffloadOptions) if option.metadata["argument"] is not None]  # fmt: skip


def _in_argument_unit(option: dataclasses.Field) -> Any:
    default = option.default
    return default / MIB if option.metadata["argument_unit"] == "MiB" and default is not None else default


def command_line_help(text: str) -> str:
    """`text` as an argparse help string, which argparse %-formats: a literal `%` (as in `'60%'`) is written `%%`."""
    return text.replace("%", "%%")


# transformers 5.23 renamed `gradient_checkpointing(_kwargs)` to `activation_checkpointing(_kwargs)`. On an older
# release the mixin adds the new names, which set the old fields, so that one script runs on every supported release.
CHECKPOINTING_RENAMES = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}


def _renamed_checkpointing_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """The new checkpointing names as fields, where this transformers' `TrainingArguments` has only the old ones."""
    if "activation_checkpointing" in {option.name for option in dataclasses.fields(transformers.TrainingArguments)}:
        return []
    return [
        ("activation_checkpointing", bool | None,
         field(default=None, metadata={"help": "The newer name of `gradient_checkpointing`, which it sets."})),
        ("activation_checkpointing_kwargs", dict | str | None,
         field(default=None, metadata={"help": "The newer name of `gradient_checkpointing_kwargs`, which it sets."})),
    ]  # fmt: skip


def _argument_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """The mixin's dataclass fields: the flag, then one per engine option, made from `OffloadOptions`, then the newer
    checkpointing names where transformers lacks them.

    Their `help` metadata is what `HfArgumentParser` hands to argparse, so it is escaped for argparse; the option's
    own help, as written, is in `OffloadOptions`.
    """
    fields = [("activation_offloading", bool, field(default=False, metadata={"help": command_line_help(_FLAG_HELP)}))]
    for argument, option in _argument_options():
        annotation = option.metadata["rule"].annotation(option.metadata["argument_unit"])
        help_text = command_line_help(option.metadata["help"])
        fields.append((argument, annotation, field(default=_in_argument_unit(option), metadata={"help": help_text})))
    return fields + _renamed_checkpointing_fields()


def _parameters_doc() -> str:
    entries = [format_option_doc("activation_offloading", "`bool`", False, _FLAG_HELP)]
    for argument, option in _argument_options():
        rule, unit = option.metadata["rule"], option.metadata["argument_unit"]
        entries.append(format_option_doc(argument, rule.type_text(unit), _in_argument_unit(option),
                                         option.metadata["help"]))  # fmt: skip
    return "\n".join(entries)


# The fields live in a base made from `OffloadOptions`, so that a name, default or help is written once (there).
_ActivationOffloadingFields = dataclasses.make_dataclass("_ActivationOffloadingFields", _argument_fields())
_ActivationOffloadingFields.__module__ = __name__  # so that the class pickles by reference, like its subclasses


@dataclass
class ActivationOffloadingArguments(_ActivationOffloadingFields):
    __doc__ = f"""
    Activation offloading arguments (hf-offload), as a mixin for any `TrainingArguments` subclass.

    The fields other than `activation_offloading` are the options of [`hf_offload.OffloadOptions`], named
    `activation_offloading_<option>`, with windows and pinned-memory caps in MiB. Invalid values raise `ValueError` at
    construction, naming the argument and the values it accepts in its unit.

    Parameters:
{_parameters_doc()}
    """

    def __post_init__(self) -> None:
        # Where the mixin added the newer checkpointing names (transformers resolves its own): the newer name sets the
        # older field, which the Trainer reads, and then mirrors it, as the newer releases' arguments do.
        renamed = [
            names
            for names in CHECKPOINTING_RENAMES.items()
            if names[0] in _ActivationOffloadingFields.__dataclass_fields__
        ]
        for new_name, old_name in renamed:
            if getattr(self, new_name) is not None:
                setattr(self, old_name, getattr(self, new_name))
        # Mixed into a TrainingArguments subclass, the other bases' __post_init__ runs first: it resolves the
        # deprecated checkpointing aliases that the native-offload check reads.
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        for new_name, old_name in renamed:
            setattr(self, new_name, getattr(self, old_name, None))
        # Each field as its rule reads it, in the field's unit: the command line's text as what it means ('true' ->
        # True, 'none' -> None, '64' -> 64.0), so that code reading the arguments sees values, not spellings. A value
        # a rule refuses fails here, naming the argument, rather than when training starts.
        for argument, option in _argument_options():
            rule, unit = option.metadata["rule"], option.metadata["argument_unit"]
            setattr(self, argument, rule.read(getattr(self, argument), argument, unit))
        self.offload_options()
        budget = ARGUMENT_PREFIX + "memory_budget"
        if getattr(self, budget) is not None and not self.activation_offloading:
            raise ValueError(f"{budget}={getattr(self, budget)!r} is set but activation_offloading is False: the "
                             "memory budget is a plan for activation offloading, so it would be ignored. Set "
                             "activation_offloading=True, or leave the budget unset.")  # fmt: skip
        if self.activation_offloading and isinstance(self, transformers.TrainingArguments):
            self._turn_off_native_checkpoint_offload()

    def offload_options(self) -> OffloadOptions:
        """The engine options these fields stand for, validated in the fields' own names and units.

        Raises:
            ValueError: naming the argument, the values it accepts and the value given.
        """
        values = {}
        for argument, option in _argument_options():
            rule, unit = option.metadata["rule"], option.metadata["argument_unit"]
            values[option.name] = rule.check(getattr(self, argument), argument, unit)
        check_budget_for_device(values["memory_budget"], values["device_type"], ARGUMENT_PREFIX + "memory_budget",
                                ARGUMENT_PREFIX + "device_type")  # fmt: skip
        check_host_memory_reserve(values["host_memory_reserve_bytes"], ARGUMENT_PREFIX + "host_memory_reserve_mib",
                                  "MiB")  # fmt: skip
        return OffloadOptions(**values)

    def _checkpointing_kwargs(self) -> list[str]:
        """Names of the checkpointing kwargs fields in use, or none when checkpointing is off.

        transformers has resolved the deprecated names by now (the old one mirrors the new one); older versions have
        only the old ones.
        """
        if not any(getattr(self, name, None) for name in ("activation_checkpointing", "gradient_checkpointing")):
            return []
        return [name for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
                if isinstance(getattr(self, name, None), dict)]  # fmt: skip

    def _turn_off_native_checkpoint_offload(self) -> None:
        # Native offload wraps each checkpointed layer in save_on_cpu, whose hooks would take the layer inputs away
        # from ours and copy them synchronously on the compute stream.
        names = self._checkpointing_kwargs()
        if not any(getattr(self, name).get(_NATIVE_OFFLOAD_KEY) for name in names):
            return
        warnings.warn(
            "activation_offloading=True and activation_checkpointing_kwargs={'offload': True} would both offload the "
            "checkpointed activations: hf-offload takes over and the native offload is turned off.",
            UserWarning,
            stacklevel=4,  # the line that built the arguments
        )
        for name in names:
            # A new dict: the caller's may be shared with other arguments objects.
            kwargs = getattr(self, name)
            setattr(self, name, {key: value for key, value in kwargs.items() if key != _NATIVE_OFFLOAD_KEY})


def with_offloading_doc(summary: str) -> str:
    """A docstring for a class that applies the mixin: its summary, then the mixin's parameters."""
    return summary + "\n\n    Parameters:" + ActivationOffloadingArguments.__doc__.split("Parameters:", 1)[1]


@dataclass
class TrainingArguments(ActivationOffloadingArguments, transformers.TrainingArguments):
    __doc__ = with_offloading_doc(
        """
    [`transformers.TrainingArguments`] plus activation offloading (hf-offload).

    Setting `activation_offloading=True` is the only change a working `Trainer` script needs: every `Trainer` built
    with these arguments gets an `ActivationOffloadingCallback` automatically. The other parameters are those of
    [`transformers.TrainingArguments`]."""
    )
