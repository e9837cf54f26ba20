"""HF directory I/O: roundtrips, sharding, clear errors on broken checkpoints, preset sizes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.qwen3.config import PRESETS
from qwen3_pretrain.models.qwen3.hf_io import (
    HFCheckpointReader,
    HFCheckpointWriter,
    expected_shapes,
    hf_to_internal,
    internal_to_hf,
    load_hf_model,
    parse_size,
    save_hf_model,
)
from qwen3_pretrain.models.qwen3.model import Qwen3Model

# Published totals (model cards / config.json of Qwen/Qwen3-*), in billions.
PUBLISHED_PARAMS_B = {"qwen3-0.6b": 0.596, "qwen3-1.7b": 1.721, "qwen3-4b": 4.022,
                      "qwen3-8b": 8.191, "qwen3-14b": 14.768, "qwen3-32b": 32.762,
                      # the model cards: "30.5B in total and 3.3B activated", "235B in total and 22B activated"
                      "qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.0}
PUBLISHED_ACTIVE_B = {"qwen3-30b-a3b": 3.3, "qwen3-235b-a22b": 22.0}


def make_model(cfg, seed: int = 0) -> Qwen3Model:
    model = Qwen3Model(cfg)
    model.init_weights(seed)
    return model


def assert_same_weights(a: Qwen3Model, b: Qwen3Model) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def hf_tensors(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def rewrite(path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def saved(tiny_config, tmp_path):
    """An untied tiny model saved in fp32 as one file: (model, directory)."""
    model = make_model(tiny_config())
    return model, save_hf_model(model, tmp_path / "model", dtype=torch.float32)


# --- names ----------------------------------------------------------------


def test_name_mapping_roundtrip_and_unknown_names():
    assert internal_to_hf("layers.11.attn.k_norm.weight") == "model.layers.11.self_attn.k_norm.weight"
    assert hf_to_internal("model.layers.3.post_attention_layernorm.weight") == "layers.3.mlp_norm.weight"
    assert hf_to_internal("lm_head.weight") == "lm_head.weight"
    for name in ("embed_tokens.weight", "layers.0.attn_norm.weight", "layers.7.mlp.down_proj.weight", "norm.weight"):
        assert hf_to_internal(internal_to_hf(name)) == name
    with pytest.raises(UserError, match="model.rotary_emb.inv_freq"):
        hf_to_internal("model.rotary_emb.inv_freq")
    with pytest.raises(UserError, match="layers.0.attn.qkv.weight"):
        internal_to_hf("layers.0.attn.qkv.weight")


@pytest.mark.parametrize("text, expected", [(1234, 1234), ("5GB", 5 * 10**9), ("500MB", 500 * 10**6),
                                            ("2GiB", 2 * 2**30), ("100kb", 100_000), ("1.5MiB", 1_572_864)])
def test_parse_size(text, expected):
    """HF's convention: GB is 10^9 bytes, GiB 2^30."""
    assert parse_size(text) == expected


def test_parse_size_rejects_nonsense():
    with pytest.raises(UserError, match="5 XB"):
        parse_size("5 XB")


# --- roundtrips -----------------------------------------------------------


def test_fp32_roundtrip_is_bit_exact(saved):
    model, path = saved
    assert sorted(os.listdir(path)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert_same_weights(load_hf_model(path), model)
    assert not [p for p in os.listdir(path.parent) if ".tmp-" in p or ".old-" in p]


def test_bf16_save_roundtrip(tiny_config, tmp_path):
    model = make_model(tiny_config())
    path = save_hf_model(model, tmp_path / "bf16")  # default dtype: bf16
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    reader = HFCheckpointReader(path)
    assert all(reader.dtype(n) == torch.bfloat16 for n in reader.names())
    with open(path / "model.safetensors", "rb") as f:  # header: 8-byte length, then JSON
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}
    assert_same_weights(load_hf_model(path, dtype=torch.bfloat16), model.to(torch.bfloat16))


