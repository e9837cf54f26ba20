"""Predicted step time, throughput and MFU of a layout: a roofline-style model.

Per micro-batch on the slowest pipeline stage, compute = hardware FLOPs (model
FLOPs + recomputation, per layer kind: ``layers.flops_per_token``) / (tp x peak
x efficiency), with the peak of the precision the matmuls run in (bf16, or fp32
for ``mixed_precision: fp32``, against which MFU is then reported too) and a
Gated DeltaNet's chunked delta rule at the fp32 peak (it computes in fp32); a
MoE block runs whole on every tp rank, its FLOPs repeated; the FLOPs are
``flops``' (attention over the causal half of the square, as the kernels run
it; MFU, HFU and the full-square MFU from ``flops.token_flops``, as the
training log's; the multi-token-prediction layer on the last stage when
``Layout.mtp``); or, when longer, the host's time to issue the stage's layers
(``Hardware.host_seconds_per_layer``: eager or compiled, with or without tensor
parallelism's DTensors; a third more with full recompute; a Gated DeltaNet
layer's extra operators, a Python loop over the sequence's chunks, scaled from
the operator counts: ``layers.host_ops_per_layer``), which the device cannot
run ahead of. To that each micro-batch adds its tensor-, context- and
expert-parallel collectives and its pipeline messages, on the critical path
(their bytes and seconds: ``plan/comm.py``).

A step runs ``m + (p - 1)/v`` micro-batch times (the last ``(p - 1)/v`` are
the bubble), plus what data parallelism's (FSDP's) gathers and reductions leave
exposed beyond the compute that hides them (``comm.dp_exposed``; the most any
stage leaves: the step ends when every stage has reduced). The optimizer step
is bound by memory bandwidth (AdamW reads and writes 28 bytes per local
parameter). Cross-node bytes are the bus bytes of the groups that span nodes:
with one NIC per device, the share of the inter-node links each device loads.

MoE routing skew (``Layout.moe_rank_load`` > 1 under ep): the heaviest
expert-parallel rank computes that many times its share of the expert FLOPs
and its all-to-alls take that many times longer; every rank waits for it.
FP8 (``Layout.fp8``, ``plan/fp8.py``): the FP8 projections' FLOPs at the FP8
peak, their casts as bytes at the memory bandwidth, FSDP's gathers of them at
one byte per weight with FP8 all-gather.

``StepEstimate.breakdown`` splits the step into what holds it: matmuls (FLOPs
at the efficiency), bandwidth-bound work (FP8 casts, the optimizer step), the
host's excess over the device, each axis's exposed communication and the
pipeline bubble; ``bottleneck`` names the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qwen3_pretrain.hardware import GB, Hardware
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan import comm
from qwen3_pretrain.plan import formulas as F
from qwen3_pretrain.plan import fp8 as FP8
from qwen3_pretrain.plan.flops import head_flops, token_flops
from qwen3_pretrain.plan.layers import flops_per_token, host_ops_per_layer, mtp_flops_per_token
from qwen3_pretrain.plan.layout import Cluster, Layout, StageShape, check_model_fits_layout, stage_shapes
from qwen3_pretrain.plan.memory import stage_params

ADAMW_BYTES_PER_PARAM = 28  # reads param, grad, two moments (16); writes param and moments (12)


@dataclass(frozen=True)
class StepEstimate:
    step_time_s: float
    tokens_per_sec_per_device: float
    mfu: float  # model FLOPs (attention's causal half) / peak: plan/flops.py
    bubble_fraction: float
    compute_time_s: float  # busy compute time of the slowest stage per step
    comm_time_s: dict[str, float]  # exposed communication seconds per step, per mesh axis
    comm_bytes_per_axis: dict[str, float]  # bytes each device moves per step, per mesh axis (bus bytes)
    # ... on each pipeline rank (the figures above are the slowest one's): the pp and dp terms differ by stage
    comm_bytes_per_stage: tuple[dict[str, float], ...]
    dp_bytes_per_group: dict[str, float]  # the dp axis's bytes split by group: dp_shard, dp_replicate
    cross_node_bytes: float  # the bytes above on groups that span nodes (each device's share of its NIC's load)
    host_bound: bool = False  # some stage's micro-batch waits on the host issuing its operators
    hfu: float = 0.0  # MFU with what recompute runs again
    mfu_full_square: float = 0.0  # MFU with attention over the whole square (PaLM's, torchtitan's convention)
    # Seconds of the step by what holds it (``BREAKDOWN``); they add up to ``step_time_s``
    breakdown: dict[str, float] = field(default_factory=dict)
    dp_total_s: float = 0.0  # FSDP's collectives of the step, hidden or not (``comm_time_s["dp"]`` is exposed)

    @property
    def bottleneck(self) -> str:
        """The largest term of the breakdown: ``matmul`` (compute-bound), ``bandwidth`` (FP8 casts, the
        optimizer step: memory-bound), ``host`` (operators issued slower than computed), ``bubble``, or the
        exposed communication of a mesh axis (``comm tp`` ...)."""
        if not self.breakdown:
            return ""
        return max(self.breakdown.items(), key=lambda kv: kv[1])[0]


# The terms of ``StepEstimate.breakdown``
BREAKDOWN = ("matmul", "bandwidth", "host", "comm tp", "comm cp", "comm pp", "comm ep", "comm dp", "bubble")


# FSDP's exposed seconds, by the name this module gave it before the communication terms moved to plan/comm.py
_dp_exposed = comm.dp_exposed


def _stage_flops_per_microbatch(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> tuple[float, float]:
    """Hardware FLOPs of one micro-batch's forward + backward on this stage, all tp ranks together: (matmuls
    and attention's core, of which ``_stage_fp8_flops_per_microbatch`` run in FP8 and the rest at the compute
    dtype's peak; at fp32's: a Gated DeltaNet's chunked delta rule). Per layer kind
    (``layers.flops_per_token``); the LM head on the last stage, with the multi-token-prediction layer
    where ``layout.mtp`` trains it."""
    matmul = fp32 = 0.0
    for kind, count in shape.layer_kinds:
        kind_matmul, kind_fp32 = flops_per_token(cfg, layout, kind)
        matmul, fp32 = matmul + count * kind_matmul, fp32 + count * kind_fp32
    if shape.has_head:
        mtp_matmul, mtp_fp32 = mtp_flops_per_token(cfg, layout)
        matmul, fp32 = matmul + head_flops(cfg, layout.mtp) + mtp_matmul, fp32 + mtp_fp32
    return matmul * layout.microbatch_tokens, fp32 * layout.microbatch_tokens


def _moe_skew_flops_per_microbatch(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> float:
    """The FLOPs the heaviest expert-parallel rank computes beyond its even share (all tp ranks together, as
    ``_stage_flops_per_microbatch``): its experts take ``moe_rank_load`` times their share of the pairs, and
    every rank waits for it at the next all-to-all. Per pair and MoE layer one expert's three projections, 6
    FLOPs per weight (2 more where full or MLP recompute reruns them)."""
    if layout.ep == 1 or not shape.sparse_layers or layout.moe_rank_load == 1:
        return 0.0
    passes = 4 if layout.activation_checkpointing in ("full", "mlp") else 3
    repeat = 1 if layout.moe_tokens_split_by_tp else layout.tp
    per_token = 2.0 * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size * passes * repeat
    return (layout.moe_rank_load - 1) * per_token * shape.sparse_layers * layout.microbatch_tokens


def _stage_fp8_flops_per_microbatch(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> tuple[float, float]:
    """Of ``_stage_flops_per_microbatch``'s matmul FLOPs, those ``layout.fp8`` runs in FP8: (the projections',
    the routed experts'; ``fp8.fp8_flops_per_token``; the LM head, the embedding, the router and the MTP layer
    stay in bf16)."""
    total = sum(count * FP8.fp8_flops_per_token(cfg, layout, kind) for kind, count in shape.layer_kinds)
    experts = sum(count * FP8.fp8_expert_flops_per_token(cfg, layout, kind) for kind, count in shape.layer_kinds)
    tokens = layout.microbatch_tokens
    return (total - experts) * tokens, experts * tokens


def _fp8_cast_bytes(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> float:
    """Bytes one rank moves per micro-batch casting to FP8 (``fp8.cast_bytes_per_token``,
    ``fp8.weight_cast_bytes``)."""
    if layout.fp8 == "off":
        return 0.0
    per_token = sum(count * FP8.cast_bytes_per_token(cfg, layout, kind) for kind, count in shape.layer_kinds)
    return per_token * layout.microbatch_tokens + FP8.weight_cast_bytes(cfg, layout, shape)


def _host_seconds(cfg: Qwen3Config, layout: Layout, hardware: Hardware, shape: StageShape) -> float:
    """The host's time to issue the stage's layers' forward and backward for a micro-batch. Under tp a layer
    recomputed whole is compiled only in parts (its norms stay eager DTensor code: parallel/parallelize.py
    compile_layer), so it is counted as eager; full recompute issues the forward twice. A Gated DeltaNet
    layer issues more operators than the Qwen3 layer the figures were timed on
    (``layers.host_ops_per_layer``); those beyond it are plain tensors under tp (the delta rule on the rank's
    own heads) and cost what a layer's operators cost without tp. A trained multi-token-prediction layer's
    decoder layers (full attention) on the head's stage count as Qwen3 layers."""
    compiled = layout.compile and not (layout.tp > 1 and layout.activation_checkpointing == "full")
    per_layer = hardware.host_seconds_per_layer(layout.tp > 1, compiled)
    per_extra_layer = hardware.host_seconds_per_layer(False, compiled)
    seconds = sum(count * (per_layer + (host_ops_per_layer(cfg, layout, kind) - 1) * per_extra_layer)
                  for kind, count in shape.layer_kinds)
    if shape.has_head and layout.mtp:
        seconds += cfg.mtp_num_hidden_layers * per_layer
    return seconds * (4 / 3 if layout.activation_checkpointing == "full" else 1.0)


