#!/usr/bin/env bash
# tensorwire's GPU bundle (built by `cargo xtask gpu-bundle`): every GPU check and bench, run
# within a time budget (default 8 minutes), on the machine this folder was copied to.
#
#   bash run.sh [REPORT_DIR]        # REPORT_DIR defaults to $OUT, else this folder
#
# It finds the CUDA driver (libcuda.so.1) and the NCCL of the Python package nvidia-nccl-cu13
# (or -cu12; cudarc opens NCCL as libnccl.so, so a symlink to the wheel's libnccl.so.2 goes in
# a temporary folder on LD_LIBRARY_PATH), runs each check with what is left of the budget,
# prints one line per check (PASS, FAIL or SKIP with its reason) and `N passed, N failed,
# N skipped`, and writes REPORT_DIR/gpu-report.json (every check, its figures, the ratios) and
# REPORT_DIR/gpu-log.txt (every output line). Exit status: 0 when nothing failed, else 1.
# Without a GPU every check skips, saying why.
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPORT_DIR=${1:-${OUT:-$HERE}}
mkdir -p "$REPORT_DIR"
REPORT="$REPORT_DIR/gpu-report.json"
LOG="$REPORT_DIR/gpu-log.txt"
BUDGET=${TW_BUNDLE_BUDGET_S:-470}
START=$(date +%s)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# The binaries travel compressed (the bundle must stay small): unpacked here for this run.
if [ -f "$HERE/payload.tar.gz" ]; then
    mkdir -p "$TMP/payload"
    tar -xzf "$HERE/payload.tar.gz" -C "$TMP/payload" || { echo "cannot unpack $HERE/payload.tar.gz" >&2; exit 1; }
    ROOT="$TMP/payload"
else
    ROOT="$HERE"
fi
: >"$LOG"
CHECKS="$TMP/checks.jsonl"
: >"$CHECKS"
PASSED=0 FAILED=0 SKIPPED=0

log() { echo "$*" | tee -a "$LOG"; }

# JSON string of $1.
json_str() {
    printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/\t/ /g' | tr -d '\r' |
        awk 'BEGIN { printf "\"" } { if (NR > 1) printf "\\n"; printf "%s", $0 } END { printf "\"" }'
}

left() { echo $((BUDGET - ($(date +%s) - START))); }

# --- the driver -----------------------------------------------------------------------------
LIBCUDA=""
for d in $(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1/ { print $NF }' | xargs -r -n1 dirname) \
    /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/local/nvidia/lib \
    /usr/lib/wsl/lib /usr/local/cuda/compat; do
    if [ -e "$d/libcuda.so.1" ]; then
        LIBCUDA="$d/libcuda.so.1"
        export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        break
    fi
done
log "libcuda: ${LIBCUDA:-not found}"

# --- NCCL from the Python package -------------------------------------------------------------
PY=$(command -v python3 || command -v python || true)
NCCL_DIR=""
if [ -n "$PY" ]; then
    NCCL_DIR=$("$PY" - <<'EOF' 2>/dev/null
import importlib.util, os
for name in ("nvidia.nccl",):
    spec = importlib.util.find_spec(name)
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            lib = os.path.join(loc, "lib")
            if os.path.exists(os.path.join(lib, "libnccl.so.2")):
                print(lib)
                raise SystemExit
EOF
)
fi
if [ -n "$NCCL_DIR" ]; then
    mkdir -p "$TMP/nccl"
    ln -sf "$NCCL_DIR/libnccl.so.2" "$TMP/nccl/libnccl.so"
    export LD_LIBRARY_PATH="$TMP/nccl:$NCCL_DIR:${LD_LIBRARY_PATH:-}"
fi
log "NCCL: ${NCCL_DIR:-not found (no nvidia-nccl-cu13/cu12 Python package)}"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${GPUS:-0}" -ge 1 ] 2>/dev/null || GPUS=1
MACHINE=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
log "GPUs: $GPUS ${MACHINE:+($MACHINE)}"

# The test executables start their workers ($BIN/tw-rpc-worker, $BIN/tw-autograd-worker)
# from here.
export TW_BIN_DIR="$ROOT/bin"
export TENSORWIRE_SECRET="gpu-bundle-$$-$RANDOM$RANDOM"

# record NAME STATUS SECONDS REASON RESULT_JSON
record() {
    local name=$1 status=$2 secs=$3 reason=$4 result=${5:-null}
    case $status in
    pass) PASSED=$((PASSED + 1)); log "PASS $name (${secs}s)" ;;
    fail) FAILED=$((FAILED + 1)); log "FAIL $name (${secs}s): $reason" ;;
    skip) SKIPPED=$((SKIPPED + 1)); log "SKIP $name: $reason" ;;
    esac
    printf '{"name": %s, "status": "%s", "seconds": %s, "reason": %s, "result": %s}\n' \
        "$(json_str "$name")" "$status" "$secs" "$(json_str "$reason")" "$result" >>"$CHECKS"
}

