"""HuggingFace in and out of training: continue from a HF directory (each rank reading its slices),
and merge a sharded checkpoint into a model that transformers loads with the training model's logits."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from qwen3_pretrain import save_hf_model
from qwen3_pretrain.models.qwen3 import Qwen3Config, Qwen3Model
from tests._train_helpers import TINY_MODEL, check_ok, child_env, losses, make_corpus, run_train, write_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A HF model directory holding the same weights a random init with seed 7 gives."""
    model = Qwen3Model(Qwen3Config(**TINY_MODEL))
    model.init_weights(7)
    path = tmp_path_factory.mktemp("hf") / "tiny"
    save_hf_model(model, path, dtype=torch.float32)
    return path


@pytest.mark.distributed
def test_continue_from_hf_weights_equals_the_same_init(corpus, hf_dir, tmp_path):
    random_init = tmp_path / "random"
    check_ok(run_train(write_config(tmp_path / "a.yaml", corpus, random_init, total_steps=3), 1))
    from_hf = tmp_path / "from_hf"
    cfg = write_config(tmp_path / "b.yaml", corpus, from_hf, total_steps=3, model_name="my-tiny-model",
                       model_path=str(hf_dir), model_overrides={})
    proc = run_train(cfg, 2, "tp=2")
    check_ok(proc)
    assert "(continued pre-training)" in proc.stdout
    got, want = losses(from_hf), losses(random_init)
    assert max(abs(g - w) / w for g, w in zip(got, want)) < 1e-5, (got, want)


def test_model_name_contradicting_the_checkpoint_is_an_error(corpus, hf_dir, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", model_name="qwen3-8b", model_path=str(hf_dir),
                       model_overrides={})
    proc = run_train(cfg, 1)
    assert proc.returncode == 2
    assert "contradicts" in proc.stderr and "hidden_size: preset 4096 vs 64" in proc.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, layout", [(4, {"tp": 2, "pp": 2}), (1, {})], ids=["tp2-pp2", "one-stage"])
def test_merge_after_training_loads_in_transformers(nproc, layout, corpus, tmp_path):
    """Under pp 2 the tied head is a parameter of its own on the last stage; on one stage it is the
    embedding, stored once: both merge into the same HF layout."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=2, **layout)
    check_ok(run_train(cfg, nproc))
    merged = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "qwen3_pretrain", "merge", "--input_path", str(out),
                           "--output_path", str(merged), "--model_name", "qwen3-0.6b", "--dtype", "fp32"],
                          capture_output=True, text=True, env=child_env(), timeout=120)
    check_ok(proc)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # The training model's weights straight from the sharded checkpoint, in the plain model.
    dcp_to_torch_save(out / "step_0000002", tmp_path / "flat.pt")
    state = torch.load(tmp_path / "flat.pt", weights_only=False)["model"]
    assert ("lm_head.weight" in state) == bool(layout.get("pp")), sorted(state)[:3]
    state.setdefault("lm_head.weight", state["embed_tokens.weight"])  # the plain model names the tie twice
    model = Qwen3Model(Qwen3Config(**TINY_MODEL))
    model.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 500, (2, 32))
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens)).abs().max().item()
    print(f"merged model vs training model: max abs logits diff {diff:.2e}")
    assert diff <= 1e-5
