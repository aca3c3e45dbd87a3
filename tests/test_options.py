"""The options object (`hf_offload/options.py`): one set of rules, checked as the user wrote the values, in the engine
and the model's entry point alike; the Trainer arguments made from it are `callbacks/test_arguments.py`'s."""

import dataclasses
import inspect
import logging
import math
import warnings

import pytest
import torch
import transformers
from helpers import checkpointing_enable

from hf_offload import OffloadActivations, OffloadOptions, TrainingArguments, get_act_offloading_ctx_manager

MIB = 2**20


# ---------------------------------------------------------------------------------------------------- engine options


def test_defaults_and_trls_positional_order():
    assert OffloadOptions() == OffloadOptions(True, True, 1024, None)
    assert OffloadOptions(False, False, 7, 3) == OffloadOptions(
        use_pin_memory=False, use_streams=False, min_offload_size=7, max_fwd_stash_size=3
    )
    assert OffloadOptions().forward_window_bytes == 128 * MIB
    with pytest.raises(dataclasses.FrozenInstanceError):
        OffloadOptions().keep_tail = False


def test_the_context_builder_names_trls_arguments_in_trls_order():
    # help() and IDEs show them, and TRL's positional call (with its fifth, warn_if_no_head) runs unchanged.
    parameters = list(inspect.signature(get_act_offloading_ctx_manager).parameters.values())
    names = [parameter.name for parameter in parameters[:6]]
    assert names == ["model", "use_pin_memory", "use_streams", "min_offload_size", "max_fwd_stash_size",
                     "warn_if_no_head"]  # fmt: skip
    assert [parameter.default for parameter in parameters[1:5]] == list(dataclasses.astuple(OffloadOptions())[:4])
    context = get_act_offloading_ctx_manager(torch.nn.Linear(2, 2), False, False, 7, 3, False, device_type="cpu")
    assert context.options == OffloadOptions(False, False, 7, 3, device_type="cpu")
    with pytest.raises(TypeError, match="not both"):
        get_act_offloading_ctx_manager(torch.nn.Linear(2, 2), False, options=OffloadOptions())


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("use_pin_memory", 1, "True or False"),
        ("use_streams", "yes", "True or False"),
        ("min_offload_size", -1, "an int number of bytes >= 0"),
        ("min_offload_size", 1.5, "an int number of bytes >= 0"),
        ("min_offload_size", True, "an int number of bytes >= 0"),
        ("max_fwd_stash_size", 0, "None or an int >= 1"),
        ("forward_window_bytes", 0, "an int number of bytes >= 1"),
        ("forward_window_bytes", math.inf, "an int number of bytes >= 1"),
        ("prefetch_window_bytes", -1, "None or an int number of bytes >= 0"),
        ("prefetch_window_bytes", math.nan, "None or an int number of bytes >= 0"),
        ("keep_tail", None, "True or False"),
        ("max_pinned_memory_fraction", 0, "None or a number in (0, 0.9]"),
        ("max_pinned_memory_fraction", 0.95, "None or a number in (0, 0.9]"),
        ("max_pinned_memory_fraction", math.nan, "None or a number in (0, 0.9]"),
        ("max_pinned_bytes", -5, "None or an int number of bytes >= 0"),
        ("host_memory_reserve_bytes", -1, "None or an int number of bytes >= 0"),
        ("host_memory_reserve_bytes", 1.5, "None or an int number of bytes >= 0"),
        ("device_type", "tpu", "None, 'cpu' or the available accelerator's type"),
        ("tile_mlp", "yes", "'auto', 'true' or 'false'"),
        ("tile_mlp", 1, "'auto', True or False"),
    ],
)
def test_a_bad_value_names_the_option_and_what_it_accepts(option, value, allowed):
    expected = f"{option} must be {allowed}, got {value!r}"
    with pytest.raises(ValueError) as error:
        OffloadOptions(**{option: value})
    assert str(error.value) == expected
    with pytest.raises(ValueError) as error:  # the engine and the model entry point apply the same rules
        OffloadActivations(**{option: value})
    assert str(error.value) == expected


def test_unknown_options_and_mixed_forms_are_type_errors():
    with pytest.raises(TypeError, match="prefetch_window"):
        OffloadOptions(prefetch_window=0)
    # The function the user called, and the option they probably meant.
    model = torch.nn.Linear(2, 2)
    unknown = r"\(\) got an unknown option '(forward_window_mib|prefetch_windows)'; did you mean '(forward|prefetch)_"
    with pytest.raises(TypeError, match="get_act_offloading_ctx_manager" + unknown + r"window_bytes'\?"):
        get_act_offloading_ctx_manager(model, forward_window_mib=10)
    with pytest.raises(TypeError, match="OffloadActivations" + unknown + r"window_bytes'\?"):
        OffloadActivations(prefetch_windows=0)
    with pytest.raises(TypeError, match="not both"):
        OffloadActivations(min_offload_size=1, options=OffloadOptions())


@pytest.mark.parametrize("model", ["a string", None, torch.zeros(2)])
def test_a_model_that_is_not_a_module_is_a_type_error_naming_what_was_passed(model):
    with pytest.raises(TypeError, match=f"torch.nn.Module, got {type(model).__name__}"):
        get_act_offloading_ctx_manager(model, device_type="cpu")


# ---------------------------------------------------------------------------------------------------- warnings


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_either_kind_of_checkpointing_moves_the_layer_inputs_without_a_warning(tmp_path, caplog):
    """Reentrant checkpointing saves each layer's input in the forward as the non-reentrant kind does, and the
    engine moves it; what a layer recomputes in backward is used at once under either kind. No warning is due."""
    offloaded = {}
    for use_reentrant in (True, None, False):
        kwargs = {} if use_reentrant is None else {"use_reentrant": use_reentrant}  # {}: torch's default, reentrant
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            TrainingArguments(str(tmp_path), activation_offloading=True, activation_checkpointing=True,
                              activation_checkpointing_kwargs=kwargs)  # fmt: skip
        model = tiny_llama().train()
        checkpointing_enable(model, kwargs)
        context = get_act_offloading_ctx_manager(model, device_type="cpu")
        ids = torch.randint(64, (2, 8))
        with caplog.at_level(logging.WARNING, logger="hf_offload"):
            for _ in range(2):
                with context:
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
        stats = context.get_stats()
        offloaded[use_reentrant] = stats["tensors_offloaded"], stats["bytes_offloaded"]
        context.remove_hooks()
    assert not [record.getMessage() for record in caplog.records if "reentrant" in record.getMessage()]
    assert offloaded[True] == offloaded[None] == offloaded[False] and offloaded[True][0] > 0, offloaded


def test_a_second_context_nested_inside_another_warns(caplog):
    outer, inner = OffloadActivations(device_type="cpu"), OffloadActivations(device_type="cpu")
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        with outer, outer:  # the same context again is not a second one
            pass
        assert not caplog.records
        with outer, inner:
            pass
    assert len(caplog.records) == 1 and "inside another one" in caplog.records[0].getMessage()
