"""The README as a newcomer reads it: every Python snippet runs as written, and the options table says what the code
says."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_offload import OffloadOptions
from hf_offload.callbacks.arguments import ARGUMENT_PREFIX, ActivationOffloadingArguments

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
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
    arguments = {field.name: field for field in dataclasses.fields(ActivationOffloadingArguments)}
    for name, field in arguments.items():
        assert rows[name] == field.metadata["help"].replace("%%", "%"), name  # as `--help` prints it
    engine_only = [option for option in dataclasses.fields(OffloadOptions) if option.metadata["argument"] is None]
    for option in engine_only:
        assert rows[option.name] == option.metadata["help"], option.name
    assert len(rows) == len(arguments) + len(engine_only)
    assert all(name.startswith(ARGUMENT_PREFIX) or name == "activation_offloading" for name in arguments)


def test_install_says_how_to_install_what_exists():
    # hf-offload is not on PyPI: "pip install hf-offload" would fail, so the README installs from the clone.
    install = README.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^pip install .*$", install, flags=re.MULTILINE)
    assert commands and all(command.startswith("pip install -e ") for command in commands)
