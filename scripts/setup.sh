#!/usr/bin/env bash
# Creates a virtual environment (once) with PyTorch and hf-offload installed in editable mode with its dev extras
# (HF_OFFLOAD_EXTRAS names others: CI adds qlora, so that the QLoRA tests run there), and activates it.
#   HF_OFFLOAD_VENV=...     where (default .venv)
#   HF_OFFLOAD_NEWEST=1     the newest releases of every dependency instead of the versions in constraints.txt
# By default the dependencies are the versions the project was last tested with (constraints.txt), so that a release
# upstream never changes what the tests run on by itself; scripts/test_newest.sh runs them on the newest releases.
# Sourced by the other scripts; safe to run again (it only installs what is missing or changed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${HF_OFFLOAD_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
# Pin torch before anything can pull a different build. Which build pip's index serves is its own affair (PyPI's
# Linux wheel is the CUDA build, on any machine): TORCH_INDEX_URL names another index, such as
# https://download.pytorch.org/whl/cpu for the CPU-only build.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
if [ "${HF_OFFLOAD_NEWEST:-0}" = 1 ]; then
  python -m pip install -q --upgrade --upgrade-strategy eager -e ".[${HF_OFFLOAD_EXTRAS:-dev}]" \
    "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')"
else
  python -m pip install -q -e ".[${HF_OFFLOAD_EXTRAS:-dev}]" -c constraints.txt
fi
# HF_OFFLOAD_DEEPSPEED=1 (CI sets it): DeepSpeed, for the tests of its Ulysses sequence parallelism on CPU processes,
# into a folder of its own that only those tests' processes put on their path (its import changes what accelerate
# and the Trainer do, which no other test should see). Built without its compiled operators, which nothing here uses;
# without build isolation, which would install another torch to build it.
if [ "${HF_OFFLOAD_DEEPSPEED:-0}" = 1 ] && [ ! -d "$venv/deepspeed-site/deepspeed" ]; then
  wheels=$(mktemp -d)
  DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$wheels"
  python -m pip install -q --no-deps --target "$venv/deepspeed-site" "$wheels"/deepspeed-*.whl hjson==3.1.0 \
    py-cpuinfo==9.0.0 msgpack==1.2.4 einops==0.8.2
  rm -rf "$wheels"
fi
