#!/usr/bin/env python
"""python tools/merge_checkpoint.py --input_path DIR --output_path DIR --model_name NAME (same as: qwen3-pretrain merge)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qwen3_pretrain.cli import run_command  # noqa: E402

sys.exit(run_command("qwen3_pretrain.checkpoint.merge:main", sys.argv[1:]))
