"""The README as a newcomer reads it: every Python snippet runs as written, and the options table says what the code
says."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_offload import OffloadOptions
from hf_offload.callbacks.arguments import ARGUMENT_PREFIX, CHECKPOINTING_RENAMES, ActivationOffloadingArguments
from hf_offload.callbacks.stats_logs import HEADLINE_KEYS, LOG_PREFIX, log_entries
from hf_offload.stats import KEPT_REASONS, STAND_ASIDE_REASONS, OffloadStats

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
_OPTIONAL = (ROOT / "pyproject.toml").read_text().split("\n[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
EXTRAS = set(re.findall(r"^(\w+) = \[", _OPTIONAL, flags=re.MULTILINE))
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_each_snippet_runs_as_written_in_a_fresh_interpreter(snippet, tmp_path):
    result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def table_rows() -> dict[str, str]:
    """The options table: field or engine option -> the row's meaning column."""
    rows = {}
    options_section = README.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    for line in options_section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (cells[0] or cells[1]).startswith("`") and cells[3] != "meaning":
            rows[(cells[0] or cells[1]).strip("`")] = cells[3]
    return rows


def test_the_options_table_has_every_option_with_the_help_the_command_line_shows():
    rows = table_rows()
    arguments = {
        field.name: field
        for field in dataclasses.fields(ActivationOffloadingArguments)
        if field.name not in CHECKPOINTING_RENAMES
    }  # added on an older transformers, documented in Install
    for name, field in arguments.items():
        assert rows[name] == field.metadata["help"].replace("%%", "%"), name  # as `--help` prints it
    engine_only = [option for option in dataclasses.fields(OffloadOptions) if option.metadata["argument"] is None]
    for option in engine_only:
        assert rows[option.name] == option.metadata["help"], option.name
    assert len(rows) == len(arguments) + len(engine_only)
    assert all(name.startswith(ARGUMENT_PREFIX) or name == "activation_offloading" for name in arguments)


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_install_says_how_to_install_what_exists():
    # hf-offload is not on PyPI: "pip install hf-offload" would fail, so the README installs from the clone.
    commands = re.findall(r"^pip install .*$", section("Install"), flags=re.MULTILINE)
    ours = [command for command in commands if "torch" not in command.split("#")[0]]
    assert ours and all(command.startswith("pip install -e ") for command in ours)
    assert not re.search(r"pip install (hf-offload|hf_offload)\b", README)
    extras = {extra for command in ours for extra in re.findall(r"\[(\w+)\]", command)}
    assert extras and extras <= EXTRAS  # every extra it names exists


def test_a_newcomer_finds_install_and_the_two_commands_in_the_first_80_lines():
    first = "\n".join(README.splitlines()[:80])
    assert "\n## Install\n" in first and "pip install -e ." in first
    assert "\nbash scripts/train.sh " in first and "\nbash scripts/test.sh " in first


def test_every_file_the_readme_names_exists():
    named = set(re.findall(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh|ipynb|jsonl|json|png|yaml|toml))", README))
    assert len(named) > 15
    assert not [path for path in sorted(named) if not (ROOT / path).exists()]


def test_the_layout_names_every_module():
    layout = section("Layout")
    for module in sorted((ROOT / "hf_offload").glob("*.py")):
        assert f"hf_offload/{module.name}" in layout, module.name
    for package in ("engine", "memory_budget", "tiled"):
        for module in sorted((ROOT / "hf_offload" / package).glob("*.py")):
            assert f"  {module.name} " in layout or module.name == "__init__.py", module.name
    for module in sorted((ROOT / "callbacks").glob("*.py")):
        assert f"  {module.name} " in layout, module.name
    for example in sorted((ROOT / "examples").glob("*.py")):
        assert example.name in layout, example.name
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        assert script.name in layout, script.name


def test_the_statistics_section_names_every_counter_and_every_logged_entry():
    statistics = section("Statistics")
    counters = OffloadStats().as_dict()
    for reason in KEPT_REASONS:
        assert f"`{reason}`" in statistics, reason
    for reason in STAND_ASIDE_REASONS:
        assert f"`{reason}`" in statistics, reason
    assert "`steps_stood_aside_<reason>`" in statistics
    for key in [key for key in counters if not key.startswith(("tensors_kept_", "bytes_kept_", "steps_stood_aside_"))]:
        assert f"`{key}`" in statistics, key
    logged = log_entries({**counters, "steps": 1}, peak_memory_bytes=0)
    for key in [key for key in logged if not key.startswith(LOG_PREFIX + "tensors_kept_")]:
        if key[len(LOG_PREFIX) :] not in counters:  # the derived entries, named with their prefix
            assert f"`{key}`" in statistics, key
    for key in HEADLINE_KEYS:
        assert f"`{key}`" in statistics, key


def test_the_quickstart_logs_what_its_comment_promises(tmp_path):
    quickstart = SNIPPETS[0]
    assert "offload/..." in quickstart and "activation_offloading=True" in quickstart
    # The promise is about a GPU; the CPU test mode logs the same entries.
    in_test_mode = quickstart.replace("activation_offloading=True", "activation_offloading=True, "
                                      "activation_offloading_device_type='cpu'")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", in_test_mode], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("'offload/offloaded_mib_per_step'") == 2  # logging_steps=2 of max_steps=4
    assert "activation offloading over 4 step(s)" in result.stdout + result.stderr


def test_the_cpu_only_torch_the_readme_describes_is_what_setup_sh_installs():
    install = section("Install")
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/" in install
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in setup
    assert "gets the CPU build" not in README


def test_the_notebook_commands_run_with_what_dev_installs():
    pytest.importorskip("nbclient", reason="not the [dev] environment")
    commands = re.findall(r"^(jupyter \w+) notebooks/quickstart\.ipynb", README, flags=re.MULTILINE)
    assert "jupyter execute" in commands
    bin_dir = Path(sys.executable).parent
    for command in commands:
        assert (bin_dir / command.replace(" ", "-")).exists(), command
