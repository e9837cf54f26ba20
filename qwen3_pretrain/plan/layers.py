"""One decoder layer of each kind as the planner counts it on one rank: parameters, bytes kept for backward,
backward working memory, FLOPs, host operators and collectives.

A layer is a token mixer and an MLP (models/qwen3/model.py ``DecoderLayer``), each of two kinds
(``LayerKind``): attention, or a hybrid's Gated DeltaNet (``linear``); a dense MLP, or a mixture of experts
(``sparse``). How the engine parallelizes each part decides the arithmetic:

* tp: attention, a Gated DeltaNet and a dense MLP split by heads and by width, with sequence-parallel norms
  between them (parallel/tensor_parallel.py); a MoE block runs whole on every tp rank, on the gathered
  sequence (on the rank's share when ep borrows the tp ranks), so its weights, saved bytes and FLOPs are
  not divided by ``t``;
* cp: attention gathers the whole sequence's K and V (parallel/context_parallel.py); a Gated DeltaNet
  trades its tokens of all heads for the whole sequence of ``1 / cp`` of the heads (one all-to-all each
  way) and computes there, so per local token it keeps and computes what it would unsplit.

Per-token figures are per token a rank holds between the layers' blocks (``Layout.microbatch_tokens``: the
micro-batch's share of the sequence over cp, whole over tp).
"""

from __future__ import annotations

import dataclasses

from qwen3_pretrain.hardware import attention_backend
from qwen3_pretrain.models.qwen3.attention_calls import AttentionCall, describe_call
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan import formulas as F
from qwen3_pretrain.plan.flops import DELTA_RULE_CHUNK, LayerFlops, layer_flops, mtp_layers
from qwen3_pretrain.plan.layout import Layout, LayerKind

# Operators one layer issues per micro-batch (forward and backward, counted under a dispatch mode on torch
# 2.13): a Qwen3 layer, the kind hardware.HOST_MS_PER_LAYER was timed on; a Gated DeltaNet layer issues
# more, and its chunked delta rule a fixed number more per chunk of the sequence (a Python loop over them).
OPS_PER_LAYER = 247
OPS_PER_LINEAR_LAYER = 571
OPS_PER_DELTA_RULE_CHUNK = 42


def _index(cfg: Qwen3Config, kind: LayerKind) -> tuple[int, int]:
    """A layer with ``kind``'s token mixer and one with its MLP (the config owns their sizes per index)."""
    layers = range(cfg.num_hidden_layers)
    mixer = next((i for i in layers if cfg.is_linear_layer(i) == kind.linear), None)
    mlp = next((i for i in layers if cfg.is_sparse_layer(i) == kind.sparse), None)
    if mixer is None or mlp is None:
        raise ValueError(f"the model has no layer of kind {kind}")
    return mixer, mlp


def _gate_input_copied(cfg: Qwen3Config, layout: Layout) -> bool:
    """Whether a hybrid's output gate multiplies a copy of the attention kernel's output, not the output
    itself: the kernels return it in the query's layout, made heads-major by partial RoPE's concatenation
    (the releases rotate a quarter of each head) or by context parallelism's of its two chunks."""
    return cfg.is_hybrid and (cfg.rotary_dim < cfg.head_dim or layout.cp > 1)


def _attention_widths(cfg: Qwen3Config) -> tuple[int, int]:
    """The query and key/value widths of attention (a hybrid's gate not included)."""
    return cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim


# --- parameters -----------------------------------------------------------------------------------


def layer_params(cfg: Qwen3Config, layout: Layout, kind: LayerKind = LayerKind(), all_experts: bool = False) -> float:
    """Parameters of one decoder layer on a tp rank: attention (less its q/k norms), a Gated DeltaNet (less its
    gated norm's shared weight) and a dense MLP split over ``tp``; a MoE block (router, shared expert) whole
    on every tp rank, the experts split
    over ``ep`` (``all_experts``: the tp rank's share of them as the ranks that shard them hold it between
    them: all of them, or ``1 / tp`` when ep borrows the tp ranks)."""
    mixer_index, mlp_index = _index(cfg, kind)
    mixer = cfg.mixer_params(mixer_index)
    # split by heads: attention's matmuls; all of a Gated DeltaNet but the weight its heads share
    split = mixer - cfg.linear_value_head_dim if kind.linear else cfg.mixer_params(mixer_index, matmul_only=True)
    mixer += split / layout.tp - split
    mlp = cfg.mlp_params(mlp_index)
    if kind.sparse:
        experts = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts
        share = (layout.tp if layout.moe_tokens_split_by_tp else 1) if all_experts else layout.ep
        mlp += experts / share - experts
    else:
        mlp /= layout.tp
    return mixer + mlp + 2 * cfg.hidden_size  # and its two norms, whole


