"""A Qwen3-MoE model computes what transformers' ``Qwen3MoeForCausalLM`` computes, through the HF weight format.

Both directions go through files, as in test_model_parity.py: ours -> ``save_hf_model`` -> transformers, and
transformers -> ``save_pretrained`` -> ``load_hf_model``; and the packed expert layout transformers >= 5 keeps in
memory (``gate_up_proj``) is read as well. Run with ``-s`` to see the max abs differences.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from qwen3_pretrain.models.ops.moe import ExpertLoop, GroupedMM
from qwen3_pretrain.models.qwen3.hf_io import HFCheckpointReader, load_hf_model, save_hf_model
from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model
from tests.test_model_parity import max_diff, randomize

TOL = 1e-5

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
# norm_topk_prob both ways; a dense layer among sparse ones two ways (mlp_only_layers, decoder_sparse_step);
# GQA ratios 2 and 3; tied and untied heads.
CASES = {
    "untied-norm-topk": dict(MOE, norm_topk_prob=True),
    "tied-no-norm": dict(MOE, norm_topk_prob=False, tie_word_embeddings=True),
    "mlp-only-layer-1": dict(MOE, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]),
    "sparse-step-2-gqa3": dict(MOE, num_experts_per_tok=3, decoder_sparse_step=2, num_hidden_layers=4,
                               hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8),
}


def hf_config(cfg) -> "transformers.Qwen3MoeConfig":
    """transformers' config for ``cfg``, written field by field (not through our own exporter)."""
    return transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers), norm_topk_prob=cfg.norm_topk_prob,
        attn_implementation="eager")


def reference_model(cfg, seed: int):
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(hf_config(cfg)).eval()
    randomize(model, seed=seed + 1)
    return model


def ids_for(cfg, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_ours_to_transformers(case, tiny_config, tmp_path):
    cfg = tiny_config(**CASES[case])
    model = Qwen3Model(cfg)
    randomize(model, seed=1)
    save_hf_model(model, tmp_path / "hf", dtype=torch.float32)
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["model_type"] == "qwen3_moe" and saved["architectures"] == ["Qwen3MoeForCausalLM"]
    reference, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert isinstance(reference, transformers.Qwen3MoeForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = ids_for(cfg, 2)
    with torch.no_grad():
        diff = max_diff(model(ids), reference(ids).logits)
    print(f"\n[moe parity ours->transformers {case}] max abs diff {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("case", CASES)
def test_transformers_to_ours(case, tiny_config, tmp_path):
    cfg = tiny_config(**CASES[case])
    reference = reference_model(cfg, seed=3)
    reference.save_pretrained(tmp_path / "hf")
    model = load_hf_model(tmp_path / "hf", dtype=torch.float32)
    assert model.config.num_experts == cfg.num_experts and model.config.is_sparse_layer(0) == cfg.is_sparse_layer(0)
    ids = ids_for(cfg, 5)
    with torch.no_grad():
        diff = max_diff(model(ids), reference(ids).logits)
    print(f"\n[moe parity transformers->ours {case}] max abs diff {diff:.3g}")
    assert diff <= TOL


def test_packed_expert_layout_reads_the_same(tiny_config, tmp_path):
    """transformers' in-memory layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]) saved as is: the same
    model, and a slice of a stacked tensor reads only its experts and rows."""
    cfg = tiny_config(**CASES["untied-norm-topk"])
    reference = reference_model(cfg, seed=7)
    reference.save_pretrained(tmp_path / "hf")  # for config.json
    packed = {name: p.detach().clone().contiguous() for name, p in reference.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in packed
    for path in (tmp_path / "hf").glob("*.safetensors"):
        path.unlink()
    save_file(packed, str(tmp_path / "hf" / "model.safetensors"))
    model = load_hf_model(tmp_path / "hf", dtype=torch.float32)
    ids = ids_for(cfg, 8)
    with torch.no_grad():
        assert max_diff(model(ids), reference(ids).logits) <= TOL
    gate_up = packed["model.layers.1.mlp.experts.gate_up_proj"]
    inter = cfg.moe_intermediate_size
    with HFCheckpointReader(tmp_path / "hf") as reader:
        assert reader.shape("layers.1.mlp.experts.up_proj") == (8, inter, cfg.hidden_size)
        part = reader.read_slice("layers.1.mlp.experts.up_proj", (slice(2, 5), slice(3, 9)))
        assert torch.equal(part, gate_up[2:5, inter + 3:inter + 9])


def test_per_expert_files_slice_reads(tiny_config, tmp_path):
    cfg = tiny_config(**CASES["untied-norm-topk"])
    model = Qwen3Model(cfg)
    randomize(model, seed=9)
    save_hf_model(model, tmp_path / "hf", dtype=torch.float32, max_shard_size=4000)  # experts over many files
    down = model.get_parameter("layers.0.mlp.experts.down_proj")
    with HFCheckpointReader(tmp_path / "hf") as reader:
        reader.validate()
        assert reader.hf_name("layers.0.mlp.experts.down_proj") == "model.layers.0.mlp.experts.*.down_proj.weight"
        assert torch.equal(reader.read_slice("layers.0.mlp.experts.down_proj", (slice(5, 8), slice(0, 7))),
                           down[5:8, :7].detach())


def test_missing_expert_is_named(tiny_config, tmp_path):
    cfg = tiny_config(**CASES["untied-norm-topk"])
    save_hf_model(Qwen3Model(cfg), tmp_path / "hf", dtype=torch.float32)
    path = tmp_path / "hf" / "model.safetensors"
    from safetensors.torch import load_file
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight.*missing"):
        load_hf_model(tmp_path / "hf")


def test_grouped_mm_kernel_equals_the_loop(tiny_config):
    """The grouped kernel (bf16) computes what one matmul per expert computes, forward and backward."""
    cfg = tiny_config(**dict(MOE, moe_intermediate_size=32, hidden_size=64, num_attention_heads=4, head_dim=16,
                             num_experts_per_tok=3))
    results = []
    for kernel in (ExpertLoop(), GroupedMM()):
        model = Qwen3Model(cfg, ModelOptions(experts=kernel)).to(torch.bfloat16)
        randomize(model, seed=10)
        model.to(torch.bfloat16)
        out = model(ids_for(cfg, 11)).float()
        out.pow(2).mean().backward()
        results.append((out.detach(), model.get_parameter("layers.1.mlp.experts.gate_proj").grad.float()))
    (out_a, grad_a), (out_b, grad_b) = results
    assert max_diff(out_a, out_b) <= 2e-2 * out_a.abs().max().item()
    assert max_diff(grad_a, grad_b) <= 2e-2 * grad_a.abs().max().item()
