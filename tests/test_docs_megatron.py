"""docs/from-megatron.md stays true to the code: every ``key:`` it names in its tables is a TrainConfig
key, every ``key: value`` a value that key accepts, every convention key is in its conventions table with
both values, and the guide and README link to it."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from qwen3_pretrain.config.loader import coerce
from qwen3_pretrain.errors import ConfigError
from qwen3_pretrain.train.config import CONVENTION_KEYS, CONVENTIONS, TrainConfig

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "from-megatron.md"
# `key:` or `key: value` in backticks; a Megatron flag (`--...`) or a placeholder never matches
_KEY = re.compile(r"`([a-z][a-z0-9_]*):(?: ([^`]+))?`")


def _table_rows(text: str) -> list[str]:
    rows = (line.strip() for line in text.splitlines())  # a table inside a list item is indented
    return [row for row in rows if row.startswith("|") and not row.startswith("|---")]


def _named_keys(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for row in _table_rows(text) for m in _KEY.finditer(row)]


def test_every_key_in_the_tables_exists_and_takes_the_value_shown():
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    named = _named_keys(PAGE.read_text())
    assert len(named) >= 60, f"the mapping table seems to have lost its keys ({len(named)} found)"
    unknown = sorted({key for key, _ in named if key not in fields})
    assert not unknown, f"docs/from-megatron.md names keys TrainConfig does not have: {unknown}"
    for key, value in named:
        if value is not None:
            coerce(value, hints[key], key)  # raises ConfigError naming the key for a value it refuses


def test_the_key_check_can_fail():
    assert _named_keys("| `--x` | `tp:`, `no_such_key: 3` |") == [("tp", None), ("no_such_key", "3")]
    with pytest.raises(ConfigError):
        coerce("sometimes", typing.get_type_hints(TrainConfig)["lr_decay_style"], "lr_decay_style")


def test_conventions_table_lists_every_convention_key_with_both_values():
    text = PAGE.read_text()
    assert CONVENTIONS == ("default", "megatron")
    rows = {row.split("|")[1].strip(" `"): row for row in _table_rows(text)}
    for key, (default, megatron) in CONVENTION_KEYS.items():
        assert key in rows, f"docs/from-megatron.md's conventions table misses {key}"
        cells = [c.strip(" `") for c in rows[key].split("|")[2:4]]
        shown = [str(v).lower() if isinstance(v, bool) else str(v) for v in (default, megatron)]
        assert cells == shown, (key, cells, shown)


def test_linked_from_the_guide_and_the_readme():
    assert "(from-megatron.md)" in (REPO / "docs" / "README.md").read_text()
    assert "(docs/from-megatron.md)" in (REPO / "README.md").read_text()
