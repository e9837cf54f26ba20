"""The user guide stays true to the code: the generated configuration reference is current, every key of
the example configs is documented, links between the pages resolve, the error messages quoted in the
troubleshooting page still exist in the code, and the commands shown name real tools and subcommands."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from qwen3_pretrain.cli import COMMANDS
from qwen3_pretrain.config import docs
from qwen3_pretrain.config.loader import field_help
from qwen3_pretrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
EXAMPLE_CONFIGS = sorted(p for p in (REPO / "examples").rglob("*.yaml")
                         if p.name in {d.file_name for d in docs.CONFIG_DOCS})

_FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A value in a quoted message: <name>, or <'name'> for a value shown with quotes (repr).
_PLACEHOLDER = re.compile(r"<[^<>]+>")
_FORMAT_SPEC = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdifgrx]")


# --- the generated configuration reference ----------------------------------------------------------------


def test_configuration_reference_is_up_to_date():
    problem = docs.check(DOCS / "configuration.md", docs.render())
    assert problem is None, f"{problem}; run: python -m qwen3_pretrain.config.docs docs/configuration.md"


def test_check_reports_a_stale_or_missing_file_and_write_fixes_it(tmp_path, capsys):
    path = tmp_path / "configuration.md"
    assert docs.main(["--check", str(path)]) == 1
    assert docs.main([str(path)]) == 0
    assert docs.main(["--check", str(path)]) == 0
    lines = path.read_text().splitlines()
    lines[5] += " edited"
    path.write_text("\n".join(lines) + "\n")
    assert docs.main(["--check", str(path)]) == 1
    assert "out of date (first difference at line 6)" in capsys.readouterr().err


@dataclass
class _Toy:
    data_path: str = field_help(help="where the shards are (step_<N>/ | shard_*.bin)")
    mode: Literal["bf16", "fp32"] = field_help("bf16", help="precision")
    limit: int | None = field_help(None, help="a `<limit>` in code stays as is")
    extra: dict[str, Any] = field_help({"a": 1}, help="overrides")
    flag: bool = field_help(False, help="a switch")
    rate: float = field_help(1e-5, help="a number")


def test_rows_show_type_default_and_escaped_help():
    assert docs.field_rows(_Toy) == [
        r"| `data_path` | string | **required** | where the shards are (step_\<N>/ \| shard_\*.bin) |",
        "| `mode` | `bf16`, `fp32` | `bf16` | precision |",
        "| `limit` | integer, or empty | empty | a `<limit>` in code stays as is |",
        "| `extra` | mapping | `{a: 1}` | overrides |",
        "| `flag` | boolean | `false` | a switch |",
        "| `rate` | number | `1e-05` | a number |",
    ]


def test_a_field_without_help_text_is_an_error():
    @dataclass
    class NoHelp:
        steps: int = 3

    with pytest.raises(UserError, match=r"NoHelp.steps has no help text"):
        docs.field_rows(NoHelp)


def _config_classes_in_package() -> set[str]:
    """``module:Class`` of every class in the package whose body declares fields with ``field_help``."""
    found = set()
    for path in (REPO / "qwen3_pretrain").rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(stmt, ast.AnnAssign) and isinstance(stmt.value, ast.Call)
                    and getattr(stmt.value.func, "id", None) == "field_help" for stmt in node.body):
                found.add(f"{module}:{node.name}")
    return found


def test_every_config_dataclass_is_in_the_reference():
    assert _config_classes_in_package() == {d.target for d in docs.CONFIG_DOCS}


# --- example configs --------------------------------------------------------------------------------------


def _documented_keys(file_name: str) -> set[str]:
    """Keys listed in the section of docs/configuration.md for config file ``file_name``."""
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    sections = [s for s in text.split("\n## ") if s.splitlines()[0].endswith(f"(`{file_name}`)")]
    assert len(sections) == 1, f"no single section for {file_name} in docs/configuration.md"
    return set(re.findall(r"^\| `(\w+)` \|", sections[0], re.M))


def test_the_reference_example_configs_are_checked():
    names = {p.relative_to(REPO).as_posix() for p in EXAMPLE_CONFIGS}
    assert {"examples/pretrain_config.yaml", "examples/pretain_data_config.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_key_of_an_example_config_is_documented(path):
    keys = set(yaml.safe_load(path.read_text(encoding="utf-8")))
    missing = keys - _documented_keys(path.name)
    assert not missing, f"{path.name}: keys not in docs/configuration.md: {sorted(missing)}"


# --- links ------------------------------------------------------------------------------------------------


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of ``page``: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", page.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_guide_has_its_pages():
    names = {p.name for p in PAGES}
    assert {"README.md", "environment.md", "data.md", "configuration.md", "training.md", "monitoring.md",
            "checkpoints.md", "troubleshooting.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_internal_links_resolve(page):
    broken = []
    for target in _LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading with anchor #{anchor})")
    assert not broken, f"{page.name}: broken links: {broken}"


# --- quoted messages --------------------------------------------------------------------------------------


def _module_constants(tree: ast.Module) -> dict[str, str]:
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def _literal_pieces(node: ast.AST, constants: dict[str, str]) -> list[str]:
    """The fixed text of a string literal, split where a value is inserted (f-string fields, %-specs);
    a field that names a module-level string constant is the constant's text."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _FORMAT_SPEC.split(node.value)
    pieces = [""]
    for part in node.values:  # an ast.JoinedStr
        if isinstance(part, ast.Constant):
            pieces[-1] += part.value
        elif isinstance(part.value, ast.Name) and part.value.id in constants and part.conversion == -1:
            pieces[-1] += constants[part.value.id]
        else:
            pieces.append("")
    return pieces


