#!/usr/bin/env bash
# The CPU test suite at the lowest transformers, accelerate and peft that pyproject.toml declares, in a virtual
# environment of its own, so that a lower bound is only declared where the tests pass. Not part of CI (a second
# environment and a second suite): run it when a lower bound changes, or code that differs between releases.
#   VENV=...            where to build it (default /tmp/hf-offload-lowest; reused if it exists)
#   TORCH_VERSION=...   the torch to test with (default: pyproject's lower bound; the GPU tests cover that one, and
#                       TORCH_VERSION=2.13.0 keeps the CPU build that scripts/setup.sh installs)
#   TORCH_INDEX_URL=... the index torch comes from, as for setup.sh
# Arguments are passed to pytest (default: the whole suite, tests/gpu/ skipping without a GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${VENV:-/tmp/hf-offload-lowest}"
# The bounds as pyproject.toml writes them ("transformers>=5.17"), so that they are written once.
lowest() { sed -n "s/^ *\"$1>=\([0-9.]*\)\".*/\1/p" pyproject.toml; }
torch_version="${TORCH_VERSION:-$(lowest torch)}"
pins=()
for package in transformers accelerate peft; do
  version="$(lowest "$package")"
  if [ -z "$version" ]; then
    echo "lowest_versions.sh: no $package>= bound found in pyproject.toml" >&2
    exit 1
  fi
  pins+=("$package==$version")
done
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$torch_version" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$venv/bin/python" -m pip install -q -e ".[dev,qlora]" "torch==$torch_version" "${pins[@]}"
"$venv/bin/python" -c 'import accelerate, peft, torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
      f"peft {peft.__version__}")'
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
