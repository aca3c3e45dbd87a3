#!/usr/bin/env bash
# The same checks and tests as scripts/test.sh, on the newest release of every dependency (torch aside: the one
# setup.sh installs), in a virtual environment of its own (.venv-newest), so that a break upstream is seen the day
# it ships. It ends by writing what it ran on to .venv-newest/tested-versions.txt: once the tests pass there, copying
# that file over constraints.txt is how the project moves to the new releases, on purpose.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The extras CI installs (.ci/run), so that the versions written below cover every package the tests use.
export HF_OFFLOAD_VENV=.venv-newest HF_OFFLOAD_NEWEST=1 HF_OFFLOAD_EXTRAS="${HF_OFFLOAD_EXTRAS:-dev,qlora}"
bash scripts/test.sh "$@"
# shellcheck disable=SC1091
. .venv-newest/bin/activate
{
  echo "# The versions the tests were last run with: scripts/setup.sh installs these (pip's -c); torch is installed"
  echo "# first, on its own. Written by scripts/test_newest.sh after the tests passed on the newest releases."
  python -m pip freeze --exclude-editable | grep -v -E '^(torch|hf-offload)(==| @)'
} > .venv-newest/tested-versions.txt
echo "test_newest.sh: passed; the versions are in .venv-newest/tested-versions.txt (copy it to constraints.txt to move)"
