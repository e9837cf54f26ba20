#!/usr/bin/env python
"""python tools/train.py --config pretrain_config.yaml [key=value ...] (same as: qwen3-pretrain train)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qwen3_pretrain.cli import run_command  # noqa: E402

sys.exit(run_command("qwen3_pretrain.train.trainer:main", sys.argv[1:]))
