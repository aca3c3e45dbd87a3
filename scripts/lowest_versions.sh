#!/usr/bin/env bash
# The README's snippets (tests/test_readme.py) at the lowest torch and transformers that pyproject.toml declares, in a
# virtual environment of their own, so that a lower bound is only declared where it works. Not part of CI (it installs
# a second torch): run it when a lower bound or the README's snippets change.
#   VENV=...            where to build it (default /tmp/hf-offload-lowest; reused if it exists)
#   TORCH_INDEX_URL=... the index torch comes from, as for setup.sh (https://download.pytorch.org/whl/cpu: CPU-only)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${VENV:-/tmp/hf-offload-lowest}"
# The bounds as pyproject.toml writes them ("torch>=2.6"), so that they are written once.
lowest() { sed -n "s/^ *\"$1>=\([0-9.]*\)\".*/\1/p" pyproject.toml; }
torch_version="$(lowest torch)"
transformers_version="$(lowest transformers)"
if [ -z "$torch_version" ] || [ -z "$transformers_version" ]; then
  echo "lowest_versions.sh: no torch>= or transformers>= bound found in pyproject.toml" >&2
  exit 1
fi
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$torch_version" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$venv/bin/python" -m pip install -q -e ".[trl]" pytest "torch==$torch_version" "transformers==$transformers_version"
"$venv/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_readme.py "$@"
