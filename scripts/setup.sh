#!/usr/bin/env bash
# Creates .venv (once) with PyTorch and hf-offload installed in editable mode with its dev extras.
# Sourced by the other scripts; safe to run again (it only installs what is missing or changed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
# Pin torch before anything can pull a different build: on a CPU-only machine torch==2.13.0 is the CPU wheel.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
