"""merge: training checkpoints (one process and sharded over 2 gloo ranks) -> a HF directory transformers loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import load_file

from qwen3_pretrain.checkpoint.merge import main, merge_checkpoint
from qwen3_pretrain.cli import run_command
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from tests._train_helpers import free_port

VOCAB, PADDED = 300, 304  # the trainer pads the vocabulary rows to a multiple of tp
STEP = 20
REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = REPO_ROOT / "assets" / "qwen3-tokenizer"


def tiny_config(tied: bool) -> Qwen3Config:
    return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
                       tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1)


def tiny_model(tied: bool, seed: int = 0) -> Qwen3Model:
    model = Qwen3Model(tiny_config(tied))
    model.init_weights(seed)
    return model


def training_state_dict(model: Qwen3Model) -> dict[str, torch.Tensor]:
    """What the trainer saves under "model": padded vocab rows (non-zero, so leaking them shows) and a head always."""
    sd = {name: p.detach().clone() for name, p in model.named_parameters()}
    padding = torch.full((PADDED - VOCAB, model.config.hidden_size), 7.0)
    sd["embed_tokens.weight"] = torch.cat([sd["embed_tokens.weight"], padding])
    head = model.lm_head.weight.detach()
    sd["lm_head.weight"] = torch.cat([head, padding]).clone()  # a separate copy even when tied
    return sd


def write_meta(ckpt: Path, model: Qwen3Model, model_name: str = "tiny-test", tokenizer_path: str | None = None) -> None:
    meta = {"format": "qwen3-pretrain-checkpoint", "format_version": 1, "step": STEP, "tokens_seen": 1000,
            "model_name": model_name, "model_config": model.config.to_hf_dict(), "padded_vocab_size": PADDED,
            "tied": model.config.tie_word_embeddings, "tokenizer_path": tokenizer_path,
            "layout": {"tp": 1, "pp": 1, "dp": 1}, "data": {}, "config": {}, "created": "2025-01-01T00:00:00"}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def save_checkpoint(root: Path, model: Qwen3Model, step: int = STEP, latest: bool = True, **meta) -> Path:
    """A one-process training checkpoint of ``model`` in ``root``, with optimizer state beside the model."""
    ckpt = root / f"step_{step:07d}"
    sd = training_state_dict(model)
    optim = {f"state.{name}.exp_avg": torch.zeros_like(t) for name, t in list(sd.items())[:3]}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": sd, "optim": optim}, checkpoint_id=str(ckpt), no_dist=True)
    write_meta(ckpt, model, **meta)
    if latest:
        (root / "latest").write_text(ckpt.name + "\n")
    return ckpt


def hf_weights(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def to_hf_name(name: str) -> str:
    """Internal -> HF weight name, written out here independently of the code under test."""
    renames = [("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"), ("attn.", "self_attn.")]
    for old, new in renames:
        name = name.replace(old, new)
    return name if name == "lm_head.weight" else "model." + name


def assert_logits_match(out: Path, model: Qwen3Model) -> None:
    """transformers loads ``out`` with no missing/unexpected keys and computes the same logits."""
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
        got = hf(ids).logits
    assert got.shape == (2, 12, VOCAB)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Tied and untied one-process checkpoints, saved once for the module (tests copy before breaking one)."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for tied in (False, True):
        model = tiny_model(tied, seed=3 if tied else 4)
        run = root / ("tied" if tied else "untied")
        save_checkpoint(run, model, tokenizer_path=str(TOKENIZER) if tied else None)
        out[tied] = (model, run)
    return out


def copy_run(checkpoints: dict, tmp_path: Path, tied: bool = False) -> Path:
    run = tmp_path / "run"
    shutil.copytree(checkpoints[tied][1], run)
    return run


# --- output a user relies on -------------------------------------------------------------------


def test_untied_fp32_is_bit_exact_and_loads_in_transformers(checkpoints, tmp_path):
    model, run = checkpoints[False]
    result = merge_checkpoint(run, tmp_path / "hf", "tiny-test", dtype=torch.float32, progress=False)
    weights = hf_weights(result.output_path)
    params = dict(model.named_parameters())
    assert sorted(weights) == sorted(to_hf_name(n) for n in params)
    for name, param in params.items():
        assert torch.equal(weights[to_hf_name(name)], param.detach()), name
    config = json.loads((result.output_path / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32"
    assert (result.output_path / "generation_config.json").is_file()
    assert result.num_tensors == len(params) and result.num_bytes == sum(p.nbytes for p in params.values())
    assert_logits_match(result.output_path, model)


def test_tied_writes_no_head_and_copies_tokenizer(checkpoints, tmp_path):
    model, run = checkpoints[True]
    out = merge_checkpoint(run, tmp_path / "hf", "TINY-TEST", dtype=torch.float32, progress=False).output_path
    weights = hf_weights(out)
    assert "lm_head.weight" not in weights
    assert torch.equal(weights["model.embed_tokens.weight"], model.embed_tokens.weight.detach())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        assert (out / name).read_bytes() == (TOKENIZER / name).read_bytes(), name
    assert_logits_match(out, model)


def test_bf16_in_small_shards_with_index(checkpoints, tmp_path):
    model, run = checkpoints[False]
    out = merge_checkpoint(run, tmp_path / "hf", "tiny-test", max_shard_size="40KB", progress=False).output_path
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 3 and set(index["weight_map"].values()) == {f.name for f in files}
    assert all(f.stat().st_size <= 40_000 + 4096 for f in files)  # safetensors adds a small header
    weights = hf_weights(out)
    for name, param in model.named_parameters():
        got = weights[to_hf_name(name)]
        assert got.dtype == torch.bfloat16 and torch.equal(got, param.detach().to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_cli_progress_bar_summary_and_both_option_spellings(checkpoints, tmp_path, capsys):
    _, run = checkpoints[False]
    code = main(["--input-path", str(run), "--output_path", str(tmp_path / "hf"), "--model-name", "tiny-test",
                 "--tokenizer-path", str(TOKENIZER), "--step", str(STEP)])
    assert code == 0
    captured = capsys.readouterr()
    assert "25/25" in captured.err  # the bar reached every tensor: 2 layers x 11 + embedding, norm, head
    assert "25 tensors" in captured.out and "MB/s" in captured.out
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_tools_script_as_a_user_runs_it(checkpoints, tmp_path):
    _, run = checkpoints[True]
    cmd = [sys.executable, str(REPO_ROOT / "tools" / "merge_checkpoint.py"), "--input_path", str(run),
           "--output_path", str(tmp_path / "hf"), "--model_name", "tiny-test", "--dtype", "fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert "24 tensors" in proc.stdout and "Traceback" not in proc.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_missing_tokenizer_is_a_warning(checkpoints, tmp_path, caplog):
    _, run = checkpoints[False]  # saved with tokenizer_path null
    out = merge_checkpoint(run, tmp_path / "hf", "tiny-test", progress=False).output_path
    assert "no tokenizer_path" in caplog.text and not (out / "tokenizer.json").exists()


# --- choosing the checkpoint ----------------------------------------------------------------------


def test_latest_is_followed_and_step_picks_another(tmp_path):
    run = tmp_path / "run"
    old, new = tiny_model(False, seed=1), tiny_model(False, seed=2)
    save_checkpoint(run, old, step=10)
    save_checkpoint(run, new, step=STEP)
    (run / ".tmp-step_0000030-save").mkdir()  # an unfinished save is not a checkpoint
    first = hf_weights(merge_checkpoint(run, tmp_path / "a", "tiny-test", dtype=torch.float32,
                                        progress=False).output_path)
    assert torch.equal(first["model.norm.weight"], new.norm.weight.detach())
    assert torch.equal(first["model.embed_tokens.weight"], new.embed_tokens.weight.detach())
    second = hf_weights(merge_checkpoint(run, tmp_path / "b", "tiny-test", step=10, dtype=torch.float32,
                                         progress=False).output_path)
    assert torch.equal(second["model.embed_tokens.weight"], old.embed_tokens.weight.detach())


def test_incomplete_latest_falls_back_to_newest_complete_with_warning(tmp_path, caplog):
    run = tmp_path / "run"
    old = tiny_model(False, seed=1)
    save_checkpoint(run, old, step=10)
    save_checkpoint(run, tiny_model(False, seed=2), step=STEP)
    (run / f"step_{STEP:07d}" / "meta.json").unlink()
    out = merge_checkpoint(run, tmp_path / "hf", "tiny-test", dtype=torch.float32, progress=False).output_path
    assert torch.equal(hf_weights(out)["model.embed_tokens.weight"], old.embed_tokens.weight.detach())
    assert "step_0000020, which is unusable" in caplog.text and "meta.json is missing" in caplog.text
    (run / "latest").unlink()
    merge_checkpoint(run, tmp_path / "hf2", "tiny-test", progress=False)
    assert "latest is missing" in caplog.text


# --- bad input: one clear line, exit 2, nothing written ------------------------------------------------


def run_merge(capsys, *args: str) -> str:
    """Run the merge command as the CLI does; returns the error line after checking exit 2 and no traceback."""
    code = run_command("qwen3_pretrain.checkpoint.merge:main", ["--no_progress", "--model_name", "tiny-test", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("error: ")
    return err.splitlines()[-1]


def test_input_path_missing(tmp_path, capsys):
    err = run_merge(capsys, "--input_path", str(tmp_path / "nope"), "--output_path", str(tmp_path / "hf"))
    assert str(tmp_path / "nope") in err and "no such directory" in err
    assert not (tmp_path / "hf").exists()


def test_no_checkpoint_in_input(tmp_path, capsys):
    (tmp_path / "run" / ".tmp-step_0000010-save").mkdir(parents=True)
    err = run_merge(capsys, "--input_path", str(tmp_path / "run"), "--output_path", str(tmp_path / "hf"))
    assert "no checkpoint" in err and str(tmp_path / "run") in err


def test_step_that_does_not_exist_lists_available(checkpoints, tmp_path, capsys):
    run = copy_run(checkpoints, tmp_path)
    err = run_merge(capsys, "--input_path", str(run), "--output_path", str(tmp_path / "hf"), "--step", "7")
    assert "step_0000007" in err and f"available steps: {STEP}" in err


@pytest.mark.parametrize("broken", ["__0_0.distcp", ".metadata", "meta.json"])
def test_missing_file_is_named(checkpoints, tmp_path, capsys, broken):
    run = copy_run(checkpoints, tmp_path)
    (run / f"step_{STEP:07d}" / broken).unlink()
    err = run_merge(capsys, "--input_path", str(run), "--output_path", str(tmp_path / "hf"), "--step", str(STEP))
    assert str(run / f"step_{STEP:07d}" / broken) in err and "missing" in err
    assert not (tmp_path / "hf").exists()


def test_truncated_data_file_is_named(checkpoints, tmp_path, capsys):
    run = copy_run(checkpoints, tmp_path)
    data = run / f"step_{STEP:07d}" / "__0_0.distcp"
    os.truncate(data, data.stat().st_size - 100)
    err = run_merge(capsys, "--input_path", str(run), "--output_path", str(tmp_path / "hf"), "--step", str(STEP))
    assert str(data) in err and "truncated" in err


def test_damaged_metadata_is_named(checkpoints, tmp_path, capsys):
    run = copy_run(checkpoints, tmp_path)
    (run / f"step_{STEP:07d}" / ".metadata").write_bytes(b"not a pickle")
    err = run_merge(capsys, "--input_path", str(run), "--output_path", str(tmp_path / "hf"), "--step", str(STEP))
    assert str(run / f"step_{STEP:07d}" / ".metadata") in err


def test_model_name_mismatch_names_both(checkpoints, tmp_path, capsys):
    _, run = checkpoints[False]
    code = run_command("qwen3_pretrain.checkpoint.merge:main",
                       ["--input_path", str(run), "--output_path", str(tmp_path / "hf"), "--model_name", "qwen3-8b"])
    err = capsys.readouterr().err
    assert code == 2 and "'qwen3-8b'" in err and "'tiny-test'" in err and "Traceback" not in err


def test_unwritable_output_path(checkpoints, tmp_path, capsys):
    _, run = checkpoints[False]
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    err = run_merge(capsys, "--input_path", str(run), "--output_path", str(blocker / "hf"))
    assert str(blocker / "hf") in err and "writable" in err
    err = run_merge(capsys, "--input_path", str(run), "--output_path", str(blocker))  # an unrelated file
    assert str(blocker) in err and blocker.read_text() == "not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_directory(checkpoints, tmp_path, capsys):
    _, run = checkpoints[False]
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o500)
    try:
        err = run_merge(capsys, "--input_path", str(run), "--output_path", str(parent / "hf"))
    finally:
        parent.chmod(0o700)
    assert str(parent / "hf") in err and "writable" in err


# --- a checkpoint sharded over 2 gloo ranks (DTensor) ---------------------------------------------------


def _save_sharded(rank: int, world_size: int, port: int, ckpt: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        sd = training_state_dict(tiny_model(False, seed=5))
        # Row-parallel weights split along dim 1 as tensor parallelism does; everything else along dim 0.
        sharded = {name: distribute_tensor(t, mesh, [Shard(1 if name.endswith(("o_proj.weight", "down_proj.weight"))
                                                           else 0)]) for name, t in sd.items()}
        dcp.save({"model": sharded}, checkpoint_id=ckpt)
    finally:
        dist.destroy_process_group()


def test_checkpoint_sharded_over_two_ranks_merges_bit_exact(tmp_path):
    run = tmp_path / "run"
    ckpt = run / f"step_{STEP:07d}"
    port = free_port()
    # fork: the children need nothing this process has not imported already, so they start in no time
    mp.start_processes(_save_sharded, args=(2, port, str(ckpt)), nprocs=2, join=True, start_method="fork")
    model = tiny_model(False, seed=5)
    write_meta(ckpt, model)
    (run / "latest").write_text(ckpt.name + "\n")
    chunks = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata["model.embed_tokens.weight"].chunks
    assert len(chunks) == 2 and {p.name for p in ckpt.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    out = merge_checkpoint(run, tmp_path / "hf", "tiny-test", dtype=torch.float32, progress=False).output_path
    weights = hf_weights(out)
    for name, param in model.named_parameters():
        assert torch.equal(weights[to_hf_name(name)], param.detach()), name
