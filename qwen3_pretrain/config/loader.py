"""Strict loading of YAML config files into typed dataclasses.

Every config file of the project (data conversion, training, planning) is a
dataclass whose fields carry their help text in ``metadata["help"]``. Loading
is strict: an unknown key is an error that suggests the nearest valid key, and
values are coerced to the field's type with a message naming the key when they
cannot be. PyYAML reads ``1e-5`` as a string (YAML 1.1 wants a dot), so numeric
strings are accepted for numeric fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, TypeVar

import yaml

from qwen3_pretrain.errors import ConfigError, MissingFileError, UserError
from qwen3_pretrain.fsutil import write_text_atomic

T = TypeVar("T")

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def field_help(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:
    """A dataclass field with help text (used for error messages and the generated docs)."""
    meta = {"help": help}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name``, or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def lookup(table: Mapping[str, T], name: str, what: str, alternative: str = "") -> T:
    """``table[name]``, the name case-insensitive; an unknown name is the user's error, naming ``what`` it
    should be, the nearest known name and the known ones (then ``alternative``, e.g. "; or give ...")."""
    key = name.strip().lower()
    if key not in table:
        hint = nearest(key, table)
        raise UserError(f"unknown {what} {name!r}" + (f"; did you mean {hint!r}?" if hint else "")
                        + f" (known: {', '.join(table)}{alternative})")
    return table[key]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def type_kind(tp: Any) -> tuple[str, tuple[Any, ...]]:
    """The grammar of config field types, in one place for the loader (``coerce``) and the generated
    reference (``config/docs.py``): ("union", members), ("literal", choices), ("mapping", ()),
    ("list", (item type, list or tuple)), or ("scalar", (tp,)) for bool, int, float, str, Path, Any."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return "union", typing.get_args(tp)
    if origin is Literal:
        return "literal", typing.get_args(tp)
    if origin is dict or tp is dict:
        return "mapping", ()
    if origin in (list, tuple):
        return "list", ((typing.get_args(tp) or (Any,))[0], origin)
    return "scalar", (tp,)


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` to type ``tp`` or raise ConfigError naming ``key``."""
    kind, args = type_kind(tp)
    if kind == "union":
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: {value!r} is not allowed")
    if kind == "literal":
        choices = args
        normalized = value.lower() if isinstance(value, str) else value
        for choice in choices:
            if normalized == choice or (isinstance(choice, str) and normalized == choice.lower()):
                return choice
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
    if kind == "mapping":
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of key: value, got {value!r}")
        return dict(value)
    if kind == "list":
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp, container = args
        return container(coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    return _coerce_scalar(value, tp, key)


def _coerce_scalar(value: Any, tp: Any, key: str) -> Any:
    """``coerce`` for the scalar kinds: bool (true/false, yes/no, on/off, 0/1), int (a float or string with an
    integer value too), float, str (not a mapping or list), Path (``~`` expanded), Any (as is)."""
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            number = float(value) if not isinstance(value, int) else value
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if float(number).is_integer():
            return int(number)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if tp is Path:
        return Path(os.path.expanduser(str(value)))
    raise ConfigError(f"{key}: cannot read a value of type {_type_name(tp)}")


def from_dict(cls: type[T], data: dict[str, Any], source: str = "config",
              key_sources: dict[str, str] | None = None) -> T:
    """Build dataclass ``cls`` from ``data`` strictly: unknown keys and bad values are errors, blamed on
    where the key came from (``key_sources[key]``, else ``source``)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of key: value, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = (key_sources or {}).get(key, source)
        if key not in fields:
            hint = nearest(str(key), fields)
            suggestion = f"; did you mean {hint!r}?" if hint else f"; valid keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"{where}: unknown key {key!r}{suggestion}")
        kwargs[key] = coerce(value, hints[key], f"{where}: {key}")
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]  # type: ignore[misc]
    if missing:
        raise ConfigError(f"{source}: missing required key(s): {', '.join(missing)}")
    return cls(**kwargs)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["lr=1e-4", "tp=2"]`` -> ``{"lr": "1e-4" coerced later, "tp": 2}``."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-").replace("-", "_")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            out[key] = raw
    return out


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"config file {str(path)!r} does not exist{_near_config_file(path)}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value at the top level")
    return data


def _near_config_file(path: Path) -> str:
    """"; did you mean ..." for a YAML file of a near name beside ``path`` or in ``examples/`` (the reference
    workflow spells its data config pretain_data_config.yaml)."""
    for folder in (path.parent, Path("examples")):
        if folder.is_dir():
            names = {p.name: p for p in folder.glob("*.y*ml")}
            hint = nearest(path.name, names)
            if hint:
                return f"; did you mean {str(names[hint])!r}?"
    return ""


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: Iterable[str] = ()) -> T:
    """Read YAML ``path`` (optional), apply ``key=value`` overrides, build ``cls`` strictly."""
    data = read_yaml(path) if path else {}
    given = parse_overrides(overrides)
    data.update(given)
    return from_dict(cls, data, source=str(path) if path else "config",
                     key_sources={key: f"command line ({key}=...)" for key in given})


def to_dict(cfg: Any) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically: temp file + rename)."""
    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
