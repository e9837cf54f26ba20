#!/usr/bin/env bash
# One call that spends a device slot well: environment facts, the device tests, the whole CLI path on
# the device (convert -> train through fit() with a SIGTERM and a SIGKILL, each resumed, losses equal to
# an uninterrupted run's -> merge -> parse-log), then throughput and MFU of Qwen3-1.7B and 0.6B while the
# budget lasts. Each stage's result goes to OUTDIR/summary.json as soon as it ends.
#
#   bash bench/device_check.sh OUTDIR                  # one GPU or NPU, at most 480 s (--budget)
#   bash bench/device_check.sh --cpu OUTDIR            # the same stages on a CPU with tiny sizes (~2 min)
#   bash bench/device_check.sh --only tests,train_resume OUTDIR
#
# Python: $PYTHON if set, else the repository's .venv, else `python` on PATH. See docs/device_check.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
else
    PY=python
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" "$ROOT/bench/device_check.py" "$@"
