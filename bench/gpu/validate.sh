#!/usr/bin/env bash
# GPU validation of megatron-cai in at most 8 minutes on one H100/H200:
#   pytest -m gpu; Squinch codec vs copy bandwidth (byte-identical to the torch reference); attention
#   fwd+bwd vs SDPA flash and FlexAttention; 50 training steps of a ~350M GPT per attention backend
#   (tokens/s, MFU); the int8/FP8 real-GEMM QAT paths and Transformer Engine if installed.
# Writes bench/results/gpu_*.{json,md} (gpu_summary.md lists every step's status and time).
#
#   bash bench/gpu/validate.sh            # on a GPU node
#   bash bench/gpu/validate.sh --dry-run  # every step at toy sizes on the CPU (Triton interpreter)
#
# Each step runs under its own time limit (timeout) so the whole script fits 8 minutes; a step that
# fails or runs out of time is reported in the summary and makes the script exit non-zero.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python}"
DRY=0
OUT_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out-dir) OUT_DIR="$2"; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "validate.sh: unknown argument $1 (expected --dry-run, --out-dir DIR)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1
  OUT_DIR="${OUT_DIR:-${TMPDIR:-/tmp}/megatron_cai_gpu_dryrun}"
  STEP_ARGS="--dry-run"
  PYTEST_TARGETS="tests/unit_tests/squinch/test_squinch_triton.py tests/unit_tests/quantization/test_qat_linear.py"
  SCALE=4  # the limits are sized for the GPU run; the interpreter on a shared CPU gets 4x
else
  OUT_DIR="${OUT_DIR:-$ROOT/bench/results}"
  STEP_ARGS=""
  PYTEST_TARGETS="tests"
  SCALE=1
fi
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 2

SUMMARY="$OUT_DIR/gpu_summary.md"
printf '# GPU validation summary\n\n| step | status | seconds | limit s |\n|---|---|---|---|\n' > "$SUMMARY"
FAILED=0
T_ALL=$(date +%s)

# run NAME LIMIT_S CMD...: the step's own --budget-s is LIMIT - 15 s, the hard timeout is LIMIT.
run() {
  local name="$1" limit=$(( $2 * SCALE )); shift 2
  local t0 rc status
  t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  case $rc in
    0) status="ok" ;;
    124|137) status="TIMEOUT"; FAILED=1 ;;
    *) status="FAILED (rc=$rc)"; FAILED=1 ;;
  esac
  printf '| %s | %s | %s | %s |\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$limit" >> "$SUMMARY"
}

# Limits: 100 + 60 + 120 + 150 + 45 = 475 s < 8 minutes.
run "pytest -m gpu" 100 "$PY" -m pytest -m gpu -q -p no:cacheprovider $PYTEST_TARGETS
run "squinch codec" 60 "$PY" bench/gpu/codec.py $STEP_ARGS --budget-s $(( 45 * SCALE )) --out "$OUT_DIR/gpu_codec"
run "attention" 120 "$PY" bench/gpu/attention.py $STEP_ARGS --budget-s $(( 105 * SCALE )) --out "$OUT_DIR/gpu_attention"
run "training throughput" 150 "$PY" bench/gpu/train.py $STEP_ARGS --budget-s $(( 135 * SCALE )) --out "$OUT_DIR/gpu_train"
run "QAT real GEMM" 45 "$PY" bench/gpu/qat.py $STEP_ARGS --budget-s $(( 30 * SCALE )) --out "$OUT_DIR/gpu_qat"

printf '\nTotal: %s s%s.\n' "$(( $(date +%s) - T_ALL ))" "$([ "$DRY" = 1 ] && echo ' (dry run: toy sizes on the CPU)')" >> "$SUMMARY"
cat "$SUMMARY"
exit $FAILED
