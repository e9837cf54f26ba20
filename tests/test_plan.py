"""The planner: formulas against hand computations, the memory model against measured steps, the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from qwen3_pretrain.cli import run_command
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.hardware import get_device
from qwen3_pretrain.models.ops.gated_delta import CHUNK_SIZE
from qwen3_pretrain.models.ops.moe import GROUPED_MM_ALIGN, ExpertLoop, GroupedMM
from qwen3_pretrain.models.ops.precision import Fp32Linear, fp32_attention
from qwen3_pretrain.models.qwen3.config import Qwen3Config, get_preset
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from qwen3_pretrain.models.qwen3.model import ModelOptions, rope_cos_sin
from qwen3_pretrain.plan import formulas as F
from qwen3_pretrain.plan import layers, memory
from qwen3_pretrain.plan.cli import build_parser, fixed_settings
from qwen3_pretrain.plan.cli import main as plan_main
from qwen3_pretrain.plan.flops import model_layers, token_flops
from qwen3_pretrain.plan.layers import largest_tensor, saved_bytes_per_token
from qwen3_pretrain.plan.layout import Cluster, LayerKind, Layout, enumerate_layouts, stage_shapes
from qwen3_pretrain.plan.memory import GiB, recomputed_bytes_per_token, predict_memory, stage_params
from qwen3_pretrain.simulate.memtrack import MemoryTracker
from qwen3_pretrain.plan.step import _stage_flops_per_microbatch, predict_step

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ["--model", "qwen3-8b", "--nodes", "2", "--devices-per-node", "4", "--device", "910b", "--tp", "4",
             "--pp", "2", "--micro-batch-size", "4", "--seq-length", "8192", "--activation-checkpointing", "full",
             "--distributed-optimizer"]


# --- formulas ------------------------------------------------------------------------


def test_bytes_per_param_follow_megatron_and_zero():
    assert F.megatron_bytes_per_param(1, False) == 18
    assert F.megatron_bytes_per_param(4, True) == 6 + 12 / 4
    # ZeRO over 4 ranks, mixed precision: 2 + 4 + 12 sharded progressively
    assert [F.zero_bytes_per_param(s, 4) for s in range(4)] == [18, 2 + 4 + 3, 2 + 1 + 3, 0 + 1 + 3]
    assert F.zero_bytes_per_param(0, 4, mixed=False) == 16
    with pytest.raises(ValueError):
        F.zero_bytes_per_param(4, 2)


def test_megatron_activation_formula_by_hand():
    # s=2048, b=1, h=4096, a=32: sbh = 8,388,608 and 5as/h = 80
    args = dict(seq=2048, batch=1, hidden=4096, heads=32, t=8)
    assert F.megatron_activation_bytes_per_layer(seq=2048, batch=1, hidden=4096, heads=32) == 8388608 * 114
    assert F.megatron_activation_bytes_per_layer(**args) == 8388608 * (10 + 104 / 8)
    assert F.megatron_activation_bytes_per_layer(**args, sequence_parallel=True) == 8388608 * 114 / 8
    assert F.megatron_activation_bytes_per_layer(**args, sequence_parallel=True, recompute="selective") \
        == 8388608 * 34 / 8
    assert F.megatron_activation_bytes_per_layer(**args, recompute="full") == 2 * 8388608


@pytest.mark.parametrize("dtype, fp32_matmul", [(torch.bfloat16, False), (torch.float32, False),
                                                (torch.bfloat16, True)])
def test_qwen3_layer_formula_matches_what_autograd_saves(dtype, fp32_matmul):
    """Count the bytes of every storage one real decoder layer saves for backward (parameters and the
    inputs excluded) and compare with the per-token formula; also with bf16 computed on fp32 copies."""
    cfg = Qwen3Config(hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=768, vocab_size=128)
    options = ModelOptions(linear=Fp32Linear, attention=fp32_attention()) if fp32_matmul else ModelOptions()
    layer = Qwen3Model(cfg, options).to(dtype).layers["0"]
    seq = 128
    x = torch.randn(1, seq, 256, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(seq)[None], 64, cfg.rope_theta, dtype)
    outside = {t.untyped_storage()._cdata for t in [*layer.parameters(), cos, sin]}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in outside:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin)
    per_token = F.qwen3_layer_saved_bytes_per_token(256, 256, 128, 4, 2, 768, t=1, dtype_bytes=dtype.itemsize,
                                                    fp32_matmul=fp32_matmul)
    assert sum(saved.values()) / seq == per_token


@pytest.mark.parametrize("dtype, fp32_matmul", [(torch.bfloat16, False), (torch.float32, False),
                                                (torch.bfloat16, True)])
@pytest.mark.parametrize("ac_mode", ["selective", "mlp"])
def test_recompute_drops_what_the_planner_says(dtype, fp32_matmul, ac_mode):
    """The bytes one real layer keeps after its forward, measured by MemoryTracker (allocations, not the
    saved-tensor hooks: a checkpoint holds its inputs outside them), without recompute minus with it,
    equal the planner's drop for selective (attention core) and MLP recompute."""
    cfg = Qwen3Config(hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=768, vocab_size=128)
    seq = 128
    cos, sin = rope_cos_sin(torch.arange(seq)[None], 64, cfg.rope_theta, dtype)

    def kept_per_token(mode: str) -> float:
        numerics = dict(linear=Fp32Linear, attention=fp32_attention()) if fp32_matmul else {}
        layer = Qwen3Model(cfg, ModelOptions(recompute=mode, **numerics)).to(dtype).layers["0"]
        x = torch.randn(1, seq, 256, dtype=dtype, requires_grad=True)
        with MemoryTracker() as mem:
            out = layer(x, cos, sin)
            return (mem.current_bytes - out.untyped_storage().nbytes()) / seq

    layout = Layout(mixed_precision="bf16" if dtype == torch.bfloat16 else "fp32", fp32_matmul=fp32_matmul,
                    activation_checkpointing=ac_mode, device_type="cpu")
    want = recomputed_bytes_per_token(cfg, layout, ac_mode)
    assert kept_per_token("none") - kept_per_token(ac_mode) == want > 0


SPARSE = LayerKind(sparse=True)
MOE_CFG = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               intermediate_size=768, vocab_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
               mlp_only_layers=[0])


def _saved_per_token(module, *inputs, seq: int, outside=()) -> float:
    """Bytes per token of every storage ``module`` saves for backward and still holds after its forward (its
    parameters and ``outside`` excluded; a tensor saved only by a part of the graph whose result is dropped,
    such as the delta rule's last state update, is freed with it)."""
    skip = {t.untyped_storage()._cdata for t in [*module.parameters(), *outside]}
    packed: list[weakref.ref] = []

    def pack(t):
        packed.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    alive = [t for t in (ref() for ref in packed) if t is not None]
    saved = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in alive}
    del out
    return sum(n for key, n in saved.items() if key not in skip) / seq


