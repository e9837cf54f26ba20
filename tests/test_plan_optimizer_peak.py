"""AdamW's step temporaries: the planner's optimizer term and the simulation against a measured CPU step.

torch's foreach AdamW (what the engine runs where the device has no fused kernel:
``hardware.optimizer_impl``, e.g. an NPU without torch_npu's) steps each
parameter group as one list: ``sqrt`` of every second moment into a new fp32
tensor, the whole group's at once, freed before the next group. The engine's
optimizer has two groups (``train/optim.py``: weight-decayed, and not: the
embedding, the norms), so the step's temporary is the larger group, not the
whole shard (the planner's earlier term, 73% high on the model here). The
simulation builds the engine on the CPU device type, where AdamW is fused; it
plays the target's kernel (``simulate/optimizer.py``), without which a 910B
layout whose peak is the optimizer step came out 3-4 GiB low (Qwen3-8B, tp 4,
pp 2: docs/planner.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.init import init_param
from qwen3_pretrain.parallel.parallelize import PartSpec, build_stage, materialize
from qwen3_pretrain.plan.layout import Layout, stage_shapes
from qwen3_pretrain.plan.memory import _moments
from qwen3_pretrain.simulate.memtrack import MemoryTracker
from qwen3_pretrain.simulate.optimizer import target_optimizer
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.optim import build_optimizer

CFG = Qwen3Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=384, vocab_size=8192)


def _engine_optimizer(*overrides: str) -> torch.optim.AdamW:
    """The engine's AdamW (its groups and settings) over a real one-stage model, gradients set."""
    model = build_stage(CFG, PartSpec(0, 1, range(CFG.num_hidden_layers)), CFG.vocab_size, 4096)
    materialize(model, torch.device("cpu"), lambda name, shape, slices: init_param(name, shape, CFG, 0, slices))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return build_optimizer([model], load_config(TrainConfig, None, ["model_name=qwen3-8b", *overrides]), tied=False)


def _step_temporaries(optimizer: torch.optim.Optimizer) -> int:
    """Peak bytes a step allocates beyond what exists before it (its state made by a first step)."""
    optimizer.step()
    with MemoryTracker("cpu") as mem:
        optimizer.step()
    return mem.peak_bytes


def _planned(impl: str, embedding_decay: bool = False) -> float:
    layout = Layout(device_type="cpu", optimizer_impl=impl, seq_length=256, activation_checkpointing="none",
                    embedding_decay=embedding_decay)
    (shape,) = stage_shapes(CFG, layout)
    moments = _moments(CFG, layout, shape)
    return moments["optimizer step"]["optimizer"] - moments["layer backward"]["optimizer"]


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_planned_step_temporaries_are_the_measured_ones(impl):
    """Measured: fused 0; foreach 4 bytes x the decayed group (the layers and the head: 1.44 M of 2.49 M
    parameters, 5,767,168 bytes, planned exactly); the per-tensor loop two fp32 copies of the largest tensor (the embedding) and one of an MLP weight
    (8,585,216 bytes against the planned 8,388,608)."""
    engine = _engine_optimizer()
    assert engine.defaults.get("fused")  # the engine's choice on a CPU; the other kernels as a target runs them
    groups = [sum(p.numel() for p in g["params"]) for g in engine.param_groups]
    assert len(groups) == 2 and min(groups) > 0.25 * sum(groups)  # the embedding alone in the second group
    measured = _step_temporaries(target_optimizer(engine, impl))
    planned = _planned(impl)
    if impl == "fused":
        assert measured == planned == 0
    else:
        assert planned == pytest.approx(measured, rel=0.03 if impl == "for-loop" else 1e-3)
    if impl == "foreach":
        assert measured == 4 * max(groups) < 0.8 * 4 * sum(groups)


def test_decayed_embedding_moves_into_the_larger_group():
    """With weight_decay_embeddings the embedding is decayed beside the matrices: the foreach step's
    temporary is then almost the whole model's (only the norms stay apart), and the planner follows."""
    engine = _engine_optimizer("weight_decay_embeddings=true")
    groups = [sum(p.numel() for p in g["params"]) for g in engine.param_groups]
    assert max(groups) > 0.99 * sum(groups)
    measured = _step_temporaries(target_optimizer(engine, "foreach"))
    assert measured == 4 * max(groups)
    assert _planned("foreach", embedding_decay=True) == pytest.approx(measured, rel=1e-3)
    assert _planned("foreach") < 0.8 * measured  # the default grouping's term would not cover it


def test_simulation_steps_the_targets_optimizer():
    """A one-rank world whose peak is the optimizer step, simulated for the 910B (foreach AdamW: the
    planner's assumption without torch_npu's fused kernel) and for the H100 (fused): the simulated peak is
    the planner's, and the difference between the two is the larger group's fp32 temporary."""
    from qwen3_pretrain.simulate.run import make_world, simulate_ranks

    model = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096}
    cfg = load_config(TrainConfig, None, ["model_name=qwen3-8b", f"model_overrides={json.dumps(model)}", "tp=1",
                                          "pp=1", "seq_length=128", "batch_size=1", "mixed_precision=bf16"])
    peaks = {}
    for device in ("910b", "h100"):
        world = make_world(cfg, 1, hardware=device)
        (r,) = simulate_ranks(world, [0], steps=1)
        peaks[device] = r.peak
        if world.layout.optimizer_impl == "foreach":
            assert r.predicted.moment == "optimizer step"
            assert r.peak["total"] == pytest.approx(r.predicted.allocated, rel=1e-3)
    assert make_world(cfg, 1, hardware="910b").layout.optimizer_impl == "foreach"
    layers = 2 * (4 * 256 * 64 * 2 + 2 * 256 * 2 * 64 + 3 * 256 * 768) + 4096 * 256  # the decayed group
    grown = peaks["910b"]["optimizer"] - peaks["h100"]["optimizer"]
    assert grown == pytest.approx(4 * layers, rel=0.01)
