"""What `pip install` brings: the extras named in the README install what the examples and tests need, and nothing
that talks to people uninvited."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement_names(extra: str) -> set[str]:
    """The distributions an extra installs, following the extras it names of hf-offload itself."""
    names = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        match = re.fullmatch(r"hf-offload\[(.+)\]", requirement)
        if match:
            names |= set().union(*(requirement_names(name.strip()) for name in match[1].split(",")))
        else:
            names.add(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower())
    return names


def test_the_examples_extra_installs_what_the_examples_import():
    imported = set()
    for example in (ROOT / "examples").glob("*.py"):
        imported |= set(re.findall(r"^(?:import|from) (\w+)", example.read_text(), flags=re.MULTILINE))
    dependencies = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0] for requirement in PROJECT["dependencies"]}
    needs_an_extra = {"datasets", "trl"} & imported
    assert needs_an_extra and needs_an_extra <= requirement_names("examples") - dependencies


def test_the_dev_environment_has_no_bitsandbytes():
    # Imported by transformers.Trainer when installed, it logs an error-like line on CPUs with AVX512-BF16.
    assert "bitsandbytes" not in requirement_names("dev") and "bitsandbytes" in requirement_names("qlora")
    assert requirement_names("examples") <= requirement_names("dev")


def lower_bound(name: str) -> tuple[int, ...]:
    (requirement,) = [r for r in PROJECT["dependencies"] if re.match(rf"{name}\b", r)]
    return tuple(int(part) for part in re.search(r">=([\d.]+)", requirement)[1].split("."))


def test_the_lower_bounds_are_versions_the_code_and_the_readme_run_on():
    # scripts/lowest_versions.sh runs the suite at the lowest transformers, accelerate and peft; what each needs:
    readme = (ROOT / "README.md").read_text()
    arguments = (ROOT / "callbacks" / "arguments.py").read_text()
    # `activation_checkpointing` came in transformers 5.23; below it, the arguments mixin adds the name.
    renamed = '"activation_checkpointing": "gradient_checkpointing"' in arguments
    assert "activation_checkpointing=True" in readme and (lower_bound("transformers") >= (5, 23) or renamed)
    options = (ROOT / "hf_offload" / "options.py").read_text()
    assert "torch.accelerator." in options and lower_bound("torch") >= (2, 6)  # torch.accelerator: 2.6
    assert lower_bound("accelerate") >= (1, 3)  # transformers 5.23's Trainer calls unwrap_model(keep_torch_compile=)
    script = (ROOT / "scripts" / "lowest_versions.sh").read_text()
    assert "lowest torch" in script and "for package in transformers accelerate peft" in script
