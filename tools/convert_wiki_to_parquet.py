#!/usr/bin/env python
"""Wikipedia dump (.xml/.xml.bz2) or wikiextractor output -> parquet.

Usage: python tools/convert_wiki_to_parquet.py --input PATH --output FILE.parquet
(the same as ``qwen3-pretrain wiki2parquet``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from qwen3_pretrain.cli import run_command  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_command("qwen3_pretrain.convert.wiki:main", sys.argv[1:]))
