#!/usr/bin/env bash
# Quickstart: the whole pipeline on the bundled data, on a CPU, in a few minutes.
#
#   bash scripts/quickstart.sh
#
# Stages: install -> Wikipedia dump to parquet -> 16 tokenized shards -> train a
# small Qwen3 (real 151,936-token vocabulary) on 4 processes with tp 2 x pp 2,
# stopped halfway and resumed -> parse the log (CSV + PNG) -> merge the sharded
# checkpoint into a HuggingFace model -> generate from it -> what to run next.
#
# Every run starts fresh: the output directory is deleted and re-created, because
# training resumes from any checkpoint it finds there and a leftover run (of
# another length) would be continued instead of repeated. Only a directory this
# script created (it holds a .quickstart marker) or the default runs/quickstart
# is ever deleted.
#
# Environment knobs:
#   QUICKSTART_DIR=runs/quickstart   output root (relative paths: from the repository root)
#   QUICKSTART_STEPS=60              training steps (both halves together; at least 2)
#   QUICKSTART_SKIP_INSTALL=1        use the python already on PATH, install nothing
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_DIR=runs/quickstart
DIR="${QUICKSTART_DIR:-$DEFAULT_DIR}"
STEPS="${QUICKSTART_STEPS:-60}"
DATA_CONFIG=examples/quickstart/pretain_data_config.yaml
TRAIN_CONFIG=examples/quickstart/pretrain_config.yaml
PROMPT="The history of Anarchism"
STAGE=0

stage() {
    STAGE=$((STAGE + 1))
    printf '\n==== stage %d: %s ==== (%ds elapsed)\n' "$STAGE" "$*" "$SECONDS"
}

fail() {
    echo "error: $*" >&2
    exit 2
}

# Deletes only what a previous quickstart wrote (see the header).
reset_output_dir() {
    if [ -e "$DIR" ] && [ ! -f "$DIR/.quickstart" ] && [ "$DIR" != "$DEFAULT_DIR" ] \
        && [ -n "$(ls -A "$DIR" 2>/dev/null || echo file)" ]; then
        fail "QUICKSTART_DIR $DIR exists and was not written by the quickstart; choose another QUICKSTART_DIR or remove it"
    fi
    rm -rf "$DIR"
    mkdir -p "$DIR"
    touch "$DIR/.quickstart"
}

