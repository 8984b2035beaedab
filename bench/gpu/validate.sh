#!/usr/bin/env bash
# GPU validation of megatron-cai on one H100/H200, written for the validation machine (Python 3.12 as
# python3, torch 2.11.0+cu130, triton 3.6.0, no TE / apex / megatron-core, nothing installable; only the
# files under $OUT come back, at most 8, with the last 12 KB of output). Steps, most decisive first:
#   env        versions, the GPU, measured copy bandwidth and bf16 matmul rate (the ceilings)
#   codec      Squinch encode / error feedback / decode-accumulate / wire rows vs copy bandwidth
#   attention  our Triton kernels vs SDPA flash (causal) and FlexAttention (packed docs, trees), fwd / bwd
#   training   350M and 1.3B GPTs through pretrain_gpt's Trainer vs a plain torch.compile loop, and the
#              350M alternated with megatron-core 0.19.2's GPTModel (its wheel carried in bench/gpu/wheels/);
#              the Kaiju pattern (docs/kaiju.md): a training step, and decoding with the int8 cache
#   qat        the int8 / FP8 real-GEMM paths (and Transformer Engine if installed)
#   pytest     pytest -m gpu over the test files holding GPU tests, per-test time limit
# Results in ${OUT:-bench/results}: gpu_{env,codec,attention,train,qat,pytest}.json (each rewritten after
# every finished row or test, so a step stopped by its time limit keeps what it measured), gpu_summary.md
# (every step's status and table, at most 10 KB) and gpu_log.txt (this script's whole output): 8 files.
# After each step its one summary line is printed (summary.py --step), and a step JSON left at
# "running" by a killed or crashed process is marked "killed" or "crashed".
#
#   OUT=/tmp/out PYTHONPATH=$PWD bash bench/gpu/validate.sh    # on the GPU machine (bench/gpu/RUNBOOK.md)
#   OUT=$(mktemp -d) bash bench/gpu/validate.sh --dry-run       # every step at toy sizes on the CPU
#
# Each step runs under `timeout` at its limit; a step that fails or runs out of time is reported in the
# summary and makes the script exit non-zero. Environment: PYTHON (interpreter; default python3, else
# python), OUT (results folder).
#
# --extra: the second run, for a machine with time left (at most 5 minutes: its limits add up to 270 s):
#   cp         context-parallel per-chunk kernels, CP = 4 on one GPU (gpu_context_parallel.json)
#   overhead   host reads, fused optimizer, our Trainer with and without --compile (gpu_overhead.json)
# with gpu_extra_summary.md and gpu_extra_log.txt: 4 files. --list-limits prints each step's limit and
# budget (s) on the GPU, for the selected run, and exits.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY=0
EXTRA=0
LIST=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --extra) EXTRA=1 ;;
    --list-limits) LIST=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "error: validate.sh: unknown argument $1 (expected --dry-run, --extra or --list-limits)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif command -v python3 >/dev/null 2>&1; then PY=python3
else PY=python; fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1
  # a cold Inductor cache, as on the GPU machine: a cached graph keeps the output strides that a custom
  # op's fake implementation gave when it was compiled, even after that implementation changed
  INDUCTOR_CACHE="$(mktemp -d "${TMPDIR:-/tmp}/megatron_cai_inductor.XXXXXX")"
  trap 'rm -rf "$INDUCTOR_CACHE"' EXIT
  export TORCHINDUCTOR_CACHE_DIR="$INDUCTOR_CACHE"
  OUT="${OUT:-${TMPDIR:-/tmp}/megatron_cai_gpu_dryrun}"
  STEP_ARGS=(--dry-run)
  SCALE=4  # the limits are sized for the GPU; the interpreter on a shared CPU gets 4x
else
  OUT="${OUT:-$ROOT/bench/results}"
  STEP_ARGS=()
  SCALE=1
fi

