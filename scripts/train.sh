#!/usr/bin/env bash
# The main job: sets up .venv if needed, then fine-tunes a tiny Llama (built from a config, random weights) on
# the dataset shipped in examples/data with the plain Trainer and activation offloading on, and prints the
# offloading summary. On a machine without a GPU the engine runs its bookkeeping in CPU test mode, so the
# statistics are real; on a GPU it offloads to pinned host memory. Extra arguments go to the example.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
extra=()
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no GPU here: running hf-offload's bookkeeping in CPU test mode (--activation_offloading_device_type cpu)"
  extra=(--activation_offloading_device_type cpu)
fi
python examples/sft_trainer.py --output_dir runs/sft --max_steps 20 --logging_steps 5 --report_to none \
  --activation_offloading "${extra[@]}" "$@"
