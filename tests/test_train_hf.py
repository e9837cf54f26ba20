"""HuggingFace in and out of training: continue from a HF directory (each rank reading its slices),
and merge a sharded checkpoint into a model that transformers loads with the training model's logits."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from qwen3_pretrain import save_hf_model
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from tests._train_helpers import (TINY_MODEL, assert_same_training, check_ok, child_env, make_corpus, run_train,
                                  step_records, write_config)


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
    assert_same_training(step_records(from_hf), step_records(random_init), label="tp2 from HF vs random init")


def test_model_name_contradicting_the_checkpoint_is_an_error(corpus, hf_dir, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", model_name="qwen3-8b", model_path=str(hf_dir),
                       model_overrides={})
    proc = run_train(cfg, 1)
    assert proc.returncode == 2
    assert "contradicts" in proc.stderr and "hidden_size: preset 4096 vs 64" in proc.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2-pp2-dp2", "pp2-interleaved", "dp2-distributed-optimizer", "single"])
def test_merge_after_training_loads_in_transformers(layout, layout_runs, tmp_path):
    """The final checkpoint of a layout's run (see tests/_train_runs.py). Under pp 2 the tied head is a
    parameter of its own on the last stage (interleaved: on the last virtual stage); on one stage it is
    the embedding, stored once; under dp 2 every tensor is sharded over the ranks: all merge into the
    same HF layout."""
    out = layout_runs.output(layout)
    merged = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "qwen3_pretrain", "merge", "--input_path", str(out),
                           "--output_path", str(merged), "--model_name", "tiny-test", "--dtype", "fp32"],
                          capture_output=True, text=True, env=child_env(), timeout=120)
    check_ok(proc)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # The training model's weights straight from the sharded checkpoint, in the plain model.
    dcp_to_torch_save(out / (out / "latest").read_text().strip(), tmp_path / "flat.pt")
    state = torch.load(tmp_path / "flat.pt", weights_only=False)["model"]
    assert ("lm_head.weight" in state) == ("pp2" in layout), sorted(state)[:3]
    state.setdefault("lm_head.weight", state["embed_tokens.weight"])  # the plain model names the tie twice
    model = Qwen3Model(Qwen3Config.from_json_file(layout_runs.hf_init / "config.json"))
    model.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 500, (2, 32))
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens)).abs().max().item()
    print(f"merged model vs training model: max abs logits diff {diff:.2e}")
    assert diff <= 1e-5