def _matmul_speeds(layout: Layout, hardware: Hardware) -> tuple[float, float, float, float]:
    """FLOP/s of a tp group at the efficiency: the compute dtype's matmuls, fp32 ones (the delta rule), FP8
    projections and routed experts under the layout's recipe (1.0 where FP8 is off: no FLOPs run there)."""
    speed = hardware.compute_flops(layout.mixed_precision) * hardware.compute_efficiency * layout.tp
    fp32_speed = hardware.compute_flops("fp32") * hardware.compute_efficiency * layout.tp
    fp8_speed = expert_speed = 1.0
    if layout.fp8 != "off":
        fp8_speed = FP8.fp8_peak_tflops(hardware, layout.fp8) * 1e12 * hardware.compute_efficiency \
            * FP8.FP8_EFFICIENCY_RATIO[layout.fp8] * layout.tp
        experts = FP8.expert_recipe(layout)
        expert_speed = FP8.fp8_peak_tflops(hardware, experts) * 1e12 * hardware.compute_efficiency \
            * FP8.FP8_EFFICIENCY_RATIO[experts] * layout.tp
    return speed, fp32_speed, fp8_speed, expert_speed


def _stage_times(cfg: Qwen3Config, layout: Layout, hardware: Hardware, cluster: Cluster, links: dict,
                 speeds: tuple[float, float, float, float], shape: StageShape) -> dict:
    """One pipeline stage's seconds per micro-batch (compute, and each axis's communication not hidden), its
    bytes per micro-batch per axis, FSDP's per step, and whether its host is slower than its device."""
    speed, fp32_speed, fp8_speed, expert_speed = speeds
    bandwidth = hardware.memory_bandwidth_gbps * GB
    matmul_flops, fp32_flops = _stage_flops_per_microbatch(cfg, layout, shape)
    skew = _moe_skew_flops_per_microbatch(cfg, layout, shape)
    fp8_flops, expert_flops = _stage_fp8_flops_per_microbatch(cfg, layout, shape)
    if expert_flops:  # the heaviest rank's extra expert work runs at the experts' FP8 speed too
        matmul_flops, expert_flops = matmul_flops + skew, expert_flops + skew
    else:
        matmul_flops += skew
    matmul = (matmul_flops - fp8_flops - expert_flops) / speed + fp32_flops / fp32_speed \
        + fp8_flops / fp8_speed + expert_flops / expert_speed
    casts = _fp8_cast_bytes(cfg, layout, shape) / bandwidth
    device = matmul + casts
    host = _host_seconds(cfg, layout, hardware, shape)
    # an accelerator computes while its host issues ahead: a micro-batch takes the longer of the two; a
    # CPU is its own host and does both
    compute = device + host if hardware.device_type == "cpu" else max(device, host)
    tp_bytes, tp_time = comm.tp_bytes_and_time(cfg, layout, shape, links["tp"])
    cp_bytes, cp_time = comm.cp_bytes_and_time(cfg, layout, shape, links["cp"])
    pp_bytes, pp_time = comm.pp_bytes_and_time(cfg, layout, shape, links["pp"])
    ep_bytes, ep_time = comm.ep_bytes_and_time(cfg, layout, shape, comm.intra_link(hardware),
                                                comm.inter_link(hardware), comm.ep_on_node(layout, cluster))
    ep_time *= layout.moe_rank_load  # an all-to-all ends when its heaviest receiver has its pairs
    dp_bytes, gather, reduce, first, last = comm.dp_bytes_and_time(cfg, layout, shape, links)
    # a CPU waits for each of FSDP's gloo calls on the computing thread (no side stream): nothing hides, as the
    # roofline prices it (``Hardware.overlaps_collectives``)
    exposed = comm.dp_exposed(layout, shape.stage, compute, gather, reduce, first, last) \
        if hardware.overlaps_collectives else gather + reduce
    return dict(compute=compute, matmul=matmul, casts=casts, tp=tp_time, cp=cp_time, pp=pp_time, ep=ep_time,
                dp=gather + reduce, dp_exposed=exposed,
                bytes={"tp": tp_bytes, "cp": cp_bytes, "pp": pp_bytes, "ep": ep_bytes}, dp_bytes=dp_bytes,
                shape=shape, host_bound=hardware.device_type != "cpu" and host > device)