def largest_tensor(cfg: Qwen3Config, layout: Layout, kind: LayerKind) -> float:
    """The largest parameter of one layer of ``kind`` on a tp rank (AdamW's per-tensor loop works on it)."""
    h, t = cfg.hidden_size, layout.tp
    if kind.linear:  # in_proj_qkv (Qwen3-Next: in_proj_qkvz), split by heads
        mixer = h * (2 * cfg.linear_key_dim + cfg.linear_value_dim * (2 if cfg.fused_linear_projections else 1)) / t
    else:
        mixer = h * cfg.num_attention_heads * cfg.head_dim * (2 if cfg.is_hybrid else 1) / t
    if kind.sparse:  # the experts' stacked projection, the shared expert's
        mlp = max(cfg.num_experts / layout.ep * cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) * h
    else:
        mlp = h * cfg.intermediate_size / t
    return max(mixer, mlp)


# --- bytes kept for backward --------------------------------------------------------------------


def saved_bytes_per_token(cfg: Qwen3Config, layout: Layout, checkpointing: str, kind: LayerKind = LayerKind()
                          ) -> float:
    """What one layer of ``kind`` keeps for backward per local token under ``checkpointing``."""
    d, t, h = layout.dtype_bytes, layout.tp, cfg.hidden_size
    if checkpointing == "full":
        return d * h / t  # the layer's input, sequence-sharded
    intermediate = 0 if kind.sparse else cfg.intermediate_size
    if kind.linear:
        saved = _linear_layer_bytes_per_token(cfg, layout, intermediate)
    else:
        q, kv = _attention_widths(cfg)
        saved = F.qwen3_layer_saved_bytes_per_token(h, q, kv, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                    intermediate, t, d, layout.fp32_matmul, cfg.is_hybrid,
                                                    _gate_input_copied(cfg, layout))
        saved += context_parallel_bytes_per_token(cfg, layout) + attention_fallback_bytes_per_token(cfg, layout)
    if kind.sparse:
        saved += moe_bytes_per_token(cfg, layout)
        if layout.moe_tokens_split_by_tp:  # its input is the tp rank's share, not the gathered sequence
            saved -= d * h - d * h / t
    return saved - recomputed_bytes_per_token(cfg, layout, checkpointing, kind)


def _linear_layer_bytes_per_token(cfg: Qwen3Config, layout: Layout, intermediate: int) -> float:
    """A Gated DeltaNet layer without recompute: its zero-centred norms on the sequence shard, the block (its
    gathered input, the rest split by heads), the MLP's gathered input and, split, its SwiGLU."""
    d, t, h = layout.dtype_bytes, layout.tp, cfg.hidden_size
    mixer = F.gated_deltanet_saved_bytes_per_token(h, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                                   cfg.linear_key_head_dim, cfg.linear_value_head_dim, d,
                                                   DELTA_RULE_CHUNK, layout.cp, t)
    return 2 * F.zero_centred_norm_saved_bytes_per_token(h) / t + mixer + d * h + 3 * d * intermediate / t


