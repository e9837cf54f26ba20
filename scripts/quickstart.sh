#!/usr/bin/env bash
# Quickstart: the whole pipeline on toy sizes, one stage after the other, on a CPU.
# Each stage prints a header; outputs go under runs/quickstart/.
#
#   bash scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
install_project

OUT="${OUT:-runs/quickstart}"
STAGE=0
stage() {
    STAGE=$((STAGE + 1))
    printf '\n==== stage %d: %s ====\n' "$STAGE" "$*"
}

stage "model: tiny random Qwen3 -> HuggingFace format -> reload -> logits checksum"
python -m qwen3_pretrain demo --output "$OUT/tiny-qwen3"

printf '\n==== quickstart done: outputs in %s ====\n' "$OUT"
