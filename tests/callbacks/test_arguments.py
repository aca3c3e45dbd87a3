"""`callbacks/arguments.py`: hf-offload's Trainer arguments, made from the options (`hf_offload/options.py`) and
checked in the units the user wrote them in, from Python and from the command line."""

import dataclasses
import math
import subprocess
import sys

import pytest
import transformers
from helpers import EXAMPLES

from hf_offload import OffloadOptions, TrainingArguments
from hf_offload.callbacks.arguments import (
    ARGUMENT_PREFIX,
    CHECKPOINTING_RENAMES,
    ActivationOffloadingArguments,
    command_line_help,
)
from hf_offload.host_memory import HostMemory

MIB = 2**20


def parse(*argv: str) -> TrainingArguments:
    (args,) = transformers.HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", "unused", *argv]
    )
    return args


def argument_fields() -> dict[str, dataclasses.Field]:
    """The mixin's offloading fields (not the checkpointing names it adds on an older transformers)."""
    fields = dataclasses.fields(ActivationOffloadingArguments)
    return {field.name: field for field in fields if field.name not in CHECKPOINTING_RENAMES}


def test_the_arguments_are_made_from_the_options():
    fields = argument_fields()
    assert fields.pop("activation_offloading").default is False
    expected = {}
    for option in dataclasses.fields(OffloadOptions):
        if option.metadata["argument"] is None:
            continue  # an engine-only option (TRL's count of copies in flight)
        in_mib = option.metadata["argument_unit"] == "MiB" and option.default is not None
        expected[ARGUMENT_PREFIX + option.metadata["argument"]] = (
            option.default / MIB if in_mib else option.default,
            command_line_help(option.metadata["help"]),
        )
    assert {name: (field.default, field.metadata["help"]) for name, field in fields.items()} == expected
    for name in expected:  # every argument is documented, once, in the class docstring
        assert TrainingArguments.__doc__.count(f"{name} (") == 1


def test_help_prints_every_option_as_written():
    # argparse %-formats help strings: a bare '%' in an option's help crashed `--help` of every script.
    help_text = transformers.HfArgumentParser(TrainingArguments).format_help()
    assert "'60%'" in help_text and "%%" not in help_text
    assert all(ARGUMENT_PREFIX + option.metadata["argument"] in help_text
               for option in dataclasses.fields(OffloadOptions) if option.metadata["argument"])  # fmt: skip


def test_every_option_from_the_command_line():
    args = parse(
        "--activation_offloading",
        "--activation_offloading_min_size", "4096",
        "--activation_offloading_use_streams", "false",
        "--activation_offloading_use_pin_memory", "false",
        "--activation_offloading_forward_window_mib", "64",
        "--activation_offloading_prefetch_window_mib", "0",
        "--activation_offloading_keep_tail", "false",
        "--activation_offloading_max_pinned_memory_fraction", "0.25",
        "--activation_offloading_max_pinned_mib", "1.5",
        "--activation_offloading_device_type", "cpu",
    )  # fmt: skip
    assert args.activation_offloading is True
    assert args.offload_options() == OffloadOptions(
        use_pin_memory=False,
        use_streams=False,
        min_offload_size=4096,
        forward_window_bytes=64 * MIB,
        prefetch_window_bytes=0,
        keep_tail=False,
        max_pinned_memory_fraction=0.25,
        max_pinned_bytes=3 * 2**19,
        device_type="cpu",
    )
    assert parse().activation_offloading is False and parse().offload_options() == OffloadOptions()


def test_the_host_memory_reserve_from_the_command_line():
    args = parse("--activation_offloading_host_memory_reserve_mib", "16384")
    assert args.offload_options().host_memory_reserve_bytes == 16 * 2**30
    assert (
        parse("--activation_offloading_host_memory_reserve_mib", "0").offload_options().host_memory_reserve_bytes == 0
    )
    restored = parse("--activation_offloading_host_memory_reserve_mib", "none")
    assert restored.offload_options().host_memory_reserve_bytes is None
    assert OffloadOptions().host_memory_reserve_bytes is None and OffloadOptions().max_pinned_memory_fraction is None