def moe_bytes_per_token(cfg: Qwen3Config, layout: Layout) -> float:
    """What a MoE block (with a hybrid's shared expert) keeps beyond its input, per local token."""
    saved = F.qwen3_moe_saved_bytes_per_token(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                              cfg.num_experts_per_tok, cfg.norm_topk_prob, layout.dtype_bytes,
                                              cfg.shared_expert_intermediate_size)
    # expert parallelism's dispatch keeps one more int64 index vector over the pairs that arrive (their
    # regrouping by expert; measured), as many as leave under balanced routing
    saved += 8 * cfg.num_experts_per_tok if layout.ep > 1 else 0
    # Under skewed routing the heaviest expert rank receives ``moe_rank_load`` times its share of the pairs:
    # what it keeps per pair that arrives (the pair's hidden state, weight and index, its experts' gate, up
    # and weighted product) scales with it; the router's and the sort's per-token bytes do not.
    saved += (layout.moe_rank_load - 1) * received_bytes_per_token(cfg, layout)
    saved += moe_padding_bytes_per_token(cfg, layout)
    # per token of the rank's share of the sequence: a tp rank routes 1/tp of it when ep borrows tp
    return saved / (layout.tp if layout.moe_tokens_split_by_tp else 1)


# How models/ops/moe.py and moe_fp8.py pad the experts' groups (restated here: the planner imports no torch;
# tests/test_plan_moe_padding.py holds them equal): CUDA's bf16 grouped kernel to a multiple of 8 rows, the
# FP8 ones to 16 (rowwise) or 32 (MXFP8); a CPU's bf16 grouped kernel to a row bucket of at most 1/16 of the
# group and at least this many rows (eager read on the host; compiled computed on the device, the padded total
# a bound: ``N + E (CPU_BUCKET_MIN - 1) + N / 16``, the last group taking the slack).
GROUPED_MM_ALIGN, FP8_ROWWISE_ALIGN, FP8_MXFP8_ALIGN = 8, 16, 32
CPU_BUCKET_MIN = 16


def moe_group_align(layout: Layout) -> int:
    """Rows each expert's group is padded to a multiple of (1: none): CUDA's grouped kernels' alignment."""
    if layout.fp8_experts:
        return FP8_MXFP8_ALIGN if layout.fp8 == "mxfp8" else FP8_ROWWISE_ALIGN
    return GROUPED_MM_ALIGN if layout.device_type == "cuda" and layout.attention_dtype == "bfloat16" else 1


def moe_cpu_buckets(layout: Layout) -> bool:
    """Whether the experts' groups are padded to row buckets (``models/ops/moe.py``: ``bucket_rows``): bf16
    grouped experts on a CPU, eager (under compile the same buckets are computed on the device:
    ``moe_cpu_device_buckets``), unless padded to the capacity (fixed groups already)."""
    return (layout.device_type == "cpu" and layout.attention_dtype == "bfloat16" and not layout.compile
            and not layout.fp8_experts and not layout.moe_pad_to_capacity)


def moe_cpu_device_buckets(layout: Layout) -> bool:
    """Whether the experts' groups are padded to row buckets computed on the device (``models/ops/moe.py``:
    ``bucket_sizes``): bf16 grouped experts on a CPU under compile, to the bound ``bucket_bound``."""
    return (layout.device_type == "cpu" and layout.attention_dtype == "bfloat16" and layout.compile
            and not layout.fp8_experts and not layout.moe_pad_to_capacity)


def moe_groups_padded(layout: Layout) -> bool:
    """Whether the experts compute on groups padded with zero rows (``models/ops/moe.py``: ``pad_groups``):
    CUDA's grouped kernels pad them to their alignment, a CPU's bf16 one to row buckets (eager or compiled),
    pad-to-capacity to the capacity."""
    return (layout.moe_pad_to_capacity or moe_group_align(layout) > 1 or moe_cpu_buckets(layout)
            or moe_cpu_device_buckets(layout))


