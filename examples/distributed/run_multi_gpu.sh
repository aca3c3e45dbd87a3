#!/usr/bin/env bash
# Multi-GPU checks of hf-offload (issues #5 and #24) on one machine with 2 GPUs, in one call:
#
#     bash examples/distributed/run_multi_gpu.sh
#
# Every training run is 20 steps x 2 ranks, launched by accelerate, under a timeout; off and on runs are compared
# rank by rank, bitwise (compare.py), and offloading runs get the parameter audit. Items (README.md has the table):
#  1. DDP, FSDP2, DeepSpeed ZeRO-2 (+LoRA +checkpointing): off vs on, small Llama (train_distributed.py).
#  2. DeepSpeed ZeRO-3: +LoRA +checkpointing, full fine-tune, full fine-tune +checkpointing: off vs on; the audit counts
#     the parameters it saw gathered. Then the memory budget under ZeRO-3 against the full fine-tune's baseline.
#     (SKIP lines when `import deepspeed` fails.)
#  3. The memory budget under DDP and FSDP2 (a larger Llama: 8 layers, hidden 512, 1024 tokens per sample): a
#     baseline without offloading, then offloading with a budget of the baseline's static memory plus BUDGET_FRACTION
#     of what its step added at the peak (check_budget.py suggest); losses bitwise, the same plan on both ranks at
#     every step, every rank's peak under the budget at every step (check_budget.py check). Again with
#     --varied-lengths (packed batches, different lengths on the two ranks in each step; the baseline too).
#  4. TRL's SFTTrainer (sft_distributed.py, DDP): off vs on + budget, the same checks. Context parallelism
#     (train_distributed.py --cp-size 2: accelerate's ParallelismConfig, FSDP2, ring attention) and DeepSpeed's
#     Ulysses (--sp-size 2, ZeRO-1): the same checks.
#  5. The two-device GPU tests (tests/gpu, -k "two_devices or multidevice or split").
# Two waves: every run that needs no other run's result, then the budget runs (a budget run starts after its
# baseline), up to PARALLEL launches at once (results are per process, and bitwise comparisons do not depend on
# timing). On two H200s, PARALLEL=18 (every launch of a wave at once, 36 processes) ran the whole script in 164 s.
# Logs, rank JSONs, comparisons and results.md (a table of every item, the environment and the command) go to $OUT
# (./dist_out when unset). It ends with a PASS/FAIL/SKIP line per item and exits non-zero if anything failed.
#
# Knobs: STEPS (20), BUDGET_S (whole-script wall budget, 540), RUN_LIMIT_S (per launch, 120), PYTHON (python3),
# PARALLEL (launches at once, 4), SKIP_INSTALL=1 (use the environment as it is, e.g. a virtual environment),
# BUDGET_FRACTION (0.6), SFT_PACKING (bfd: TRL's padding-free default, rows of slightly different lengths; wrapped:
# every row the same length), EXTRA_TRAIN_ARGS (added to every train_distributed.py run), DEVICE=cpu (everything in
# the engine's CPU test mode on the CPU, gloo, for checking this script without GPUs: fixed budgets, smaller
# models, no GPU tests).

set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/dist_out}
mkdir -p "$OUT"
export OUT
# NVLink multicast stays off on these shared hosts (KINDS.md); set here too, so every worker inherits it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
PY=${PYTHON:-python3}
STEPS=${STEPS:-20}
BUDGET_S=${BUDGET_S:-540}
RUN_LIMIT_S=${RUN_LIMIT_S:-120}
BUDGET_FRACTION=${BUDGET_FRACTION:-0.6}
SFT_PACKING=${SFT_PACKING:-bfd}
DEVICE=${DEVICE:-cuda}
PARALLEL=${PARALLEL:-4}
PYTEST_RESERVE_S=75  # waves stop being started when less than this would be left for the GPU tests
WAVE_MIN_S=45        # nor when less than this is left for the wave itself
D=examples/distributed
T0=$(date +%s)
COMMAND="$(printf '%q ' env STEPS="$STEPS" BUDGET_S="$BUDGET_S" RUN_LIMIT_S="$RUN_LIMIT_S" \
    BUDGET_FRACTION="$BUDGET_FRACTION" SFT_PACKING="$SFT_PACKING" DEVICE="$DEVICE" PARALLEL="$PARALLEL" \
    EXTRA_TRAIN_ARGS="${EXTRA_TRAIN_ARGS:-}" bash "$D/run_multi_gpu.sh")"
