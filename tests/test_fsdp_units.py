"""Which FSDP units hold their gathered weights between forward and backward.

Without pipelining the last decoder layer to run forward keeps its weights for its backward, the first after
the loss (``apply_fsdp``'s ``keep_last_gathered``: one all-gather fewer per micro-batch); every other layer
frees them after its forward. Under pipelining every layer frees them. Checked on the module itself after a
real forward: FSDP2 swaps a unit's parameters back to their sharded DTensors when it frees the gathered ones.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore

from qwen3_pretrain.models.qwen3.config import get_preset
from qwen3_pretrain.parallel.dims import ParallelDims, stage_layer_ranges
from qwen3_pretrain.parallel.parallelize import PartSpec, build_stage, materialize, parallelize_stage
from qwen3_pretrain.train.model_source import ModelSource

TINY = {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
MOE = {**TINY, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
       "decoder_sparse_step": 1, "mlp_only_layers": []}


def _gathered_after_forward(preset: str, overrides: dict, world: int, **degrees) -> dict[str, bool]:
    """Per decoder layer (and its experts' unit) of the last stage: are its weights gathered after the
    stage's forward? Built as the engine builds it, on a fake process group."""
    cfg = dataclasses.replace(get_preset(preset), **overrides)
    rank = world - 1  # the last pipeline rank's first tp/dp rank is not needed: any rank of the last stage
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = ParallelDims.resolve(world_size=world, **degrees)
        mesh = dims.build_mesh("cpu")
        pp_rank, pp = mesh.get_local_rank("pp"), dims.pp
        part = build_stage(cfg, PartSpec(pp_rank, pp, stage_layer_ranges(cfg.num_hidden_layers, pp)[pp_rank]),
                           cfg.vocab_size, 16)
        parallelize_stage(part, mesh, dims.dp_mesh(mesh), "fp32",
                          expert_meshes=dims.expert_meshes(mesh) if dims.ep > 1 else None)
        materialize(part, torch.device("cpu"), ModelSource(cfg, None, "random init").tensor_source(cfg.vocab_size,
                                                                                                   seed=3))
        x = torch.randint(0, cfg.vocab_size, (1, 16)) if part.embed_tokens is not None \
            else torch.randn(1, 16, cfg.hidden_size)
        part(x, torch.arange(16).repeat(1, 1))
        gathered = {}
        for name, layer in part.layers.items():
            gathered[name] = not isinstance(layer.attn_norm.weight, DTensor)
        return gathered
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()


def test_without_pipelining_only_the_last_layer_stays_gathered():
    assert _gathered_after_forward("qwen3-0.6b", TINY, 2) == {"0": False, "1": False, "2": True}


def test_under_pipelining_every_layer_frees_its_weights():
    # 2 stages x dp 2: the last stage holds layers 2 (of 0-2: a 2 + 1 split) and frees it after forward
    gathered = _gathered_after_forward("qwen3-0.6b", TINY, 4, pp=2)
    assert gathered and not any(gathered.values()), gathered


def test_the_last_moe_layer_stays_gathered():
    assert _gathered_after_forward("qwen3-30b-a3b", MOE, 2) == {"0": False, "1": False, "2": True}


def test_under_expert_parallelism_the_last_layers_experts_are_not_freed_after_forward():
    """The experts' own unit (sharded over the ranks ep leaves). Read off FSDP's configuration, not a forward:
    a fake process group's all-to-all has no split sizes to exchange. (torch 2.13: a parameter group that
    frees its weights after forward has a ``post_forward_mesh_info``.)"""
    cfg = dataclasses.replace(get_preset("qwen3-30b-a3b"), **MOE)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        dims = ParallelDims.resolve(world_size=4, ep=2)
        mesh = dims.build_mesh("cpu")
        part = build_stage(cfg, PartSpec(0, 1, stage_layer_ranges(cfg.num_hidden_layers, 1)[0]), cfg.vocab_size, 16)
        parallelize_stage(part, mesh, dims.dp_mesh(mesh), "fp32", expert_meshes=dims.expert_meshes(mesh))
        freed = {name: layer.mlp.experts._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                 for name, layer in part.layers.items()}
        assert freed == {"0": True, "1": True, "2": False}
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()


def test_with_multi_token_prediction_its_layer_is_the_one_kept():
    """The multi-token-prediction layer runs forward last (after the main model's layers, before the loss)
    and its backward comes first: it keeps its weights, the main model's last layer frees them. Read off
    FSDP's configuration as above."""
    hybrid = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mtp_num_hidden_layers": 1}
    cfg = dataclasses.replace(get_preset("qwen3.5-0.8b"), **hybrid)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dims = ParallelDims.resolve(world_size=2)
        mesh = dims.build_mesh("cpu")
        part = build_stage(cfg, PartSpec(0, 1, stage_layer_ranges(cfg.num_hidden_layers, 1)[0]), cfg.vocab_size, 16,
                           multi_token_prediction=True)
        parallelize_stage(part, mesh, dims.dp_mesh(mesh), "fp32")

        def freed(unit):
            return unit._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None

        assert [freed(layer) for layer in part.layers.values()] == [True] * 4
        assert [freed(layer) for layer in part.mtp.layers.values()] == [False]
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()