def moe_padded_rows_per_token(cfg: Qwen3Config, layout: Layout) -> float:
    """Rows the heaviest expert rank's experts compute per token its MoE layers route (``Layout.moe_tokens``):
    its ``k x load`` pairs, or ``k x`` the capacity factor padded to the capacity, plus the padding of its
    ``E / ep`` groups: CUDA's bound ``E (align - 1)`` per micro-batch (``pad_groups`` pads to it, the last
    group taking the slack); a CPU's row buckets half a bucket per group on average (the bucket of a group
    of ``c`` rows is ``max(16, 2^(bits(c) - 5))`` rows: 3% of the rows at 1,024 a group); compiled, the bound
    the kernel pads to (``bucket_bound``: ``N + 15 E + N / 16`` rows, the last group taking the slack)."""
    k, tokens, groups = cfg.num_experts_per_tok, layout.moe_tokens, cfg.num_experts / layout.ep
    rows = k * (layout.moe_capacity_factor if layout.moe_pad_to_capacity else layout.moe_rank_load)
    if moe_cpu_buckets(layout):
        bucket = max(CPU_BUCKET_MIN, 2 ** max(int(rows * tokens / groups).bit_length() - 5, 0))
        return rows + groups * (bucket - 1) / 2 / tokens
    if moe_cpu_device_buckets(layout):  # the bound the compiled kernel pads to, the last group taking the slack
        return rows * 17 / 16 + groups * (CPU_BUCKET_MIN - 1) / tokens
    return rows + groups * (moe_group_align(layout) - 1) / tokens


def moe_padding_bytes_per_token(cfg: Qwen3Config, layout: Layout) -> float:
    """What padding the experts' groups (``moe_groups_padded``) adds to a MoE block's saved bytes per token
    routed: the int64 index of each pair's padded row (``pad_groups`` writes the pairs into the zeros with
    ``index_put``, whose backward keeps only that index: ``k x load`` pairs, 8 bytes each), and the padding
    rows, kept as the pairs' rows are: the row, its weight, and the experts' gate, up and weighted product
    (``d h + d + 3 d I`` each). Measured with saved-tensor hooks on one block (h 256, 16 experts of 128,
    top-4, 2,048 tokens, bf16): tests/test_plan_moe_padding.py. (With ``index_copy``, which kept its source,
    the unpadded pairs' hidden states and weights stayed beside the padded ones: ``k (d h + d)`` bytes per
    token more, 6.0 GiB of Qwen3-30B-A3B's activations at ep 16 without recompute.)"""
    if not moe_groups_padded(layout):
        return 0.0
    d, h = layout.dtype_bytes, cfg.hidden_size
    pairs = cfg.num_experts_per_tok * layout.moe_rank_load
    padding = moe_padded_rows_per_token(cfg, layout) - pairs
    return 8 * pairs + padding * (d * h + d + 3 * d * cfg.moe_intermediate_size)


def received_bytes_per_token(cfg: Qwen3Config, layout: Layout) -> float:
    """What a MoE block keeps per pair its experts compute, times ``top_k`` (per token under balanced
    routing): the pair's hidden state and weight, its gate, up and weighted product, and under ep the
    arrival index."""
    d, k = layout.dtype_bytes, cfg.num_experts_per_tok
    return k * (d * cfg.hidden_size + d + 3 * d * cfg.moe_intermediate_size + (8 if layout.ep > 1 else 0))


def recomputed_bytes_per_token(cfg: Qwen3Config, layout: Layout, checkpointing: str,
                               kind: LayerKind = LayerKind()) -> float:
    """What selective (attention core) or MLP recompute drops from a layer's saved bytes: a MoE block's whole
    (its checkpoint keeps the gathered input), a dense MLP's SwiGLU; selective recompute checkpoints the
    attention kernel's call, and in a Gated DeltaNet layer its delta rule's."""
    d, t = layout.dtype_bytes, layout.tp
    if checkpointing == "selective" and kind.linear:
        return F.gated_deltanet_recomputed_bytes_per_token(
            cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, d, DELTA_RULE_CHUNK, layout.cp, t)
    if checkpointing == "mlp" and kind.sparse:
        return moe_bytes_per_token(cfg, layout)
    if checkpointing == "mlp":
        return F.qwen3_mlp_saved_bytes_per_token(cfg.hidden_size, cfg.intermediate_size, t, d)
    if checkpointing == "selective" and not kind.linear:
        q, kv = _attention_widths(cfg)
        core = F.qwen3_attention_core_saved_bytes_per_token(q, kv, cfg.num_attention_heads, t, d, layout.fp32_matmul,
                                                            _gate_input_copied(cfg, layout))
        return core + context_parallel_bytes_per_token(cfg, layout) + attention_fallback_bytes_per_token(cfg, layout)
    return 0.0


