#!/usr/bin/env bash
# GPU training throughput and MFU of the engine: Qwen3-1.7B (whole) and Qwen3-8B (8 of its 36 layers on
# one GPU; the whole model with FSDP when 4 or more GPUs are present), bf16, seq 4096/8192, synthetic data.
#
#   bash bench/train_gpu.sh                 # all cases, ~5-8 min on one H100/H200
#   bash bench/train_gpu.sh --dry-run       # write the configs, print the commands, run nothing
#   bash bench/train_gpu.sh --only 1.7b --steps 20 --out runs/bench_gpu
#
# Each case runs under torchrun (one process per GPU) through bench/train_gpu.py: warm-up steps, then
# timed steps, each appending a record to <out>/<case>/metrics.jsonl (no checkpoint is written). The
# table shows medians over the timed steps; the target is >= 45% MFU. A case that fails (e.g. out of
# memory) prints the end of its log and the others still run.
set -euo pipefail

DRY_RUN=0 STEPS=10 WARMUP=3 ONLY="" OUT="" CASE_TIMEOUT=180
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --steps) STEPS="$2"; shift ;;
    --warmup) WARMUP="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    --case-timeout) CASE_TIMEOUT="$2"; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${OUT:-$(mktemp -d -t train_gpu.XXXXXX)}"
DATA="$OUT/data"
# Counted by torch, which honours CUDA_VISIBLE_DEVICES (ASCEND_RT_VISIBLE_DEVICES on an NPU) and sees a MIG
# slice as one device; `nvidia-smi -L` lists every GPU of the node and a line more per MIG slice.
read -r NGPU GPU_NAME < <("$PY" bench/train_gpu.py devices 2>/dev/null || echo "0 none")
if [[ $NGPU -eq 0 && $DRY_RUN -eq 0 ]]; then
  echo "error: torch sees no GPU or NPU (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); use --dry-run to see" \
       "the commands" >&2
  exit 2
fi
mkdir -p "$OUT"
echo "output: $OUT | devices: $NGPU ($GPU_NAME) | steps: $WARMUP warm-up + $STEPS timed per case"

# case name, processes, preset, seq, batch per rank, activation checkpointing, model_overrides (YAML flow),
# compile (true/false, default false)
run_case() {
  local name=$1 nproc=$2 model=$3 seq=$4 batch=$5 ac=$6 overrides=$7 compile=${8:-false}
  [[ -n "$ONLY" && "$name" != *"$ONLY"* ]] && return 0
  local dir="$OUT/$name"
  mkdir -p "$dir"
  cat > "$dir/config.yaml" <<EOF
model_name: $model
model_overrides: $overrides
data_path: $DATA
output_path: $dir
seq_length: $seq
batch_size: $batch
mixed_precision: bf16
activation_checkpointing: $ac
compile: $compile
learning_rate: 1.0e-4
warmup_steps: 100
total_steps: 100000
log_steps: 1
save_steps: 0
EOF
  local cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc"
             bench/train_gpu.py run --config "$dir/config.yaml" --steps "$STEPS" --warmup "$WARMUP")
  echo "== $name: ${cmd[*]}"
  [[ $DRY_RUN -eq 1 ]] && return 0
  local start=$SECONDS
  if ! timeout "$CASE_TIMEOUT" "${cmd[@]}" > "$dir/log.txt" 2>&1; then
    echo "   failed or timed out after $(( SECONDS - start )) s; end of $dir/log.txt:"
    tail -n 5 "$dir/log.txt" | sed 's/^/   /'
  else
    echo "   done in $(( SECONDS - start )) s"
  fi
}

if [[ $DRY_RUN -eq 0 ]]; then
  "$PY" bench/train_gpu.py data --out "$DATA"
fi

EIGHT_LAYERS="{num_hidden_layers: 8}"
run_case 1.7b-seq4096-b4-ac_none     1 qwen3-1.7b 4096 4 none "{}"
run_case 1.7b-seq4096-b4-ac_full     1 qwen3-1.7b 4096 4 full "{}"
run_case 1.7b-seq8192-b2-ac_full     1 qwen3-1.7b 8192 2 full "{}"
run_case 1.7b-seq8192-b2-ac_selective 1 qwen3-1.7b 8192 2 selective "{}"
run_case 1.7b-seq4096-b4-ac_none-compile 1 qwen3-1.7b 4096 4 none "{}" true
run_case 8b_8layers-seq8192-b1-ac_full 1 qwen3-8b 8192 1 full "$EIGHT_LAYERS"
run_case 8b_8layers-seq4096-b2-ac_full 1 qwen3-8b 4096 2 full "$EIGHT_LAYERS"
if [[ $NGPU -ge 4 ]]; then
  run_case "8b-seq8192-b1-ac_full-fsdp$NGPU" "$NGPU" qwen3-8b 8192 1 full "{}"
fi

if [[ $DRY_RUN -eq 0 ]]; then
  "$PY" bench/train_gpu.py table --runs "$OUT"
fi
