"""The formulas the planner is built from, each with where it comes from (the FLOP counts: ``flops``).

Pure arithmetic on numbers (no torch), so every one of them can be checked
against a hand computation. Sizes are in bytes, times in seconds, bandwidths
in bytes per second. ``t`` is the tensor-parallel degree throughout.

References:

* [ZeRO] Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
  Trillion Parameter Models", 2020, section 3.
* [SP] Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", 2022, section 4 and Table 2.
* [PTD-P] Narayanan et al., "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM", 2021, sections 2.2.1 and 2.2.2.
* [nccl-tests] NVIDIA nccl-tests, doc/PERFORMANCE.md (algorithm vs bus bandwidth).
"""

from __future__ import annotations

from typing import Literal

FP32 = 4
BF16 = 2

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]


# --- parameters, gradients, optimizer state ----------------------------------


def megatron_bytes_per_param(dp: int, distributed_optimizer: bool) -> float:
    """Mixed-precision AdamW bytes per parameter in Megatron-LM.

    bf16 weights 2 + fp32 gradients 4 + fp32 master weights 4 + Adam moments 8
    = 18 unsharded; the distributed optimizer (ZeRO-1 over ``dp`` ranks) shards
    the last 12: 6 + 12 / dp.
    """
    return 6 + 12 / dp if distributed_optimizer else 18.0


