#!/usr/bin/env bash
# Runs the GPU suite, the 1B peak-memory report (benchmarks/peak_1b.py) and the 1B soak (benchmarks/soak_1b.py) on
# the GPU machine, in one call, from the repository root:
#
#     bash tests/gpu/run_all.sh
#
# - installs the package (not editable) into /tmp/hf_offload_site, so that hf_offload.callbacks maps from
#   callbacks/ as it does for users, and runs Python with PYTHONSAFEPATH=1 so that the repository root's
#   hf_offload/ folder never shadows the installed copy (the test header prints which one was imported);
#   falls back to the source tree on PYTHONPATH if the install fails;
# - pytest log, junit xml and the numbers the tests record go to $OUT (./gpu_out when $OUT is unset);
# - ends with a short summary: pass/fail counts, failures, the recorded memory numbers, the 1B table, the soak;
#   exits non-zero when pytest or the soak failed.
# Environment knobs: PYTEST_PATHS (test files to run instead of tests/gpu), PYTEST_ARGS (extra pytest
# arguments), WHEELS (folders of carried wheels to install, default .whl), PEAK_1B_ARGS (arguments for peak_1b.py),
# SKIP_1B=1, PYTEST_TIMEOUT_S (whole-suite limit, default 360), PEAK_TIMEOUT_S (default 170),
# SOAK_STEPS (default 500), SOAK_ARGS (more arguments for soak_1b.py, e.g. --no-ckpt --seq 1024), SKIP_SOAK=1,
# SOAK_TIMEOUT_S (default 240; the script itself stops stepping after --max-seconds, default 170).
# Typical times on an H100: install 20-30 s, pytest about 240 s, peak_1b about 40 s, soak about 135 s.

set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
export OUT
export CUBLAS_WORKSPACE_CONFIG=:4096:8
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
T0=$(date +%s)

SITE=/tmp/hf_offload_site
SRC=/tmp/hf_offload_src  # build from a copy: setuptools writes build/ and *.egg-info next to the sources
rm -rf "$SITE" "$SRC"
mkdir -p "$SRC"
for f in pyproject.toml setup.cfg setup.py MANIFEST.in README.md LICENSE hf_offload callbacks; do
    [ -e "$f" ] && cp -r "$f" "$SRC/"