def test_sharded_save_loads_in_transformers_and_here(tiny_config, tmp_path):
    model = make_model(tiny_config())
    total = sum(p.numel() * 4 for p in model.parameters())
    path = save_hf_model(model, tmp_path / "sharded", dtype=torch.float32, max_shard_size=total // 4)
    shards = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
    assert len(shards) >= 3
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert sorted(set(index["weight_map"].values())) == shards
    assert_same_weights(load_hf_model(path), model)

    reference, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert (reference(ids).logits - model(ids)).abs().max().item() <= 1e-5


def test_tied_model_writes_no_head_and_loads_tied(tiny_config, tmp_path):
    model = make_model(tiny_config(tie_word_embeddings=True))
    path = save_hf_model(model, tmp_path / "tied", dtype=torch.float32)
    assert "lm_head.weight" not in hf_tensors(path)
    loaded = load_hf_model(path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert_same_weights(loaded, model)


def test_tied_checkpoint_with_equal_head_is_accepted_and_different_head_rejected(tiny_config, tmp_path):
    path = save_hf_model(make_model(tiny_config(tie_word_embeddings=True)), tmp_path / "tied", dtype=torch.float32)
    tensors = hf_tensors(path)
    rewrite(path, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()})
    loaded = load_hf_model(path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    rewrite(path, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1})
    with pytest.raises(UserError, match="lm_head.weight.*differs.*tie_word_embeddings"):
        load_hf_model(path)


def test_save_replaces_a_previous_model_but_not_other_directories(tiny_config, tmp_path):
    path = tmp_path / "out"
    save_hf_model(make_model(tiny_config(), seed=1), path, dtype=torch.float32, max_shard_size=4000)
    new = make_model(tiny_config(), seed=2)
    save_hf_model(new, path, dtype=torch.float32)
    assert not (path / "model.safetensors.index.json").exists()  # no stale shards of the old model
    assert_same_weights(load_hf_model(path), new)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a HuggingFace model directory"):
        save_hf_model(new, other)
    assert os.listdir(other) == ["todo.txt"]
    assert sorted(os.listdir(tmp_path)) == ["notes", "out"]


def test_failed_write_leaves_previous_model_and_no_temp_files(saved):
    model, path = saved
    with pytest.raises(UserError, match="never added"):
        with HFCheckpointWriter(path, model.config, torch.float32) as writer:
            writer.add("embed_tokens.weight", model.embed_tokens.weight)
            writer.finalize()
    assert_same_weights(load_hf_model(path), model)
    assert sorted(os.listdir(path.parent)) == ["model"]


def test_writer_rejects_wrong_shapes_and_duplicates(tiny_config, tmp_path):
    with HFCheckpointWriter(tmp_path / "w", tiny_config(), torch.float32) as writer:
        with pytest.raises(UserError, match=r"layers.0.attn.q_proj.weight.*\[3, 3\].*\[64, 32\]"):
            writer.add("layers.0.attn.q_proj.weight", torch.zeros(3, 3))
        writer.add("norm.weight", torch.ones(32))
        with pytest.raises(UserError, match="added twice"):
            writer.add("norm.weight", torch.ones(32))
        with pytest.raises(UserError, match="layers.5.mlp.up_proj.weight"):
            writer.add("layers.5.mlp.up_proj.weight", torch.zeros(64, 32))
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "config.json").write_text("{}")
        with pytest.raises(UserError, match="would overwrite the model's own config.json"):
            writer.add_file(tmp_path / "src" / "config.json")
        writer.abort()
    assert os.listdir(tmp_path) == ["src"]


# --- clear errors on broken checkpoints -----------------------------------