def zero_bytes_per_param(stage: int, dp: int, mixed: bool = True) -> float:
    """Persistent bytes per parameter under ZeRO stage 0-3 with AdamW [ZeRO, 3].

    Mixed precision here is this project's: fp32 master weights (4), fp32
    gradients (4), fp32 Adam moments (8), plus 2-byte working weights that
    only stages 0-2 keep resident (stage 3 gathers them per layer, transiently).
    ``mixed=False`` is plain fp32: 4 + 4 + 8.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    optimizer = FP32 + 8 if mixed else 8  # master weights live with the optimizer state
    weights = BF16 if mixed else FP32
    grads = float(FP32)
    if stage >= 1:
        optimizer /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        weights = 0 if mixed else weights / dp
    return weights + grads + optimizer


# --- activations ---------------------------------------------------------------


def megatron_activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, t: int = 1,
                                        sequence_parallel: bool = False,
                                        recompute: Literal["none", "selective", "full"] = "none") -> float:
    """Activation bytes of one GPT layer with 16-bit activations [SP, Table 2].

    ``sbh(34 + 5as/h)`` without parallelism; tensor parallelism divides all but
    10sbh (layer norms, dropout masks and the inputs of the first linears) by
    ``t``; adding sequence parallelism divides everything by ``t``. Selective
    recompute drops the attention-score terms (``5as/h``); full recompute keeps
    only the layer's input, ``2sbh`` (``/t`` with sequence parallelism).
    """
    sbh = seq * batch * hidden
    scores = 5 * heads * seq / hidden
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        scores = 0.0
    if sequence_parallel:
        return sbh * (34 + scores) / t
    return sbh * (10 + (24 + scores) / t)


def qwen3_layer_saved_bytes_per_token(hidden: int, q_out: int, kv_out: int, heads: int, kv_heads: int,
                                      intermediate: int, t: int = 1, dtype_bytes: int = BF16,
                                      fp32_matmul: bool = False, hybrid: bool = False,
                                      output_copied: bool = True) -> float:
    """Bytes autograd keeps per token for one Qwen3 decoder layer (no recompute).

    Counted from the operators of ``models/qwen3/model.py`` with sequence
    parallelism (norms see ``1/t`` of the tokens) and flash-style attention
    (no ``seq x seq`` scores; true of torch's SDPA on CUDA and of its CPU flash
    kernel, and of the document-masking kernels on GPUs and NPUs; the NPU's
    fused kernel keeps 16 fp32 softmax statistics per head and token instead
    of one, not modelled). With ``d`` the activation dtype's bytes:

    * RMSNorm (attention and MLP, ``models/ops/norm.py``): its input, on the
      sequence shard: ``2 d h / t``;
    * the all-gathered norm outputs the q/k/v and gate/up matmuls save: ``2 d h``
      (the whole sequence: DTensor keeps the gathered tensor, unlike
      Megatron's re-gather in backward);
    * q and k: their norm's input and the rotated value SDPA saves:
      ``2 d (q + kv) / t``; v: ``d kv / t``;
    * SDPA output (o_proj's input): ``d q / t``; its fp32 log-sum-exp: ``4 heads / t``;
    * SwiGLU (``models/ops/swiglu.py``): gate and up, and their product (down's
      input): ``3 d f / t``;
    * fp32 reciprocal root of every norm: ``4 (2 + heads + kv_heads) / t``.

    Megatron-core's fused layer keeps the same list less the q/k norms (its GPT
    has none) and the re-gathered norm outputs (34 h per token in bf16,
    [SP, Table 2]); for Qwen3-8B in bf16 at t = 1 this is 137,512 bytes, 33.6 h.

    With ``fp32_matmul`` (bf16 attention run on fp32 copies, on a CPU) SDPA
    saves its q, k, v and output in fp32: ``(4 - d)(q + 2 kv) + 4 q`` more.

    A ``hybrid``'s full-attention layer (Qwen3.5, Qwen3-Next) differs in two ways:

    * its four norms are zero-centred, in plain autograd: each keeps its fp32
      input (a copy under bf16) and the fp32 normalized value, ``8`` bytes per
      element instead of ``d``; under fp32 the q norm's input is a view of
      q_proj's output, which holds the gate too: ``4 q`` more;
    * its output gate keeps ``sigmoid(gate)`` and the product, o_proj's input:
      ``2 d q`` beside the output it multiplies; when that is a copy of the
      kernel's (``output_copied``: the kernels return the output in the query's
      layout, which the released models' partial RoPE makes heads-major by a
      concatenation, as context parallelism's concatenation of its two chunks
      does), the kernel's own output too, ``d q`` (with ``fp32_matmul`` that is
      its fp32 output, counted above).
    """
    d = dtype_bytes
    norm = 8 if hybrid else d  # what a norm keeps per element
    sharded = (2 * norm * hidden + (norm + d) * (q_out + kv_out) + d * kv_out + d * q_out
               + 4 * heads + 3 * d * intermediate + 4 * (2 + heads + kv_heads))
    if hybrid:
        sharded += 2 * d * q_out + (4 * q_out if d == 4 else 0)
        sharded += d * q_out if output_copied and not (fp32_matmul and d < 4) else 0
    if fp32_matmul and d < 4:
        sharded += (4 - d) * (q_out + 2 * kv_out) + 4 * q_out
    return sharded / t + 2 * d * hidden


def qwen3_attention_core_saved_bytes_per_token(q_out: int, kv_out: int, heads: int, t: int = 1,
                                               dtype_bytes: int = BF16, fp32_matmul: bool = False,
                                               output_copied: bool = False) -> float:
    """The part of the layer's saved bytes that selective recompute (the attention core) drops.

    Selective recompute checkpoints the attention kernel's call, as Megatron's
    selective recompute does: the checkpoint keeps the kernel's inputs q, k, v,
    which the rotations already produced, and the output stays as o_proj's
    input, so what goes is what the kernel saves beyond them. For a flash-style
    kernel that is its fp32 log-sum-exp, ``4 heads / t``; with ``fp32_matmul``
    (bf16 attention on fp32 copies) also what the fp32 copies of q, k, v and
    of the output add, ``(4 - d)(q + 2 kv) + 4 q`` over ``t``. A kernel that materializes the
    ``seq x seq`` scores (Megatron's unfused attention, the ``5as/h`` of
    ``megatron_activation_bytes_per_layer``) would lose those; none of the
    kernels this project runs keeps them. Where o_proj's input is a copy of the
    kernel's output (``output_copied``: a hybrid's gated output after partial RoPE,
    see ``qwen3_layer_saved_bytes_per_token``), the kernel's output goes too, ``d q / t``.
    """
    sharded = 4 * heads
    if fp32_matmul and dtype_bytes < 4:
        sharded += (4 - dtype_bytes) * (q_out + 2 * kv_out) + 4 * q_out
    elif output_copied:
        sharded += dtype_bytes * q_out
    return sharded / t


def qwen3_mlp_saved_bytes_per_token(hidden: int, intermediate: int, t: int = 1, dtype_bytes: int = BF16) -> float:
    """The part of the layer's saved bytes that MLP recompute (``activation_checkpointing: mlp``) drops.

    MLP recompute checkpoints each layer's MLP block
    (gate, up, SiLU, product, down): the three ``f``-wide tensors it keeps go,
    and the all-gathered MLP input is replaced by its sequence shard, which the
    checkpoint keeps to re-gather in backward.
    """
    d = dtype_bytes
    return 3 * d * intermediate / t + d * hidden - d * hidden / t


def qwen3_moe_saved_bytes_per_token(hidden: int, intermediate: int, experts: int, top_k: int,
                                    norm_topk_prob: bool, dtype_bytes: int = BF16, shared: int = 0) -> float:
    """Bytes autograd keeps per token for one Qwen3-MoE block (``models/ops/moe.py``), beyond its input.

    Counted from its operators, with ``k`` = ``top_k`` (token, expert) pairs per
    token, ``E`` experts, ``I`` the expert hidden size and ``d`` the activation
    dtype's bytes (the grouped kernel and the per-expert loop keep the same):

    * router: its fp32 softmax over all experts (``4 E``), the top-k indices
      (``8 k``) and, when the k weights are renormalised, their fp32 values
      and sum (``4 k + 4``);
    * dispatch: three int64 index vectors over the pairs (the sort order, the
      pairs' tokens, the way back: ``24 k``), the pairs' weights in ``d``
      (``d k``) and the permuted tokens (``d k h``);
    * experts: gate and up (SwiGLU keeps only those, ``models/ops/swiglu.py``)
      and the weighted product (the down projection's input), ``3 d k I``;
    * a hybrid's gated shared expert of width ``shared``: an MLP's ``3 d s``, its
      output and the gate's sigmoid, which scale each other: ``d h + d``.

    The block runs whole on every tensor-parallel rank (``parallel/parallelize.py``),
    so nothing here is divided by ``t``; the expert counts (``E`` integers per
    micro-batch) are left out.
    """
    d, k = dtype_bytes, top_k
    router = 4 * experts + 8 * k + (4 * k + 4 if norm_topk_prob else 0)
    shared_expert = 3 * d * shared + d * hidden + d if shared else 0
    return router + 24 * k + d * k + d * k * hidden + 3 * d * k * intermediate + shared_expert


def zero_centred_norm_saved_bytes_per_token(hidden: int) -> float:
    """What one of a hybrid's zero-centred RMSNorms (``1 + weight``, plain autograd in fp32: models/qwen3/
    model.py ``RMSNorm``) keeps per token: its fp32 input (a copy under bf16, the input itself under fp32),
    the fp32 reciprocal root and the fp32 normalized value before the scale, whatever the dtype. (It also
    keeps ``1 + weight`` in fp32 per call, ``4 h`` bytes per micro-batch, left out.)"""
    return 8 * hidden + 4


def gated_deltanet_saved_bytes_per_token(hidden: int, key_heads: int, value_heads: int, key_head_dim: int,
                                         value_head_dim: int, dtype_bytes: int = BF16, chunk: int = 64,
                                         cp: int = 1, tp: int = 1) -> float:
    """Bytes autograd keeps per token for one Gated DeltaNet block (``models/qwen3/gated_deltanet.py``), from
    its input (the norm's output, which the input projections keep) to ``out_proj``'s input.

    Counted from its operators with ``a`` value heads of ``dv``, key heads of ``dk``
    (``K = key_heads dk``, ``V = a dv``; the convolution runs over ``Q = 2 K + V``
    channels), the delta rule's chunk ``C`` and ``d`` the activation dtype's bytes:

    * projections and convolution: the input ``d h``, the convolution's padded
      input and output ``2 d Q``, ``beta`` ``d a``, the decay's softplus input and
      output ``8 a``;
    * q and k in fp32 with their l2 norms' roots, ``8 K + 8 key_heads`` (under
      fp32 the silu output they are views of instead, ``4 Q``);
    * the chunked delta rule (``models/ops/gated_delta.py``, fp32): per value head
      and token six ``C``-wide rows (the pairwise decays before and after
      masking, ``K K^T beta``, the triangular system, its inverse and the chunk's
      attention) and two per key head (``K K^T``, ``Q K^T``): ``24 a C + 8
      key_heads C``; the chunked q, k (``8 K``), v, the values' right-hand side,
      the writes per chunk and stacked (``16 V``), the decayed keys and queries,
      the keys' right-hand side and their writes (``16 a dk``), six decay rows
      (``24 a``), the state entering each chunk,
      kept twice (``8 a dk dv / C``), the chunk decays (``8 a / C``), and the
      boolean document masks (``C + 2``, per token of the whole sequence);
    * the gated RMSNorm and ``out_proj``: ``12 V + 4 a + 3 d V``.

    Under context parallelism (``cp``) a rank runs its ``1 / cp`` of the heads over the
    whole sequence (``parallel/context_parallel.py``: ``ContextParallelHeads``): the
    same bytes per local token, but for the document masks, which are per token of
    the whole sequence: ``cp`` times theirs. (Per micro-batch, left out: the
    convolution's ``K - 1`` padding tokens and the decay parameters' fp32 copies.)
    Tensor parallelism (``tp``) splits the heads (``parallel/tensor_parallel.py``):
    everything but the gathered input and the document masks is per head.
    """
    d, a, dk, dv = dtype_bytes, value_heads / tp, key_head_dim, value_head_dim
    key_heads = key_heads / tp
    k_dim, v_dim = key_heads * dk, a * dv
    conv = 2 * k_dim + v_dim
    qk = 8 * k_dim if d < 4 else 4 * conv
    mixing = d * hidden + 2 * d * conv + d * a + 8 * a + qk + 8 * key_heads
    return mixing + _delta_rule_bytes(key_heads, a, dk, dv, chunk, cp) + 12 * v_dim + 4 * a + 3 * d * v_dim


def _delta_rule_bytes(key_heads: float, a: float, dk: int, dv: int, chunk: int, cp: int) -> float:
    """The chunked delta rule's fp32 terms per token (``gated_deltanet_saved_bytes_per_token``'s list)."""
    k_dim, v_dim = key_heads * dk, a * dv
    return (24 * a * chunk + 8 * key_heads * chunk + 8 * k_dim + 16 * v_dim + 16 * a * dk + 24 * a
            + 8 * a * dk * dv / chunk + 8 * a / chunk + cp * (chunk + 2))


def gated_deltanet_recomputed_bytes_per_token(hidden: int, key_heads: int, value_heads: int, key_head_dim: int,
                                              value_head_dim: int, dtype_bytes: int = BF16, chunk: int = 64,
                                              cp: int = 1, tp: int = 1) -> float:
    """What selective recompute drops from a Gated DeltaNet block per token (its delta rule runs again in
    backward, keeping only its inputs): the rule's chunk terms (``gated_deltanet_saved_bytes_per_token``'s
    ``rule``) and its l2 norms' roots (``8 key_heads``), less what the checkpoint keeps that nothing else did,
    the fp32 decay (``4 a``); under a low-precision dtype the rule's fp32 copies of q and k (``8 K``) go too,
    and the convolution's outputs, its inputs, stay (``d (2 K + V)``). Measured with saved-tensor hooks on the
    real layer (tests/test_plan.py). Per head: divided by ``tp`` but for the document masks."""
    d, a, dk, dv = dtype_bytes, value_heads / tp, key_head_dim, value_head_dim
    key_heads = key_heads / tp
    k_dim, v_dim = key_heads * dk, a * dv
    copies = 8 * k_dim - d * (2 * k_dim + v_dim) if d < 4 else 0
    return _delta_rule_bytes(key_heads, a, dk, dv, chunk, cp) + 8 * key_heads - 4 * a + copies


def gated_deltanet_backward_working_bytes_per_token(value_heads: int, value_head_dim: int,
                                                    dtype_bytes: int = BF16) -> float:
    """The peak of a Gated DeltaNet block's backward beyond what it saved, per token (measured, not derived:
    the block alone, its backward's highest allocation above its start, ``(16 - d) V`` at any of the widths
    tried, fp32 and bf16): three fp32 value-wide gradients around the gated norm, and under bf16 one more in
    the compute dtype. Under tp, of the rank's value heads."""
    return (16 - dtype_bytes) * value_heads * value_head_dim


