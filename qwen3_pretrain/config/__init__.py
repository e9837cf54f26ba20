"""Typed config dataclasses and strict YAML loading."""

from qwen3_pretrain.config.loader import (
    field_help,
    from_dict,
    load_config,
    nearest,
    parse_overrides,
    save_config,
    to_dict,
)

__all__ = ["field_help", "from_dict", "load_config", "nearest", "parse_overrides", "save_config", "to_dict"]
