"""The command-line parser every subcommand uses: one convention for all of them.

A long option may be written with dashes or underscores (``--seq-length`` and
``--seq_length`` alike: the reference workflow's scripts use underscores,
shell users dashes), and ``usage:`` names the command as it is typed
(``qwen3-pretrain <command>``).
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from typing import Any, Sequence


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """An option's default after its help, once: only where there is one and the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text \
                and action.option_strings:
            text += " (default: %(default)s)"
        return text


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for ``qwen3-pretrain <command>`` (``prog``: the command's name)."""

    def __init__(self, command: str, config: type | None = None, **kwargs: Any) -> None:
        """``config``: the command's config dataclass, whose keys ``--help`` lists after the options."""
        if config is not None:
            kwargs["epilog"] = config_keys_help(config)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(prog=f"qwen3-pretrain {command}", **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        return super().parse_known_args(None if args is None else self._spelled(args), namespace)

    def _spelled(self, args: Sequence[str]) -> list[str]:
        """``args`` with every long option spelled as this parser spells it."""
        known = {opt.replace("_", "-"): opt for action in self._actions for opt in action.option_strings
                 if opt.startswith("--")}
        out = []
        for i, arg in enumerate(args):
            if arg == "--":
                return out + list(args[i:])
            if arg.startswith("--"):
                name, eq, value = arg.partition("=")
                arg = known.get(name.replace("_", "-"), name) + eq + value
            out.append(arg)
        return out


def config_keys_help(cls: type) -> str:
    """The keys of config dataclass ``cls`` with their help texts, the same table the configuration reference
    (docs/configuration.md) is generated from."""
    lines = ["config keys (in the YAML file, or key=value after the options):"]
    for field in dataclasses.fields(cls):
        text = textwrap.fill(field.metadata.get("help", ""), width=100, initial_indent="      ",
                             subsequent_indent="      ")
        lines += [f"  {field.name}", text]
    return "\n".join(lines)
