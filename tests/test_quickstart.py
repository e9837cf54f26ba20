"""The quickstart script end to end (reduced), its guards, and ``generate`` against transformers."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from qwen3_pretrain.cli import run_command
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.generate import SamplingConfig, generate
from qwen3_pretrain.models.qwen3.hf_io import load_hf_model, save_hf_model
from qwen3_pretrain.models.qwen3.model import Qwen3Model

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "quickstart.sh"
GENERATE = "qwen3_pretrain.models.qwen3.generate:main"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
PROMPT = "The quick brown fox"


def run_quickstart(out: Path, steps: int, timeout: float = 900) -> subprocess.CompletedProcess:
    """``bash scripts/quickstart.sh`` with this interpreter's environment first on PATH and no install."""
    env = dict(os.environ, QUICKSTART_DIR=str(out), QUICKSTART_STEPS=str(steps), QUICKSTART_SKIP_INSTALL="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("QWEN3_PRETRAIN_DEBUG", None)
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# --- the script ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_quickstart_writes_every_artefact_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    # A previous quickstart's leftovers must be replaced, not resumed from.
    (out / "w_pretrain").mkdir(parents=True)
    (out / ".quickstart").touch()
    (out / "w_pretrain" / "stale.txt").write_text("from an earlier run")
    proc = run_quickstart(out, steps=4)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert not (out / "w_pretrain" / "stale.txt").exists()
    for n in range(1, 9):
        assert f"==== stage {n}: " in proc.stdout

    assert (out / "data" / "wiki.parquet").stat().st_size > 0
    shards = out / "data" / "d_convert"
    assert (shards / "manifest.json").is_file()
    for k in range(16):
        assert (shards / f"shard_{k:05d}.bin").is_file() and (shards / f"shard_{k:05d}.idx").is_file()

    ckpt = out / "w_pretrain"
    assert (ckpt / "latest").read_text().strip() == "step_0000004"
    resumed = re.search(r"resumed from (\S+) at step (\d+)", log)
    assert resumed, log[-4000:]
    resume_step = int(resumed.group(2))
    assert 1 <= resume_step < 4  # the first half stopped early and the second continued from there
    assert Path(resumed.group(1)).name == f"step_{resume_step:07d}"
    assert (ckpt / f"step_{resume_step:07d}" / "meta.json").is_file()
    assert (ckpt / "step_0000004" / "meta.json").is_file()

    with open(out / "train_metrics.csv", newline="") as f:
        steps = [int(float(row["step"])) for row in csv.DictReader(f)]
    assert steps == [1, 2, 3, 4]
    assert (out / "train_metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    merged = out / "w_pretrain_merged"
    assert (merged / "tokenizer.json").is_file()
    model = load_hf_model(merged)
    assert model.config.vocab_size == 151936 and model.config.tie_word_embeddings
    assert re.search(r"continuation \(\d+ tokens, top-50 sampling, T=0.8\): '", proc.stdout)

    # The closing hints run as printed from a fresh shell (no environment activated, nothing on PATH).
    hints = proc.stdout[proc.stdout.index("the command line"):].splitlines()[1:4]
    fresh = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    for hint in hints[:2]:  # --help, and generate from the merged model
        run = subprocess.run(["bash", "-c", hint.strip() + " --max_new_tokens 4" * ("generate" in hint)],
                             cwd=REPO_ROOT, env=fresh, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (hint, run.stderr[-2000:])


def test_quickstart_rejects_a_bad_step_count(tmp_path: Path) -> None:
    proc = run_quickstart(tmp_path / "qs", steps=1, timeout=60)
    assert proc.returncode == 2
    assert "QUICKSTART_STEPS=1" in proc.stderr
    assert not (tmp_path / "qs").exists()


def test_quickstart_never_deletes_a_directory_it_did_not_write(tmp_path: Path) -> None:
    mine = tmp_path / "important"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = run_quickstart(mine, steps=4, timeout=60)
    assert proc.returncode == 2
    assert "was not written by the quickstart" in proc.stderr
    assert (mine / "notes.txt").read_text() == "keep me"


# --- generate -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 with the real vocabulary, saved in fp32 with the bundled tokenizer."""
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=512)
    model = Qwen3Model(cfg)
    model.init_weights(seed=3)
    tokenizer_dir = REPO_ROOT / "assets" / "qwen3-tokenizer"
    path = tmp_path_factory.mktemp("gen") / "model"
    save_hf_model(model, path, dtype=torch.float32, extra_files=[tokenizer_dir / f for f in TOKENIZER_FILES])
    return path


def prompt_ids(model_dir: Path) -> list[int]:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT).ids


def test_greedy_generation_matches_transformers(tiny_model_dir: Path) -> None:
    ids = prompt_ids(tiny_model_dir)
    ours = generate(load_hf_model(tiny_model_dir), ids, SamplingConfig(max_new_tokens=12))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # generate all 12 tokens, like ours without stop ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours == out[0, len(ids):].tolist()


def test_top_1_sampling_is_greedy_and_sampling_follows_the_seed(tiny_model_dir: Path) -> None:
    model = load_hf_model(tiny_model_dir)
    ids = prompt_ids(tiny_model_dir)
    greedy = generate(model, ids, SamplingConfig(max_new_tokens=6))
    assert generate(model, ids, SamplingConfig(max_new_tokens=6, top_k=1, seed=5)) == greedy
    sampled = generate(model, ids, SamplingConfig(max_new_tokens=6, top_k=1000, seed=1))
    assert sampled == generate(model, ids, SamplingConfig(max_new_tokens=6, top_k=1000, seed=1))
    assert sampled != greedy


def test_generation_ends_at_a_stop_token(tiny_model_dir: Path) -> None:
    model = load_hf_model(tiny_model_dir)
    ids = prompt_ids(tiny_model_dir)
    first = generate(model, ids, SamplingConfig(max_new_tokens=1))
    assert generate(model, ids, SamplingConfig(max_new_tokens=8), stop={first[0]}) == first


def test_cli_prints_prompt_and_continuation(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = generate(load_hf_model(tiny_model_dir), prompt_ids(tiny_model_dir), SamplingConfig(max_new_tokens=5))
    text = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).decode(expected, skip_special_tokens=False)
    code = run_command(GENERATE, ["--model", str(tiny_model_dir), "--prompt", PROMPT, "--max_new_tokens", "5"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"prompt ({len(prompt_ids(tiny_model_dir))} tokens): {PROMPT!r}" in out
    assert f"continuation ({len(expected)} tokens, greedy): {text!r}" in out


@pytest.mark.parametrize("args, message", [
    (["--max_new_tokens", "0"], "--max_new_tokens 0"),
    (["--top_k", "-1"], "--top_k -1"),
    (["--temperature", "0"], "--temperature 0"),
])
def test_cli_rejects_bad_sampling_options(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str],
                                          args: list[str], message: str) -> None:
    code = run_command(GENERATE, ["--model", str(tiny_model_dir), "--prompt", PROMPT, *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_cli_names_a_missing_tokenizer(tiny_model_dir: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code = run_command(GENERATE, ["--model", str(tiny_model_dir), "--prompt", PROMPT, "--tokenizer", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "tokenizer.json") in err and "--tokenizer" in err


def test_empty_prompt_is_a_user_error(tiny_model_dir: Path) -> None:
    with pytest.raises(UserError, match="--prompt"):
        generate(load_hf_model(tiny_model_dir), [], SamplingConfig())
