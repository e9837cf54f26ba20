#!/usr/bin/env python
"""parquet -> tokenized, sharded Megatron indexed dataset.

Usage: python tools/data_convert.py --config pretain_data_config.yaml [key=value ...]
(the same as ``qwen3-pretrain convert``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from qwen3_pretrain.cli import run_command  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_command("qwen3_pretrain.convert.run:main", sys.argv[1:]))
