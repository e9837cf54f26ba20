"""Training log or metrics.jsonl -> CSV, summary and plot (the reference workflow's monitoring step).

    python tools/parse_train_log.py --log_path pretrain.log --output_path train_metrics.csv [--plot metrics.png]

Same as ``qwen3-pretrain parse-log``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from qwen3_pretrain.cli import run_command  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_command("qwen3_pretrain.analysis.parse_log:main", sys.argv[1:]))