# Step of the newest training record in metrics.jsonl (0 before the first).
last_logged_step() {
    local line
    line=$(grep '"loss"' "$1" 2>/dev/null | tail -n 1 || true)
    [[ $line =~ \"step\":\ ([0-9]+) ]] && echo "${BASH_REMATCH[1]}" || echo 0
}

# One training rank started by launcher $1 (its other children include the log's tee): signalling
# one rank is enough, the ranks agree to stop together.
worker_of() {
    local kids kid
    kids=$(cat "/proc/$1/task/$1/children" 2>/dev/null || pgrep -P "$1" 2>/dev/null || true)
    for kid in $kids; do
        if tr '\0' ' ' < "/proc/$kid/cmdline" 2>/dev/null | grep -q "qwen3_pretrain train"; then
            echo "$kid"
            return
        fi
    done
}

# First half: SIGTERM once step (half - 1) is logged, so the step in flight is the last; the
# trainer finishes it, saves a checkpoint and exits 0.
train_first_half() {
    local half=$1 metrics="$DIR/w_pretrain/metrics.jsonl" pid worker
    # A simple command, so $! is the launcher itself (env execs python), not a subshell.
    "${TRAIN[@]}" > >(tee -a "$DIR/train.log") 2>&1 &
    pid=$!
    # A background job ignores Ctrl-C: stop the launcher (it passes SIGTERM on) if this script exits first.
    trap 'kill -TERM "$pid" 2>/dev/null || true' EXIT
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$(last_logged_step "$metrics")" -ge $((half > 1 ? half - 1 : 1)) ]; then
            worker=$(worker_of "$pid")
            if [ -n "$worker" ]; then
                echo ">>> quickstart: sending SIGTERM to training rank pid $worker: stop after about step $half"
                kill -TERM "$worker" 2>/dev/null || true
            else
                echo ">>> quickstart: warning: found no training rank to signal; training runs to the end" >&2
            fi
            break
        fi
        sleep 0.5
    done
    wait "$pid"
    trap - EXIT
}

[[ $STEPS =~ ^[0-9]+$ ]] && [ "$STEPS" -ge 2 ] || fail "QUICKSTART_STEPS=$STEPS: give a whole number >= 2"
HALF=$((STEPS / 2))

stage "install"
if [ "${QUICKSTART_SKIP_INSTALL:-}" = 1 ]; then
    echo "skipped (QUICKSTART_SKIP_INSTALL=1): using $(command -v python)"
else
    source scripts/_venv.sh
    install_project
    echo "python: $(command -v python)"
fi
reset_output_dir
# The same command for both halves: total_steps (and so the LR schedule) must not change on resume.
TRAIN=(env OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 4 -m qwen3_pretrain train
       --config "$TRAIN_CONFIG" output_path="$DIR/w_pretrain" data_path="$DIR/data/d_convert" total_steps="$STEPS")

stage "Wikipedia dump -> parquet"
DUMPS=(assets/enwiki-sample/*.bz2)
python -m qwen3_pretrain wiki2parquet --input "${DUMPS[0]}" --output "$DIR/data/wiki.parquet"

stage "parquet -> 16 tokenized shards (bundled Qwen3 tokenizer)"
python -m qwen3_pretrain convert --config "$DATA_CONFIG" \
    input_path="$DIR/data/wiki.parquet" output_path="$DIR/data/d_convert"

stage "train a small Qwen3 on 4 processes (tp 2 x pp 2), steps 1..~$HALF, then stop"
train_first_half "$HALF"
echo ">>> quickstart: stopped; checkpoints: $(cd "$DIR/w_pretrain" && echo step_*), latest -> $(cat "$DIR/w_pretrain/latest")"

stage "resume the same command from the checkpoint, up to step $STEPS"
"${TRAIN[@]}" 2>&1 | tee -a "$DIR/train.log"
grep -m 1 "resumed from" "$DIR/train.log" | sed -E 's/^.* INFO /\n>>> quickstart: the second run /' \
    || fail "the second run did not report resuming (see $DIR/train.log)"

stage "parse the training log -> CSV + PNG"
python -m qwen3_pretrain parse-log --log_path "$DIR/train.log" \
    --output_path "$DIR/train_metrics.csv" --plot "$DIR/train_metrics.png"
python - "$DIR/train_metrics.csv" <<'PY'
import csv, sys
with open(sys.argv[1], newline="") as f:
    rows = [(int(float(r["step"])), float(r["loss"])) for r in csv.DictReader(f)]
tail = [loss for _, loss in rows[-5:]]
print(f">>> quickstart: loss {rows[0][1]:.2f} at step {rows[0][0]} -> {rows[-1][1]:.2f} at step {rows[-1][0]} "
      f"(mean of the last {len(tail)} steps: {sum(tail) / len(tail):.2f})")
PY

stage "merge the sharded checkpoint -> HuggingFace model"
python -m qwen3_pretrain merge --input_path "$DIR/w_pretrain" --output_path "$DIR/w_pretrain_merged" \
    --model_name qwen3-0.6b

stage "load the merged model and continue a prompt"
# A few minutes of CPU training teach the model which words are frequent, not grammar: expect a
# jumble of common words (greedy decoding would repeat the most frequent one).
python -m qwen3_pretrain generate --model "$DIR/w_pretrain_merged" --prompt "$PROMPT" \
    --max_new_tokens 24 --top_k 50 --temperature 0.8 --seed 0

stage "where everything is, and what to run on a cluster"
# The commands below run as printed from a fresh shell in this folder: through the environment's own
# command (no activation needed); after 'source $BIN/activate', plain 'qwen3-pretrain' works too.
BIN=$(dirname "$(command -v python)")
[[ $BIN == "$PWD"/* ]] && BIN=${BIN#"$PWD"/}
CLI="$BIN/qwen3-pretrain"
cat <<EOF
artefacts:
  $DIR/data/wiki.parquet            the bundled dump as parquet
  $DIR/data/d_convert/              shard_000{00..15}.bin/.idx + manifest.json
  $DIR/w_pretrain/                  checkpoints (step_*/, latest), metrics.jsonl, config.yaml
  $DIR/train.log                    the training output of both halves
  $DIR/train_metrics.csv / .png     parsed metrics and loss curve
  $DIR/w_pretrain_merged/           HuggingFace model (config.json, model.safetensors, tokenizer)

the command line (from this folder, in any shell; or 'source $BIN/activate' and then just 'qwen3-pretrain'):
  $CLI --help
  $CLI generate --model $DIR/w_pretrain_merged --prompt "$PROMPT"
  $CLI plan --model qwen3-8b --nodes 2 --devices-per-node 4 --device 910b

on a cluster (see examples/):
  1. convert the full dump: $CLI wiki2parquet --input enwiki-latest-pages-articles.xml.bz2 \\
         --output /mnt/dist_data/data/pretain/d_ori/wiki.parquet
     $CLI convert --config examples/pretain_data_config.yaml \\
         input_path=/mnt/dist_data/data/pretain/d_ori/wiki.parquet output_path=/mnt/dist_data/data/pretain/d_convert
  2. train: edit examples/pretrain_config.yaml and examples/hostfile, then from that folder:
         nohup ./pretrain_qwen3.sh > pretrain.log 2>&1 &   (mpirun -np 8 over the hostfile; PATH must find $BIN's python)
  3. merge: $CLI merge --input_path /mnt/dist_data/Qwen3-8B/w_pretrain \\
         --output_path /mnt/dist_data/Qwen3-8B/w_pretrain_merged --model_name qwen3-8b
EOF
printf '\n==== quickstart done in %ds: outputs in %s ====\n' "$SECONDS" "$DIR"
