#!/usr/bin/env bash
# Sets up .venv if needed, checks the code with ruff (pyproject.toml's [tool.ruff]: lint rules, and the formatting
# `ruff format` gives), then runs the CPU test suite
# (tests/gpu/ is skipped without a GPU).
# pytest exits non-zero when a test fails and also when no test ran at all (exit code 5).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
python -m ruff check .
python -m ruff format --check .
python -m pytest -q "$@"
