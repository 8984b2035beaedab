#!/usr/bin/env bash
# The main job, end to end on a CPU: build the embedded demo corpus (the Python standard library's own
# sources), train a tokenizer, preprocess to Megatron .bin/.idx, train a small GPT, stop halfway with a
# checkpoint, resume to the end, and sample text from the result.
#
#   bash examples/quickstart.sh            # ~6 minutes on a 2-core CPU
#
# Environment overrides: DATA_DIR (data/), CKPT_DIR (checkpoints/quickstart), TRAIN_ITERS (600),
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

DATA=${DATA_DIR:-data}
CKPT=${CKPT_DIR:-checkpoints/quickstart}
ITERS=${TRAIN_ITERS:-600}
HALF=$((ITERS / 2))
LOGS=$CKPT/logs
mkdir -p "$DATA"

echo "== 1/5 demo corpus"
[ -s "$DATA/demo.jsonl" ] || python tools/make_demo_corpus.py --output "$DATA/demo.jsonl"
echo "== 2/5 tokenizer"
[ -s "$DATA/tok.model" ] || python tools/train_tokenizer.py --input "$DATA/demo.jsonl" --vocab-size 4096 \
    --model-prefix "$DATA/tok"
echo "== 3/5 preprocess"
[ -s "$DATA/demo_text_document.idx" ] || python tools/preprocess_data.py --input "$DATA/demo.jsonl" \
    --output-prefix "$DATA/demo" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tok.model" \
    --append-eod --workers 2

rm -rf "$CKPT"
mkdir -p "$LOGS"
TRAIN=(
  --data-path "$DATA/demo_text_document" --split 969,30,1
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tok.model"
  --num-layers 6 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --position-embedding-type rope --squared-relu
  --micro-batch-size 8 --global-batch-size 8 --train-iters "$ITERS"
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0
  --hidden-dropout 0 --attention-dropout 0
  --log-interval 10 --eval-interval 200 --eval-iters 5 --num-workers 0
  --save "$CKPT" --save-interval 200 --tensorboard-dir "$CKPT/tensorboard"
)
echo "== 4/5 train to iteration $HALF, save and stop; then resume to $ITERS"
python pretrain_gpt.py "${TRAIN[@]}" --exit-interval "$HALF" "$@" | tee "$LOGS/part1.log"
python pretrain_gpt.py "${TRAIN[@]}" --load "$CKPT" "$@" | tee "$LOGS/part2.log"
python - "$LOGS/part1.log" "$LOGS/part2.log" <<'PY'
import re, sys
losses = [float(m.group(1)) for path in sys.argv[1:] for line in open(path)
          for m in [re.search(r"\| lm loss: ([0-9.E+-]+) \|", line)] if m]
first, last = losses[0], losses[-1]
print(f"first logged lm loss {first:.4f}, final {last:.4f}: {100 * (1 - last / first):.1f}% lower")
PY

echo "== 5/5 sample from the trained model"
python tools/generate.py --load "$CKPT" --prompt "def __init__(self" --max-new-tokens 80 --temperature 0.7 \
    --top-p 0.9 --seed 1
