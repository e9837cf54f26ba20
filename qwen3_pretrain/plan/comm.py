"""A step's communication per mesh axis: the bytes each collective moves and the seconds it adds, for the
step-time model (``step.predict_step``, which adds them to compute).

Per micro-batch on one pipeline stage, on the critical path (not overlapped):

* tensor parallelism = every sequence-parallel all-gather and reduce-scatter of
  ``[tokens, hidden]`` activations, per layer kind (``layers.tp_collectives``):
  attention (or Gated DeltaNet) and a dense MLP 2 + 2 in forward, 2 + 2 in
  backward, 2 + 1 more for full recompute (it stops before the MLP's output
  scatter) and 1 gather for MLP recompute (none for selective, the attention
  core); a MoE block run whole on every tp rank one gather each way and none
  under a MoE block on each rank's tokens; the embedding's reduce-scatter, the
  loss's gather of the hidden states and all-reduce of its gradient, and the
  loss's per-chunk statistics all-reduces;
* context parallelism = per attention layer an all-gather of the whole
  sequence's K and V over the cp ranks (twice with selective or full recompute,
  which rerun attention) and a reduce-scatter of their gradients; per Gated
  DeltaNet layer three all-to-alls each way (tokens to heads and back, again under
  full recompute: ``layers.cp_calls``); every token count above is a rank's
  share of the sequence (``seq / cp``);
* expert parallelism = per MoE layer the routed pairs' all-to-alls out and back,
  forward, backward and what recompute repeats (``ep_bytes_and_time``);
* pipeline = one activation (``[tokens / tp, hidden]`` and the int64 RoPE
  positions ``[tokens]``) and one gradient transferred per micro-batch; a middle
  stage moves each twice (received and sent on), an end stage once
  (``pp_bytes_and_time``).

Per step, data parallelism (FSDP) all-gathers the stage's compute-dtype weights
for each micro-batch's forward and backward (the head and final norm once per
micro-batch; under pipeline parallelism, which keeps units gathered after
backward, ``m + 1`` times a step, the head once: ``_gathers``) and
reduce-scatters fp32 gradients once per step (all-reduces them without the
distributed optimizer). A collective hides only behind compute that runs while
it is in flight (``dp_exposed``): a micro-batch's gathers behind its own forward
and backward, the reductions behind the backward they follow, which, where
gradients accumulate unsharded, is the step's last micro-batch's alone; under
pipelining the schedule reduces after a stage's last backward, hidden only by
the cool-down slots after it; the first unit's gather and the last unit's
reduction are always exposed. Under HSDP the gathers and reduce-scatters run in
the ``dp_shard`` group and each reduction adds an all-reduce of the fp32
gradient shards across the replicas, each group on its own link.

Every collective costs ``bytes x factor / bus bandwidth + latency``
(``formulas.collective_seconds``), on the node's links where the axis's group
fits in a node (``Cluster.axis_is_intra_node``), else on the network's.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen3_pretrain.hardware import GB, Hardware
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan import formulas as F
from qwen3_pretrain.plan import fp8 as FP8
from qwen3_pretrain.plan.layers import cp_calls, layer_params, mtp_kind, mtp_trained, tp_collectives
from qwen3_pretrain.plan.layout import Cluster, LayerKind, Layout, StageShape
from qwen3_pretrain.plan.memory import stage_params


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s
    latency: float  # s


def intra_link(hw: Hardware) -> Link:
    return Link(hw.intra_node_gbps * GB, hw.intra_node_latency_us * 1e-6)


def inter_link(hw: Hardware) -> Link:
    return Link(hw.inter_node_gbps * GB, hw.inter_node_latency_us * 1e-6)


def axis_links(layout: Layout, cluster: Cluster, hw: Hardware) -> dict[str, Link]:
    intra, inter = intra_link(hw), inter_link(hw)
    return {axis: intra if cluster.axis_is_intra_node(layout, axis) else inter
            for axis in ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp")}


def tp_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape, link: Link) -> tuple[float, float]:
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


def cp_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape, link: Link) -> tuple[float, float]:
    """(bus bytes, seconds) of one micro-batch's context-parallel collectives on this stage, per layer kind
    (``layers.cp_calls``: attention's K/V all-gathers, a Gated DeltaNet's all-to-alls), on the critical path."""
    if layout.cp == 1:
        return 0.0, 0.0
    calls = [call for kind, count in shape.layer_kinds for call in cp_calls(cfg, layout, kind) * count]
    nbytes = sum(b * F.bus_bandwidth_factor(kind, layout.cp) for kind, b in calls)
    seconds = sum(F.collective_seconds(kind, b, layout.cp, link.bandwidth, link.latency) for kind, b in calls)
    return nbytes, seconds


def ep_on_node(layout: Layout, cluster: Cluster) -> int:
    """How many ranks of an ep group share a node (the group is ``ep`` consecutive ranks)."""
    return max(1, min(layout.ep, cluster.devices_per_node))


def ep_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape, intra: Link, inter: Link,
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


def pp_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape, link: Link) -> tuple[float, float]:
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
            for params, gathers, layers in units:
                # a unit group's share of the decoder layers: their FP8 projections gathered at 1 B each
                nbytes = layout.dtype_bytes * params - (layout.dtype_bytes - 1) * low * layers
                calls += [("dp_shard", "all_gather", nbytes, group)] * gathers
            if low:  # the FP8 weights' scales: one all-reduce of their maxima
                calls.append(("dp_shard", "all_reduce", 4.0 * 7 * shape.num_layers, group))
            calls += [("dp_shard", "reduce_scatter", layout.grad_bytes * held, group)] * reductions
        if replicas > 1:
            calls += [("dp_replicate", "all_reduce", layout.grad_bytes * held / group, replicas)] * reductions
    return calls


def _gathers(cfg: Qwen3Config, layout: Layout, shape: StageShape, sp, experts: float = 0.0
             ) -> tuple[list[tuple[float, int, float]], list[tuple[float, int, float]]]:
    """(parameters, all-gathers per step, share of the decoder layers) of the stage's FSDP units, in groups;
    and of the ``experts`` (parameters, under expert parallelism units of their own, freed after forward
    like the layers).

    Layers and the embedding free their weights after forward (``reshard_after_forward``), so backward
    gathers them again; the LM head and the root (final norm) keep theirs from forward to backward, and a
    tied embedding too (its head applies it in the loss). Without pipelining a backward frees them all
    again: per micro-batch two gathers and one, except the last layer to run forward, which keeps its
    weights for its backward right after the loss (``parallel/parallelize.py``: one gather). Under pipeline parallelism the
    schedule keeps a unit
    gathered after its backward until the step ends, so a forward right after a backward finds it
    gathered: of a stage's ``m`` forwards and ``m`` backwards, each forward after a forward gathers (the
    warm-up), each backward after a forward (one per micro-batch in the steady state, plus the first of
    the cool-down) too: ``m + 1`` for the units freed after forward, once for the others. With
    ``keep_params_gathered`` every unit is gathered once per step.
    """
    if layout.keep_params_gathered:  # every unit gathered at the step's first forward, freed at its end
        return [(sp.held - experts, 1, 1.0)], [(experts, 1, 0.0)]
    embedding = cfg.vocab_size * cfg.hidden_size / layout.tp if shape.has_embedding and not sp.tied_head else 0.0
    freed = sp.layers - experts + embedding
    m = layout.num_microbatches
    rest = sp.held - experts - freed  # the head and the root
    if layout.pp > 1:
        return [(freed, m + 1, 1.0), (rest, 1, 0.0)], [(experts, m + 1, 0.0)]
    # the last layer joins the units gathered once per micro-batch (the calls' count, so the latency
    # priced per unit and call, is the same as before it did)
    kind = mtp_kind(cfg) if mtp_trained(cfg, layout) else LayerKind.of(cfg, cfg.num_hidden_layers - 1)
    last_experts = experts / shape.sparse_layers if experts and kind.sparse else 0.0
    last = layer_params(cfg, layout, kind) - last_experts if shape.num_layers else 0.0
    share = last / (sp.layers - experts) if last else 0.0
    return ([(freed - last, 2 * m, 1.0 - share), (rest + last, m, share)],
            [(experts - last_experts / 2, 2 * m, 0.0)])  # the same bytes in as many calls as before


def dp_bytes_and_time(cfg: Qwen3Config, layout: Layout, shape: StageShape,
                       links: dict[str, Link]) -> tuple[dict[str, float], float, float, float, float]:
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


def dp_exposed(layout: Layout, stage: int, compute: float, gather: float, reduce: float, first: float,
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
