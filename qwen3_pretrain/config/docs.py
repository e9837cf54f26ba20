"""The configuration reference (``docs/configuration.md``), generated from the config dataclasses.

    python -m qwen3_pretrain.config.docs docs/configuration.md          # write it
    python -m qwen3_pretrain.config.docs --check docs/configuration.md  # exit 1 if it is stale

Each key's type, default and description come from the dataclass field
(``field_help(default, help=...)``), so the reference cannot drift from what
the loader accepts; a test runs ``--check``. A field without help text is an
error here rather than an empty cell, so it is caught when it is added.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from qwen3_pretrain.config.loader import type_kind
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.fsutil import write_text_atomic

DEFAULT_PATH = "docs/configuration.md"
REGENERATE = "python -m qwen3_pretrain.config.docs docs/configuration.md"


@dataclass(frozen=True)
class ConfigDoc:
    """One config file of the workflow: the dataclass that reads it and the words around its table."""

    target: str  # "module:ClassName"
    file_name: str  # the file name the reference workflow uses
    title: str
    intro: str


CONFIG_DOCS: tuple[ConfigDoc, ...] = (
    ConfigDoc(
        "qwen3_pretrain.convert.config:DataConvertConfig", "pretain_data_config.yaml", "Data conversion",
        "Read by `qwen3-pretrain convert --config FILE` (same as `python tools/data_convert.py --config FILE`). "
        "Example: [examples/pretain_data_config.yaml](../examples/pretain_data_config.yaml). "
        "Guide: [data.md](data.md)."),
    ConfigDoc(
        "qwen3_pretrain.train.config:TrainConfig", "pretrain_config.yaml", "Training",
        "Read by `qwen3-pretrain train --config FILE` (same as `python tools/train.py --config FILE`). "
        "The first keys are those of the reference workflow's file, the rest are extras with defaults. "
        "Example: [examples/pretrain_config.yaml](../examples/pretrain_config.yaml). "
        "Guide: [training.md](training.md)."),
)

_HEADER = f"""# Configuration reference

<!-- Generated from the config dataclasses by `{REGENERATE}`; do not edit by hand. -->

What each key of the YAML config files means, its type and its default. Loading is strict: an unknown key
is an error that names the nearest valid key, and a value that does not fit the type is an error naming
the key. Any key can also be given after the file as `key=value` on the command line (it wins over the
file), e.g. `python tools/train.py --config pretrain_config.yaml tp=2 total_steps=10`.

"Empty" means YAML null: write `null`, `~`, or nothing after the colon. Numbers such as `1e-5` may be
written without a decimal point.
"""

_SIMPLE_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path", dict: "mapping",
                 Any: "any"}


def load_class(target: str) -> type:
    """The class named by ``"module:ClassName"``."""
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def type_text(tp: Any) -> str:
    """A reader's name for type ``tp``: ``integer``, ``` `bf16`, `fp32` ```, ``string, or empty``."""
    kind, args = type_kind(tp)
    if kind == "union":
        members = [arg for arg in args if arg is not type(None)]
        text = " or ".join(type_text(arg) for arg in members)
        return f"{text}, or empty" if len(members) < len(args) else text
    if kind == "literal":
        return ", ".join(f"`{choice}`" for choice in args)
    if kind == "list":
        return f"list of {type_text(args[0])}"
    if kind == "mapping":
        return "mapping"
    if tp in _SIMPLE_TYPES:
        return _SIMPLE_TYPES[tp]
    return getattr(tp, "__name__", str(tp))


def default_text(field: dataclasses.Field) -> str:
    """The default as it would be written in YAML, ``required`` when there is none, ``empty`` for None."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "**required**"
    if value is None:
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (dict, list, tuple)):
        return f"`{yaml.safe_dump(value, default_flow_style=True).strip()}`"
    if isinstance(value, str) and not value:
        return '`""`'
    return f"`{value}`"


def _cell(text: str) -> str:
    """``text`` on one line, safe in a table cell: outside `code` spans, ``<`` and ``*`` would start HTML
    or emphasis (``step_<N>/``, ``shard_*.bin``); a ``|`` anywhere would end the cell."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # even pieces are outside code spans
        parts[i] = parts[i].replace("<", "\\<").replace("*", "\\*")
    return "`".join(parts).replace("|", "\\|")


def field_rows(cls: type) -> list[str]:
    """One Markdown table row per config key of ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    rows = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        help_text = field.metadata.get("help", "").strip()
        if not help_text:
            raise UserError(f"{cls.__module__}.{cls.__name__}.{field.name} has no help text; declare it with "
                            "field_help(default, help='...') so the configuration reference can describe it")
        cells = [f"`{field.name}`", type_text(hints[field.name]), default_text(field)]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + f" | {_cell(help_text)} |")
    return rows


def render_section(doc: ConfigDoc) -> str:
    """The Markdown section of one config file: heading, intro, table of keys."""
    cls = load_class(doc.target)
    lines = [f"## {doc.title} (`{doc.file_name}`)", "", doc.intro, "",
             "| key | type | default | description |", "|---|---|---|---|", *field_rows(cls)]
    return "\n".join(lines) + "\n"


def render(docs: tuple[ConfigDoc, ...] = CONFIG_DOCS) -> str:
    """The whole configuration reference."""
    contents = [f"- [{d.title} (`{d.file_name}`)](#{_anchor(d)})" for d in docs]
    return "\n".join([_HEADER, *contents, "", *(render_section(d) for d in docs)]).rstrip("\n") + "\n"


def _anchor(doc: ConfigDoc) -> str:
    # GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces -> '-'.
    heading = f"{doc.title} ({doc.file_name})".lower()
    return "".join(ch for ch in heading if ch.isalnum() or ch in "-_ ").replace(" ", "-")


def first_difference(old: str, new: str) -> int:
    """1-based number of the first line where ``old`` and ``new`` differ."""
    old_lines, new_lines = old.splitlines(), new.splitlines()
    for number, (a, b) in enumerate(zip(old_lines, new_lines), 1):
        if a != b:
            return number
    return min(len(old_lines), len(new_lines)) + 1


def check(path: Path, expected: str) -> str | None:
    """None when ``path`` holds ``expected``, else what is wrong with it."""
    if not path.is_file():
        return f"{path} does not exist"
    current = path.read_text(encoding="utf-8")
    if current == expected:
        return None
    return f"{path} is out of date (first difference at line {first_difference(current, expected)})"


def write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


def main(argv: list[str]) -> int:
    """Write the reference, or with ``--check`` return 1 when the file differs from it."""
    parser = argparse.ArgumentParser(prog="python -m qwen3_pretrain.config.docs", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=DEFAULT_PATH, help=f"Markdown file (default {DEFAULT_PATH})")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the file is stale")
    args = parser.parse_args(argv)
    path, text = Path(args.path), render()
    if args.check:
        problem = check(path, text)
        if problem:
            print(f"{problem}; regenerate it with: python -m qwen3_pretrain.config.docs {path}", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    write(path, text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    # Not through cli.run_command: config sits below cli and never imports it.
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
