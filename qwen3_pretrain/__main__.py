import sys

from qwen3_pretrain.cli import main

sys.exit(main())