def backward_gradient_bytes_per_token(cfg: Qwen3Config, layout: Layout, kind: LayerKind) -> float:
    """Gradients alive at once at the widest point of one layer's backward: the MLP's (a MoE block's pairs'
    ``k I``-wide ones, unsplit by tp), or a Gated DeltaNet's, split by heads, when wider."""
    d, h = layout.dtype_bytes, cfg.hidden_size
    if kind.sparse:
        grads = F.qwen3_backward_working_bytes_per_token(h, cfg.num_experts_per_tok * cfg.moe_intermediate_size, 1, d)
        grads *= layout.moe_rank_load
        # the padded rows' gradient beside the unpadded rows' (models/ops/moe.py), as the simulation of CUDA's
        # grouped kernel holds it; a CPU step's peak with row buckets does not show it (bench/plan_validate.py's
        # MoE bf16 cases: within 0.1% without it, 2% over with it)
        if moe_groups_padded(layout) and not moe_cpu_buckets(layout):
            grads += d * h * moe_padded_rows_per_token(cfg, layout)
        grads /= layout.tp if layout.moe_tokens_split_by_tp else 1
    else:
        grads = F.qwen3_backward_working_bytes_per_token(h, cfg.intermediate_size, layout.tp, d)
    if kind.linear:
        grads = max(grads, F.gated_deltanet_backward_working_bytes_per_token(
            cfg.linear_num_value_heads, cfg.linear_value_head_dim, d) / layout.tp)
    return grads


# --- attention only -----------------------------------------------------------------------------


def attention_calls(cfg: Qwen3Config, layout: Layout) -> list[AttentionCall]:
    """The attention calls one layer makes per micro-batch on one rank: the whole sequence, or under cp the
    rank's two query chunks against the keys up to each (rank 0's: chunk 0 is plain causal, chunk
    ``2 cp - 1`` sees all keys; every rank's two chunks see ``2 cp + 1`` chunks of keys in all)."""
    heads, kv_heads = cfg.num_attention_heads // layout.tp, cfg.num_key_value_heads // layout.tp
    shape = dict(kernel=layout.attention_kernel, dtype=layout.attention_dtype, batch=layout.samples_per_microbatch,
                 q_heads=heads, kv_heads=kv_heads, head_dim=cfg.head_dim, documents=layout.document_mask)
    if layout.cp == 1:
        return [describe_call(q_len=layout.seq_length, kv_len=layout.seq_length, **shape)]
    chunk = layout.seq_length // (2 * layout.cp)
    return [describe_call(q_len=chunk, kv_len=chunk, **shape),
            describe_call(q_len=chunk, kv_len=layout.seq_length, **shape)]


def math_fallbacks(cfg: Qwen3Config, layout: Layout) -> list[AttentionCall]:
    """The layout's attention calls that its device serves with SDPA's math kernel."""
    return [c for c in attention_calls(cfg, layout) if attention_backend(layout.device_type, c) == "math"]


def attention_fallback_bytes_per_token(cfg: Qwen3Config, layout: Layout) -> float:
    """What SDPA's math kernel keeps beyond a fused kernel, per local token of a layer, where the device
    falls back to it (inside the kernel call: selective recompute drops it): fp32 probabilities
    [batch, heads, q_len, kv_len], an fp32 copy of q and fp32 copies of k and v expanded to the query heads."""
    kept = sum(4 * c.batch * c.q_heads * (c.q_len * c.kv_len + c.q_len * c.head_dim + 2 * c.kv_len * c.head_dim)
               for c in math_fallbacks(cfg, layout))
    return kept / layout.microbatch_tokens


def context_parallel_bytes_per_token(cfg: Qwen3Config, layout: Layout) -> float:
    """What context parallelism adds to an attention layer's saved bytes per local token (all inside the
    kernel call, so selective recompute drops it): attention keeps the K and V of the whole sequence, gathered
    from the cp ranks, instead of its own, ``(cp - 1) 2 kv / t`` in the dtype attention computes in; and its
    two query chunks' outputs, which SDPA keeps, are copies besides o_proj's input, ``d q / t`` (with
    ``fp32_matmul`` they are the fp32 outputs the layer formula already counts; a hybrid's gated output is
    such a copy unsplit too, counted by the layer formula)."""
    if layout.cp == 1:
        return 0.0
    q, kv = _attention_widths(cfg)
    gathered = (layout.cp - 1) * 2 * kv * (4 if layout.fp32_matmul else layout.dtype_bytes)
    copies = 0 if layout.fp32_matmul or cfg.is_hybrid else layout.dtype_bytes * q
    return (gathered + copies) / layout.tp


