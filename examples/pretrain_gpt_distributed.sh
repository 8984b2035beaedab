#!/usr/bin/env bash
# TP x PP x DP on one CPU machine with torchrun and gloo: 8 processes as TP=2, PP=2, DP=2.
# Uses the quickstart's data when it exists (run examples/quickstart.sh once), else synthetic tokens.
#
#   bash examples/pretrain_gpt_distributed.sh [extra pretrain_gpt.py flags]
#   NPROC=4 TP=2 PP=1 bash examples/pretrain_gpt_distributed.sh --squinch
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
[ -f .venv/bin/activate ] && . .venv/bin/activate

NPROC=${NPROC:-8}
TP=${TP:-2}
PP=${PP:-2}
DATA=${DATA_DIR:-data/quickstart}
if [ -s "$DATA/demo_text_document.idx" ]; then
  DATA_ARGS=(--data-path "$DATA/demo_text_document" --tokenizer-model "$DATA/tok.model")
else
  DATA_ARGS=(--mock-data --vocab-size 4096)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  "${DATA_ARGS[@]}" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel \
  --use-distributed-optimizer --overlap-grad-reduce \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --position-embedding-type rope --squared-relu \
  --micro-batch-size 4 --global-batch-size 32 --train-iters 50 \
  --lr 1e-3 --lr-warmup-iters 5 --lr-decay-style cosine --hidden-dropout 0 --attention-dropout 0 \
  --log-interval 5 --eval-interval 25 --eval-iters 2 --num-workers 0 \
  --save checkpoints/distributed --save-interval 25 "$@"
