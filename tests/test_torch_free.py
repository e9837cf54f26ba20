"""The commands that need no tensors start without torch: ``plan`` (without ``--commbench``), and ``wiki2parquet``
and ``convert`` on one process. Each runs here with torch made unimportable; importing it anywhere on their
path fails the command (a faster start, and the package docstrings' promise kept)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DUMP = REPO / "assets" / "enwiki-sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"

RUN_WITHOUT_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} imported by a command that must not need it")
            return None

    sys.meta_path.insert(0, NoTorch())
    from qwen3_pretrain.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN_WITHOUT_TORCH, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.mark.parametrize("args", [
    ["plan", "--model", "qwen3-8b", "--nodes", "2", "--devices-per-node", "4", "--device", "910b"],
    ["plan", "--config", str(REPO / "examples" / "pretrain_config.yaml"), "--device", "h100"],
])
def test_plan_runs_without_torch(args, tmp_path):
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fit" in proc.stdout


def test_wiki2parquet_and_convert_run_without_torch(tmp_path):
    parquet = tmp_path / "wiki.parquet"
    proc = _run("wiki2parquet", "--input", str(DUMP), "--output", str(parquet), "--workers", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run("convert", f"input_path={parquet}", f"tokenizer_path={REPO / 'assets' / 'qwen3-tokenizer'}",
                f"output_path={tmp_path / 'out'}", "shards=2", "workers=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "manifest.json").is_file()