def cp_mask_bytes(layout: Layout) -> float:
    """The additive masks of context-parallel attention's two query chunks, ``c x (r + 1) c`` and
    ``c x (2 cp - r) c`` with ``c = seq / 2 cp``: ``c^2 (2 cp + 1)`` values in attention's dtype, per sample
    under document masking (built per micro-batch), once otherwise (the causal ones are kept for good). Only
    the CPU's kernel builds them (an accelerator's takes its own causal mode and document boundaries)."""
    if layout.cp == 1 or not layout.dense_document_mask:
        return 0.0
    chunk = layout.seq_length // (2 * layout.cp)
    samples = layout.samples_per_microbatch if layout.document_mask else 1
    return chunk * chunk * (2 * layout.cp + 1) * samples * (4 if layout.fp32_matmul else layout.dtype_bytes)


# --- time: FLOPs, host operators, collectives -----------------------------------------------------


def flops_per_token(cfg: Qwen3Config, layout: Layout, kind: LayerKind) -> tuple[float, float]:
    """Hardware FLOPs of one layer of ``kind`` per local token, forward, backward and recomputation, all tp
    ranks together: (matmuls and attention's core, at the compute dtype's peak; the chunked delta rule, which
    computes in fp32). ``flops.layer_flops``' counts (attention over the causal half of the square, as the
    kernels run it); a MoE block (its active parameters) runs whole on every tp rank: ``tp`` times over."""
    mixer_index, mlp_index = _index(cfg, kind)
    return _hardware_flops(layout, layer_flops(cfg, mixer_index, mlp_index, layout.seq_length), kind.sparse)


def mtp_flops_per_token(cfg: Qwen3Config, layout: Layout) -> tuple[float, float]:
    """``flops_per_token`` of the multi-token-prediction layer's decoder layers, on the stage with the head,
    where ``layout.mtp`` trains it (its fc and second head pass: ``flops.head_flops``); (0, 0) otherwise."""
    if not layout.mtp:
        return 0.0, 0.0
    parts = [_hardware_flops(layout, layer, cfg.is_sparse_layer(0)) for layer in mtp_layers(cfg, layout.seq_length)]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


# --- the multi-token-prediction layer ---------------------------------------------------------------


def mtp_kind(cfg: Qwen3Config) -> LayerKind:
    """The kind of the multi-token-prediction layer's decoder layers: full attention, layer 0's MLP."""
    return LayerKind(linear=False, sparse=cfg.is_sparse_layer(0))


def mtp_trained(cfg: Qwen3Config, layout: Layout) -> int:
    """The multi-token-prediction layer's decoder layers the head's stage trains (0: none)."""
    return cfg.mtp_num_hidden_layers if layout.mtp else 0


def mtp_params(cfg: Qwen3Config, layout: Layout, all_experts: bool = False) -> float:
    """Parameters of the multi-token-prediction layer on a tp rank of the head's stage, where ``layout.mtp``
    trains it: its decoder layers (``layer_params``), ``fc`` ([embedding | hidden] to hidden, column-parallel
    over tp) and its three norms (whole: sequence-parallel)."""
    if not mtp_trained(cfg, layout):
        return 0.0
    h = cfg.hidden_size
    layers = mtp_trained(cfg, layout) * layer_params(cfg, layout, mtp_kind(cfg), all_experts)
    return layers + 2 * h * h / layout.tp + 3 * h


