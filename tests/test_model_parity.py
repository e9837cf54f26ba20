"""The model computes what HuggingFace's ``Qwen3ForCausalLM`` computes, through the HF weight format.

Both directions go through files: our model -> ``save_hf_model`` ->
``transformers.from_pretrained``, and ``transformers`` -> ``save_pretrained``
-> ``load_hf_model``. Run with ``-s`` to see the max abs differences.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from qwen3_pretrain.models.qwen3.hf_io import load_hf_model, save_hf_model
from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model

TOL = 1e-5

# Tied and untied; head_dim equal to and different from hidden / heads; GQA ratios 1, 3 and 2.
CASES = {
    "tied-mha-headdim16": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                               tie_word_embeddings=True),
    "untied-gqa3-headdim8": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                 num_hidden_layers=3, intermediate_size=96),
    "tied-gqa2-headdim32": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                tie_word_embeddings=True, rope_theta=10_000.0),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights, norms included: norms left at one would hide a swapped q_norm/k_norm."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)


def hf_config(cfg) -> "transformers.Qwen3Config":
    """The transformers config for ``cfg``, written field by field (not through our own exporter)."""
    return transformers.Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        attn_implementation="eager")  # HF's own attention code, not the SDPA kernel our model calls


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_ours_to_transformers(case, tiny_config, tmp_path):
    cfg = tiny_config(**CASES[case])
    model = Qwen3Model(cfg)
    randomize(model, seed=1)
    save_hf_model(model, tmp_path / "hf", dtype=torch.float32)
    reference, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = max_diff(model(ids), reference(ids).logits)
    print(f"\n[parity ours->transformers {case}] max abs diff {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("case", CASES)
def test_transformers_to_ours(case, tiny_config, tmp_path):
    cfg = tiny_config(**CASES[case])
    torch.manual_seed(3)
    reference = transformers.Qwen3ForCausalLM(hf_config(cfg)).eval()
    randomize(reference, seed=4)
    reference.save_pretrained(tmp_path / "hf")
    model = load_hf_model(tmp_path / "hf", dtype=torch.float32)
    assert model.config.rope_theta == cfg.rope_theta
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = max_diff(model(ids), reference(ids).logits)
    print(f"\n[parity transformers->ours {case}] max abs diff {diff:.3g}")
    assert diff <= TOL


def test_explicit_positions_match_default(tiny_config):
    model = Qwen3Model(tiny_config())
    randomize(model, seed=6)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(model(ids, positions=torch.arange(12).expand(2, 12)), model(ids))


def test_document_mask_equals_separate_documents(tiny_config):
    model = Qwen3Model(tiny_config()).eval()
    randomize(model, seed=8)
    gen = torch.Generator().manual_seed(9)
    docs = [torch.randint(0, 256, (1, n), generator=gen) for n in (5, 8, 3)]
    packed = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]  # restarts at 0 per document
    masked = Qwen3Model(tiny_config(), ModelOptions(document_mask=True)).eval()
    masked.load_state_dict(model.state_dict())
    with torch.no_grad():
        separate = torch.cat([model(d) for d in docs], dim=1)
        diff = max_diff(masked(packed, positions=positions), separate)
    print(f"\n[document mask vs separate documents] max abs diff {diff:.3g}")
    assert diff <= TOL