def qwen3_backward_working_bytes_per_token(hidden: int, intermediate: int, t: int = 1,
                                           dtype_bytes: int = BF16) -> float:
    """Gradients alive at once while one layer runs backward (beyond what it saved).

    Two ``f``-wide gradients (the product's and one of gate/up) and two
    ``h``-wide ones (the incoming gradient and the gathered input's) at the
    MLP's backward, the widest point of a layer.
    """
    d = dtype_bytes
    return 2 * d * intermediate / t + 2 * d * hidden


# --- pipeline -------------------------------------------------------------------


def pipeline_bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step: ``(p - 1) / (v m + p - 1)`` [PTD-P, 2.2].

    The bubble lasts ``(p - 1)/v`` micro-batch times (``v`` virtual stages per
    rank, 1 for plain 1F1B) against ``m`` micro-batch times of work; this is the
    bubble's share of the whole step, ``r / (1 + r)`` of Megatron's ratio ``r``.
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline sizes must be positive: p={p}, m={m}, v={v}")
    return (p - 1) / (v * m + p - 1)


def megatron_bubble_ratio(p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal time, ``(1/v)(p - 1)/m`` [PTD-P, 2.2.1-2.2.2]."""
    return (p - 1) / (v * m)


def inflight_microbatches(schedule: Literal["1f1b", "interleaved", "gpipe"], p: int, stage: int, m: int,
                          v: int = 1) -> float:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at its peak.

    In units of a whole stage's layers. GPipe: all ``m`` (every forward runs
    before the first backward). 1F1B: ``p - stage`` (the first stage holds
    ``p``) [PTD-P, 2.2.1]. Interleaved: rank ``r`` warms up with
    ``(v - 1) p + 2 (p - 1 - r)`` forward chunks and holds one more, each of
    ``1/v`` of its layers [Megatron-LM ``get_num_warmup_microbatches``; the
    same warm-up as torch's ``ScheduleInterleaved1F1B``]; for ``r = 0`` that
    is ``p + (p - 1)/v`` [SP, 4.2.3]. Never more than the ``m`` micro-batches.
    """
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is not in 0..{p - 1}")
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or v == 1:
        return float(min(m, p - stage))
    chunks = (v - 1) * p + 2 * (p - 1 - stage) + 1
    return min(m * v, chunks) / v


# --- communication ----------------------------------------------------------------


def bus_bandwidth_factor(kind: Collective, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor [nccl-tests].

    All-reduce ``2(n-1)/n``; all-gather and reduce-scatter ``(n-1)/n`` (with the
    size of the whole gathered buffer); all-to-all ``(n-1)/n`` (of a rank's whole
    buffer, split evenly); point-to-point 1. Bus bandwidth is what
    each link carries, comparable to the hardware's link speed whatever ``n``.
    """
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "p2p":
        return 1.0
    raise ValueError(f"unknown collective {kind!r}")


def all_to_all_bytes(nbytes: float, n: int) -> float:
    """Bytes one rank sends in an all-to-all of its ``nbytes`` buffer over ``n`` ranks, split evenly: all but
    its own ``1 / n``. (nccl-tests' bus bandwidth for all-to-all has the same factor.)"""
    return nbytes * (n - 1) / n


def collective_seconds(kind: Collective, nbytes: float, n: int, bus_bandwidth: float, latency: float) -> float:
    """Time of one ring collective over ``n`` ranks: ``nbytes x factor / busbw + latency``.

    ``nbytes`` is the whole buffer (for all-gather: the output; for
    reduce-scatter: the input). One rank alone communicates nothing.
    """
    if n <= 1 and kind != "p2p":
        return 0.0
    return nbytes * bus_bandwidth_factor(kind, n) / bus_bandwidth + latency