@pytest.fixture(scope="module")
def code_text() -> list[str]:
    """Every piece of fixed text in the package's string literals."""
    pieces = []
    for path in (REPO / "qwen3_pretrain").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = _module_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                pieces += _literal_pieces(node, constants)
    return [p for p in pieces if len(p) >= 8]


def _quoted_messages() -> list[str]:
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```text\n(.*?)^```", text, re.M | re.S)
    lines = [line for block in blocks for line in block.splitlines() if line.strip()]
    # "error: " is added by the command line, "INFO "/"WARNING " by the log format.
    return [re.sub(r"^(error: |INFO |WARNING )", "", line) for line in lines]


def test_troubleshooting_quotes_many_messages():
    assert len(_quoted_messages()) >= 30


@pytest.mark.parametrize("message", _quoted_messages(), ids=lambda m: m[:60])
def test_quoted_message_is_still_in_the_code(message, code_text):
    fragments = [f for f in _PLACEHOLDER.split(message) if len(f.strip()) >= 8]
    assert fragments, "a quoted message needs some fixed text"
    missing = [f for f in fragments if not any(f in piece for piece in code_text)]
    assert not missing, f"no string in qwen3_pretrain/ contains {missing}; update docs/troubleshooting.md"


# --- commands ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_name_real_tools_and_subcommands(page):
    text = page.read_text(encoding="utf-8")
    paths = set(re.findall(r"(?<![\w/.])((?:tools|examples|scripts|bench)/[\w./-]*\w)", text))
    missing = sorted(p for p in paths if not (REPO / p).exists())
    code = "\n".join(_FENCE.findall(text) + re.findall(r"`[^`\n]*`", text))
    unknown = sorted(set(re.findall(r"qwen3-pretrain ([a-z][\w-]*)", code)) - set(COMMANDS))
    assert not missing and not unknown, f"{page.name}: missing files {missing}, unknown subcommands {unknown}"


# --- the short commands run as written --------------------------------------------------------------------


_SHELL_FENCE = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.M | re.S)
# Commands quick enough to run here, as the pages write them (the rest: training runs, device installs).
_SHORT = re.compile(r"^(source \.venv/bin/activate|\.venv/bin/qwen3-pretrain --help|qwen3-pretrain (plan|[a-z-]+ --help)"
                    r"|python -m qwen3_pretrain\.config\.docs --check|lint-imports"
                    r"|python tools/(convert_wiki_to_parquet|data_convert)\.py)")


def _runs_here(command: str) -> bool:
    """Whether a command's inputs exist in the repository (the reference workflow's own inputs, its cluster's
    /mnt/... and its wikiextractor folder, exist only there; ``runs/`` is what earlier commands write)."""
    for word in command.split():
        if word.startswith("/mnt/") or word == "wiki_text":
            return False
        if word.endswith((".yaml", ".bz2")) and not (REPO / word).exists():
            return False
    return True


def _short_commands() -> list[tuple[str, str]]:
    """Each shell block's short commands, in order, up to its first long one (a training run): one script per
    block, since a block's commands build on each other."""
    found = []
    for page in [REPO / "README.md", *PAGES]:
        for block in _SHELL_FENCE.findall(page.read_text(encoding="utf-8")):
            script = []
            for line in block.replace("\\\n", " ").splitlines():
                command = line.split("  #")[0].strip()
                if not command or command.startswith("#"):
                    continue
                if not _SHORT.match(command) or "--commbench" in command:
                    break
                script.append(command)
            if script and all(_runs_here(c) for c in script) and script != ["source .venv/bin/activate"]:
                found.append((page.name, "\n".join(["set -e", *script])))
    return found


@pytest.mark.parametrize("page, command", _short_commands(), ids=lambda v: v.replace("set -e\n", "")[:60])
def test_short_commands_run_as_written_from_a_fresh_shell(page, command, tmp_path):
    """In a fresh shell with the environment activated (as the pages say to), from a folder holding the
    repository's assets, examples and tools (so that what they write lands in a temporary folder)."""
    import os
    import subprocess
    import sys

    for name in ("assets", "examples", "tools", "docs", "pyproject.toml", ".venv", "qwen3_pretrain"):
        if (REPO / name).exists():
            (tmp_path / name).symlink_to(REPO / name)
    venv_bin = Path(sys.executable).parent
    env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "VIRTUAL_ENV": ""}
    if not (tmp_path / ".venv").exists():  # the test's own environment stands for the repository's
        (tmp_path / ".venv").mkdir()
        (tmp_path / ".venv" / "bin").symlink_to(venv_bin)
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{page}: {command}\n{proc.stderr[-2000:]}"