def test_a_reserve_of_all_the_host_memory_is_refused_in_the_unit_it_was_given(tmp_path, monkeypatch):
    monkeypatch.setattr("hf_offload.options.read_host_memory", lambda: HostMemory(64 * 2**30, 60 * 2**30))
    with pytest.raises(ValueError) as error:
        OffloadOptions(host_memory_reserve_bytes=64 * 2**30)
    assert str(error.value) == (
        "host_memory_reserve_bytes must be None or less than this host's memory, 68719476736 bytes (it is the host "
        "memory the pinned pool leaves available; 0 for no reserve), got 68719476736 bytes"
    )
    with pytest.raises(ValueError) as error:  # MiB mistaken for bytes' magnitude
        TrainingArguments(
            str(tmp_path), activation_offloading=True, activation_offloading_host_memory_reserve_mib=2**20
        )
    assert str(error.value) == (
        "activation_offloading_host_memory_reserve_mib must be None or less than this host's memory, 65536 MiB (it is "
        "the host memory the pinned pool leaves available; 0 for no reserve), got 1048576 MiB"
    )
    assert OffloadOptions(host_memory_reserve_bytes=64 * 2**30 - 1).host_memory_reserve_bytes == 64 * 2**30 - 1


def test_none_on_the_command_line_restores_a_default_of_none():
    args = parse("--activation_offloading_prefetch_window_mib", "none",
                 "--activation_offloading_max_pinned_mib", "None")  # fmt: skip
    assert args.offload_options().prefetch_window_bytes is None and args.offload_options().max_pinned_bytes is None


@pytest.mark.parametrize(
    ("argument", "value", "allowed"),
    [
        ("min_size", "-1", "an int number of bytes >= 0"),
        ("forward_window_mib", "0", "a number of MiB > 0"),
        ("forward_window_mib", "nan", "a number of MiB > 0"),
        ("forward_window_mib", "inf", "a number of MiB > 0"),
        ("prefetch_window_mib", "-2", "none or a number of MiB >= 0"),
        ("prefetch_window_mib", "nan", "none or a number of MiB >= 0"),
        ("prefetch_window_mib", "lots", "none or a number of MiB >= 0"),
        ("max_pinned_memory_fraction", "1.5", "none or a number in (0, 0.9]"),
        ("max_pinned_memory_fraction", "nan", "none or a number in (0, 0.9]"),
        ("max_pinned_mib", "-1", "none or a number of MiB >= 0"),
        ("host_memory_reserve_mib", "-1", "none or a number of MiB >= 0"),
        ("host_memory_reserve_mib", "lots", "none or a number of MiB >= 0"),
        ("device_type", "tpu", "None, 'cpu' or the available accelerator's type"),
        ("tile_mlp", "yes", "'auto', 'true' or 'false'"),
        ("tile_mlp", "maybe", "'auto', 'true' or 'false'"),
    ],
)
def test_a_bad_argument_is_named_in_its_own_unit(argument, value, allowed):
    name = ARGUMENT_PREFIX + argument
    with pytest.raises(ValueError) as error:
        parse(f"--{name}", value)
    assert str(error.value).startswith(f"{name} must be {allowed}, got ")
    assert "bytes" not in str(error.value) or argument == "min_size"


def test_parsed_fields_hold_what_the_command_line_text_means():
    args = parse("--activation_offloading_tile_mlp", "true", "--activation_offloading_prefetch_window_mib", "none",
                 "--activation_offloading_forward_window_mib", "64", "--activation_offloading_min_size", "4096",
                 "--activation_offloading_max_pinned_memory_fraction", "0.25")  # fmt: skip
    assert args.activation_offloading_tile_mlp is True
    assert args.activation_offloading_prefetch_window_mib is None
    assert args.activation_offloading_forward_window_mib == 64.0
    assert args.activation_offloading_min_size == 4096 and args.activation_offloading_max_pinned_memory_fraction == 0.25
    assert parse("--activation_offloading_tile_mlp", "AUTO").activation_offloading_tile_mlp == "auto"
    assert args.offload_options().forward_window_bytes == 64 * 2**20


