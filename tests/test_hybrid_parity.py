"""The hybrids (Qwen3.5 dense and MoE, Qwen3-Next) compute what transformers' models compute, through the HF
weight format, and stay exact on packed documents where transformers' own kernels do not.

Both directions go through files, as in test_model_parity.py: transformers -> ``save_pretrained`` ->
``load_hf_model``, and ours -> ``save_hf_model`` -> transformers, which must load the file as the class of its
family with no key missing or left over. Packed rows are compared document by document with transformers
running each document alone. Run with ``-s`` to see the max abs differences.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from qwen3_pretrain.models.qwen3.hf_io import load_hf_model, save_hf_model
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from tests.test_model_parity import max_diff, randomize

TOL = 1e-4

# Small widths with every quirk of the releases: GQA, head_dim != hidden / heads, partial RoPE (a quarter of
# each head), grouped value heads (2 per key head), a full-attention layer every second layer.
COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=256,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)

CASES = {
    "qwen3.5-untied": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                       dict(COMMON, intermediate_size=48, tie_word_embeddings=False)),
    "qwen3.5-tied": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                     dict(COMMON, intermediate_size=48, tie_word_embeddings=True)),
    "qwen3.5-moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, dict(COMMON, **MOE)),
    "qwen3-next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(COMMON, **MOE, intermediate_size=40, mlp_only_layers=[2], norm_topk_prob=True)),
}


def reference_model(case: str, seed: int):
    config_class, model_class, fields = CASES[case]
    torch.manual_seed(seed)
    model = model_class(config_class(**fields, attn_implementation="eager")).eval()
    randomize(model, seed=seed + 1)
    return model


def ids_for(vocab: int, seed: int, length: int = 23) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_transformers_to_ours(case, tmp_path):
    reference = reference_model(case, seed=0)
    reference.save_pretrained(tmp_path / "hf")
    model = load_hf_model(tmp_path / "hf", dtype=torch.float32)
    assert model.config.model_type == reference.config.model_type
    assert model.config.num_params() == sum(p.numel() for p in reference.parameters())
    ids = ids_for(CASES[case][2]["vocab_size"], 1)
    with torch.no_grad():
        diff = max_diff(model(ids), reference(ids).logits)
    print(f"\n[hybrid parity transformers->ours {case}] max abs diff {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("case", CASES)
def test_ours_to_transformers(case, tmp_path):
    reference = reference_model(case, seed=3)
    reference.save_pretrained(tmp_path / "ref")
    config = load_hf_model(tmp_path / "ref").config
    model = Qwen3Model(config)
    randomize(model, seed=4)
    save_hf_model(model, tmp_path / "hf", dtype=torch.float32)
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["architectures"] == [type(reference).__name__]
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert type(loaded) is type(reference)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = ids_for(config.vocab_size, 5)
    with torch.no_grad():
        diff = max_diff(model(ids), loaded(ids).logits)
    print(f"\n[hybrid parity ours->transformers {case}] max abs diff {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("case", ["qwen3.5-untied", "qwen3-next"])
def test_gated_deltanet_rows_are_held_per_key_head(case, tmp_path):
    """The layer holds its [q | k | v] channels (the convolution's rows; Qwen3.5's in_proj_qkv's) grouped per
    key head, so that any contiguous block of rows is whole heads, as tensor parallelism splits them; the
    files keep transformers' order (q of all heads, then k, then v). Reading reorders them (a slice reads its
    rows), writing restores the files bit for bit."""
    from safetensors.torch import load_file

    from qwen3_pretrain.models.qwen3.hf_io import HFCheckpointReader

    reference = reference_model(case, seed=6)
    reference.save_pretrained(tmp_path / "hf")
    heads, dk = COMMON["linear_num_key_heads"], COMMON["linear_key_head_dim"]
    values = COMMON["linear_num_value_heads"] // heads * COMMON["linear_value_head_dim"]  # per key head
    layer = reference.model.layers[0].linear_attn
    names = {"conv1d.weight": layer.conv1d.weight}
    if case.startswith("qwen3.5"):
        names["in_proj_qkv.weight"] = layer.in_proj_qkv.weight
    with HFCheckpointReader(tmp_path / "hf") as reader:
        for name, files in names.items():
            files = files.detach()
            q, k, v = files[:heads * dk], files[heads * dk:2 * heads * dk], files[2 * heads * dk:]
            held = torch.cat([torch.cat([q[h * dk:(h + 1) * dk], k[h * dk:(h + 1) * dk],
                                         v[h * values:(h + 1) * values]]) for h in range(heads)])
            assert torch.equal(reader.read(f"layers.0.linear_attn.{name}"), held), name
            rows = (slice(5, 3 * len(held) // 4),) + (slice(None),) * (held.dim() - 1)
            assert torch.equal(reader.read_slice(f"layers.0.linear_attn.{name}", rows), held[rows]), name
    save_hf_model(load_hf_model(tmp_path / "hf"), tmp_path / "out", dtype=torch.float32)
    written = load_file(tmp_path / "out" / "model.safetensors")
    source = load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == source.keys()
    assert all(torch.equal(written[n], source[n]) for n in source)


@pytest.mark.parametrize("case", ["qwen3.5-untied", "qwen3-next"])
def test_packed_documents_equal_each_document_alone(case, tmp_path):
    reference = reference_model(case, seed=6)
    reference.save_pretrained(tmp_path / "hf")
    model = load_hf_model(tmp_path / "hf", dtype=torch.float32, document_mask=True)
    lengths = [13, 1, 18]  # a one-token document between two others
    docs = [ids_for(model.config.vocab_size, 7 + k, n)[:1] for k, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        logits = model(packed, positions)
        offset = 0
        for doc, n in zip(docs, lengths):
            diff = max_diff(logits[:, offset:offset + n], reference(doc).logits)
            print(f"\n[hybrid packed {case}] document of {n}: max abs diff {diff:.3g}")
            assert diff <= TOL
            offset += n
        # transformers on the packed row leaks the first document into the next: the test can tell
        assert max_diff(reference(packed).logits[:, lengths[0] + 1:], logits[:, lengths[0] + 1:]) > 1e-2


HYBRID_PRESETS = ["qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b",
                  "qwen3.5-122b-a10b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b"]
REFERENCE_CLASSES = {"qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
                     "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
                     "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM)}


@pytest.mark.parametrize("name", HYBRID_PRESETS)
def test_preset_parameter_counts_equal_transformers(name):
    """Each preset's count (total and, for MoE, active) equals transformers' model of the same config, built
    on the meta device; and the config transformers reads from our config.json is the same model."""
    from qwen3_pretrain.models.qwen3.config import get_preset

    cfg = get_preset(name)
    config_class, model_class = REFERENCE_CLASSES[cfg.model_type]
    data = cfg.to_hf_dict()
    data.pop("model_type"), data.pop("architectures")
    with torch.device("meta"):
        reference = model_class(config_class(**data))
    assert cfg.num_params() == sum(p.numel() for p in reference.parameters())
    assert reference.config.layer_types == cfg.layer_types
    if cfg.is_moe:
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        idle = (cfg.num_experts - cfg.num_experts_per_tok) * per_expert * cfg.num_sparse_layers
        assert cfg.num_params(active=True) == cfg.num_params() - idle


def _with_mtp(path, config, seed: int):
    """Add to a saved model the multi-token-prediction layer the releases ship (``mtp.*``: transformers
    neither makes nor loads one), with random values."""
    from safetensors.torch import load_file, save_file

    from qwen3_pretrain.models.qwen3.hf_io import expected_shapes, expert_hf_name, internal_to_hf

    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    config = dataclasses.replace(config, mtp_num_hidden_layers=1)
    for name, shape in expected_shapes(config, mtp=True).items():
        if not name.startswith("mtp."):
            continue
        values = 0.2 * torch.randn(shape, generator=gen)
        if ".mlp.experts." in name:  # one tensor per expert, as the releases store them
            tensors.update({expert_hf_name(name, e): values[e] for e in range(shape[0])})
        else:
            tensors[internal_to_hf(name)] = values
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_multi_token_prediction_equals_its_definition_on_transformers_modules(tmp_path):
    """The MTP layer's logits equal the layer rebuilt from transformers' own modules (its decoder layer as a
    full-attention layer, its zero-centred norm, its rotary embedding) on the checkpoint's mtp.* weights:
    norm(embedding of token t+1) and norm(final hidden state at t), concatenated, projected, one decoder
    layer, a norm, the shared head."""
    reference = reference_model("qwen3.5-untied", seed=8)
    reference.save_pretrained(tmp_path / "hf")
    config = load_hf_model(tmp_path / "hf").config
    _with_mtp(tmp_path / "hf", config, seed=9)
    model = load_hf_model(tmp_path / "hf", dtype=torch.float32, mtp=True)
    ids = ids_for(config.vocab_size, 10)
    next_ids = ids_for(config.vocab_size, 11)
    with torch.no_grad():
        logits, mtp_logits = model(ids, None, next_ids)
        want = _reference_mtp_logits(reference, tmp_path / "hf", ids, next_ids)
    diff = max_diff(mtp_logits, want)
    print(f"\n[hybrid mtp] max abs diff {diff:.3g}")
    assert diff <= TOL
    assert max_diff(logits, reference(ids).logits) <= TOL


def _reference_mtp_logits(reference, path, ids, next_ids):
    from safetensors.torch import load_file
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    weights = {k[len("mtp."):]: v for k, v in load_file(path / "model.safetensors").items() if k.startswith("mtp.")}
    cfg = reference.config
    layer_cfg = type(cfg)(**{**cfg.to_dict(), "layer_types": ["full_attention"] * cfg.num_hidden_layers})
    layer_cfg._attn_implementation = "eager"
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = hf.Qwen3_5RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.data.copy_(weights[f"{name}.weight"])
    layer = hf.Qwen3_5DecoderLayer(layer_cfg, 0).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in weights.items() if k.startswith("layers.0.")})
    hidden = reference.model(ids).last_hidden_state  # after the final norm
    embeds = reference.model.embed_tokens(next_ids)
    x = torch.cat([norms["pre_fc_norm_embedding"](embeds), norms["pre_fc_norm_hidden"](hidden)], dim=-1)
    x = torch.nn.functional.linear(x, weights["fc.weight"])
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    cos_sin = hf.Qwen3_5TextRotaryEmbedding(layer_cfg)(x, positions)
    seq = ids.shape[1]
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    x = layer(x, position_embeddings=cos_sin, attention_mask=causal, position_ids=positions)
    return reference.lm_head(norms["norm"](x))


@pytest.mark.parametrize("preset, pattern", [("qwen3-0.6b", ["full_attention"] * 4),
                                             ("qwen3.5-0.8b", ["linear_attention"] * 3 + ["full_attention"]),
                                             ("qwen3-next-80b-a3b", ["linear_attention"] * 3 + ["full_attention"])])
def test_model_overrides_change_the_depth_of_a_preset(preset, pattern, tmp_path):
    """``model_overrides: {num_hidden_layers: 5}`` on a preset: a dense one stays all attention, a hybrid keeps
    its pattern (three Gated DeltaNet layers, then full attention) over the new depth."""
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig
    from qwen3_pretrain.train.model_source import resolve_model

    cfg = from_dict(TrainConfig, {"model_name": preset, "data_path": str(tmp_path), "output_path": str(tmp_path),
                                  "model_overrides": {"num_hidden_layers": 5, "hidden_size": 64}}, source="test")
    model = resolve_model(cfg).config
    assert model.num_hidden_layers == 5 and model.layer_types == pattern + pattern[:1]


# The released sizes, as REFERENCE.md lists them from the checkpoints' config.json (written out here, not read
# from the presets): hidden, layers, attention heads / KV heads, MLP (or expert) width, Gated DeltaNet key /
# value heads, experts / top-k, tied, vocabulary.
PUBLISHED = {
    "qwen3.5-0.8b": (1024, 24, 8, 2, 3584, 16, 16, 0, 0, True, 248320),
    "qwen3.5-2b": (2048, 24, 8, 2, 6144, 16, 16, 0, 0, True, 248320),
    "qwen3.5-4b": (2560, 32, 16, 4, 9216, 16, 32, 0, 0, True, 248320),
    "qwen3.5-9b": (4096, 32, 16, 4, 12288, 16, 32, 0, 0, False, 248320),
    "qwen3.5-27b": (5120, 64, 24, 4, 17408, 16, 48, 0, 0, False, 248320),
    "qwen3.5-35b-a3b": (2048, 40, 16, 2, 512, 16, 32, 256, 8, False, 248320),
    "qwen3.5-122b-a10b": (3072, 48, 32, 2, 1024, 16, 64, 256, 8, False, 248320),
    "qwen3.5-397b-a17b": (4096, 60, 32, 2, 1024, 16, 64, 512, 10, False, 248320),
    "qwen3-next-80b-a3b": (2048, 48, 16, 2, 512, 16, 32, 512, 10, False, 151936),
}


@pytest.mark.parametrize("name", HYBRID_PRESETS)
def test_presets_have_the_published_sizes(name):
    from qwen3_pretrain.models.qwen3.config import get_preset

    cfg = get_preset(name)
    width = cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size
    got = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, width,
           cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.num_experts,
           cfg.num_experts_per_tok if cfg.is_moe else 0, cfg.tie_word_embeddings, cfg.vocab_size)
    assert got == PUBLISHED[name]
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.linear_key_head_dim) == (256, 64, 1e7, 128)
    assert cfg.layer_types[3::4] == ["full_attention"] * (cfg.num_hidden_layers // 4)
    assert cfg.num_linear_layers == 3 * cfg.num_hidden_layers // 4
    if cfg.is_moe:
        assert cfg.shared_expert_intermediate_size == width and cfg.norm_topk_prob
