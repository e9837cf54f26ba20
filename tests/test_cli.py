"""The ``qwen3-pretrain`` entry point, run as a user runs it: in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from qwen3_pretrain.cli import COMMANDS, main


def run_cli(repo_root, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    env.pop("QWEN3_PRETRAIN_DEBUG", None)  # it turns user errors back into tracebacks
    return subprocess.run([sys.executable, "-m", "qwen3_pretrain", *args], cwd=repo_root, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command(repo_root):
    result = run_cli(repo_root, "--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert re.search(rf"^\s+{re.escape(name)}\s", result.stdout, re.MULTILINE), name


def test_unknown_command_exits_2_with_a_suggestion(repo_root):
    result = run_cli(repo_root, "demoo")
    assert result.returncode == 2
    assert "unknown command 'demoo'; did you mean 'demo'?" in result.stderr


def test_demo_runs_and_reloads_bit_exact(repo_root, tmp_path):
    out = tmp_path / "tiny"
    result = run_cli(repo_root, "demo", "--output", str(out), "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert "logits shape: [1, 10, 151936]" in result.stdout
    assert re.search(r"checksum: sum=-?\d+\.\d+ first=\[", result.stdout)
    assert "equal the in-memory model's: yes" in result.stdout
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()


def test_user_error_is_one_line_without_traceback(tmp_path, capsys, monkeypatch):
    # In-process (same path as the console script, without paying a second torch import).
    monkeypatch.delenv("QWEN3_PRETRAIN_DEBUG", raising=False)
    code = main(["demo", "--output", str(tmp_path / "x"), "--tokenizer", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "tokenizer.json" in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "x").exists()


def _library_errors(argv: list[str]) -> int:
    """A command failing the way a library fails: a ValueError and an OSError that are no user error of ours."""
    import torch

    if argv == ["torch"]:
        torch.zeros(2).view(3)
    if argv == ["value"]:
        raise ValueError("a library's own ValueError")
    raise OSError(5, "a library's own OSError")


@pytest.mark.parametrize("kind, message", [("torch", "shape '[3]' is invalid"), ("value", "a library's own ValueError"),
                                           ("os", "a library's own OSError")])
def test_other_errors_keep_their_traceback_and_exit_non_zero(repo_root, kind, message):
    code = f"import sys; from qwen3_pretrain.cli import run_command; sys.exit(run_command({TARGET!r}, [{kind!r}]))"
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    env.pop("QWEN3_PRETRAIN_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo_root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr and message in proc.stderr
    assert "in _library_errors" in proc.stderr and "error: " not in proc.stderr


TARGET = "tests.test_cli:_library_errors"


def test_package_import_does_not_import_torch(repo_root):
    code = "import sys, qwen3_pretrain; print(qwen3_pretrain.__version__, 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo_root)}, timeout=60)
    assert result.returncode == 0, result.stderr
    version = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["version"]
    assert result.stdout.split() == [version, "False"]


def test_package_exports_the_model_api():
    import qwen3_pretrain as q
    from qwen3_pretrain.models.qwen3 import hf_io, model

    assert q.load_hf_model is hf_io.load_hf_model and q.save_hf_model is hf_io.save_hf_model
    assert q.Qwen3Model is model.Qwen3Model
    preset = q.get_preset("Qwen3-8B")
    assert isinstance(preset, q.Qwen3Config) and preset.hidden_size == 4096


def _env_probe(argv: list[str]) -> int:
    """A subcommand that reports what it sees: THP_MEM_ALLOC_ENABLE and whether torch was imported."""
    print(f"THP={os.environ.get('THP_MEM_ALLOC_ENABLE')} torch_loaded={'torch' in sys.modules}")
    return 0


def _probe(repo_root, env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    env["PYTHONPATH"] = os.pathsep.join([str(repo_root), str(repo_root / "tests")])
    code = "import sys; from qwen3_pretrain.cli import run_command; sys.exit(run_command('test_cli:_env_probe', []))"
    result = subprocess.run([sys.executable, "-c", code], cwd=repo_root, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_commands_ask_for_huge_pages_before_torch_loads_unless_the_user_says_otherwise(repo_root):
    # torch reads the variable once, at its first allocation: it must be set before torch is imported.
    assert _probe(repo_root, None) == "THP=1 torch_loaded=False"
    assert _probe(repo_root, "0") == "THP=0 torch_loaded=False"


def test_version_is_the_projects(repo_root):
    version = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["version"]
    for flag in ("--version", "-V"):
        result = run_cli(repo_root, flag)
        assert result.returncode == 0 and result.stdout.strip() == f"qwen3-pretrain {version}"
    installed = subprocess.run([str(repo_root / ".venv" / "bin" / "qwen3-pretrain"), "--version"], capture_output=True,
                               text=True) if (repo_root / ".venv" / "bin" / "qwen3-pretrain").exists() else None
    assert installed is None or installed.stdout.strip() == f"qwen3-pretrain {version}"