def test_missing_tensor_is_named(saved):
    _, path = saved
    tensors = hf_tensors(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    rewrite(path, tensors)
    with pytest.raises(UserError, match=r"model.safetensors.*'model.layers.1.mlp.up_proj.weight' is missing"):
        load_hf_model(path)


def test_extra_tensor_is_named(saved):
    _, path = saved
    tensors = hf_tensors(path)
    rewrite(path, {**tensors, "model.layers.2.mlp.up_proj.weight": torch.zeros(64, 32)})
    with pytest.raises(UserError, match="unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
        HFCheckpointReader(path).validate()
    rewrite(path, {**tensors, "model.rotary.freqs": torch.zeros(4)})
    with pytest.raises(UserError, match="model.safetensors.*'model.rotary.freqs'"):
        load_hf_model(path)


def test_wrong_shape_names_tensor_and_both_shapes(saved):
    _, path = saved
    tensors = hf_tensors(path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 32)
    rewrite(path, tensors)
    with pytest.raises(UserError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[16, 32\], "
                                        r"expected \[32, 32\]"):
        load_hf_model(path)


def test_malformed_config_json_is_named(saved):
    _, path = saved
    (path / "config.json").write_text('{"hidden_size": 32,')
    with pytest.raises(UserError, match="config.json.*malformed"):
        load_hf_model(path)


def test_index_naming_a_missing_file_is_named(tiny_config, tmp_path):
    path = save_hf_model(make_model(tiny_config()), tmp_path / "sharded", dtype=torch.float32, max_shard_size=8000)
    second = sorted(p for p in os.listdir(path) if p.startswith("model-"))[1]
    (path / second).unlink()
    with pytest.raises(FileNotFoundError, match=f"index.json lists '{second}', which is missing"):
        load_hf_model(path)


def test_missing_directory_config_or_weights(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_hf_model(tmp_path / "no-such-model")
    _, path = saved
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf_model(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_model(path)


# --- partial reads --------------------------------------------------------


def test_read_slice_equals_slicing_the_full_tensor(tiny_config, tmp_path):
    path = save_hf_model(make_model(tiny_config()), tmp_path / "m", dtype=torch.bfloat16, max_shard_size=8000)
    reader = HFCheckpointReader(path)
    assert reader.shape("layers.1.mlp.down_proj.weight") == (32, 64)
    full = reader.read("layers.1.mlp.down_proj.weight")
    for slices in [(slice(8, 24),), (slice(None), slice(16, 48)), (slice(0, 32, 1), slice(0, 1))]:
        assert torch.equal(reader.read_slice("layers.1.mlp.down_proj.weight", slices), full[slices])
    norm = reader.read("layers.0.attn.q_norm.weight", dtype=torch.float32)
    assert torch.equal(reader.read_slice("layers.0.attn.q_norm.weight", (slice(4, 12),), dtype=torch.float32),
                       norm[4:12])
    assert norm.dtype == torch.float32


# --- preset sizes ---------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_parameter_counts_match_published(preset):
    cfg = PRESETS[preset]
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    counted = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    assert counted == cfg.num_params()
    assert expected_shapes(cfg) == {name: tuple(p.shape) for name, p in model.named_parameters()}
    if preset not in PUBLISHED_PARAMS_B:  # the hybrids' cards count their vision tower: test_hybrid_parity.py
        return
    published = PUBLISHED_PARAMS_B[preset] * 1e9
    print(f"\n[params {preset}] meta model {counted / 1e9:.3f}B, num_params() {cfg.num_params() / 1e9:.3f}B, "
          f"published {PUBLISHED_PARAMS_B[preset]:.3f}B")
    assert abs(counted - published) / published < 0.005
    if preset in PUBLISHED_ACTIVE_B:  # the cards round the active count to two digits
        active = cfg.num_params(active=True)
        assert abs(active / 1e9 - PUBLISHED_ACTIVE_B[preset]) / PUBLISHED_ACTIVE_B[preset] < 0.02
        assert cfg.num_sparse_layers == cfg.num_hidden_layers


def test_a_preset_given_experts_by_overrides_is_saved_as_a_moe_model():
    """model_overrides that add experts to a dense preset (as docs/moe.md shows) make a Qwen3-MoE model, which
    its config.json must say, or transformers would load it as a dense model with its MLPs missing."""
    import dataclasses

    cfg = dataclasses.replace(PRESETS["qwen3-0.6b"], num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)
    data = cfg.to_hf_dict()
    assert data["model_type"] == "qwen3_moe" and data["architectures"] == ["Qwen3MoeForCausalLM"]
    assert dataclasses.replace(cfg, num_experts=0).to_hf_dict()["architectures"] == ["Qwen3ForCausalLM"]