# Step limits (s), from an estimate for one H200 with cold compile caches (each Python step pays ~7 s of
# interpreter, torch and CUDA start-up); they add up to 420 s:
#   env        20  start-up + 1 GiB copies and 8k^3 bf16 matmuls (~10 s)
#   codec      36  five Triton compiles (~10 s) + byte checks at 16M elements + graph-timed ops (~15 s)
#   attention 104  our 4 kernels (~15 s), flex compiled fwd+bwd for two shapes (~50 s), timing (~10 s)
#   training  160  350M: ours (~10 s) + compiled peer (~45 s); ours alternated with megatron-core's
#                  GPTModel (~25 s); the packed-document rows (~10 s each) and the eager peer (~7 s);
#                  the Kaiju pattern's training row (~10 s) and its two decode rows (~5 s each);
#                  then 1.3B rows (~20 s each) as the budget allows (each row is skipped, not cut, when
#                  its estimate no longer fits)
#   qat        32  two 8k x 4k x 4k GEMM paths; qat.py asks for 8 s left before each (ROW_NEED_S),
#                  so its budget (17 s) holds both (tests/unit_tests/gpu/test_gpu_validate_limits.py)
#   pytest     68  collection of the 7 files with GPU tests (~10 s), ~40 GPU tests (flex ones last:
#                  ~50 s of compiles), 45 s per test at most
# Each step's own budget (--budget-s) is its limit minus 15 s, so it ends its rows itself and writes
# them; `timeout` is the backstop (its rows so far are already on disk).
LIMITS=(env:20 codec:36 attention:104 training:160 qat:32 pytest:68)
# --extra (same start-up and margins): cp 3 batches at T = 16k, each ~10 s of kernels + compiles (~45 s);
# overhead: host reads and the optimizer (~20 s), 350M ours plain / packed (~10 s each) and with
# --compile (Inductor, ~45 s each), 1.3B --compile as the budget allows
EXTRA_LIMITS=(cp:90 overhead:180)
[ "$EXTRA" = 1 ] && LIMITS=("${EXTRA_LIMITS[@]}")
limit_of() { local kv; for kv in "${LIMITS[@]}"; do [ "${kv%%:*}" = "$1" ] && echo $(( ${kv##*:} * SCALE )); done; }

# run NAME CMD...: runs under timeout at the step's limit; output to the terminal and gpu_log.txt.
run() {
  local name="$1" limit; limit=$(limit_of "$1"); shift
  local t0 rc status
  t0=$(date +%s)
  echo "=== $name (limit ${limit}s) $(date +%H:%M:%S)" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status="ok" ;;
    124|137) status="TIMEOUT"; FAILED=1 ;;
    *) status="FAILED(rc=$rc)"; FAILED=1 ;;
  esac
  local secs=$(( $(date +%s) - t0 ))
  echo "=== $name: $status in ${secs}s" | tee -a "$LOG"
  STEPS="$STEPS $name:$status:$secs:$limit"
  # a JSON left at "running" becomes killed / crashed; the step's summary line goes to the output now
  "$PY" bench/gpu/summary.py --out "$OUT" --step "$name:$status:$secs:$limit" --rc "$rc" 2>&1 | tee -a "$LOG"
}

budget() { echo $(( $(limit_of "$1") - 15 * SCALE )); }
step() { local name="$1" script="$2" file="$3"; shift 3
  run "$name" "$PY" "bench/gpu/$script" ${STEP_ARGS[@]+"${STEP_ARGS[@]}"} --budget-s "$(budget "$name")" --out "$OUT/$file" "$@"; }

if [ "$LIST" = 1 ]; then
  SCALE=1
  for kv in "${LIMITS[@]}"; do echo "${kv%%:*} $(limit_of "${kv%%:*}") $(budget "${kv%%:*}")"; done
  exit 0
fi

mkdir -p "$OUT" || { echo "error: cannot create OUT=$OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT" || exit 2
# pytest collects only the test files holding @pytest.mark.gpu tests: fast, and no import of a module
# that needs a package the machine lacks (on the CPU those tests skip)
PYTEST_TARGETS=$(grep -rlE "pytest\.mark\.gpu" tests/unit_tests --include='test_*.py' | sort)
LOG="$OUT/gpu_log.txt"
[ "$EXTRA" = 1 ] && LOG="$OUT/gpu_extra_log.txt"
: > "$LOG"
STEPS=""   # name:status:seconds:limit, for the summary
FAILED=0
T_ALL=$(date +%s)

SUMMARY_NAME=gpu_summary.md
if [ "$EXTRA" = 1 ]; then
  SUMMARY_NAME=gpu_extra_summary.md
  step cp context_parallel.py gpu_context_parallel.json
  step overhead overhead_rows.py gpu_overhead.json
else
step env env.py gpu_env.json
step codec codec.py gpu_codec.json
step attention attention.py gpu_attention.json
step training train.py gpu_train.json
step qat qat.py gpu_qat.json
if "$PY" -c "import pytest" 2>/dev/null; then
  # bench/gpu/pytest_progress.py: gpu_pytest.json after every test, per-test time limit, flex tests last
  MEGATRON_CAI_PYTEST_JSON="$OUT/gpu_pytest.json" MEGATRON_CAI_TEST_TIMEOUT_S=$(( 45 * SCALE )) \
    PYTHONPATH="$ROOT/bench/gpu:$PYTHONPATH" \
    run pytest "$PY" -m pytest -m gpu -q -p no:cacheprovider -p pytest_progress --continue-on-collection-errors \
    $PYTEST_TARGETS
else
  echo "=== pytest: SKIPPED (pytest is not importable by $PY)" | tee -a "$LOG"
  STEPS="$STEPS pytest:SKIPPED(no-pytest):0:$(limit_of pytest)"
fi
fi

TOTAL=$(( $(date +%s) - T_ALL ))
if ! "$PY" bench/gpu/summary.py --out "$OUT" --steps "$STEPS" --total-s "$TOTAL" --name "$SUMMARY_NAME" \
    $([ "$DRY" = 1 ] && echo --dry-run) \
    2>&1 | tee -a "$LOG"; then
  echo "summary.py failed; steps (name:status:seconds:limit):$STEPS" | tee -a "$LOG"
  FAILED=1
fi
exit $FAILED
