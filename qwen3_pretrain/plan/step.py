"""Predicted step time, throughput and MFU of a layout: a roofline-style model.

Per micro-batch on the slowest pipeline stage:

* compute = hardware FLOPs (model FLOPs + recomputation, per layer kind:
  ``layers.flops_per_token``) / (tp x peak x efficiency), with the peak of the
  precision the matmuls run in (bf16, or fp32 for ``mixed_precision: fp32``,
  against which MFU is then reported too) and a Gated DeltaNet's chunked delta
  rule at the fp32 peak (it computes in fp32); a MoE block runs whole on every
  tp rank, its FLOPs repeated; the FLOPs are ``flops``' (attention over the
  causal half of the square, as the kernels run it; MFU, HFU and the
  full-square MFU from ``flops.token_flops``, as the training log's; the
  multi-token-prediction layer on the last stage when ``Layout.mtp``);
  or, when longer, the host's time to issue the stage's layers
  (``Hardware.host_seconds_per_layer``: eager or compiled, with or without
  tensor parallelism's DTensors; a third more with full recompute; a Gated
  DeltaNet layer's extra operators, a Python loop over the sequence's chunks,
  scaled from the operator counts: ``layers.host_ops_per_layer``), which the
  device cannot run ahead of;
* tensor parallelism = every sequence-parallel all-gather and reduce-scatter of
  ``[tokens, hidden]`` activations, on the critical path (not overlapped), per
  layer kind (``layers.tp_collectives``): attention (or Gated DeltaNet) and a
  dense MLP 2 + 2 in forward, 2 + 2 in backward, 2 + 1 more for full recompute
  (it stops before the MLP's output scatter) and 1 gather for MLP recompute (none
  for selective, the attention core); a MoE block run whole on every tp rank one
  gather each way and none under a MoE block on each rank's tokens; the
  embedding's reduce-scatter, the loss's gather of the hidden states and
  all-reduce of its gradient, and the loss's per-chunk statistics all-reduces;
* context parallelism = per attention layer an all-gather of the whole
  sequence's K and V over the cp ranks (twice with selective or full recompute,
  which rerun attention) and a reduce-scatter of their gradients; per Gated
  DeltaNet layer three all-to-alls each way (tokens to heads and back, again under
  full recompute: ``layers.cp_calls``); not overlapped; every token count above
  is a rank's share of the sequence (``seq / cp``);
* pipeline = one activation (``[tokens / tp, hidden]`` and the int64 RoPE
  positions ``[tokens]``) and one gradient transferred per micro-batch, not
  overlapped; a middle stage moves each twice (received and sent on), an end
  stage once (``_pp_bytes_and_time``).

A step runs ``m + (p - 1)/v`` micro-batch times (the last ``(p - 1)/v`` are
the bubble). Data parallelism (FSDP) all-gathers the stage's compute-dtype
weights for each micro-batch's forward and backward (the head and final norm
once per micro-batch; under pipeline parallelism, which keeps units gathered
after backward, ``m + 1`` times a step, the head once: ``_gathers``) and
reduce-scatters fp32 gradients once per step (all-reduces them without the
distributed optimizer). A collective hides only behind compute that runs while
it is in flight (``_dp_exposed``): a micro-batch's gathers behind its own
forward and backward, the reductions behind the backward they follow, which,
where gradients accumulate unsharded, is the step's last micro-batch's alone;
under pipelining the schedule reduces after a stage's last backward, hidden
only by the cool-down slots after it; the first unit's gather and the last
unit's reduction are always exposed. What exceeds its window adds to the step.
Under HSDP the gathers and reduce-scatters run in the ``dp_shard`` group and
each reduction adds an all-reduce of the fp32 gradient shards across the
replicas, each group on its own link. The optimizer step is bound by memory
bandwidth (AdamW reads and writes 28 bytes per local parameter). Every
collective costs ``bytes x factor / bus bandwidth + latency``
(``formulas.collective_seconds``). Cross-node bytes are the bus bytes of the
groups that span nodes: with one NIC per device, the share of the inter-node
links each device loads.

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
from qwen3_pretrain.plan import formulas as F
from qwen3_pretrain.plan import fp8 as FP8
from qwen3_pretrain.plan.flops import head_flops, token_flops
from qwen3_pretrain.plan.layers import (cp_calls, flops_per_token, host_ops_per_layer, mtp_flops_per_token,
                                        tp_collectives)
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


@dataclass(frozen=True)
class _Link:
    bandwidth: float  # bytes/s
    latency: float  # s


def _intra_link(hw: Hardware) -> _Link:
    return _Link(hw.intra_node_gbps * GB, hw.intra_node_latency_us * 1e-6)


def _inter_link(hw: Hardware) -> _Link:
    return _Link(hw.inter_node_gbps * GB, hw.inter_node_latency_us * 1e-6)


def _links(layout: Layout, cluster: Cluster, hw: Hardware) -> dict[str, _Link]:
    intra, inter = _intra_link(hw), _inter_link(hw)
    return {axis: intra if cluster.axis_is_intra_node(layout, axis) else inter
            for axis in ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp")}


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


def _tp_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape, link: _Link) -> tuple[float, float]:
    """(bus bytes, seconds) of one micro-batch's tensor-parallel collectives on this stage: each layer's
    (``layers.tp_collectives``), the embedding's and the loss's."""
    t = layout.tp
    if t == 1:
        return 0.0, 0.0
    tokens = layout.microbatch_tokens
    act = layout.dtype_bytes * tokens * cfg.hidden_size  # one [tokens, hidden] activation
    calls: list[tuple[F.Collective, float]] = []
    for kind, count in shape.layer_kinds:
        gathers, scatters = tp_collectives(layout, kind)
        calls += ([("all_gather", act)] * gathers + [("reduce_scatter", act)] * scatters) * count
    if shape.has_embedding:
        calls += [("reduce_scatter", act), ("all_gather", act)]
    if shape.has_head:
        chunks = -(-tokens // layout.loss_chunk_tokens)
        calls += [("all_gather", act), ("all_reduce", act), ("reduce_scatter", act)]
        calls += [("all_reduce", 4.0 * min(tokens, layout.loss_chunk_tokens) * 2)] * (2 * chunks)
    nbytes = sum(b * F.bus_bandwidth_factor(kind, t) for kind, b in calls)
    seconds = sum(F.collective_seconds(kind, b, t, link.bandwidth, link.latency) for kind, b in calls)
    return nbytes, seconds


def _cp_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape, link: _Link) -> tuple[float, float]:
    """(bus bytes, seconds) of one micro-batch's context-parallel collectives on this stage, per layer kind
    (``layers.cp_calls``: attention's K/V all-gathers, a Gated DeltaNet's all-to-alls), on the critical path."""
    if layout.cp == 1:
        return 0.0, 0.0
    calls = [call for kind, count in shape.layer_kinds for call in cp_calls(cfg, layout, kind) * count]
    nbytes = sum(b * F.bus_bandwidth_factor(kind, layout.cp) for kind, b in calls)
    seconds = sum(F.collective_seconds(kind, b, layout.cp, link.bandwidth, link.latency) for kind, b in calls)
    return nbytes, seconds


def _ep_on_node(layout: Layout, cluster: Cluster) -> int:
    """How many ranks of an ep group share a node (the group is ``ep`` consecutive ranks)."""
    return max(1, min(layout.ep, cluster.devices_per_node))


def _ep_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape, intra: _Link, inter: _Link,
                       on_node: int) -> tuple[float, float]:
    """(bytes sent, seconds) of one micro-batch's expert-parallel all-to-alls on this stage, on the critical
    path. Per MoE layer: the pairs (``top_k`` per token the layer routes, ``Layout.moe_tokens``) go out with
    their routing weight (``h + 1`` values each) and come back (``h``); backward sends
    the gradients the same two ways, and recompute repeats the forward's two. With balanced routing a rank
    keeps ``1 / ep`` of its pairs and sends the rest (``formulas.all_to_all_bytes``). Each forward first
    exchanges the per-expert counts (``E`` int64). A group spanning nodes sends ``(on_node - 1) / ep`` of
    each buffer over the node's links and ``(ep - on_node) / ep`` over the network at once: the slower
    share sets the time."""
    if layout.ep == 1 or not shape.sparse_layers:
        return 0.0, 0.0
    pairs = layout.moe_tokens * cfg.num_experts_per_tok
    d, h = layout.dtype_bytes, cfg.hidden_size
    rounds = 2 if layout.activation_checkpointing in ("full", "mlp") else 1
    buffers = [pairs * (h + 1) * d, pairs * h * d] * (1 + rounds) + [8 * cfg.num_experts] * rounds
    nbytes = shape.sparse_layers * sum(F.all_to_all_bytes(b, layout.ep) for b in buffers)
    ep = layout.ep
    link = inter if on_node < ep else intra

    def seconds_of(b: float) -> float:
        return max(b * (on_node - 1) / ep / intra.bandwidth, b * (ep - on_node) / ep / inter.bandwidth) \
            + link.latency

    return nbytes, shape.sparse_layers * sum(seconds_of(b) for b in buffers)


def _pp_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape, link: _Link) -> tuple[float, float]:
    """(bytes sent + received, seconds) of one micro-batch's pipeline messages on this pipeline rank.

    Forward a stage passes its hidden states ``[tokens / tp, hidden]`` and the
    RoPE positions (int64 ``[tokens]``, which every stage needs and which have
    no gradient); backward the hidden states' gradient. Each model chunk the
    rank holds exchanges both with the chunk before it and the one after it,
    except the first chunk of the model (no one before) and the last (no one
    after): an end stage moves one message each way per micro-batch, a middle
    one two. The time counts one transfer each way, on the critical path.
    """
    if layout.pp == 1:
        return 0.0, 0.0
    tokens = layout.microbatch_tokens
    hidden = layout.dtype_bytes * tokens * cfg.hidden_size / layout.tp
    forward, backward = hidden + 8 * tokens, hidden
    neighbours = 2 * layout.stages_per_rank - (shape.stage == 0) - (shape.stage == layout.pp - 1)
    seconds = sum(F.collective_seconds("p2p", b, 2, link.bandwidth, link.latency) for b in (forward, backward))
    return neighbours * (forward + backward), seconds


def _dp_calls(cfg: Qwen3Config, layout: Layout, shape: StageShape
              ) -> list[tuple[str, F.Collective, float, int]]:
    """FSDP's collectives of one step as (mesh axis, kind, bytes, ranks): weight all-gathers and gradient
    reduce-scatters inside the shard group, then (HSDP) an all-reduce of the gradient shards across the
    replicas, as FSDP2 runs them per unit. Without the distributed optimizer the shard group is one rank:
    only the all-reduce of the whole gradients is left. Under expert parallelism a rank's experts are
    sharded over the ``shards / ep`` ranks ep leaves (none when ep takes them all)."""
    sp = stage_params(cfg, layout, shape)
    m, shards, replicas = layout.num_microbatches, layout.shards, layout.replicas
    experts = 0.0
    if layout.ep > 1:
        experts = shape.sparse_layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts / layout.ep
    reductions = 1 if layout.accumulates_unsharded else m
    dense_units, expert_units = _gathers(cfg, layout, shape, sp, experts)
    calls: list[tuple[str, F.Collective, float, int]] = []
    fp8_gathered = sum(n * FP8.fp8_weight_params(cfg, layout, kind, FP8.GATHERED_IN_FP8)
                       for kind, n in shape.layer_kinds) if layout.fp8_all_gather else 0.0
    efsdp = shards * layout.tp // layout.ep if layout.ep > 1 else shards
    for which, (held, group, units) in enumerate(((sp.held - experts, shards, dense_units),
                                                  (experts, efsdp, expert_units))):
        if not held:
            continue
        low = fp8_gathered if which == 0 else 0.0
        if group > 1:
            for index, (params, gathers) in enumerate(units):
                # the first unit group holds the decoder layers: their FP8 projections gathered at 1 B each
                nbytes = layout.dtype_bytes * params - (layout.dtype_bytes - 1) * (low if index == 0 else 0)
                calls += [("dp_shard", "all_gather", nbytes, group)] * gathers
            if low:  # the FP8 weights' scales: one all-reduce of their maxima
                calls.append(("dp_shard", "all_reduce", 4.0 * 7 * shape.num_layers, group))
            calls += [("dp_shard", "reduce_scatter", layout.grad_bytes * held, group)] * reductions
        if replicas > 1:
            calls += [("dp_replicate", "all_reduce", layout.grad_bytes * held / group, replicas)] * reductions
    return calls


def _gathers(cfg: Qwen3Config, layout: Layout, shape: StageShape, sp, experts: float = 0.0
             ) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """(parameters, all-gathers per step) of the stage's FSDP units, in two groups; and of the ``experts``
    (parameters, under expert parallelism units of their own, freed after forward like the layers).

    Layers and the embedding free their weights after forward (``reshard_after_forward``), so backward
    gathers them again; the LM head and the root (final norm) keep theirs from forward to backward, and a
    tied embedding too (its head applies it in the loss). Without pipelining a backward frees them all
    again: per micro-batch two gathers and one. Under pipeline parallelism the schedule keeps a unit
    gathered after its backward until the step ends, so a forward right after a backward finds it
    gathered: of a stage's ``m`` forwards and ``m`` backwards, each forward after a forward gathers (the
    warm-up), each backward after a forward (one per micro-batch in the steady state, plus the first of
    the cool-down) too: ``m + 1`` for the units freed after forward, once for the others. With
    ``keep_params_gathered`` every unit is gathered once per step.
    """
    if layout.keep_params_gathered:  # every unit gathered at the step's first forward, freed at its end
        return [(sp.held - experts, 1)], [(experts, 1)]
    embedding = cfg.vocab_size * cfg.hidden_size / layout.tp if shape.has_embedding and not sp.tied_head else 0.0
    freed = sp.layers - experts + embedding
    m = layout.num_microbatches
    again = 2 * m if layout.pp == 1 else m + 1
    kept = m if layout.pp == 1 else 1
    expert_units = [(experts, again)]
    return [(freed, again), (sp.held - experts - freed, kept)], expert_units


def _dp_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape,
                       links: dict[str, _Link]) -> tuple[dict[str, float], float, float, float, float]:
    """(bus bytes per step by dp axis, seconds of the weight all-gathers, of the gradient reductions, of one
    unit's gather, of one unit's reduction) of FSDP's collectives in one step. Each runs as one collective per
    FSDP unit: the latency is paid per unit."""
    calls = _dp_calls(cfg, layout, shape)
    nbytes = {"dp_shard": 0.0, "dp_replicate": 0.0}
    gather = reduce = first = last = 0.0
    units = shape.num_layers + 2
    for axis, kind, b, n in calls:
        nbytes[axis] += b * F.bus_bandwidth_factor(kind, n)
        seconds = F.collective_seconds(kind, b, n, links[axis].bandwidth, links[axis].latency * units)
        unit = F.collective_seconds(kind, b / units, n, links[axis].bandwidth, links[axis].latency)
        if kind == "all_gather":
            gather, first = gather + seconds, first or unit
        else:
            reduce, last = reduce + seconds, unit
    return nbytes, gather, reduce, first, last


def _backward_share(layout: Layout) -> float:
    """The share of a micro-batch's compute that is its backward (with what recompute reruns): 2 of 3 units
    of work, 3 of 4 with full recompute."""
    return 3 / 4 if layout.activation_checkpointing == "full" else 2 / 3


def _dp_exposed(layout: Layout, stage: int, compute: float, gather: float, reduce: float, first: float,
                last: float) -> float:
    """Seconds of FSDP's collectives the stage's compute cannot hide, per step.

    A collective hides only behind compute that runs while it is in flight and does not wait for it:

    * without pipelining, each micro-batch's weight all-gathers (half before its forward's layers, half
      before its backward's) behind that forward's or backward's compute; the gradient reductions behind
      the backward they follow: every micro-batch's, or, where gradients accumulate unsharded until the
      step's last micro-batch, all of them behind that one backward (the rest of the step is long over);
      with the weights kept gathered, all gathers behind the first forward;
    * under pipeline parallelism the gathers spread over the stage's whole busy time, and the schedule
      reduces the gradients after the stage's last backward: only the cool-down slots after it hide them
      (stage ``s`` finishes ``s`` backwards before stage 0, which has none);
    * always: the first unit's gather before any compute, and (without pipelining) the last unit's
      reduction after all of it.

    Compute slowed by the collectives sharing its memory and cores is not modelled."""
    m, b = layout.num_microbatches, _backward_share(layout)
    forward, backward = (1 - b) * compute, b * compute
    if layout.pp > 1:
        return max(0.0, gather - m * compute) + max(0.0, reduce - stage * backward) + first
    if layout.keep_params_gathered:
        exposed = max(0.0, gather - forward) + max(0.0, reduce - backward)
    else:
        per = gather / m
        if layout.accumulates_unsharded:  # every reduction behind the last micro-batch's backward
            exposed = (m - 1) * (max(0.0, per / 2 - forward) + max(0.0, per / 2 - backward)) \
                + max(0.0, per / 2 - forward) + max(0.0, per / 2 + reduce - backward)
        else:
            exposed = m * (max(0.0, per / 2 - forward) + max(0.0, per / 2 + reduce / m - backward))
    return exposed + first + last


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
    tp_bytes, tp_time = _tp_bytes_and_time(cfg, layout, shape, links["tp"])
    cp_bytes, cp_time = _cp_bytes_and_time(cfg, layout, shape, links["cp"])
    pp_bytes, pp_time = _pp_bytes_and_time(cfg, layout, shape, links["pp"])
    ep_bytes, ep_time = _ep_bytes_and_time(cfg, layout, shape, _intra_link(hardware), _inter_link(hardware),
                                           _ep_on_node(layout, cluster))
    ep_time *= layout.moe_rank_load  # an all-to-all ends when its heaviest receiver has its pairs
    dp_bytes, gather, reduce, first, last = _dp_bytes_and_time(cfg, layout, shape, links)
    return dict(compute=compute, matmul=matmul, casts=casts, tp=tp_time, cp=cp_time, pp=pp_time, ep=ep_time,
                dp=gather + reduce, dp_exposed=_dp_exposed(layout, shape.stage, compute, gather, reduce, first, last),
                bytes={"tp": tp_bytes, "cp": cp_bytes, "pp": pp_bytes, "ep": ep_bytes}, dp_bytes=dp_bytes,
                shape=shape, host_bound=hardware.device_type != "cpu" and host > device)


def predict_step(cfg: Qwen3Config, layout: Layout, hardware: Hardware, cluster: Cluster | None = None) -> StepEstimate:
    """Step time, tokens/s per device and MFU of ``layout`` on ``hardware`` (see the module docstring)."""
    check_model_fits_layout(cfg, layout)
    cluster = cluster or Cluster(1, layout.world_size)
    links = _links(layout, cluster, hardware)
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
        + per_axis["ep"] * (layout.ep - _ep_on_node(layout, cluster)) / max(layout.ep - 1, 1),
        breakdown=breakdown,
        dp_total_s=max(x["dp"] for x in per_stage),
    )
