#!/usr/bin/env bash
# Train a GPT on your own corpus, offline: a tokenizer, the indexed dataset, a run that
# saves and stops, and a second run that resumes it. CI runs this script on a small corpus
# (tests/test_own_corpus.py); README.md's "Your own corpus" shows the same commands.
#
#   bash examples/own_corpus.sh CORPUS WORK [pretrain_gpt.py flags...]
#
# CORPUS: .jsonl (one {"text": ...} object a line) or plain text (one document a line).
# WORK:   a directory for the tokenizer, the dataset (and its index cache), the checkpoints
#         and the offload files.
# The flags after WORK go to both training runs, after the script's own (so they win):
# the model's shape, the batch, --lr, ...
#
# The tokenizer, from the environment; nothing is downloaded:
#   VOCAB_FILE + MERGE_FILE  an existing GPT-2 vocab.json and merges.txt (GPT2BPETokenizer);
#   TOKENIZER_JSON           an existing Hugging Face tokenizer.json (HuggingFaceTokenizer;
#                            EOS_TOKEN, default <|endoftext|>, names its end-of-document token);
#   neither                  a byte-level BPE of VOCAB_SIZE (default 8192) tokens is trained
#                            on CORPUS into WORK/tokenizer/ (GPT2BPETokenizer).
# TRAIN_ITERS (default 20): the run's length. STOP_AT (default half of it): the first run
# saves and exits there (--exit-interval; a job killed by its scheduler does the same with
# --exit-signal-handler), the second loads it and trains on to TRAIN_ITERS.
# SPLIT (default 90,10,0): the train, validation and test weights over the documents. Every
# part with a weight must get at least one document (each part's bounds are its cumulative
# share x the documents, rounded), so Megatron's default 969,30,1 needs over 500 documents;
# a part that should stay empty gets weight 0.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: bash examples/own_corpus.sh CORPUS WORK [pretrain_gpt.py flags...]" >&2
    exit 2
fi
CORPUS=$1 WORK=$2
shift 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
TRAIN_ITERS=${TRAIN_ITERS:-20}
STOP_AT=${STOP_AT:-$((TRAIN_ITERS / 2))}
SPLIT=${SPLIT:-90,10,0}
mkdir -p "$WORK/tokenizer" "$WORK/data" "$WORK/ckpt" "$WORK/offload"

# 1. The tokenizer.
if [ -n "${VOCAB_FILE:-}" ]; then
    TOK=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE"
         --merge-file "${MERGE_FILE:?VOCAB_FILE needs MERGE_FILE}")
elif [ -n "${TOKENIZER_JSON:-}" ]; then
    "$PY" -c '
import sys
from transformers import PreTrainedTokenizerFast
PreTrainedTokenizerFast(tokenizer_file=sys.argv[1], eos_token=sys.argv[2]).save_pretrained(sys.argv[3])
' "$TOKENIZER_JSON" "${EOS_TOKEN:-<|endoftext|>}" "$WORK/tokenizer"
    TOK=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORK/tokenizer")
else
    "$PY" -c '
import json, sys
from tokenizers import ByteLevelBPETokenizer
corpus, vocab_size, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def texts():
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"] if corpus.endswith((".json", ".jsonl")) else line
bpe = ByteLevelBPETokenizer()
bpe.train_from_iterator(texts(), vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                        show_progress=False)
bpe.save_model(out)
' "$CORPUS" "${VOCAB_SIZE:-8192}" "$WORK/tokenizer"
    TOK=(--tokenizer-type GPT2BPETokenizer --vocab-file "$WORK/tokenizer/vocab.json"
         --merge-file "$WORK/tokenizer/merges.txt")
fi

# 2. The indexed dataset: $WORK/data/corpus_text_document.bin and .idx.
"$PY" "$ROOT/tools/preprocess_data.py" --input "$CORPUS" --output-prefix "$WORK/data/corpus" \
    --append-eod --workers 2 "${TOK[@]}"

# 3. Train, save and stop at STOP_AT; 4. the same command again resumes from the checkpoint.
# A --load directory without a checkpoint yet starts from scratch, so both runs are the same.
TRAIN=("$PY" "$ROOT/examples/pretrain_gpt.py" --snake-offload --snake-offload-dir "$WORK/offload"
       "${TOK[@]}" --data-path "$WORK/data/corpus_text_document" --split "$SPLIT"
       --data-cache-path "$WORK/data/cache"
       --train-iters "$TRAIN_ITERS" --save "$WORK/ckpt" --load "$WORK/ckpt" "$@")
"${TRAIN[@]}" --exit-interval "$STOP_AT"
"${TRAIN[@]}"