@pytest.mark.parametrize("dtype, kernel, norm", [(torch.bfloat16, "grouped_mm", True), (torch.float32, "loop", True),
                                                 (torch.bfloat16, "loop", False)])
def test_moe_layer_formula_matches_what_autograd_saves(dtype, kernel, norm):
    """A real sparse decoder layer (attention + MoE block) saves what the planner's per-token formulas say, up
    to the expert counts (one small int32 vector per micro-batch); the planner's layer figure uses them."""
    cfg = Qwen3Config(**dict(MOE_CFG, norm_topk_prob=norm))
    experts = GroupedMM() if kernel == "grouped_mm" else ExpertLoop()
    layer = Qwen3Model(cfg, ModelOptions(experts=experts)).to(dtype).layers["1"]
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    seq = 128
    x = torch.randn(1, seq, 256, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(seq)[None], 64, cfg.rope_theta, dtype)
    measured = _saved_per_token(layer, x, cos, sin, seq=seq, outside=(cos, sin))  # fp32: the norm keeps x itself
    d = dtype.itemsize
    moe = F.qwen3_moe_saved_bytes_per_token(256, 96, 8, 2, norm, d)
    want = F.qwen3_layer_saved_bytes_per_token(256, 256, 128, 4, 2, 0, t=1, dtype_bytes=d) + moe
    counts = (4 * 8 if kernel == "grouped_mm" else 0) / seq  # the grouped kernel's int32 offsets
    assert measured == want + counts
    # unpadded groups, as this kernel computes them: an NPU layout's (bf16 on a CPU pads them to row buckets,
    # eager or compiled, which the planner adds: tests/test_plan_moe_padding.py, tests/test_roofline_moe.py)
    layout = Layout(mixed_precision="bf16" if dtype == torch.bfloat16 else "fp32", device_type="npu", compile=True)
    assert saved_bytes_per_token(cfg, layout, "none", SPARSE) == want
    # MLP recompute keeps only the block's input: what it drops is the whole MoE term.
    assert recomputed_bytes_per_token(cfg, layout, "mlp", SPARSE) == moe
    # the dense formula's MLP share (at the same width) is not what a MoE block keeps
    assert moe != F.qwen3_layer_saved_bytes_per_token(256, 256, 128, 4, 2, 96, t=1, dtype_bytes=d) \
        - F.qwen3_layer_saved_bytes_per_token(256, 256, 128, 4, 2, 0, t=1, dtype_bytes=d)


def test_moe_recompute_drops_what_the_planner_says():
    """MoE recompute (``activation_checkpointing: mlp``) measured by MemoryTracker on a real sparse block."""
    cfg = Qwen3Config(**MOE_CFG)
    seq = 128

    def kept_per_token(mode: str) -> float:
        # CUDA's grouped kernel as the engine builds it (groups padded to 8 rows: plan/layers.py counts them)
        experts = GroupedMM(align=GROUPED_MM_ALIGN)
        block = Qwen3Model(cfg, ModelOptions(recompute=mode, experts=experts)).to(torch.bfloat16).layers["1"].mlp
        x = torch.randn(1, seq, 256, dtype=torch.bfloat16, requires_grad=True)
        with MemoryTracker() as mem:
            out = block(x)
            return (mem.current_bytes - out.untyped_storage().nbytes()) / seq

    layout = Layout(mixed_precision="bf16", activation_checkpointing="mlp", device_type="cuda", seq_length=seq)
    want = recomputed_bytes_per_token(cfg, layout, "mlp", SPARSE)
    assert kept_per_token("none") - kept_per_token("mlp") == pytest.approx(want, abs=4 * 8 / seq)


def test_moe_stage_parameters_add_up_to_the_real_model():
    """Qwen3-30B-A3B on one rank: the planner's count is the model's; under tp 2 x pp 2 the attention splits
    over tp and the experts do not (a MoE block is whole on every tp rank); FLOPs count active parameters."""
    cfg = get_preset("qwen3-30b-a3b")
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    real = sum(p.numel() for p in model.parameters())
    (shape,) = stage_shapes(cfg, Layout())
    assert shape.sparse_layers == 48 and stage_params(cfg, Layout(), shape).total == real
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)
    lay = Layout(tp=2, pp=2)
    parts = [stage_params(cfg, lay, s).total for s in stage_shapes(cfg, lay)]
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    norms = L * (2 * h + 2 * cfg.head_dim) + h
    assert sum(parts) == pytest.approx((real - experts - norms) / 2 + experts + norms)
    # a mixed model: mlp_only_layers are dense, and their stage holds their dense parameters
    mixed = Qwen3Config(**MOE_CFG)
    with torch.device("meta"):
        real = sum(p.numel() for p in Qwen3Model(mixed).parameters())
    shapes = stage_shapes(mixed, Layout(pp=2))
    assert [s.sparse_layers for s in shapes] == [0, 1]
    assert sum(stage_params(mixed, Layout(pp=2), s).total for s in shapes) == real
    # expert parallelism: a rank gathers 1/ep of the experts; the ranks hold every expert once between them,
    # over tp too when ep borrows the tp ranks
    experts_all = 48 * 3 * 2048 * 768 * 128
    for lay, held_experts, tp_share in ((Layout(dp=8, ep=8), experts_all / 8, 1),
                                        (Layout(tp=2, dp=4, ep=8), experts_all / 8, 2)):
        (shape,) = stage_shapes(cfg, lay)
        plain = stage_params(cfg, lay.replace(ep=1), shape)
        sp = stage_params(cfg, lay, shape)
        assert plain.total - sp.total == pytest.approx(experts_all - experts_all / tp_share)
        assert plain.held - sp.held == pytest.approx(experts_all - held_experts)
    # one process, no recompute: hardware FLOPs are the model's active FLOPs
    lay = Layout(seq_length=4096, micro_batch_size=1, activation_checkpointing="none")
    assert sum(_stage_flops_per_microbatch(cfg, lay, stage_shapes(cfg, lay)[0])) == pytest.approx(
        token_flops(cfg, 4096).model * 4096)