declare -A RESULT  # item -> "PASS ..." / "FAIL ..." / "SKIP ..."
ITEMS=()
result() { ITEMS+=("$1"); RESULT[$1]="$2"; echo "==> $1: $2"; }
left() { echo $((BUDGET_S - ($(date +%s) - T0))); }

# Model, data and budgets. On the GPU, budgets come from the baselines' peaks; the CPU test mode has no peak counter,
# so it gets fixed ones, which make these small models plan (checked once on a CPU: 'cccK' and 'OOKK' kinds of plans).
if [ "$DEVICE" = cpu ]; then
    DEV_ARGS=(--device-type cpu)
    BIG=(--hidden 256 --layers 4 --seq-len 256 --batch 2)
    SFT_MODEL=(--hidden 64 --layers 4 --max-length 128 --batch 2)
    CPU_BUDGET=40MiB CPU_SFT_BUDGET=8MiB
    PYTEST_RESERVE_S=0
else
    DEV_ARGS=()
    BIG=(--hidden 512 --layers 8 --seq-len 1024 --batch 2)
    SFT_MODEL=(--hidden 512 --layers 8 --max-length 1024 --batch 2)
fi

# ------------------------------------------------------------------------------------------------ install
# Carried wheels (trl, deepspeed and its missing deps, ...) and the package itself go to /tmp/site; PYTHONSAFEPATH
# keeps the repository's hf_offload/ folder from shadowing the installed copy.
# SKIP_INSTALL=1 uses the environment as it is (a virtual environment with the package and its needs installed).
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    {
        if ls .whl/*.whl >/dev/null 2>&1; then
            timeout 180 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        fi &&
            timeout 120 $PY -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site .
    } >"$OUT/install.log" 2>&1 || { echo "run_multi_gpu: install failed:"; tail -20 "$OUT/install.log"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONSAFEPATH=1

$PY - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib, os, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "devices",
      torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("transformers", "accelerate", "peft", "trl", "datasets", "hf_offload", "deepspeed", "pydantic"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as error:
        print(name, "IMPORT FAILED:", repr(error)[:200])
print({k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")})
EOF
if [ "$DEVICE" != cpu ]; then
    GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    if [ "${GPUS:-0}" -lt 2 ]; then
        echo "run_multi_gpu: needs 2 CUDA devices, found ${GPUS:-0} (DEVICE=cpu runs the CPU test mode)"
        exit 1
    fi
fi
if $PY -c "import deepspeed" >"$OUT/deepspeed_import.log" 2>&1; then HAVE_DS=1; else HAVE_DS=0; fi

# ------------------------------------------------------------------------------------------------ helpers
# launch NAME CONFIG SCRIPT ARGS...: one accelerate launch in the background, on a port of its own, under a timeout
# that leaves the GPU tests their time; at most PARALLEL at once (it first waits for the oldest). `wave` waits for
# every launch still running. Each finished launch prints its rank summary lines.
declare -A STARTED
RUNNING=()  # "name:pid", oldest first
PORT=29511
finish_oldest() {
    local name=${RUNNING[0]%%:*} pid=${RUNNING[0]##*:} rc
    RUNNING=("${RUNNING[@]:1}")
    wait "$pid"
    rc=$(cat "$OUT/$name.rc" 2>/dev/null || echo '?')
    echo "--- $name: rc=$rc in $(($(stat -c %Y "$OUT/$name.rc" 2>/dev/null || date +%s) - STARTED[$name])) s$([ "$rc" = 124 ] && echo ' (timed out)')"
    grep -E '^\[[A-Z_0-9 ]+ rank [0-9]+/' "$OUT/$name.log" | cut -c1-400 || tail -5 "$OUT/$name.log"
}
wave() { while [ ${#RUNNING[@]} -gt 0 ]; do finish_oldest; done; }

launch() {
    local name=$1 config=$2 script=$3
    shift 3
    while [ ${#RUNNING[@]} -ge "$PARALLEL" ]; do finish_oldest; done
    local limit=$(($(left) - PYTEST_RESERVE_S))
    [ "$limit" -gt "$RUN_LIMIT_S" ] && limit=$RUN_LIMIT_S
    rm -f "$OUT/$name".rank*.json "$OUT/$name.rc"  # never compare a stale file from an earlier run
    if [ "$limit" -lt 30 ]; then
        echo "run_multi_gpu: $name not started: time budget spent" | tee "$OUT/$name.log"
        return
    fi
    local extra=()
    [ "$script" = train_distributed.py ] && extra=(--steps "$STEPS" ${EXTRA_TRAIN_ARGS:-})
    [ "$script" = sft_distributed.py ] && extra=(--steps "$STEPS")
    PORT=$((PORT + 1))
    STARTED[$name]=$(date +%s)
    (
        timeout -k 10 "$limit" $PY -m accelerate.commands.launch --config_file "$D/$config" --num_processes 2 \
            --main_process_port "$PORT" "$D/$script" --out "$OUT/$name.json" "${DEV_ARGS[@]}" "${extra[@]}" "$@" \
            >"$OUT/$name.log" 2>&1
        echo $? >"$OUT/$name.rc"  # its exit status, written as it ends (the file's time is its end)
    ) &
    RUNNING+=("$name:$!")
}

# time_for_wave: whether a wave may still start (else the items it would run are SKIPped by their checks).
time_for_wave() { [ $(($(left) - PYTEST_RESERVE_S)) -ge $WAVE_MIN_S ]; }

# missing RUN: nothing when RUN left its rank files; else "SKIP <why>" when it was not started for lack of time, or
# "FAIL <why>" (it timed out, crashed, or was not started because its baseline gave no budget).
missing() {
    local run=$1
    ls "$OUT/$run".rank*.json >/dev/null 2>&1 && return
    local log="$OUT/$run.log" why
    if [ ! -e "$log" ]; then
        echo "FAIL $run never ran"
    elif grep -q "not started: time budget spent" "$log"; then
        echo "SKIP time budget spent"
    elif why=$(grep -h -m1 "not started" "$log"); then
        echo "FAIL ${why#run_multi_gpu: }"
    elif [ "$(cat "$OUT/$run.rc" 2>/dev/null)" = 124 ]; then
        echo "FAIL $run timed out after $(($(stat -c %Y "$OUT/$run.rc") - STARTED[$run])) s (hung or too slow; see $run.log)"
    else
        why=$(grep -h -E 'Error|error:' "$log" | grep -v -i warn | tail -1 | cut -c1-200)
        echo "FAIL $run left no rank files (exit $(cat "$OUT/$run.rc" 2>/dev/null || echo '?'); see $run.log)${why:+: $why}"
    fi
}

# compare_runs ITEM A B [--rtol X]: records PASS if bitwise, MATCH-NOT-BITWISE if only within rtol, else FAIL.
compare_runs() {
    local item=$1 a=$2 b=$3
    shift 3
    local gone
    gone=$(missing "$a")
    [ -z "$gone" ] && gone=$(missing "$b")
    if [ -n "$gone" ]; then
        result "$item losses" "$gone"
        return
    fi
    local file="$OUT/compare_${item// /_}.txt"
    $PY "$D/compare.py" "$OUT/$a.json" "$OUT/$b.json" "$@" >"$file" 2>&1
    local rc=$?
    grep -E '^compare:|final trainable' "$file"
    case $rc in
        0) result "$item losses" "PASS bitwise equal ($(grep -o '([0-9]* ranks x [0-9]* steps' "$file" | tr -d '('), weights too)" ;;
        2) result "$item losses" "FAIL not bitwise, $(grep -o 'max relative.*' "$file")" ;;
        *) result "$item losses" "FAIL $(grep -E '^compare: ' "$file" | grep -v note | head -2 | tr '\n' ' ')" ;;
    esac
}

# audit ITEM RUN: the parameter audit of an offloading run, from its rank files (under ZeRO-3 with the count of
# parameters the audit saw gathered).
audit() {
    local line
    line=$($PY - "$OUT/$2.json" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
records = [json.loads(p.read_text()) for p in sorted(out.parent.glob(f"{out.stem}.rank*.json"))]
if not records:
    print("FAIL no rank files (the run did not finish)"); sys.exit()
violations = sum(r["param_audit"]["violations"] for r in records)
stats = [r["offload_stats"] or {} for r in records]
kept = [s.get("tensors_kept_parameter", 0) for s in stats]
moved = [s.get("tensors_offloaded", 0) for s in stats]
problems = [p for r in records for p in r["problems"]]
verdict = "PASS" if not problems and violations == 0 else "FAIL"
example = f"; e.g. {records[0]['param_audit']['examples'][:1]}" if violations else ""
zero3 = ""
if records[0].get("zero_stage") == 3:
    seen = [r["param_audit"]["zero3_gathered_seen"] for r in records]
    distinct = [r["param_audit"]["zero3_gathered_distinct"] for r in records]
    zero3 = f"gathered parameters seen {sum(seen)} ({seen} per rank, {distinct} distinct), offloaded {violations}; "
print(f"{verdict} {zero3}{violations} parameter tensors sent to offloading (all ranks); per rank: offloaded {moved}, "
      f"kept as parameter {kept}"
      f"{example}{'; ' + '; '.join(sorted(set(problems))) if problems else ''}")
EOF
    )
    result "$1 params never offloaded" "$line"
}

# launch_budget NAME BASELINE CONFIG SCRIPT ARGS...: `launch` with --memory-budget, once the baseline's run gave one
# (GPU: check_budget.py suggest, from its peak; CPU test mode: a fixed budget, the host having no peak counter).
launch_budget() {
    local name=$1 baseline=$2 config=$3 script=$4 budget
    shift 4
    if [ "$DEVICE" = cpu ]; then
        budget=$CPU_BUDGET
        [ "$script" = sft_distributed.py ] && budget=$CPU_SFT_BUDGET
    else
        budget=$($PY "$D/check_budget.py" suggest "$OUT/$baseline.json" --fraction "$BUDGET_FRACTION" 2>&1 | tail -1)
    fi
    if ! [[ $budget =~ ^[0-9]+$ || $DEVICE = cpu ]]; then
        rm -f "$OUT/$name".rank*.json
        echo "run_multi_gpu: $name not started: no budget from $baseline ($budget)" >"$OUT/$name.log"
        return
    fi
    echo "run_multi_gpu: $name: memory budget $budget (from $baseline)"
    launch "$name" "$config" "$script" "$@" --memory-budget "$budget"
}

# check_plan ITEM RUN: same plan on every rank at every step, peaks under the budget (check_budget.py check).
check_plan() {
    local item=$1 run=$2 gone
    gone=$(missing "$run")
    if [ -n "$gone" ]; then
        result "$item plan+peaks" "$gone"
        return
    fi
    $PY "$D/check_budget.py" check "$OUT/$run.json" >"$OUT/check_$run.txt" 2>&1
    local rc=$?
    cat "$OUT/check_$run.txt"
    local detail
    detail=$(grep -E '^(plans|peaks):' "$OUT/check_$run.txt" | sed -E 's/^(plans|peaks): (PASS|FAIL) ?/\1: /' | paste -sd'|' | sed 's/|/; /g')
    if [ $rc = 0 ]; then result "$item plan+peaks" "PASS $detail"; else result "$item plan+peaks" "FAIL $detail"; fi
}

# ------------------------------------------------------------------------------------------------ the waves
# The two waves of the header. Within a wave `launch` keeps PARALLEL launches going; the runs never verified on GPUs
# before (the budget baselines, ZeRO-3) start first, so that a short BUDGET_S spends itself on them.
echo "==================== wave 1: baselines for the budget runs; ZeRO-3; DDP, FSDP2 and ZeRO-2 off/on"
launch bddp_base ddp.yaml train_distributed.py --no-offload "${BIG[@]}"
launch bddp_vbase ddp.yaml train_distributed.py --no-offload "${BIG[@]}" --varied-lengths
launch bfsdp_base fsdp2.yaml train_distributed.py --no-offload "${BIG[@]}"
launch bfsdp_vbase fsdp2.yaml train_distributed.py --no-offload "${BIG[@]}" --varied-lengths
launch sft_off ddp.yaml sft_distributed.py --no-offload "${SFT_MODEL[@]}" --packing-strategy "$SFT_PACKING"
# Context parallelism: FSDP2 and the device mesh come from the Trainer's arguments (--cp-size), so plain ddp.yaml.
[ "$DEVICE" != cpu ] && launch bcp_base ddp.yaml train_distributed.py --no-offload "${BIG[@]}" --cp-size 2
[ "$DEVICE" != cpu ] && [ $HAVE_DS = 1 ] && launch bsp_base ddp.yaml train_distributed.py --no-offload "${BIG[@]}" --sp-size 2
if [ $HAVE_DS = 1 ]; then
    launch ds3_full_off deepspeed_zero3.yaml train_distributed.py --no-offload
    launch ds3_full_on deepspeed_zero3.yaml train_distributed.py --offload
    launch ds3_lora_off deepspeed_zero3.yaml train_distributed.py --no-offload --lora --checkpointing
    launch ds3_lora_on deepspeed_zero3.yaml train_distributed.py --offload --lora --checkpointing
    launch ds3_ckpt_off deepspeed_zero3.yaml train_distributed.py --no-offload --checkpointing
    launch ds3_ckpt_on deepspeed_zero3.yaml train_distributed.py --offload --checkpointing
fi
launch ddp_off ddp.yaml train_distributed.py --no-offload
launch ddp_on ddp.yaml train_distributed.py --offload
launch fsdp2_off fsdp2.yaml train_distributed.py --no-offload
launch fsdp2_on fsdp2.yaml train_distributed.py --offload
if [ $HAVE_DS = 1 ]; then
    launch ds2_off deepspeed_zero2.yaml train_distributed.py --no-offload --lora --checkpointing
    launch ds2_on deepspeed_zero2.yaml train_distributed.py --offload --lora --checkpointing
fi
wave

# Budget runs whose ranks see different lengths in one step are among them, with the SFTTrainer's (TRL's packing
# gives rows of slightly different lengths too): the planner's ranks must agree on each step's tokens.
echo "==================== wave 2: the memory budget under DDP, FSDP2 (fixed and varied lengths), SFTTrainer, ZeRO-3"
if time_for_wave; then
    launch_budget bddp_on bddp_base ddp.yaml train_distributed.py --offload "${BIG[@]}"
    launch_budget bfsdp_on bfsdp_base fsdp2.yaml train_distributed.py --offload "${BIG[@]}"
    launch_budget bddp_von bddp_vbase ddp.yaml train_distributed.py --offload "${BIG[@]}" --varied-lengths
    launch_budget bfsdp_von bfsdp_vbase fsdp2.yaml train_distributed.py --offload "${BIG[@]}" --varied-lengths
    launch_budget sft_on sft_off ddp.yaml sft_distributed.py --offload "${SFT_MODEL[@]}" --packing-strategy "$SFT_PACKING"
    [ "$DEVICE" != cpu ] && launch_budget bcp_on bcp_base ddp.yaml train_distributed.py --offload "${BIG[@]}" --cp-size 2
    [ "$DEVICE" != cpu ] && [ $HAVE_DS = 1 ] &&
        launch_budget bsp_on bsp_base ddp.yaml train_distributed.py --offload "${BIG[@]}" --sp-size 2
    # The ZeRO-3 budget's baseline is the full fine-tune's run without offloading (same arguments).
    [ $HAVE_DS = 1 ] && launch_budget ds3_budget ds3_full_off deepspeed_zero3.yaml train_distributed.py --offload
    wave
fi

echo "==================== comparisons"
compare_runs ddp ddp_off ddp_on
audit ddp ddp_on
# The issue asks that the losses match; bitwise is what offloading promises, so only bitwise passes, and the
# relative difference is reported when they are only close.
compare_runs fsdp2 fsdp2_off fsdp2_on --rtol 1e-5
audit fsdp2 fsdp2_on
for pair in "ddp budget:bddp_base:bddp_on" "fsdp2 budget:bfsdp_base:bfsdp_on" "ddp budget varied:bddp_vbase:bddp_von" \
    "fsdp2 budget varied:bfsdp_vbase:bfsdp_von" "sft budget:sft_off:sft_on"; do
    IFS=: read -r item base run <<<"$pair"
    compare_runs "$item" "$base" "$run"
    check_plan "$item" "$run"
done
if [ "$DEVICE" != cpu ]; then
    compare_runs "cp budget" bcp_base bcp_on
    check_plan "cp budget" bcp_on
    if [ $HAVE_DS = 1 ]; then
        compare_runs "ulysses budget" bsp_base bsp_on
        check_plan "ulysses budget" bsp_on
    fi
else  # ring attention's CPU kernel and DeepSpeed's gloo start: tests/sequence_sharding_on_cpu.py, for the tests only
    result "cp budget losses" "SKIP DEVICE=cpu (tests/test_distributed_examples.py runs it on CPU processes)"
    result "ulysses budget losses" "SKIP DEVICE=cpu (tests/test_distributed_examples.py runs it on CPU processes)"
fi
if [ $HAVE_DS = 1 ]; then
    compare_runs "deepspeed zero2" ds2_off ds2_on
    audit "deepspeed zero2" ds2_on
    compare_runs "zero3 lora+ckpt" ds3_lora_off ds3_lora_on
    audit "zero3 lora+ckpt" ds3_lora_on
    compare_runs "zero3 full" ds3_full_off ds3_full_on
    audit "zero3 full" ds3_full_on
    compare_runs "zero3 full+ckpt" ds3_ckpt_off ds3_ckpt_on
    audit "zero3 full+ckpt" ds3_ckpt_on
    compare_runs "zero3 budget" ds3_full_off ds3_budget
    check_plan "zero3 budget" ds3_budget
    audit "zero3 budget" ds3_budget
else
    echo "run_multi_gpu: deepspeed not installed (import deepspeed failed: $(tail -1 "$OUT/deepspeed_import.log"))"
    result "deepspeed losses" "SKIP deepspeed not installed"
fi

# ------------------------------------------------------------------------------------------------ GPU tests
echo "==================== tests/gpu two-device tests"
limit=$(left)
[ "$limit" -gt 240 ] && limit=240
if [ "$DEVICE" = cpu ]; then
    result "gpu two-device tests" "SKIP DEVICE=cpu"
elif [ "$limit" -lt 20 ]; then
    result "gpu two-device tests" "SKIP time budget spent"
else
    timeout -k 10 "$limit" $PY -m pytest tests/gpu/test_gpu_multidevice.py tests/gpu/test_engine_streams.py \
        -k "two_devices or multidevice or split" -q -rA -p no:cacheprovider -W ignore::FutureWarning \
        -W ignore::DeprecationWarning >"$OUT/pytest_multidevice.log" 2>&1
    rc=$?
    grep -E '^(PASSED|FAILED|ERROR|SKIPPED)' "$OUT/pytest_multidevice.log" | cut -c1-200
    last=$(tail -1 "$OUT/pytest_multidevice.log")
    if [ $rc = 0 ] && [[ $last == *passed* ]]; then
        result "gpu two-device tests" "PASS $last"
    else
        result "gpu two-device tests" "FAIL rc=$rc (a run where no test passed fails too): $last"
    fi
fi

# ------------------------------------------------------------------------------------------------ summary
ELAPSED=$(($(date +%s) - T0))
echo
echo "==================== summary (${ELAPSED} s; logs, rank JSONs and comparisons in $OUT)"
status=0
{
    echo "# run_multi_gpu.sh results"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%MZ), ${ELAPSED} s, from the repository root:"
    echo
    echo '```'
    echo "$COMMAND"
    echo '```'
    echo
    echo "Environment:"
    echo
    echo '```'
    cat "$OUT/env.txt"
    echo "git $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo '```'
    echo
    echo "| item | result |"
    echo "| --- | --- |"
} >"$OUT/results.md"
for item in "${ITEMS[@]}"; do
    printf '%-36s %s\n' "$item" "${RESULT[$item]}"
    printf '| %s | %s |\n' "$item" "$(echo "${RESULT[$item]}" | sed 's/|/\\|/g')" >>"$OUT/results.md"
    case ${RESULT[$item]} in FAIL*) status=1 ;; esac
done
echo "results: $OUT/results.md"
exit $status
