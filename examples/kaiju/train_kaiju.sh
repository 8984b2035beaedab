#!/usr/bin/env bash
# A Kaiju-style model (Character.ai's recipe, docs/kaiju.md) trained on CPU from the demo corpus:
#   multi-query attention, sliding windows of 1,024 positions on 5 of every 6 layers (--window-attn-skip-freq 6),
#   K/V shared by neighbouring layers (--kv-share-pattern 2), squared ReLU, int8 quantization-aware training with
#   dynamic clamping (--qat int8 --qat-clamp rms), Squinch 6-bit gradients between the two data-parallel ranks,
#   Attention Z-Reg. Decode it with the int8 cache: tools/generate.py --load CKPT --kv-cache-dtype int8.
#
#   bash examples/kaiju/train_kaiju.sh [tiny|small|base] [extra pretrain_gpt.py flags]
#
#   size   layers  hidden  heads (KV)  seq    params (4k vocab)   50 iterations, 2 ranks on a loaded 2-core CPU:
#   tiny   6       256     4 (1)       2048   5.1 M               5.5 min, loss 8.36 -> 5.34
#   small  12      384     6 (1)       2048   19.6 M              13 min, loss 8.39 -> 5.48
#   base   12      512     8 (1)       2048   34.0 M              14.5 min, loss 8.38 -> 5.92
# All three are CPU-scale (Kaiju itself is 13B-110B); on GPUs scale them with later flags
# (e.g. --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096), NPROC and OMP_NUM_THREADS.
#
# Environment: DATA_DIR (data/quickstart: the quickstart's corpus is reused or built), CKPT_DIR
# (checkpoints/kaiju-SIZE), TRAIN_ITERS (50), NPROC (2), MOCK_DATA=1 (random tokens, no corpus: CI).
# Later flags win, so extra arguments override the size's.
set -euo pipefail
cd "$(dirname "$0")/../.."

SIZE=${1:-tiny}
[ $# -gt 0 ] && shift
case "$SIZE" in
  tiny)  MODEL=(--num-layers 6 --hidden-size 256 --num-attention-heads 4 --seq-length 2048) ;;
  small) MODEL=(--num-layers 12 --hidden-size 384 --num-attention-heads 6 --seq-length 2048) ;;
  base)  MODEL=(--num-layers 12 --hidden-size 512 --num-attention-heads 8 --seq-length 2048) ;;
  *) echo "error: size must be tiny, small or base, got '$SIZE'" >&2; exit 2 ;;
esac

DATA=${DATA_DIR:-data/quickstart}
CKPT=${CKPT_DIR:-checkpoints/kaiju-$SIZE}
ITERS=${TRAIN_ITERS:-50}
NPROC=${NPROC:-2}

if [ "${MOCK_DATA:-0}" = 1 ]; then
  DATA_FLAGS=(--mock-data --vocab-size 512)
else
  mkdir -p "$DATA"
  [ -s "$DATA/demo.jsonl" ] || python tools/make_demo_corpus.py --output "$DATA/demo.jsonl" --max-doc-kb 0.5
  [ -s "$DATA/tok.model" ] || python tools/train_tokenizer.py --input "$DATA/demo.jsonl" --vocab-size 4096 \
      --model-prefix "$DATA/tok"
  [ -s "$DATA/demo_text_document.idx" ] || python tools/preprocess_data.py --input "$DATA/demo.jsonl" \
      --output-prefix "$DATA/demo" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tok.model" \
      --append-eod --workers 2
  DATA_FLAGS=(--data-path "$DATA/demo_text_document" --split 969,30,1 --reset-attention-mask
              --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tok.model")
fi

KAIJU=(
  --group-query-attention --num-query-groups 1               # multi-query attention
  --window-size 1024 --window-attn-skip-freq 6               # 5 local layers : 1 global
  --kv-share-pattern 2                                       # neighbouring layers share K/V
  --squared-relu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
  --qat int8 --qat-clamp rms --qat-granularity row          # int8 QAT, dynamic clamping per token
  --squinch                                                  # 6-bit gradients between DP ranks
  --attention-zreg-coeff 1e-4                                # Attention Z-Reg
)
TRAIN=(
  "${DATA_FLAGS[@]}" "${MODEL[@]}" "${KAIJU[@]}"
  --hidden-dropout 0 --attention-dropout 0
  --micro-batch-size 1 --global-batch-size "$NPROC" --train-iters "$ITERS"
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0
  --log-interval 10 --eval-interval 0 --eval-iters 0 --num-workers 0 --save "$CKPT" --save-interval "$ITERS"
)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "$NPROC" = 1 ]; then
  python pretrain_gpt.py "${TRAIN[@]}" "$@"
else
  torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py "${TRAIN[@]}" "$@"
fi