def test_pipeline_bubble_and_inflight():
    assert F.pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert F.pipeline_bubble_fraction(4, 8, v=2) == pytest.approx(3 / 19)
    r = F.megatron_bubble_ratio(4, 8, 2)
    assert r == pytest.approx(3 / 16) and F.pipeline_bubble_fraction(4, 8, 2) == pytest.approx(r / (1 + r))
    assert F.pipeline_bubble_fraction(1, 5) == 0
    assert [F.inflight_microbatches("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert F.inflight_microbatches("1f1b", 4, 0, 2) == 2
    assert F.inflight_microbatches("gpipe", 4, 3, 8) == 8
    # interleaved, first rank: p + (p - 1) / v stage-loads
    assert F.inflight_microbatches("interleaved", 4, 0, 8, v=2) == 4 + 3 / 2
    assert F.inflight_microbatches("interleaved", 4, 3, 8, v=2) == (4 + 1) / 2


def test_flops_per_token_by_hand():
    # Qwen3-8B: per layer 2*4096^2 + 2*4096*1024 + 3*4096*12288 = 192,937,984 weights; attention's core
    # 4 * 4096 FLOPs per attended key forward, 3x with backward, over 8192 / 2 keys (causal) or 8192 (square)
    n_matmul = 36 * 192937984 + 151936 * 4096
    core = 36 * 3 * 4 * 4096
    flops = token_flops(get_preset("qwen3-8b"), 8192)
    assert flops.full_square == 6 * n_matmul + core * 8192 == 59904098304  # PaLM's 6 N + 12 L q s
    assert flops.model == 6 * n_matmul + core * 4096 == 52656340992
    assert flops.full_square / flops.model == pytest.approx(1.1376, abs=1e-4)  # the full square overstates
    assert flops.hardware == flops.model  # no recompute
    # full recompute: the layers' forward once more (a third of their FLOPs) but the down projection, whose
    # output backward does not need (the checkpoint stops before it); mlp: gate and up; selective: the core
    down = 36 * 2 * 4096 * 12288
    assert token_flops(get_preset("qwen3-8b"), 8192, "full").hardware == pytest.approx(
        flops.model + (flops.model - 6 * 151936 * 4096) / 3 - down)
    assert token_flops(get_preset("qwen3-8b"), 8192, "mlp").hardware == flops.model + 2 * down
    assert token_flops(get_preset("qwen3-8b"), 8192, "selective").hardware == flops.model + core * 4096 / 3
    small = token_flops(get_preset("qwen3-1.7b"), 8192)
    assert small.full_square / small.model == pytest.approx(1.2145, abs=1e-4)
    for name in ("qwen3-0.6b", "qwen3-14b", "qwen3-32b"):
        cfg = get_preset(name)
        q, kv, f = cfg.num_attention_heads * 128, cfg.num_key_value_heads * 128, cfg.intermediate_size
        layer = 2 * cfg.hidden_size * q + 2 * cfg.hidden_size * kv + 3 * cfg.hidden_size * f
        n_matmul = cfg.num_hidden_layers * layer + cfg.vocab_size * cfg.hidden_size
        assert token_flops(cfg, 4096).model == 6 * n_matmul + 6 * cfg.num_hidden_layers * q * 4096


def test_collective_costs_follow_nccl_tests_conventions():
    assert F.bus_bandwidth_factor("all_reduce", 4) == 1.5
    assert F.bus_bandwidth_factor("all_gather", 4) == 0.75
    assert F.bus_bandwidth_factor("p2p", 2) == 1
    assert F.collective_seconds("all_reduce", 1e9, 4, 100e9, 1e-5) == pytest.approx(0.015 + 1e-5)
    assert F.collective_seconds("all_gather", 1e9, 1, 100e9, 1e-5) == 0


# --- memory and step model -------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b"])
def test_stage_parameters_add_up_to_the_real_model(name):
    """One rank, no parallelism: the planner's count equals the model's parameters (a tied weight once);
    under pp > 1 the engine's last stage holds a copy of a tied head."""
    cfg = get_preset(name)
    with torch.device("meta"):
        real = sum(p.numel() for p in Qwen3Model(cfg).parameters())
    extra_head = cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0
    (shape,) = stage_shapes(cfg, Layout())
    assert stage_params(cfg, Layout(), shape).total == real
    # pp=2, tp=4: the two ranks hold everything once, matrices split four ways
    lay = Layout(tp=4, pp=2)
    parts = [stage_params(cfg, lay, s).total for s in stage_shapes(cfg, lay)]
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    norms = L * (2 * h + 2 * cfg.head_dim) + h
    assert sum(parts) == pytest.approx((real + extra_head - norms) / 4 + norms)


def test_memory_reacts_to_the_layout_as_expected():
    cfg = get_preset("qwen3-8b")
    base = Layout(tp=4, pp=2, micro_batch_size=4, seq_length=8192)
    acts = {ac: predict_memory(cfg, base.replace(activation_checkpointing=ac), stage=0).activations
            for ac in ("none", "selective", "mlp", "full")}
    assert acts["full"] < acts["mlp"] < acts["selective"] < acts["none"]
    sharded = predict_memory(cfg, Layout(dp=8, seq_length=2048), stage=0)
    replicated = predict_memory(cfg, Layout(dp=8, seq_length=2048, distributed_optimizer=False), stage=0)
    assert sharded.optimizer < replicated.optimizer / 4 and sharded.total < replicated.total / 2
    # the first pipeline stage holds p micro-batches in flight, the last one
    heavy = base.replace(activation_checkpointing="none")
    first, last = predict_memory(cfg, heavy, stage=0), predict_memory(cfg, heavy, stage=1)
    assert first.activations > 1.5 * last.activations
    assert predict_memory(cfg, heavy).total == max(first.total, last.total)


@pytest.mark.parametrize("case, floor, rel", [("tiny", 100, 0.15), ("moe-h512-mlp-bf16-v4k-s2048", 500, 0.05)])
def test_predicted_memory_matches_a_measured_training_step(case, floor, rel):
    """The 'tiny' validation case (real 151,936 vocabulary) within 15% of MemoryTracker's measurement; a MoE
    model whose experts' activations decide the peak within 5%."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_validate.py"), "--cases", case],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    row = out.stdout.strip().splitlines()[-1].split()
    measured, predicted = float(row[1]), float(row[2])
    assert measured > floor  # MiB: the optimizer state of a 151,936-token vocabulary alone is more than 100
    assert predicted == pytest.approx(measured, rel=rel)


def test_step_estimate_is_consistent():
    cfg = get_preset("qwen3-8b")
    lay = Layout(tp=4, pp=2, micro_batch_size=4, seq_length=8192)
    est = predict_step(cfg, lay, get_device("910b"), Cluster(2, 4))
    assert est.bubble_fraction == pytest.approx(1 / 5)
    assert est.tokens_per_sec_per_device == pytest.approx(4 * 8192 / est.step_time_s / 8)
    flops = token_flops(cfg, 8192, lay.activation_checkpointing)
    assert est.mfu == pytest.approx(est.tokens_per_sec_per_device * flops.model / 313e12)
    assert est.hfu == pytest.approx(est.tokens_per_sec_per_device * flops.hardware / 313e12)
    assert est.hfu > est.mfu  # full recompute
    assert est.mfu_full_square == pytest.approx(est.tokens_per_sec_per_device * flops.full_square / 313e12)
    assert 0 < est.mfu < 0.4  # never above the stated efficiency
    assert est.comm_bytes_per_axis["tp"] > 0 and est.comm_bytes_per_axis["dp"] == 0
    # tp across nodes is slower than inside one
    wide = predict_step(cfg, Layout(tp=8, seq_length=8192, micro_batch_size=1), get_device("h100"), Cluster(2, 4))
    narrow = predict_step(cfg, Layout(tp=8, seq_length=8192, micro_batch_size=1), get_device("h100"), Cluster(1, 8))
    assert wide.step_time_s > narrow.step_time_s


def test_hsdp_shards_state_by_its_group_and_keeps_only_an_all_reduce_across_nodes():
    """HSDP over 8 nodes x 8: memory follows the shard group (dp 64 sharded by 8 holds what dp 8 fully
    sharded holds); cross-node bytes, by hand: flat FSDP over all 64 ranks sends everything across nodes
    (two bf16 all-gathers of the weights per step, one of the LM head, the final norm and the last layer,
    which stay gathered from forward to backward, and one fp32 reduce-scatter, (n-1)/n each); shard groups
    of one node's 8 ranks leave only the all-reduce of the fp32 gradient shards, 2 (r-1)/r x 4P/8, r = 8."""
    cfg, hw, cluster = get_preset("qwen3-8b"), get_device("h100"), Cluster(8, 8)
    flat = Layout(dp=64, seq_length=4096)
    hsdp = flat.replace(dp_shard=8)
    assert (hsdp.shards, hsdp.replicas) == (8, 8)
    assert predict_memory(cfg, hsdp) == predict_memory(cfg, Layout(dp=8, seq_length=4096))
    p = cfg.num_params()
    head = cfg.vocab_size * cfg.hidden_size + cfg.hidden_size  # the LM head and the final norm
    kept = head + (p - head - cfg.vocab_size * cfg.hidden_size) / cfg.num_hidden_layers  # and the last layer
    gathered = 2 * (2 * (p - kept) + kept)
    assert predict_memory(cfg, hsdp).optimizer == pytest.approx(8 * p / 8)
    flat_est, hsdp_est = predict_step(cfg, flat, hw, cluster), predict_step(cfg, hsdp, hw, cluster)
    assert flat_est.cross_node_bytes == pytest.approx((gathered + 4 * p) * 63 / 64)
    assert hsdp_est.cross_node_bytes == pytest.approx(2 * 7 / 8 * 4 * p / 8)
    assert hsdp_est.dp_bytes_per_group["dp_shard"] == pytest.approx((gathered + 4 * p) * 7 / 8)
    # one node: nothing crosses, with or without HSDP
    assert predict_step(cfg, Layout(dp=8, seq_length=4096, dp_shard=4), hw, Cluster(1, 8)).cross_node_bytes == 0


@pytest.mark.parametrize("layout, words", [
    (dict(dp=6, dp_shard=4), "dp_shard 4 must be a positive divisor of dp 6"),
    (dict(dp=4, dp_shard=2, distributed_optimizer=False), "it needs the distributed optimizer"),
])
def test_hsdp_layout_errors_name_the_values(layout, words):
    with pytest.raises(UserError, match=words):
        Layout(**layout)


def test_enumeration_respects_heads_devices_and_batch():
    cfg = get_preset("qwen3-8b")
    layouts = list(enumerate_layouts(cfg, Cluster(2, 4), Layout(seq_length=4096), global_batch_size=32))
    assert layouts and all(lay.world_size == 8 and lay.global_batch_size == 32 for lay in layouts)
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}
    assert all(lay.pp == 1 or lay.num_microbatches >= lay.pp for lay in layouts)


# --- CLI ------------------------------------------------------------------------------------


def test_plan_reference_layout_table(capsys):
    assert plan_main(REFERENCE) == 0
    out = capsys.readouterr().out
    assert "1 layout(s), 1 fit" in out
    row = [line for line in out.splitlines() if line.startswith(" 1 ")][0]
    assert row.split()[1:9] == ["4", "1", "2", "1", "1", "1", "4", "1"] and "yes" in row  # tp cp pp dp shard ep mbs gas


def test_plan_json_keys_and_order(capsys):
    assert plan_main(["--model", "qwen3-1.7b", "--devices-per-node", "8", "--seq-length", "4096",
                      "--global-batch-size", "64", "--json", "--top", "5"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 5
    keys = {"tp", "pp", "dp", "micro_batch_size", "gradient_accumulation_steps", "activation_checkpointing",
            "distributed_optimizer", "memory_gib", "bubble_fraction", "step_time_s", "tokens_per_sec_per_device",
            "mfu", "hfu", "mfu_full_square", "fits"}
    assert keys <= set(rows[0])
    assert set(rows[0]["memory_gib"]) == {"parameters", "gradients", "optimizer", "activations", "logits",
                                          "overhead", "total"}
    speeds = [float(f'{r["tokens_per_sec_per_device"]:.3g}') for r in rows if r["fits"]]  # to the model's precision
    assert speeds == sorted(speeds, reverse=True)


def test_plan_rows_carry_the_config_keys_that_realise_them(capsys, tmp_path):
    """A MoE plan's best row, its ``config`` keys as written into a training config, loads as a TrainConfig
    and describes the same layout (the engine's own description of it equals the row's)."""
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig
    from qwen3_pretrain.train.engine import engine_layout, resolve_parallelism

    # at even routing (the default imbalance prices the heaviest ep rank's extra work, which ranks ep lower)
    assert plan_main(["--model", "qwen3-30b-a3b", "--nodes", "2", "--devices-per-node", "8", "--seq-length", "4096",
                      "--global-batch-size", "256", "--moe-imbalance", "1", "--json", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["ep"] > 1 for r in rows)  # the search tries expert parallelism for a MoE model
    for row in rows:
        keys = row["config"]
        cfg = from_dict(TrainConfig, {"model_name": "qwen3-30b-a3b", "data_path": str(tmp_path),
                                      "output_path": str(tmp_path / "out"), **keys}, source="plan row")
        par = resolve_parallelism(cfg, keys["rank_size"], get_preset("qwen3-30b-a3b"))
        lay = engine_layout(cfg, par, 4096, "cuda", fp32_matmul=False)
        assert (lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.micro_batch_size, lay.gradient_accumulation_steps,
                lay.activation_checkpointing) == (row["tp"], row["pp"], row["dp"], row["cp"], row["ep"],
                                                  row["micro_batch_size"], row["gradient_accumulation_steps"],
                                                  row["activation_checkpointing"])
        assert lay.global_batch_size == row["global_batch_size"] == 256


def test_plan_reads_the_training_config(tmp_path, capsys):
    conf = tmp_path / "pretrain_config.yaml"
    conf.write_text("model_name: qwen3-8b\nmodel_path: /nowhere\nrank_size: 8\ntp: 4\npp: 2\nseq_length: 8192\n"
                    "batch_size: 4\nlearning_rate: 1e-5\nmixed_precision: bf16\ndistributed_optimizer: True\n"
                    "gradient_checkpointing: True\nsome_future_key: 3\n")
    assert plan_main(["--config", str(conf), "--nodes", "2", "--devices-per-node", "4", "--device", "910b",
                      "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["tp"], row["pp"], row["dp"], row["micro_batch_size"]) == (4, 2, 1, 4)
    assert row["activation_checkpointing"] == "full" and row["fits"]


def test_plan_says_what_would_make_it_fit(capsys):
    assert plan_main(["--model", "qwen3-32b", "--devices-per-node", "2", "--device", "a100", "--tp", "2",
                      "--seq-length", "4096"]) == 0
    out = capsys.readouterr().out
    assert "nothing fits in 80.0 GiB per device" in out and "nodes it fits" in out


MEGATRON_CARD = ["--model", "qwen3-8b", "--nodes", "2", "--devices-per-node", "8", "--device", "h100", "--seq-length",
                 "4096", "--tp", "1", "--pp", "1", "--dp", "16", "--micro-batch-size", "1", "--global-batch-size",
                 "1024", "--activation-checkpointing", "none", "--distributed-optimizer"]


def test_megatron_layout_fits_without_recompute_with_lean_activations(capsys):
    """Megatron-Bridge's Qwen3-8B layout (16 x H100, 64 micro-batches, no recompute): with the layer keeping
    Megatron's list of tensors (137,512 bytes per token and layer) the unsharded fp32 gradients FSDP
    accumulates (4 bytes x 8.19B) and 36 layers of activations fit 80 GB, but FSDP gathers the weights twice
    per micro-batch (about 1,800 GB per device per step); reducing the gradients every micro-batch keeps
    4/16 bytes per parameter instead."""
    four_p = 4 * get_preset("qwen3-8b").num_params()
    assert plan_main(MEGATRON_CARD + ["--no-keep-params-gathered", "--json"]) == 0
    rows = {r["dp_shard"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {16, 8}  # all 16 dp ranks, and HSDP with one node's 8 (dp spans two nodes)
    assert all(r["fits"] for r in rows.values())
    assert rows[16]["memory_gib"]["gradients"] == pytest.approx(four_p / GiB, abs=1e-3)
    # 36 layers of what each keeps (and the stage's few tensors beside them)
    assert rows[16]["memory_gib"]["activations"] == pytest.approx(36 * 137_512 * 4096 / GiB, rel=0.01)
    # two gathers of the bf16 weights per micro-batch (one of the head, kept from forward to backward):
    # about 128 x 2P x 15/16, and one fp32 reduction
    assert 240 < rows[16]["comm_gb_per_step"]["dp"] / (four_p / 4 * 15 / 16 / 1e9) < 260
    assert plan_main(MEGATRON_CARD + ["--reduce-grads-every-microbatch", "--no-keep-params-gathered", "--json"]) == 0
    rows = {r["dp_shard"]: r for r in json.loads(capsys.readouterr().out)}
    assert all(r["fits"] and r["activation_checkpointing"] == "none" for r in rows.values())
    assert [rows[s]["memory_gib"]["gradients"] for s in (16, 8)] == pytest.approx([four_p / 16 / GiB,
                                                                                  four_p / 8 / GiB], abs=1e-3)
    # HSDP sends only the all-reduce of the 4P/8 shards across the two nodes, per micro-batch (64)
    assert rows[8]["cross_node_gb_per_step"] == pytest.approx(64 * four_p / 8 / 1e9, abs=1e-3)
    assert rows[16]["cross_node_gb_per_step"] > 10 * rows[8]["cross_node_gb_per_step"]


def test_megatron_accumulation_at_megatrons_layout(capsys):
    """Megatron's accumulation (weights gathered once per step, gradients reduced once) at the same card:
    with fp32 gradients the whole bf16 model beside them does not fit 80 GB, and the planner says which
    setting makes it fit; with bf16 gradients (Megatron's default without --accumulate-allreduce-grads-in-fp32)
    it is the planner's first choice among all layouts without recompute, moving about 31 GB per device per
    step over the data-parallel ranks instead of about 1,800 GB."""
    two_p = 2 * get_preset("qwen3-8b").num_params()
    assert plan_main(MEGATRON_CARD + ["--keep-params-gathered", "--json"]) == 0
    out = capsys.readouterr()
    assert not any(r["fits"] for r in json.loads(out.out))
    # of the two settings that make it fit, the one moving 30 GB rather than 64 fp32 reductions
    assert "with gradients accumulated and reduced in bf16 (--grad-reduce-dtype bf16) it fits" in out.err
    free = ["--model", "qwen3-8b", "--nodes", "2", "--devices-per-node", "8", "--device", "h100", "--seq-length",
            "4096", "--global-batch-size", "1024", "--micro-batch-size", "1",
            "--activation-checkpointing", "none"]  # degrees searched
    assert plan_main(free + ["--grad-reduce-dtype", "bf16", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["fits"] and best["keep_params_gathered"] and (best["tp"], best["pp"], best["dp"]) == (1, 1, 16)
    # one gather of the bf16 weights and one bf16 reduction: 2 x 2P x 15/16
    assert best["comm_gb_per_step"]["dp"] == pytest.approx(2 * two_p * 15 / 16 / 1e9, rel=0.01)
    assert best["comm_gb_per_step"]["dp"] < 50
    assert best["memory_gib"]["total"] < 76
    assert best["config"]["keep_params_gathered"] and best["config"]["grad_reduce_dtype"] == "bf16"


@pytest.mark.parametrize("argv, words", [
    (["--model", "qwen3-8b", "--tp", "3"], "does not divide"),
    (["--model", "qwen3-8b", "--devices-per-node", "8", "--tp", "4", "--pp", "4"], "does not divide the cluster"),
    (["--model", "qwen3-8b", "--device", "h10"], "did you mean 'h100'"),
    (["--model", "qwen3-9b"], "unknown model preset"),
    (["--model", "qwen3-8b", "--commbench", "/nonexistent.json"], "does not exist"),
    (["--model", "qwen3-8b", "--dp", "8", "--dp-shard", "3"], "--dp-shard 3 must be a positive divisor of dp 8"),
])
def test_plan_impossible_requests_are_one_line_errors(argv, words, capsys):
    assert run_command("qwen3_pretrain.plan.cli:main", argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err


def test_user_errors_are_value_errors():
    with pytest.raises(UserError):
        Layout(tp=0)
    with pytest.raises(UserError, match="pp=2 needs at least 2"):
        predict_memory(get_preset("qwen3-8b"), Layout(pp=2))
    assert predict_memory(get_preset("qwen3-0.6b"), Layout()).total / GiB > 1


def test_document_mask_memory_follows_the_kernel_that_runs():
    """Only the CPU's kernel materializes the document mask: one [seq, seq] per sample of each micro-batch
    in flight, in the dtype attention computes in (fp32 when bf16 is multiplied in fp32). The accelerators'
    kernels take the document boundaries and hold no seq x seq tensor."""
    cfg = get_preset("qwen3-0.6b")
    base = Layout(pp=2, micro_batch_size=4, pp_microbatch_size=2, seq_length=8192, activation_checkpointing="full")

    def held(layout: Layout) -> float:  # what stage 0 holds for its micro-batches in flight
        return memory._held_activations(cfg, layout, stage_shapes(cfg, layout)[0])

    plain = held(base)
    in_flight = 2  # 1F1B: the first of 2 stages holds 2 micro-batches
    for device_type, fp32_matmul, mask_bytes in (("cuda", False, 0), ("cpu", False, 2), ("cpu", True, 4)):
        layout = base.replace(document_mask=True, device_type=device_type, fp32_matmul=fp32_matmul)
        extra = held(layout) - held(base.replace(fp32_matmul=fp32_matmul))
        assert extra == in_flight * 2 * 8192 * 8192 * mask_bytes
    assert held(base.replace(document_mask=True)) == plain
    for device, dense in (("h100", False), ("910b3", False), ("cpu", True)):
        args = build_parser().parse_args(["--device", device])
        layout, _ = fixed_settings(args, {"document_mask": True})
        assert layout.document_mask and layout.dense_document_mask == dense


def test_the_32k_plan_splits_the_sequence_and_counts_cp_traffic(capsys):
    """Qwen3-8B at seq 32768 on 8 x 910B (64 GB): layouts fit, the fastest splits the sequence (cp > 1)
    and moves K/V bytes on the cp axis; cp shards the weights with dp (FSDP over dp x cp)."""
    assert plan_main(["--model", "qwen3-8b", "--seq-length", "32768", "--nodes", "1", "--devices-per-node", "8",
                      "--device", "910b", "--json", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    best = rows[0]
    assert best["fits"] and best["cp"] > 1 and best["comm_gb_per_step"]["cp"] > 0
    assert best["dp_shard"] == best["dp"] * best["cp"]
    cfg = get_preset("qwen3-8b")
    split = Layout(cp=4, tp=2, seq_length=32768, activation_checkpointing="none")
    whole = split.replace(cp=1)
    assert predict_memory(cfg, split).activations < predict_memory(cfg, whole).activations / 3
    # selective recompute reruns attention, its K/V gather included: one gather more per layer than none
    hw = get_device("910b")
    none, selective = (predict_step(cfg, split.replace(activation_checkpointing=ac), hw).comm_bytes_per_axis["cp"]
                       for ac in ("none", "selective"))
    assert selective == pytest.approx(none * 3 / 2)


def test_a_math_fallback_is_counted_where_the_device_runs_one():
    """The planner asks the device's kernel rules which kernel serves each attention call and counts what
    SDPA's math kernel keeps where it runs: fp32 training with GQA on CUDA (flash wants half precision,
    efficient equal head counts), measured against the kept bytes the formula names. bf16, or a CPU, keep
    no probabilities."""
    cfg = get_preset("qwen3-8b")
    base = Layout(tp=2, seq_length=4096, activation_checkpointing="none")
    assert layers.math_fallbacks(cfg, base) == []  # bf16 on CUDA: flash
    fp32 = base.replace(mixed_precision="fp32")
    (call,) = layers.math_fallbacks(cfg, fp32)
    assert (call.api, call.mask, call.dtype, call.q_heads, call.kv_heads) == ("sdpa", "causal", "float32", 16, 4)
    probabilities = 4 * 16 * 4096 * 4096  # fp32 [1, 16 heads, 4096, 4096]
    extra = layers.attention_fallback_bytes_per_token(cfg, fp32) * 4096
    assert probabilities < extra < 1.1 * probabilities
    assert saved_bytes_per_token(cfg, fp32, "none") - saved_bytes_per_token(
        cfg, fp32.replace(device_type="cpu"), "none") == pytest.approx(extra / 4096)
    # selective recompute drops it with the rest of the kernel's saved tensors
    assert saved_bytes_per_token(cfg, fp32, "selective") == saved_bytes_per_token(
        cfg, fp32.replace(device_type="cpu"), "selective")
    # the context-parallel chunk under bf16 is flash's lower-right causal mode, not a masked math call
    assert layers.math_fallbacks(cfg, base.replace(cp=8, seq_length=32768)) == []


def test_the_search_skips_layouts_the_sequence_does_not_split_over(capsys):
    """seq 6000 on 32 devices: layouts whose seq / cp does not divide by tp are skipped, not fatal (each
    layout is checked as the trainer checks it); a fixed tp that cannot split it is refused by name."""
    from qwen3_pretrain.cli import main as cli_main

    args = ["plan", "--model", "qwen3-8b", "--nodes", "4", "--devices-per-node", "8", "--device", "h100",
            "--seq-length", "6000", "--global-batch-size", "64"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "yes" in out  # layouts that fit were listed
    assert cli_main(["plan", "--model", "qwen3-8b", "--nodes", "1", "--devices-per-node", "8", "--device", "h100",
                     "--seq-length", "6001", "--tp", "2"]) == 2
    assert "seq_length 6001 is not a multiple of tp = 2" in capsys.readouterr().err


def test_the_host_bounds_a_micro_batch_from_below():
    """A micro-batch takes at least the host's time to issue its layers (bench/host_overhead.py's figures):
    a small model on an H100 under tp 2 is host-bound in eager mode, less so compiled; Qwen3-8B at seq 4096
    without tp is compute-bound either way."""
    from qwen3_pretrain.hardware import HOST_MS_PER_LAYER

    hw = get_device("h100")
    small, big = get_preset("qwen3-0.6b"), get_preset("qwen3-8b")
    layout = Layout(tp=2, seq_length=256, activation_checkpointing="none")
    eager, compiled = predict_step(small, layout, hw), predict_step(small, layout.replace(compile=True), hw)
    layers = small.num_hidden_layers
    assert eager.compute_time_s == pytest.approx(layers * HOST_MS_PER_LAYER[(True, False)] / 1e3)
    assert compiled.compute_time_s == pytest.approx(layers * HOST_MS_PER_LAYER[(True, True)] / 1e3)
    assert compiled.tokens_per_sec_per_device > 2 * eager.tokens_per_sec_per_device
    layout = Layout(tp=1, seq_length=4096, activation_checkpointing="none")
    assert predict_step(big, layout, hw).step_time_s == predict_step(big, layout.replace(compile=True), hw).step_time_s


@pytest.mark.parametrize("flags", [["--compile"], ["--reduce-grads-every-microbatch", "--grad-reduce-dtype", "bf16"]])
def test_every_plan_row_is_a_config_train_accepts(flags, capsys, tmp_path):
    """No row carries a combination the training config refuses (compile with cp, ep or tp with selective
    recompute; reduce_grads_every_microbatch under pp; keep_params_gathered without sharding)."""
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig

    assert plan_main(["--model", "qwen3-8b", "--nodes", "2", "--devices-per-node", "8", "--seq-length", "8192",
                      "--global-batch-size", "64", "--json", "--top", "100000", *flags]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) > 100 and any(r["pp"] > 1 for r in rows)
    for row in rows:
        from_dict(TrainConfig, {"model_name": "qwen3-8b", "data_path": str(tmp_path),
                                "output_path": str(tmp_path / "out"), **row["config"]}, source="plan row")


# --- the hybrids (Qwen3.5, Qwen3-Next): Gated DeltaNet and gated full-attention layers ---------------------

HYBRID_CFG = dict(model_type="qwen3_5_text", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, intermediate_size=768, vocab_size=128,
                  layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
                  partial_rotary_factor=0.25)


def _per_call_bytes(cfg: Qwen3Config, linear: bool, d: int, seq: int) -> float:
    """What a hybrid layer keeps once per call, not per token (the formulas leave it out), per token of
    ``seq``: each zero-centred norm's fp32 ``1 + weight``; a Gated DeltaNet's convolution padding (``K - 1``
    tokens of its channels), its weight's rows regrouped from per key head to [q | k | v], the fp32 copies
    of its decay parameters, less its last chunk's writes (kept only for the state after the sequence,
    which is dropped); attention's q and k norms' scales."""
    norms = 2 * 4 * cfg.hidden_size
    if linear:  # less the delta rule's last chunk's writes (4 bytes x 64 tokens x its value width), dropped
        conv = 2 * cfg.linear_key_dim + cfg.linear_value_dim
        return (norms + d * conv * (2 * cfg.linear_conv_kernel_dim - 1) + 2 * 4 * cfg.linear_num_value_heads
                - 4 * 64 * cfg.linear_value_dim) / seq
    return (norms + 2 * 4 * cfg.head_dim) / seq


@pytest.mark.parametrize("linear, model_type, rotary", [(True, "qwen3_5_text", 0.25), (True, "qwen3_next", 0.25),
                                                        (False, "qwen3_5_text", 0.25), (False, "qwen3_next", 1.0)])
@pytest.mark.parametrize("dtype, fp32_matmul", [(torch.bfloat16, False), (torch.float32, False),
                                                (torch.bfloat16, True)])
def test_hybrid_layer_formulas_match_what_autograd_saves(linear, model_type, rotary, dtype, fp32_matmul):
    """A Gated DeltaNet layer (both projection layouts) and a hybrid's gated full-attention layer (partial RoPE
    as released, and whole) save, per token, what the planner's formulas say (counted by saved-tensor hooks on
    the real layer, parameters and the RoPE tables excluded), beside the few per-call tensors named in
    ``_per_call_bytes``."""
    cfg = Qwen3Config(**dict(HYBRID_CFG, model_type=model_type, partial_rotary_factor=rotary))
    options = ModelOptions(linear=Fp32Linear, attention=fp32_attention()) if fp32_matmul else ModelOptions()
    layer = Qwen3Model(cfg, options).to(dtype).layers["0" if linear else "1"]
    seq = 256  # 4 chunks of the delta rule (with 2, the first one's decay is kept by none)
    x = torch.randn(1, seq, 256, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(seq)[None], cfg.rotary_dim, cfg.rope_theta, dtype)
    measured = _saved_per_token(layer, x, cos, sin, seq=seq, outside=(cos, sin))
    layout = Layout(mixed_precision="bf16" if dtype == torch.bfloat16 else "fp32", fp32_matmul=fp32_matmul,
                    device_type="cpu")
    planned = saved_bytes_per_token(cfg, layout, "none", LayerKind(linear=linear))
    assert measured == planned + _per_call_bytes(cfg, linear, dtype.itemsize, seq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ac_mode", ["selective", "mlp"])
@pytest.mark.parametrize("heads", [(2, 4, 32, 48), (1, 4, 16, 96)])  # Gated DeltaNet key, value heads, dk, dv
def test_hybrid_recompute_drops_what_the_planner_says(ac_mode, dtype, heads):
    """Measured by MemoryTracker on the real layers: selective recompute drops the delta rule's chunk terms
    from a Gated DeltaNet layer and the attention kernel's extras from a gated attention layer; MLP recompute
    the SwiGLU of either. (Per call, not per token, the Gated DeltaNet layer without recompute frees its last
    chunk's writes with the final state it never returns: 4 bytes x 64 tokens x its value width.)"""
    key_heads, value_heads, dk, dv = heads
    cfg = Qwen3Config(**dict(HYBRID_CFG, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                             linear_key_head_dim=dk, linear_value_head_dim=dv))
    seq = 256  # 4 chunks of the delta rule (with 2, the first one's decay is kept by none)
    cos, sin = rope_cos_sin(torch.arange(seq)[None], cfg.rotary_dim, cfg.rope_theta, dtype)
    layout = Layout(activation_checkpointing=ac_mode, device_type="cpu",
                    mixed_precision="bf16" if dtype == torch.bfloat16 else "fp32")
    for index, kind in (("0", LayerKind(linear=True)), ("1", LayerKind())):
        def kept_per_token(mode: str) -> float:
            layer = Qwen3Model(cfg, ModelOptions(recompute=mode)).to(dtype).layers[index]
            x = torch.randn(1, seq, 256, dtype=dtype, requires_grad=True)
            with MemoryTracker() as mem:
                out = layer(x, cos, sin)
                return (mem.current_bytes - out.untyped_storage().nbytes()) / seq

        want = recomputed_bytes_per_token(cfg, layout, ac_mode, kind)
        per_call = 4 * 64 * cfg.linear_value_dim / seq if kind.linear and ac_mode == "selective" else 0
        assert kept_per_token("none") - kept_per_token(ac_mode) == want - per_call
        assert want > 0


def _tp_rank_params(cfg: Qwen3Config, tp: int, pp: int) -> list[int]:
    """Parameters one tp rank of each pipeline stage holds once the engine's tensor-parallel plan is applied
    (meta tensors on the fake process group): DTensors count their local shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from qwen3_pretrain.parallel.dims import stage_layer_ranges
    from qwen3_pretrain.parallel.parallelize import PartSpec, build_stage
    from qwen3_pretrain.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        counts = []
        for stage, owned in enumerate(stage_layer_ranges(cfg.num_hidden_layers, pp)):
            part = build_stage(cfg, PartSpec(stage, pp, owned), cfg.vocab_size, 4096)
            apply_tensor_parallel(part, mesh)
            counts.append(sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in part.parameters()))
        return counts
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name, tp, pp", [("qwen3.5-9b", 4, 2), ("qwen3.5-35b-a3b", 2, 2),
                                          ("qwen3-next-80b-a3b", 2, 1)])
def test_hybrid_stage_parameters_are_the_real_stages(name, tp, pp):
    """Each pipeline stage's parameters on a tp rank, as the planner counts them, are those the engine's stage
    holds after its tensor-parallel plan: attention, Gated DeltaNet layers (but their gated norm) and dense
    MLPs split, norms and MoE blocks (their shared expert too) whole. The presets are cut to 8 layers (6 Gated DeltaNet, 2 attention)
    and 16 experts; their largest tensor and, unsplit, FLOPs per token follow the config."""
    cfg = get_preset(name)
    cfg = dataclasses.replace(cfg, num_hidden_layers=8, layer_types=cfg.layer_types[:8],
                              num_experts=min(cfg.num_experts, 16))
    layout = Layout(tp=tp, pp=pp, micro_batch_size=pp)
    shapes = stage_shapes(cfg, layout)
    assert [s.linear_layers for s in shapes] == ([3, 3] if pp == 2 else [6])
    assert [stage_params(cfg, layout, s).total for s in shapes] == _tp_rank_params(cfg, tp, pp)
    (whole,) = stage_shapes(cfg, Layout(activation_checkpointing="none"))
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    largest = max(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    assert max(largest_tensor(cfg, Layout(), kind) for kind, _ in whole.layer_kinds) == largest
    # one rank, no recompute: the hardware FLOPs are the model's, the delta rule's apart (it computes in fp32)
    lay = Layout(seq_length=4096, activation_checkpointing="none")
    matmul, rule = _stage_flops_per_microbatch(cfg, lay, whole)
    assert rule == 6 * cfg.linear_attention_flops_per_token(CHUNK_SIZE) * 4096
    assert matmul + rule == pytest.approx(token_flops(cfg, 4096).model * 4096)


@pytest.mark.parametrize("recompute, tp", [("none", 1), ("full", 1), ("selective", 2)])
def test_planner_counts_the_trained_mtp_layer(recompute, tp):
    """With the multi-token-prediction layer trained (``Layout.mtp``), the last stage's FLOPs are the training
    log's count with it (flops.token_flops, checked against torch's count in tests/test_mfu.py): its fc, its
    decoder layer (a MoE block whole on every tp rank) and the second head pass; without it, the count without."""
    cfg = get_preset("qwen3.5-35b-a3b")
    cfg = dataclasses.replace(cfg, num_hidden_layers=4, layer_types=cfg.layer_types[:4], num_experts=16)
    assert cfg.mtp_num_hidden_layers == 1
    seq = 2048
    for mtp in (False, True):
        lay = Layout(tp=tp, seq_length=seq, activation_checkpointing=recompute, mtp=mtp)
        (whole,) = stage_shapes(cfg, lay)
        matmul, rule = _stage_flops_per_microbatch(cfg, lay, whole)
        counted = token_flops(cfg, seq, recompute, mtp).hardware * seq
        if tp == 1:
            assert matmul + rule == pytest.approx(counted, rel=1e-12)
        else:  # the MoE blocks (the MTP layer's too) run whole on each tp rank: their FLOPs tp times
            sparse = sum(layer.mlp * (3 + (recompute == "full")) for layer in model_layers(cfg, seq, mtp)) * seq
            assert matmul + rule == pytest.approx(counted + (tp - 1) * sparse, rel=1e-12)
    trained = predict_step(cfg, Layout(tp=tp, seq_length=seq, activation_checkpointing=recompute, mtp=True),
                           get_device("h100"))
    untrained = predict_step(cfg, Layout(tp=tp, seq_length=seq, activation_checkpointing=recompute),
                             get_device("h100"))
    assert trained.step_time_s > untrained.step_time_s


def test_plan_reads_mtp_loss_weight_from_the_config():
    parse = build_parser().parse_args
    assert not fixed_settings(parse([]), {})[0].mtp
    assert fixed_settings(parse([]), {"mtp_loss_weight": 0.3})[0].mtp
    assert not fixed_settings(parse([]), {"mtp_loss_weight": 0.0})[0].mtp
    assert not fixed_settings(parse(["--no-mtp"]), {"mtp_loss_weight": 0.3})[0].mtp
    assert fixed_settings(parse(["--mtp"]), {})[0].mtp


def test_hybrid_plan_rows_are_configs_train_accepts(capsys, tmp_path):
    """Qwen3.5-27B at seq 32768 on 8 x H100: the search splits the sequence (cp; tp x cp must divide the Gated
    DeltaNet's 16 key heads), and every row, written into a training config, loads and is the layout the
    engine describes."""
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig
    from qwen3_pretrain.train.engine import engine_layout, resolve_parallelism

    # without a memory margin: the cp rows sit at 97% of the device's memory, tight under the default one
    assert plan_main(["--model", "qwen3.5-27b", "--nodes", "1", "--devices-per-node", "8", "--device", "h100",
                      "--seq-length", "32768", "--memory-margin", "0", "--json", "--top", "40"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["fits"] and rows[0]["cp"] > 1 and rows[0]["comm_gb_per_step"]["cp"] > 0
    model = get_preset("qwen3.5-27b")
    for row in rows:
        keys = row["config"]
        cfg = from_dict(TrainConfig, {"model_name": "qwen3.5-27b", "data_path": str(tmp_path),
                                      "output_path": str(tmp_path / "out"), **keys}, source="plan row")
        lay = engine_layout(cfg, resolve_parallelism(cfg, keys["rank_size"], model), 4096, "cuda", fp32_matmul=False)
        assert (lay.tp, lay.cp, lay.pp, lay.dp, lay.micro_batch_size, lay.activation_checkpointing) == \
            (row["tp"], row["cp"], row["pp"], row["dp"], row["micro_batch_size"], row["activation_checkpointing"])
