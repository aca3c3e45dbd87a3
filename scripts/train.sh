#!/usr/bin/env bash
# The main job: sets up .venv if needed, then trains a Llama built from a config (random weights) on the dataset
# shipped in examples/data twice with the plain Trainer, with activation checkpointing alone and with checkpointing
# plus hf-offload, and prints what it ran, where the models went and the two runs side by side (on a GPU: peak memory
# and step time). Without a GPU, hf-offload runs in its CPU test mode, which saves no memory, and the job says so.
# Extra arguments go to examples/with_and_without.py (--output_dir, --max_steps, --seed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
python examples/with_and_without.py --output_dir runs/main "$@"
