"""What the training config's ``data_path`` names: one converted dataset, or several with weights.

Three spellings, all read into the same tuple of ``DataSource`` (path, weight
normalized so the weights sum to 1):

- one directory, as before: ``data_path: /data/wiki``;
- a YAML list: ``data_path: [{path: /data/wiki, weight: 0.7}, {path: /data/books, weight: 0.3}]``;
- Megatron's flat string of ``weight path`` pairs: ``data_path: "0.7 /data/wiki 0.3 /data/books"``.

A string is read as the flat form when its first word is a number; otherwise
it is one path (so a directory whose name holds a space, or a number after one,
``/data/wiki 2024``, still works). Only numpy-free parsing lives here: the training config checks
``data_path`` when it is loaded, before anything heavy is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from qwen3_pretrain.errors import ConfigError

# The blend repeats its assignment of samples to sources every PERIOD samples (data/blend.py); a source
# needs at least one sample per period, so its share of the weights must be at least 1 / PERIOD.
PERIOD = 1 << 20
_FORMS = ("write one directory, a list of {path: DIR, weight: W} mappings, or the flat form "
          "\"0.7 /data/wiki 0.3 /data/books\"")


@dataclass(frozen=True)
class DataSource:
    """One converted dataset of a blend and its share of the samples."""

    path: str
    weight: float  # normalized: the weights of one data_path sum to 1


def parse_data_path(value: Any, key: str = "data_path") -> tuple[DataSource, ...]:
    """The datasets ``value`` names, in the order given, with normalized weights; ConfigError naming
    ``key`` and the offending value otherwise."""
    if isinstance(value, (list, tuple)):
        pairs = [_list_item(item, f"{key}[{i}]") for i, item in enumerate(value)]
    elif isinstance(value, str):
        pairs = _flat_pairs(value, key)
    else:
        raise ConfigError(f"{key}: {value!r} is not a path; {_FORMS}")
    if not pairs:
        raise ConfigError(f"{key} is empty; {_FORMS}")
    return _normalized(pairs, key)


def _flat_pairs(value: str, key: str) -> list[tuple[str, float]]:
    words = value.split()
    if not words:
        raise ConfigError(f"{key} is empty; {_FORMS}")
    if not _is_number(words[0]):
        return [(value.strip(), 1.0)]
    if len(words) % 2:
        raise ConfigError(f"{key} {value!r}: the flat form is pairs of 'weight path', but it has {len(words)} "
                          "words (an odd count); give every path its weight, e.g. \"0.7 /data/wiki 0.3 /data/books\"")
    pairs = []
    for weight, path in zip(words[0::2], words[1::2]):
        if not _is_number(weight):
            raise ConfigError(f"{key} {value!r}: {weight!r} stands where a weight belongs; the flat form is pairs "
                              "of 'weight path', the weight first")
        pairs.append((path, _weight(weight, f"{key} {value!r}: the weight of {path}")))
    return pairs


def _list_item(item: Any, where: str) -> tuple[str, float]:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: {item!r} is not a mapping; write each dataset as {{path: DIR, weight: W}}")
    unknown = sorted(set(item) - {"path", "weight"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} in {item!r}; a dataset "
                          "has only 'path' and 'weight'")
    for name in ("path", "weight"):
        if item.get(name) in (None, ""):
            raise ConfigError(f"{where}: {item!r} has no {name!r}; write each dataset as {{path: DIR, weight: W}}")
    if not isinstance(item["path"], str):
        raise ConfigError(f"{where}: path {item['path']!r} is not a string")
    return item["path"], _weight(item["weight"], f"{where}: the weight of {item['path']}")


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _weight(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where} is {value!r}, not a number")
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} is {value!r}, not a number") from None
    if not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"{where} is {value!r}; weights must be positive numbers (drop a dataset to leave "
                          "it out)")
    return weight


def _normalized(pairs: list[tuple[str, float]], key: str) -> tuple[DataSource, ...]:
    paths = [path for path, _ in pairs]
    repeated = sorted({p for p in paths if paths.count(p) > 1})
    if repeated:
        raise ConfigError(f"{key}: {', '.join(repeated)} listed more than once; give each dataset once, with "
                          "the sum of its weights")
    total = math.fsum(weight for _, weight in pairs)
    sources = tuple(DataSource(path, weight / total) for path, weight in pairs)
    smallest = min(sources, key=lambda s: s.weight)
    if len(sources) > 1 and smallest.weight * PERIOD < 1:
        raise ConfigError(f"{key}: {smallest.path} gets {smallest.weight:.3g} of the samples, less than the "
                          f"smallest share 1/{PERIOD}; raise its weight or leave it out")
    return sources
