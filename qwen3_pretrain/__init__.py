"""Pre-training of Qwen3 language models on torch.distributed.

The model API is importable from the top level (``from qwen3_pretrain import
load_hf_model``) but is imported on first use only, so commands that do not
need torch (data conversion, planning, log parsing) start without loading it
(``tests/test_torch_free.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"  # keep in step with pyproject.toml

_LAZY = {
    "load_hf_model": "qwen3_pretrain.models.qwen3.hf_io",
    "save_hf_model": "qwen3_pretrain.models.qwen3.hf_io",
    "Qwen3Config": "qwen3_pretrain.models.qwen3.config",
    "get_preset": "qwen3_pretrain.models.qwen3.config",
    "Qwen3Model": "qwen3_pretrain.models.qwen3.model",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'qwen3_pretrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