# check NAME LIMIT_S COMMAND...: runs it with min(LIMIT_S, what is left), classifies it.
# SKIPPED lines (and no failure) make a skip; exit 0 a pass; anything else a failure.
check() {
    local name=$1 limit=$2
    shift 2
    local rest
    rest=$(left)
    if [ "$rest" -lt 10 ]; then
        record "$name" fail 0 "not run: the ${BUDGET}s budget is spent"
        return
    fi
    [ "$limit" -gt "$rest" ] && limit=$rest
    local out="$TMP/out" t0 rc
    t0=$(date +%s)
    echo "=== $name: $*" >>"$LOG"
    # Through bash, so that the exported helper functions below run like commands.
    timeout -k 5 "$limit" bash -c '"$@"' _ "$@" >"$out" 2>&1
    rc=$?
    cat "$out" >>"$LOG"
    local secs=$(($(date +%s) - t0))
    local result
    result=$(grep -o 'RESULT {.*}' "$out" | head -1 | sed 's/^RESULT //')
    [ -n "$result" ] || result=null
    local skip
    skip=$(grep -m1 -o 'SKIPPED[: ].*' "$out" | sed 's/^SKIPPED:\? *//')
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        record "$name" fail "$secs" "timed out after ${limit}s: $(tail -n 3 "$out" | tr '\n' ' ')" "$result"
    elif [ $rc -ne 0 ]; then
        record "$name" fail "$secs" "exit $rc: $(grep -E 'FAIL|ERROR|panicked|error' "$out" | head -n 3 | tr '\n' ' ')" "$result"
    elif [ -n "$skip" ] && ! grep -q '^\(\[rank [0-9]*\] \)\?OK\|^PASS\|^SUMMARY: PASS' "$out"; then
        record "$name" skip "$secs" "$skip" "$result"
    else
        record "$name" pass "$secs" "" "$result"
    fi
}

BIN="$ROOT/bin"
LAUNCH=("$BIN/tensorwire" launch)

# 1. The CUDA backend on its own: round trips, device-to-device, device maps, an agent calling
#    itself, a 1-rank NCCL all_reduce and nccl group, staging throughput against raw copies.
gpu_check() {
    "$BIN/tw-gpu-check" --bench-mib 256
    local rc=$?
    # Exit 2: no device at all (its FAIL line names why).
    if [ $rc -eq 2 ]; then echo "SKIPPED: no usable CUDA device"; return 0; fi
    return $rc
}
export BIN HERE PY GPUS
export -f gpu_check
check "tw-gpu-check (backend, device maps, 1-rank NCCL, staging vs raw copies)" 120 gpu_check

# 2. Same-host CUDA IPC against the staged path, remote() with CUDA tensors, the benches
#    (256 MiB device to device over IPC / staged / a memcpy; small calls CUDA vs CPU).
check "ipc: 2 processes on cuda:0, by IPC handle (+ benches)" 90 \
    "${LAUNCH[@]}" --nproc 2 -- "$BIN/tw-gpu-suite" ipc
check "ipc: the same over the staged path (TENSORWIRE_CUDA_IPC=0)" 90 \
    env TENSORWIRE_CUDA_IPC=0 "${LAUNCH[@]}" --nproc 2 -- "$BIN/tw-gpu-suite" ipc
# What each CUDA IPC driver call costs here (open/close of a handle, IPC events, copies out of
# an open mapping): where the IPC path's time per tensor goes.
ipc_costs() {
    if [ -z "$PY" ]; then echo "SKIPPED: no python3"; return 0; fi
    "$PY" "$HERE/ipc_costs.py"
}
export -f ipc_costs
check "ipc driver call costs (ctypes, 2 processes)" 60 ipc_costs
check "device-tensors: 2 processes, CUDA tensors by device maps (tw-rpc-worker)" 60 \
    env TW_DEVICES=cuda "${LAUNCH[@]}" --nproc 2 -- "$BIN/tw-rpc-worker" device-tensors

# 3. The nccl process group: every collective (one rank per GPU), its bench against
#    torch.distributed, the timeout abort of a rank hung on purpose, NCCL's async error.
nccl_group() {
    env TW_TIMEOUT_MS=60000 "$BIN/tensorwire" launch --nproc "$GPUS" -- "$BIN/tw-pg-worker" nccl
    local rc=$?
    # Exit 4: the group could not be set up; without a driver or NCCL that is a skip (its
    # SETUP-ERROR line says why), with both a failure.
    if [ $rc -eq 4 ] && { [ -z "$LIBCUDA" ] || [ -z "$NCCL_DIR" ]; }; then
        echo "SKIPPED: the nccl group cannot be set up here (driver: ${LIBCUDA:-none}, NCCL: ${NCCL_DIR:-none})"
        return 0
    fi
    return $rc
}
export LIBCUDA NCCL_DIR
export -f nccl_group
check "nccl group: every collective, $GPUS rank(s) (tw-pg-worker nccl)" 90 nccl_group
check "nccl all_reduce 256 MiB, $GPUS rank(s) (tensorwire)" 90 \
    "${LAUNCH[@]}" --nproc "$GPUS" -- "$BIN/tw-gpu-suite" nccl-bench