done
# Wheels carried in the folders WHEELS names (.whl/ by default: e.g. trl, liger-kernel, not in the GPU image) go to
# the same target, ahead of the image's packages: a folder of newer transformers wheels tests today's releases.
for wheels in ${WHEELS:-.whl}; do
    ls "$wheels"/*.whl >/dev/null 2>&1 || continue
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$wheels"/*.whl \
        >>"$OUT/install.log" 2>&1 && echo "run_all: installed carried wheels: $(ls "$wheels" | tr '\n' ' ')"
done
if $PY -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" "$SRC" >>"$OUT/install.log" 2>&1; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONSAFEPATH=1
    echo "run_all: installed hf-offload into $SITE"
else
    echo "run_all: install failed (see install.log); using the source tree on PYTHONPATH"
    tail -5 "$OUT/install.log"
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    $PY - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
for name in ("transformers", "peft", "accelerate", "trl", "datasets", "liger_kernel", "hf_offload"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"), m.__file__)
    except Exception as e:
        print(name, "IMPORT FAILED", repr(e))
try:
    import hf_offload.callbacks  # noqa: F401
    print("hf_offload.callbacks importable")
except Exception as e:
    print("hf_offload.callbacks IMPORT FAILED", repr(e))
EOF
} 2>&1 | tee "$OUT/env.txt"

TIMEOUT_ARGS=""
if $PY -c "import pytest_timeout" >/dev/null 2>&1; then TIMEOUT_ARGS="--timeout=150"; fi

echo "run_all: pytest ${PYTEST_PATHS:-tests/gpu}"
set -o pipefail
# --continue-on-collection-errors: a module whose imports fail here (a package missing from the image) is
# reported as an error without stopping the other modules. At the suite's limit pytest gets SIGINT, not SIGTERM: it
# then stops as on Ctrl-C and still writes its summary (the tests that passed, the one it was in, the durations)
# and the junit xml, where a killed run leaves a line of dots; 30 s later it is killed.
timeout -s INT -k 30 "${PYTEST_TIMEOUT_S:-360}" $PY -m pytest ${PYTEST_PATHS:-tests/gpu} -q -rA --maxfail=30 $TIMEOUT_ARGS \
    --continue-on-collection-errors \
    -p no:cacheprovider -W ignore::FutureWarning -W ignore::DeprecationWarning \
    --durations=15 --junitxml="$OUT/gpu_tests.xml" ${PYTEST_ARGS:-} >"$OUT/gpu_tests.log" 2>&1
PYTEST_RC=$?
set +o pipefail
T1=$(date +%s)
echo "run_all: pytest rc=$PYTEST_RC in $((T1 - T0)) s"

PEAK_RC=skipped
if [ "${SKIP_1B:-0}" != "1" ]; then
    echo "run_all: peak_1b.py"
    timeout "${PEAK_TIMEOUT_S:-170}" $PY benchmarks/peak_1b.py ${PEAK_1B_ARGS:-} >"$OUT/peak_1b.log" 2>&1
    PEAK_RC=$?
fi
T2=$(date +%s)

SOAK_RC=skipped
if [ "${SKIP_SOAK:-0}" != "1" ]; then
    echo "run_all: soak_1b.py, ${SOAK_STEPS:-500} steps"
    timeout "${SOAK_TIMEOUT_S:-240}" $PY benchmarks/soak_1b.py --steps "${SOAK_STEPS:-500}" ${SOAK_ARGS:-} \
        >"$OUT/soak_1b.log" 2>&1
    SOAK_RC=$?
fi
T3=$(date +%s)

# ---------------------------------------------------------------- summary (this is what the output tail shows)
echo
echo "================ pytest: slowest ================"
sed -n '/slowest .*durations/,/^=/p' "$OUT/gpu_tests.log" | grep -v '^=' | head -16
echo "================ pytest: skipped ================"
grep -E '^SKIPPED' "$OUT/gpu_tests.log" | cut -c1-160 | head -8
echo "================ pytest: numbers ================"
sed -n '/hf-offload GPU numbers/,/^=/p' "$OUT/gpu_tests.log" | grep -v '^=' | cut -c1-400
echo "================ peak_1b (rc=$PEAK_RC) ================"
[ -f "$OUT/peak_1b.log" ] && grep -v '^\[transformers\]' "$OUT/peak_1b.log" | tail -14
echo "================ soak_1b (rc=$SOAK_RC) ================"
[ -f "$OUT/soak_1b.log" ] && grep -v '^\[transformers\]' "$OUT/soak_1b.log" | tail -30 | cut -c1-220
echo "================ pytest: failures / errors ($(grep -cE '^(FAILED|ERROR) ' "$OUT/gpu_tests.log") in all, first 20) ================"
grep -E '^(FAILED|ERROR) ' "$OUT/gpu_tests.log" | cut -c1-220 | head -20
echo "---- first failure, traceback tail ----"
awk '/^=+ FAILURES =+$/{f=1;next} f&&/^=+ /{exit} f' "$OUT/gpu_tests.log" | awk '/^_+ .* _+$/{n++} n==1' | tail -30 | cut -c1-300
echo "================ pytest result ================"
grep -E ': KeyboardInterrupt$' "$OUT/gpu_tests.log" | sed 's/^/stopped at the time limit in: /'
tail -1 "$OUT/gpu_tests.log"
echo "run_all: pytest rc=$PYTEST_RC ($((T1 - T0)) s), peak_1b rc=$PEAK_RC ($((T2 - T1)) s)," \
    "soak_1b rc=$SOAK_RC ($((T3 - T2)) s), files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[ "$PYTEST_RC" = 0 ] && { [ "$SOAK_RC" = 0 ] || [ "$SOAK_RC" = skipped ]; }
