"""`callbacks/trl.py`: a counterpart of every TRL training configuration, with all its fields and hf-offload's, that
parses, pickles and says how to install TRL where it is missing."""

import dataclasses
import importlib
import pickle
import pkgutil
import re
import sys

import pytest
import torch
import transformers
import trl

import hf_offload.callbacks
from hf_offload import ActivationOffloadingArguments
from hf_offload.callbacks import trl as offloading_configs
from hf_offload.callbacks.trl import GRPOConfig


def trl_configs() -> dict[str, type[transformers.TrainingArguments]]:
    """Every TRL configuration that subclasses `TrainingArguments`, by name, found without hf-offload's rules.

    All of `trl`'s top-level names, then every module of `trl.experimental` (imported), where a name `trl` exports
    wins (`trl.experimental.kto.KTOConfig` is a deprecated alias of `trl.KTOConfig`).
    """

    def is_training_arguments(candidate: object) -> bool:
        return isinstance(candidate, type) and issubclass(candidate, transformers.TrainingArguments)

    configs = {name: getattr(trl, name) for name in dir(trl) if is_training_arguments(getattr(trl, name))}
    experimental = importlib.import_module("trl.experimental")
    for package in pkgutil.iter_modules(experimental.__path__):
        module = importlib.import_module(f"trl.experimental.{package.name}")
        for name, candidate in vars(module).items():
            defined_here = is_training_arguments(candidate) and candidate.__module__.startswith(module.__name__)
            if defined_here and name not in configs:
                configs[name] = candidate
    return configs


def field_names(config: type) -> set[str]:
    return {field.name for field in dataclasses.fields(config)}


def test_every_trl_config_has_a_counterpart_with_all_its_fields_and_ours():
    configs = trl_configs()
    assert {"SFTConfig", "DPOConfig", "GRPOConfig", "RLOOConfig", "GKDConfig", "OnlineDPOConfig"} <= configs.keys()
    assert sorted(name for name in configs if hasattr(trl, name)) == offloading_configs.__all__
    for name, trl_config in configs.items():
        counterpart = getattr(offloading_configs, name)
        assert counterpart.__bases__ == (ActivationOffloadingArguments, trl_config), name
        assert (counterpart.__module__, counterpart.__qualname__) == ("hf_offload.callbacks.trl", name)
        assert field_names(counterpart) == field_names(trl_config) | field_names(ActivationOffloadingArguments), name
        assert "hf-offload" in counterpart.__doc__ and "activation_offloading_min_size" in counterpart.__doc__
        assert getattr(hf_offload.callbacks, name) is counterpart  # the package forwards every name
    assert set(offloading_configs.__all__) <= set(dir(offloading_configs))


def test_names_that_are_not_trl_training_configs_are_missing():
    for name in ("ModelConfig", "NoSuchConfig", "SFTTrainer"):  # ModelConfig is TRL's, but not TrainingArguments
        with pytest.raises(AttributeError, match=name):
            getattr(offloading_configs, name)
        assert not hasattr(hf_offload.callbacks, name)


@pytest.mark.parametrize("name", offloading_configs.__all__)
def test_trl_configs_parse_with_one_activation_offloading_flag(tmp_path, name):
    config_class = getattr(offloading_configs, name)
    flags = [field for field in dataclasses.fields(config_class) if field.name == "activation_offloading"]
    assert len(flags) == 1 and "hf-offload" in flags[0].metadata["help"]  # ours, where TRL has its own
    argv = ["--output_dir", str(tmp_path), "--bf16", "false", "--activation_offloading"]
    argv += ["--activation_offloading_min_size", "0"]
    (args,) = transformers.HfArgumentParser(config_class).parse_args_into_dataclasses(args=argv)
    assert isinstance(args, getattr(trl, name))
    assert args.activation_offloading is True and args.activation_offloading_min_size == 0
    assert "'60%'" in transformers.HfArgumentParser(config_class).format_help()  # `--help` works too


def test_a_config_round_trips_through_pickle(tmp_path, monkeypatch):
    config = GRPOConfig(str(tmp_path), activation_offloading=True, activation_offloading_min_size=0, bf16=False)
    torch.save(config, tmp_path / "training_args.bin")  # as the Trainer saves its arguments
    assert torch.load(tmp_path / "training_args.bin", weights_only=False) == config

    # A process that loads saved arguments has not made the class yet: unpickling makes it, by its name.
    saved = pickle.dumps(config)
    monkeypatch.delitem(vars(offloading_configs), "GRPOConfig")
    loaded = pickle.loads(saved)
    assert type(loaded) is offloading_configs.GRPOConfig and type(loaded) is not GRPOConfig
    assert loaded.to_dict() == config.to_dict()


def test_without_trl_the_import_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now fails as if TRL were not installed
    monkeypatch.delitem(sys.modules, "hf_offload.callbacks.trl", raising=False)
    monkeypatch.delattr(hf_offload.callbacks, "trl", raising=False)  # set by the import of the submodule
    advice = re.escape("pip install 'hf-offload[trl]'")
    with pytest.raises(ImportError, match=advice):
        importlib.import_module("hf_offload.callbacks.trl")
    with pytest.raises(ImportError, match=advice):
        hf_offload.callbacks.SFTConfig  # noqa: B018
