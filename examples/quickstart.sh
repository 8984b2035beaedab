#!/usr/bin/env bash
# The main job, end to end on a CPU, from a fresh clone (no GPU, no download beyond the Python packages):
#   1. a corpus of the Python standard library's own sources, cut into short documents (~0.5 KB);
#   2. a sentencepiece tokenizer, and Megatron's .bin/.idx;
#   3. two data-parallel ranks (torchrun, gloo) train a small GPT with Squinch 6-bit gradients and the
#      distributed optimizer, on rows of packed documents that cannot see each other
#      (--reset-attention-mask); they stop halfway with a checkpoint, and a second launch resumes it;
#   4. a summary: the loss reduction, the gradient bytes sent against what bf16 would have sent, a sample.
#
#   bash examples/quickstart.sh            # the README gives its time on 2 idle cores, installs included
#
# Environment overrides: DATA_DIR (data/quickstart), CKPT_DIR (checkpoints/quickstart), TRAIN_ITERS (500),
# PYTHON (python3). Extra arguments are passed to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
python -c "import megatron_cai, sentencepiece, tqdm" 2>/dev/null || pip install -q -e .

DATA=${DATA_DIR:-data/quickstart}
CKPT=${CKPT_DIR:-checkpoints/quickstart}
ITERS=${TRAIN_ITERS:-500}
HALF=$((ITERS / 2))
LOGS=$CKPT/logs
mkdir -p "$DATA"

echo "== 1/5 demo corpus: the standard library's sources, cut into ~0.5 KB documents"
[ -s "$DATA/demo.jsonl" ] || python tools/make_demo_corpus.py --output "$DATA/demo.jsonl" --max-doc-kb 0.5
echo "== 2/5 tokenizer"
[ -s "$DATA/tok.model" ] || python tools/train_tokenizer.py --input "$DATA/demo.jsonl" --vocab-size 4096 \
    --model-prefix "$DATA/tok"
echo "== 3/5 preprocess to Megatron .bin/.idx"
[ -s "$DATA/demo_text_document.idx" ] || python tools/preprocess_data.py --input "$DATA/demo.jsonl" \
    --output-prefix "$DATA/demo" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tok.model" \
    --append-eod --workers 2

rm -rf "$CKPT"
mkdir -p "$LOGS"
TRAIN=(
  --data-path "$DATA/demo_text_document" --split 969,30,1 --reset-attention-mask
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tok.model"
  --num-layers 6 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --position-embedding-type rope
  --squared-relu --hidden-dropout 0 --attention-dropout 0
  --micro-batch-size 4 --global-batch-size 8 --train-iters "$ITERS"
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0
  --squinch --use-distributed-optimizer
  --log-interval 10 --eval-interval 200 --eval-iters 5 --num-workers 0
  --save "$CKPT" --save-interval 200 --tensorboard-dir "$CKPT/tensorboard"
)
LAUNCH=(torchrun --standalone --nproc-per-node 2)
export OMP_NUM_THREADS=1  # one thread per rank: the two ranks share the two cores
echo "== 4/5 two ranks train to iteration $HALF, save and stop; a second launch resumes to $ITERS"
"${LAUNCH[@]}" pretrain_gpt.py "${TRAIN[@]}" --exit-interval "$HALF" "$@" | tee "$LOGS/part1.log"
"${LAUNCH[@]}" pretrain_gpt.py "${TRAIN[@]}" --load "$CKPT" "$@" | tee "$LOGS/part2.log"

echo "== 5/5 sample from the trained model"
python tools/generate.py --load "$CKPT" --prompt "def __init__(self" --max-new-tokens 80 --temperature 0.7 \
    --top-p 0.9 --seed 1 > "$LOGS/sample.log"   # shown in the summary

python examples/quickstart_summary.py --data "$DATA/demo_text_document" --seq-length 256 --data-parallel 2 \
    --logs "$LOGS/part1.log" "$LOGS/part2.log" --sample "$LOGS/sample.log" --seconds "$SECONDS"
