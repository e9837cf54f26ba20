"""``simulate``'s step of many micro-batches extrapolated from two shorter simulated steps
(simulate/microbatches.py) against the whole step simulated, on tiny models: gradient accumulation under
FSDP, a 1F1B pipeline with tp, MoE with ep; and the figures table's arithmetic (bench/planner_figures.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.simulate.microbatches import extrapolation_counts
from qwen3_pretrain.simulate.run import make_world, simulate_ranks
from qwen3_pretrain.train.config import TrainConfig

BENCH = Path(__file__).resolve().parents[1] / "bench"

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
TINY_MOE = {"num_hidden_layers": 2, "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 4,
            "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 512}


def _bench_module(name: str):
    """``bench/<name>.py`` imported from its file, not through ``sys.path``: bench/ put on the path would stay
    there for every later test of the session, where its scripts' names could shadow a module's."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while its classes are made
    spec.loader.exec_module(module)
    return module


def _both(overrides: list[str], world_size: int, device: str = "h100"):
    cfg = load_config(TrainConfig, None, ["seq_length=32", "activation_checkpointing=full", *overrides])
    world = make_world(cfg, world_size, hardware=device)
    ranks = world.dims.first_rank_of_stages()
    whole = simulate_ranks(world, ranks, jobs=2, extrapolate=False)
    short = simulate_ranks(world, ranks, jobs=2)
    return world, whole, short


def _same(whole, short) -> None:
    for w, s in zip(whole, short):
        assert w.extrapolated_from is None and s.extrapolated_from is not None
        assert s.trace.matmuls == w.trace.matmuls
        assert s.trace.attention == w.trace.attention
        assert s.trace.host_ops == w.trace.host_ops
        for phase, ops in w.trace.memory.items():
            got = s.trace.memory[phase]
            assert (got.ops, got.regions) == (ops.ops, ops.regions), phase
            assert got.eager_bytes == pytest.approx(ops.eager_bytes, rel=1e-12, abs=1e-6), phase
            assert got.fused_bytes == pytest.approx(ops.fused_bytes, rel=1e-12, abs=1e-6), phase
        assert s.comm_calls.keys() == w.comm_calls.keys()
        for key, (nbytes, calls) in w.comm_calls.items():
            assert s.comm_calls[key][1] == calls and s.comm_calls[key][0] == pytest.approx(nbytes), key
        assert s.attention == w.attention
        assert s.peak == w.peak  # held memory stops growing after the shorter steps' counts
        for mode in ("eager", "compiled"):
            assert s.roofline[mode]["step_s"] == pytest.approx(w.roofline[mode]["step_s"], rel=1e-6)


def test_counts_only_where_they_save_work():
    assert extrapolation_counts(64, 1, "1f1b") == (2, 3)
    assert extrapolation_counts(5, 1, "1f1b") is None  # 2 + 3 micro-batches: no saving
    assert extrapolation_counts(6, 1, "1f1b") == (2, 3)
    assert extrapolation_counts(64, 4, "1f1b") == (4, 5)  # the warm-up of 3 forwards complete
    assert extrapolation_counts(64, 2, "gpipe") is None  # the peak grows with the count
    assert extrapolation_counts(64, 2, "interleaved") is None


def test_accumulation_under_fsdp_extrapolates_exactly():
    """dp 2 (FSDP, weights gathered per micro-batch), 6 accumulated micro-batches: simulated at 2 and 3."""
    _, whole, short = _both(["model_name=qwen3-8b", f"model_overrides={json.dumps(TINY)}", "tp=1", "pp=1",
                             "batch_size=1", "gradient_accumulation_steps=6"], 2)
    assert short[0].extrapolated_from == (2, 3)
    _same(whole, short)


def test_1f1b_pipeline_with_tp_extrapolates_exactly():
    """tp 2 x pp 2, 6 pipeline micro-batches, both stages; built for the 910B (its kernels and pricing)."""
    world, whole, short = _both(["model_name=qwen3-8b", f"model_overrides={json.dumps(TINY)}", "tp=2", "pp=2",
                                 "batch_size=6", "pp_microbatch_size=1"], 4, device="910b")
    assert world.layout.num_microbatches == 6 and len(short) == 2
    _same(whole, short)
    assert whole[0].roofline["eager"]["breakdown_s"]["bubble"] > 0


def test_moe_with_ep_extrapolates_exactly():
    """Qwen3-MoE, dp 2 x ep 2, 6 accumulated micro-batches (the heaviest ep rank at 2x the mean)."""
    cfg = load_config(TrainConfig, None, ["seq_length=32", "activation_checkpointing=full",
                                          "model_name=qwen3-30b-a3b", f"model_overrides={json.dumps(TINY_MOE)}",
                                          "tp=1", "pp=1", "ep=2", "batch_size=1", "gradient_accumulation_steps=6"])
    world = make_world(cfg, 2, moe_imbalance=2.0)
    whole = simulate_ranks(world, [0], jobs=2, extrapolate=False)
    short = simulate_ranks(world, [0], jobs=2)
    _same(whole, short)
    assert ("ep", "all_to_all", 2) in short[0].comm_calls


def test_what_52_percent_needs_is_computed_from_the_breakdown():
    """bench/planner_figures.py's ``reach`` on hand-made breakdowns: MFU scales as 1 / step, so 40% MFU at
    a 1.3 s step needs 1.0 s at 52%; overheads go first, then compute."""
    reach = _bench_module("planner_figures").reach

    # 1.0 s compute + 0.3 s of overheads at 40%: the step must fall to 1.0 s, i.e. every overhead gone.
    overheads = {"matmul": 0.6, "attention": 0.3, "elementwise": 0.1, "communication": 0.2, "host": 0.1,
                 "bubble": 0.0, "step": 1.3}
    r = reach(overheads, 0.40)
    assert r["target_step_s"] == pytest.approx(1.0) and r["gap_s"] == pytest.approx(0.3)
    assert r["verdict"] == "overheads" and r["overheads_cut"] == pytest.approx(1.0)
    assert set(r["overheads_s"]) == {"communication", "host"}  # a zero bubble is not an overhead to cut
    assert r["compute_only_mfu"] == pytest.approx(0.52)
    # compute alone 1.2 s at 26% of a 1.5 s step: 52% needs 0.75 s, compute 37.5% shorter with no overheads.
    compute = {"matmul": 1.0, "attention": 0.1, "elementwise": 0.1, "communication": 0.1, "host": 0.0,
               "bubble": 0.2, "step": 1.5}
    r = reach(compute, 0.26)
    assert r["verdict"] == "compute" and r["compute_cut"] == pytest.approx(0.375)
    assert reach(compute, 0.60)["verdict"] == "reached"