def predict_step(cfg: Qwen3Config, layout: Layout, hardware: Hardware, cluster: Cluster | None = None) -> StepEstimate:
    """Step time, tokens/s per device and MFU of ``layout`` on ``hardware`` (see the module docstring)."""
    check_model_fits_layout(cfg, layout)
    cluster = cluster or Cluster(1, layout.world_size)
    links = comm.axis_links(layout, cluster, hardware)
    peak = hardware.compute_flops(layout.mixed_precision)
    bandwidth = hardware.memory_bandwidth_gbps * GB
    m, v = layout.num_microbatches, layout.stages_per_rank
    speeds = _matmul_speeds(layout, hardware)
    per_stage = [_stage_times(cfg, layout, hardware, cluster, links, speeds, shape)
                 for shape in stage_shapes(cfg, layout)]
    host_bound = any(x["host_bound"] for x in per_stage)
    # The slowest stage paces the pipeline; its numbers describe the step. FSDP's exposed time: the most any
    # stage leaves exposed (the step ends when every stage has reduced).
    slowest = max(per_stage, key=lambda x: x["compute"] + x["tp"] + x["cp"] + x["pp"] + x["ep"])
    slots = m + (layout.pp - 1) / v
    busy = m * slowest["compute"]
    dp_exposed = max(x["dp_exposed"] for x in per_stage)
    total_params = stage_params(cfg, layout, slowest["shape"]).total
    optimizer = ADAMW_BYTES_PER_PARAM * total_params / layout.shards / bandwidth
    per_mb = slowest["compute"] + slowest["tp"] + slowest["cp"] + slowest["pp"] + slowest["ep"]
    step = slots * per_mb + dp_exposed + optimizer
    breakdown = {"matmul": m * slowest["matmul"], "bandwidth": m * slowest["casts"] + optimizer,
                 "host": m * (slowest["compute"] - slowest["matmul"] - slowest["casts"]),
                 **{f"comm {axis}": m * slowest[axis] for axis in ("tp", "cp", "pp", "ep")},
                 "comm dp": dp_exposed, "bubble": (slots - m) * per_mb}
    tokens_per_device = layout.tokens_per_step / step / layout.world_size
    flops = token_flops(cfg, layout.seq_length, layout.activation_checkpointing, layout.mtp)
    per_stage_axis = tuple({"tp": m * x["bytes"]["tp"], "cp": m * x["bytes"]["cp"], "pp": m * x["bytes"]["pp"],
                            "ep": m * x["bytes"]["ep"], "dp": sum(x["dp_bytes"].values())} for x in per_stage)
    per_axis = per_stage_axis[per_stage.index(slowest)]
    return StepEstimate(
        step_time_s=step,
        tokens_per_sec_per_device=tokens_per_device,
        mfu=tokens_per_device * flops.model / peak,
        hfu=tokens_per_device * flops.hardware / peak,
        mfu_full_square=tokens_per_device * flops.full_square / peak,
        bubble_fraction=F.pipeline_bubble_fraction(layout.pp, m, v),
        compute_time_s=busy,
        host_bound=host_bound,
        comm_time_s={"tp": m * slowest["tp"], "cp": m * slowest["cp"], "pp": m * slowest["pp"],
                     "ep": m * slowest["ep"], "dp": dp_exposed},
        comm_bytes_per_axis=per_axis,
        comm_bytes_per_stage=per_stage_axis,
        dp_bytes_per_group=slowest["dp_bytes"],
        cross_node_bytes=sum(b for axis, b in {**{k: per_axis[k] for k in ("tp", "cp", "pp")},
                                               **slowest["dp_bytes"]}.items()
                             if not cluster.axis_is_intra_node(layout, axis))
        + per_axis["ep"] * (layout.ep - comm.ep_on_node(layout, cluster)) / max(layout.ep - 1, 1),
        breakdown=breakdown,
        dp_total_s=max(x["dp"] for x in per_stage),
    )