@pytest.mark.parametrize("budget", ["60%", "auto"])
def test_a_share_of_the_device_in_the_cpu_test_mode_fails_where_it_is_given(tmp_path, budget):
    """The CPU test mode has no device memory to take a share of: the arguments and the options refuse such a budget
    when they are built, naming the option as the user wrote it, instead of a traceback in `train()`."""
    with pytest.raises(ValueError) as error:
        TrainingArguments(str(tmp_path), activation_offloading=True, activation_offloading_memory_budget=budget,
                          activation_offloading_device_type="cpu")  # fmt: skip
    assert str(error.value) == (
        "activation_offloading_memory_budget must be a size with activation_offloading_device_type='cpu' (the CPU "
        f"test mode has no device memory to take a share of): an int number of bytes or a string such as '512MiB', "
        f"got {budget!r}"
    )
    with pytest.raises(ValueError, match=r"^memory_budget must be a size with device_type='cpu' "):
        OffloadOptions(memory_budget=budget, device_type="cpu")
    assert OffloadOptions(memory_budget="512MiB", device_type="cpu").memory_budget == "512MiB"


def test_non_finite_numbers_from_python_name_the_field(tmp_path):
    for name in ("activation_offloading_forward_window_mib", "activation_offloading_max_pinned_mib"):
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=rf"^{name} must be .*MiB.*, got {value!r}$"):
                TrainingArguments(str(tmp_path), **{name: value})


def test_a_bad_command_line_value_exits_with_usage_not_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "sft_trainer.py"), "--output_dir", str(tmp_path),
         "--activation_offloading_forward_window_mib", "nan"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert "error: activation_offloading_forward_window_mib must be a number of MiB > 0, got nan" in result.stderr
    assert "usage:" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("option", ["tile_mlp", "tile_layer"])
@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), ("true", True), ("False", False)])
def test_tiling_from_the_command_line(option, text, value):
    args = parse("--activation_offloading", f"--activation_offloading_{option}", text)
    assert getattr(args.offload_options(), option) == value
    assert getattr(OffloadOptions(**{option: text}), option) == value


def test_the_checkpointing_fields_take_either_name_on_every_supported_transformers(tmp_path):
    """transformers 5.23 renamed `gradient_checkpointing(_kwargs)` to `activation_checkpointing(_kwargs)`; on an older
    release the mixin adds the new names, so that the README's snippets run as written on both."""
    args = TrainingArguments(str(tmp_path), activation_checkpointing=True,
                             activation_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip
    assert args.gradient_checkpointing and args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.activation_checkpointing
    parsed = parse(
        "--activation_checkpointing", "true", "--activation_checkpointing_kwargs", '{"use_reentrant": false}'
    )
    assert parsed.gradient_checkpointing and parsed.gradient_checkpointing_kwargs == {"use_reentrant": False}
    old = TrainingArguments(str(tmp_path), gradient_checkpointing=True)
    assert old.gradient_checkpointing and not ActivationOffloadingArguments().activation_offloading


def test_a_memory_budget_without_offloading_is_refused_where_it_is_set(tmp_path):
    """Without activation_offloading=True no callback runs, so a budget would be ignored without a word."""
    with pytest.raises(ValueError, match="activation_offloading_memory_budget='4GiB' is set but activation_offloading"):
        TrainingArguments(str(tmp_path), activation_offloading_memory_budget="4GiB")
    with pytest.raises(ValueError, match="activation_offloading=True"):
        parse("--activation_offloading_memory_budget", "auto")
    assert TrainingArguments(str(tmp_path), activation_offloading=True,
                             activation_offloading_memory_budget="4GiB").activation_offloading  # fmt: skip


@pytest.mark.parametrize("kwargs_name", ["activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"])
def test_native_checkpoint_offload_is_turned_off_with_a_warning(tmp_path, kwargs_name):
    native = {"offload": True, "use_reentrant": False}
    with pytest.warns(UserWarning, match="native offload is turned off"):
        args = TrainingArguments(
            str(tmp_path), activation_offloading=True, activation_checkpointing=True, **{kwargs_name: native}
        )
    assert args.activation_checkpointing_kwargs == args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert native == {"offload": True, "use_reentrant": False}  # the caller's dict is left alone
    without_ours = TrainingArguments(str(tmp_path), activation_checkpointing=True, **{kwargs_name: native})
    assert without_ours.activation_checkpointing_kwargs == native