def mtp_saved_bytes_per_token(cfg: Qwen3Config, layout: Layout, checkpointing: str) -> float:
    """What the multi-token-prediction layer keeps for backward per local token (0 where not trained): its
    decoder layers as any of their kind under ``checkpointing``; outside them (never recomputed) the two
    norms before ``fc`` and the one after the layers (on the sequence shard, each an fp32 reciprocal root
    and, zero-centred in a hybrid, its fp32 input and normalized value: ``formulas.qwen3_layer_saved_bytes_
    per_token``), ``fc``'s input, the [embedding | hidden] pair gathered over tp, and the gradient of the
    gathered hidden states its pass of the fused loss computes in forward, as the main pass's."""
    n = mtp_trained(cfg, layout)
    if not n:
        return 0.0
    d, t, h = layout.dtype_bytes, layout.tp, cfg.hidden_size
    norm = 8 if cfg.is_hybrid else d  # per element
    layers = n * saved_bytes_per_token(cfg, layout, checkpointing, mtp_kind(cfg))
    return layers + 3 * (norm * h + 4) / t + 2 * d * h + d * h


def _hardware_flops(layout: Layout, layer: LayerFlops, sparse: bool) -> tuple[float, float]:
    if sparse and not layout.moe_tokens_split_by_tp:
        layer = dataclasses.replace(layer, mlp=layer.mlp * layout.tp)
    ac = layout.activation_checkpointing
    rule = layer.rule * (4 if ac in ("full", "selective") else 3)  # both rerun the delta rule
    return layer.training() + layer.recomputed(ac) - rule, rule


def host_ops_per_layer(cfg: Qwen3Config, layout: Layout, kind: LayerKind) -> float:
    """Operators the host issues for one layer of ``kind`` per micro-batch, in units of a Qwen3 layer's
    (what ``Hardware.host_seconds_per_layer`` was timed on). The chunked delta rule loops over the chunks of
    the whole sequence, whatever cp (each rank runs its heads over all of it)."""
    if not kind.linear:
        return 1.0
    chunks = -(-layout.seq_length // DELTA_RULE_CHUNK)
    return (OPS_PER_LINEAR_LAYER + OPS_PER_DELTA_RULE_CHUNK * chunks) / OPS_PER_LAYER


def tp_collectives(layout: Layout, kind: LayerKind) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of ``[tokens, hidden]`` activations one layer issues per micro-batch
    under tp. Attention, a Gated DeltaNet and a dense MLP gather their input and reduce-scatter their output
    in forward, the reverse in backward; a MoE block run whole gathers its input in forward and its output's
    gradient in backward and cuts the rest out locally; a MoE block on the rank's share of the tokens (ep
    borrowing tp) none. Full recompute repeats the forward's, stopping before the MLP's output
    scatter (checkpointing's early stop); MLP recompute re-gathers a dense MLP's input."""
    ac = layout.activation_checkpointing
    full = int(ac == "full")
    gathers, scatters = 2 + full, 2 + full
    if kind.sparse and not layout.moe_tokens_split_by_tp:
        gathers += 2 + full
    elif not kind.sparse:
        gathers += 2 + int(ac in ("full", "mlp"))
        scatters += 2
    return gathers, scatters


def cp_calls(cfg: Qwen3Config, layout: Layout, kind: LayerKind) -> list[tuple[F.Collective, float]]:
    """(kind, bytes of the whole buffer) of one layer's context-parallel collectives per micro-batch.
    Attention: the all-gather of the whole sequence's K and V (again when recompute reruns attention) and the
    reduce-scatter of their gradients. Gated DeltaNet: its all-to-alls of this rank's tokens of its tp rank's
    heads of [q | k | v] and of [b, a] to heads and of the output back, forward, again in backward for the
    gradients, and again under full recompute (``parallel/context_parallel.py``: ``ContextParallelHeads``)."""
    if layout.cp == 1:
        return []
    ac, d = layout.activation_checkpointing, layout.dtype_bytes
    if kind.linear:
        key, value, heads = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        forward = [d * layout.microbatch_tokens * width / layout.tp for width in (2 * key + value, 2 * heads, value)]
        return [("all_to_all", b) for b in forward * (3 if ac == "full" else 2)]
    kv = cfg.num_key_value_heads * cfg.head_dim / layout.tp
    whole = 2 * d * kv * layout.samples_per_microbatch * layout.seq_length  # K and V, gathered
    gathers = 2 if ac in ("selective", "full") else 1
    return [("all_gather", whole)] * gathers + [("reduce_scatter", whole)]