torch_bench() {
    if [ -z "$PY" ]; then echo "SKIPPED: no python3"; return 0; fi
    if ! "$PY" -c 'import torch' 2>/dev/null; then echo "SKIPPED: PyTorch is not installed"; return 0; fi
    "$PY" -m torch.distributed.run --standalone --nproc_per_node="$GPUS" "$HERE/torch_allreduce.py"
}
export -f torch_bench
check "torch.distributed all_reduce 256 MiB, $GPUS rank(s) (baseline)" 120 torch_bench
check "nccl timeout abort: rank 1 hangs on purpose" 60 \
    "${LAUNCH[@]}" --nproc 2 -- "$BIN/tw-gpu-suite" nccl-timeout
check "nccl async error: rank 1 exits mid-group" 60 \
    "${LAUNCH[@]}" --nproc 2 -- "$BIN/tw-gpu-suite" nccl-async-error

# 4. The `::cuda` multi-process RPC and autograd tests, one check each (TW_DEVICES=cuda);
#    last, as the longest (32 workers in one of them): what the budget leaves.
run_tests() {
    local exe=$1 pattern=$2 limit=$3
    local t
    if [ ! -x "$exe" ]; then
        record "$(basename "$exe")" skip 0 "not in this bundle"
        return
    fi
    for t in $("$exe" --list --format terse 2>/dev/null | sed -n 's/: test$//p' | grep -E "$pattern"); do
        # --nocapture: a test that skips says so on its output.
        check "$(basename "$exe")::$t" "$limit" "$exe" --exact "$t" --test-threads 1 --nocapture
    done
}
run_tests "$ROOT/tests/rpc_processes" '::cuda$' 90
run_tests "$ROOT/tests/autograd_processes" 'on_cuda' 120
run_tests "$ROOT/tests/rpc_agent" 'default_backend_is_cuda' 60

# --- the report -------------------------------------------------------------------------------
field() { # field CHECK_NAME_PREFIX KEY
    grep -F "\"name\": \"$1" "$CHECKS" | head -1 | grep -o "\"$2\": [0-9.e+-]*" | head -1 | awk '{ print $2 }'
}
ratio() { # ratio A B: A / B, or null
    if [ -n "$1" ] && [ -n "$2" ]; then awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "null" }'; else echo null; fi
}
IPC_RPC=$(field "ipc: 2 processes" rpc_256mib_s)
IPC_MEMCPY=$(field "ipc: 2 processes" memcpy_256mib_s)
STAGED_RPC=$(field "ipc: the same over the staged" rpc_256mib_s)
STAGED_MEMCPY=$(field "ipc: the same over the staged" memcpy_256mib_s)
CUDA_CALL=$(field "ipc: 2 processes" small_call_cuda_s)
CPU_CALL=$(field "ipc: 2 processes" small_call_cpu_s)
TW_AR=$(field "nccl all_reduce" nccl_all_reduce_256mib_s)
TORCH_AR=$(field "torch.distributed" torch_all_reduce_256mib_s)
{
    printf '{\n  "machine": %s,\n  "gpus": %s,\n  "libcuda": %s,\n  "nccl_dir": %s,\n' \
        "$(json_str "${MACHINE:-}")" "$GPUS" "$(json_str "$LIBCUDA")" "$(json_str "$NCCL_DIR")"
    printf '  "summary": {"passed": %s, "failed": %s, "skipped": %s, "seconds": %s},\n' \
        "$PASSED" "$FAILED" "$SKIPPED" "$(($(date +%s) - START))"
    printf '  "ratios": {\n'
    printf '    "ipc_rpc_throughput_over_memcpy": %s,\n' "$(ratio "$IPC_MEMCPY" "$IPC_RPC")"
    printf '    "staged_rpc_throughput_over_memcpy": %s,\n' "$(ratio "$STAGED_MEMCPY" "$STAGED_RPC")"
    printf '    "ipc_over_staged_speedup": %s,\n' "$(ratio "$STAGED_RPC" "$IPC_RPC")"
    printf '    "small_call_cuda_over_cpu_latency": %s,\n' "$(ratio "$CUDA_CALL" "$CPU_CALL")"
    printf '    "nccl_all_reduce_tensorwire_over_torch_time": %s\n' "$(ratio "$TW_AR" "$TORCH_AR")"
    printf '  },\n  "targets": {"ipc_rpc_throughput_over_memcpy": ">= 0.8"},\n  "checks": [\n'
    sed '$!s/$/,/' "$CHECKS" | sed 's/^/    /'
    printf '  ]\n}\n'
} >"$REPORT"
log "ratios: IPC/memcpy $(ratio "$IPC_MEMCPY" "$IPC_RPC"), staged/memcpy $(ratio "$STAGED_MEMCPY" "$STAGED_RPC"), CUDA/CPU small-call latency $(ratio "$CUDA_CALL" "$CPU_CALL"), tensorwire/torch all_reduce time $(ratio "$TW_AR" "$TORCH_AR")"
log "$PASSED passed, $FAILED failed, $SKIPPED skipped in $(($(date +%s) - START))s; report: $REPORT"
[ "$FAILED" -eq 0 ]
