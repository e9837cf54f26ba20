"""Predicted peak memory per device of this project's training engine.

What the engine keeps, per pipeline rank (all counts local to one tp rank;
``P`` its parameters, ``d`` the compute dtype's bytes, ``dp`` the ranks that
shard the weights: the data-parallel degree with the distributed optimizer,
1 without, ``dp_shard`` under HSDP, whose replicas hold the same shards):

* **parameters**: fp32 master weights sharded by FSDP (``4 P / dp``), plus the
  unsharded working weights FSDP gathers in the compute dtype: the two largest
  FSDP units at a time (the one computing, the one prefetched), or, under
  pipeline parallelism, whose schedule keeps units gathered after their
  backward, up to the whole stage (``d P``); a layer still frees its weights
  after its forward, so at the loss only the head and the root are gathered.
  FSDP wraps every layer, the LM head, and the rest (embedding, final norm) at
  the root.
* **gradients**: fp32 and sharded like the master weights (``4 P / dp``) after
  the step's reduce-scatter. With several micro-batches per step the engine
  skips the reduction until the last one, so the stage's *unsharded* fp32
  gradients (``4 P``) accumulate in between (unless gradients are reduced
  every micro-batch: then the sharded ones do); while a unit's gradient is
  produced and reduced, its compute-dtype gradient and an fp32 reduce buffer.
* **optimizer**: AdamW's two fp32 moments (``8 P / dp``) plus its step's
  temporaries: none with the fused kernel (the engine's choice on CPU and
  CUDA), on the foreach path (torch's default on other accelerators) one
  buffer the size of the larger parameter group's shard (with weight decay or
  without: the groups step one after the other), two of the largest tensor on
  the per-tensor loop.
* **activations**: what autograd saves per layer under the chosen recompute,
  by kind of layer (``layers.saved_bytes_per_token``: attention or a hybrid's
  Gated DeltaNet, a dense MLP or experts), times the micro-batches in flight on
  the stage, plus, for the micro-batch in backward, one layer's recomputation
  and its gradients.
* **logits**: the fused LM head + cross-entropy's working set on the last
  stage: one chunk's logits in fp32 (the compute dtype's matmul output and
  gradient share their bytes), and the head's weight gradient, accumulated in
  fp32 over the chunks.
* **FP8** (``fp8`` set): the FP8 copy of the computing layer's projections, or with FP8 all-gather the
  gathered projections at one byte per weight (``plan/fp8.py``), in the parameters column.
* **overhead**: allocator fragmentation (a stated fraction of the above) plus
  the runtime's own reservation (context, communicator buffers).

The peak is the largest of six moments of a step: the loss, the start of
backward, a layer's backward, the backward of the stage's first layer (every other unit's
gradient reduced by then), the end of backward and the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan import formulas as F
from qwen3_pretrain.plan import fp8 as FP8
from qwen3_pretrain.plan.layers import (backward_gradient_bytes_per_token, cp_mask_bytes, largest_tensor,
                                        layer_params, mtp_kind, mtp_params, mtp_saved_bytes_per_token,
                                        mtp_trained, recomputed_bytes_per_token, saved_bytes_per_token)
from qwen3_pretrain.plan.layout import LayerKind, Layout, StageShape, check_model_fits_layout, stage_shapes

GiB = 1024**3

# Allocator fragmentation and caching, as a share of the allocated peak: PyTorch's
# caching allocator typically reserves 5-15% more than it hands out in training.
OVERHEAD_FRACTION = 0.10


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted peak memory of one device, in bytes, split by what holds it."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    overhead: float
    total: float
    stage: int = 0  # pipeline rank this describes
    moment: str = ""  # when in the step the peak falls

    @property
    def allocated(self) -> float:
        """What the tensor allocator hands out at the peak (total minus overhead)."""
        return self.total - self.overhead

    def gib(self) -> dict[str, float]:
        """The byte fields in GiB, rounded to 3 decimals."""
        names = ("parameters", "gradients", "optimizer", "activations", "logits", "overhead", "total")
        return {n: round(getattr(self, n) / GiB, 3) for n in names}


@dataclass(frozen=True)
class StageParams:
    """Parameter counts of one pipeline rank (its tp shard), per FSDP unit."""

    total: float  # every parameter of the stage's tp shard, each expert once: what the ranks shard between them
    layer: float  # its largest decoder layer (a unit each)
    head: float  # the LM head (a unit), 0 off the last stage
    root: float  # the root unit: embedding and/or final norm, whatever the stage holds
    largest_tensor: float
    tied_head: bool  # the head applies the embedding's weight (tied, one stage): ``head`` is 0
    layers: float = 0.0  # all its decoder layers
    pair: float = 0.0  # its two largest decoder layers (one computing, one prefetched)
    held: float = 0.0  # what one rank gathers whole: ``total`` with its ``1 / ep`` of the experts


def stage_params(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> StageParams:
    t, h = layout.tp, cfg.hidden_size
    per_layer = {kind: layer_params(cfg, layout, kind) for kind, _ in shape.layer_kinds}
    layers = sum(n * per_layer[kind] for kind, n in shape.layer_kinds)
    every_expert = sum(n * (layer_params(cfg, layout, kind, all_experts=True) - per_layer[kind])
                       for kind, n in shape.layer_kinds if kind.sparse)
    # The multi-token-prediction layer, trained on the head's stage: its decoder layers are FSDP units as the
    # stage's own, its fc and norms belong to the root unit.
    mtp_layers = mtp_trained(cfg, layout) if shape.has_head else 0
    mtp_layer = layer_params(cfg, layout, mtp_kind(cfg)) if mtp_layers else 0.0
    mtp_rest = mtp_params(cfg, layout) - mtp_layers * mtp_layer if mtp_layers else 0.0
    every_expert += mtp_layers * (layer_params(cfg, layout, mtp_kind(cfg), all_experts=True) - mtp_layer)
    layers += mtp_layers * mtp_layer
    sizes = sorted([size for kind, n in shape.layer_kinds for size in [per_layer[kind]] * min(n, 2)]
                   + [mtp_layer] * min(mtp_layers, 2))[-2:]
    layer, pair = (sizes[-1] if sizes else 0.0), sum(sizes)
    vocab = cfg.vocab_size * h / t
    # A tied head beside its embedding applies the embedding's weight (models/ops/loss.py:TiedLMHead); under
    # pp > 1 it is a parameter of its own on the last stage (parallel/grads.py:TiedWeights).
    tied_head = cfg.tie_word_embeddings and shape.has_embedding and shape.has_head
    head = vocab if shape.has_head and not tied_head else 0.0
    root = (vocab if shape.has_embedding else 0.0) + (h if shape.has_head else 0.0) + mtp_rest
    tensors = [largest_tensor(cfg, layout, kind) for kind, _ in shape.layer_kinds]
    largest = max(tensors + ([vocab] if shape.has_head or shape.has_embedding else []) + [0.0])
    held = layers + head + root
    return StageParams(held + every_expert, layer, head, root, largest, tied_head, layers, pair, held)


def _largest_group(cfg: Qwen3Config, layout: Layout, shape: StageShape, sp: StageParams) -> float:
    """The parameters of the stage's larger AdamW group (train/optim.py: with weight decay, or without it:
    the embedding, a tied head, the norms; with ``weight_decay_embeddings`` the embedding and a tied head are
    decayed, ``Layout.embedding_decay``). The foreach path steps the groups one after the other, and each
    takes one temporary per tensor (``sqrt`` of the second moment, fp32) for the whole group: measured on a
    CPU, AdamW(foreach=True) with the engine's groups on a 2-layer model of 2.49 M parameters (1.44 M decayed,
    1.05 M not) allocated exactly 4 x 1.44 M bytes in its step: tests/test_plan_optimizer_peak.py)."""
    h, t = cfg.hidden_size, layout.tp
    tied = cfg.tie_word_embeddings and shape.has_head
    embedding = cfg.vocab_size * h / t if (shape.has_embedding or tied) and not layout.embedding_decay else 0.0
    norms = shape.num_layers * (2 * h + 2 * cfg.head_dim) + (h if shape.has_head else 0)
    undecayed = embedding + norms
    return max(sp.total - undecayed, undecayed)


def _microbatch_tokens(layout: Layout) -> int:
    return layout.microbatch_tokens


def _held_activations(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> float:
    """Activations the stage keeps for all micro-batches in flight at its peak."""
    inflight = F.inflight_microbatches(layout.pp_schedule, layout.pp, shape.stage, layout.num_microbatches,
                                       layout.stages_per_rank)
    return inflight * _microbatch_activations(cfg, layout, shape)


def _microbatch_activations(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> float:
    """Activations the stage keeps for one micro-batch from its forward to its backward."""
    tokens, d, h = _microbatch_tokens(layout), layout.dtype_bytes, cfg.hidden_size
    ac = layout.activation_checkpointing
    per_mb = tokens * sum(n * saved_bytes_per_token(cfg, layout, ac, kind) for kind, n in shape.layer_kinds)
    per_mb += 2 * d * tokens * cfg.rotary_dim  # RoPE cos and sin, shared by the layers
    if layout.cp > 1:
        per_mb += cp_mask_bytes(layout)
    elif layout.document_mask and layout.dense_document_mask:
        # The CPU kernel's additive mask, [seq, seq] per sample in the dtype attention computes in, built
        # once per micro-batch and kept for backward by every layer's attention.
        per_mb += tokens * layout.seq_length * (4 if layout.fp32_matmul else d)
    if shape.has_head:
        # Final norm (its input and fp32 reciprocal root, sequence-sharded) and the gradient of the
        # gathered hidden states that the fused loss computes in forward and keeps for backward.
        per_mb += tokens * ((d * h + 4) / layout.tp + d * h)
        per_mb += tokens * mtp_saved_bytes_per_token(cfg, layout, ac)
    return per_mb


def _first_layer_share(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> float:
    """The share of the stage's kept activations that its first layer holds: layer 0's, without pipelining
    (the only case that asks; a hybrid's Gated DeltaNet layers keep many times what its attention layers do)."""
    ac = layout.activation_checkpointing
    layers = sum(n * saved_bytes_per_token(cfg, layout, ac, kind) for kind, n in shape.layer_kinds)
    return saved_bytes_per_token(cfg, layout, ac, LayerKind.of(cfg, 0)) / layers if layers else 0.0


def _backward_working(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> float:
    """One micro-batch's recomputed layer plus the gradients of the layer in backward (the largest of the
    kinds of layer the stage holds: ``layers.backward_gradient_bytes_per_token``)."""
    worst = 0.0
    for kind, _ in shape.layer_kinds:
        if layout.activation_checkpointing == "full":
            recomputed = saved_bytes_per_token(cfg, layout, "none", kind)
        else:
            recomputed = recomputed_bytes_per_token(cfg, layout, layout.activation_checkpointing, kind)
        worst = max(worst, recomputed + backward_gradient_bytes_per_token(cfg, layout, kind))
    return _microbatch_tokens(layout) * worst


def loss_working_bytes(cfg: Qwen3Config, layout: Layout) -> float:
    """Peak of the fused LM head + cross-entropy (``models/ops/loss.py``) beyond what it keeps for backward.

    One chunk of ``c`` tokens: its logits in fp32 (4 per local vocab entry; in
    bf16 the matmul's output before the upcast and the gradient after the
    downcast live in those same bytes, converted in place through one row, which
    is gone before the weight's gradient exists, so it never adds to the peak);
    the head's weight gradient: in fp32 the running sum; in bf16 over one or two
    chunks the gradient (the second chunk's product is written into the logits'
    spent bytes and added to the first's), over three or more the fp32 running
    sum (each product in the logits' spent bytes), rounded after the logits are
    freed (sum and rounded copy then, if larger than the logits and sum; a
    product in a buffer of its own where a chunk has fewer tokens than the
    hidden size); and its
    input, the final norm's output (plus its gathered copy under tp). With
    ``fp32_matmul`` (bf16 multiplied in fp32 on a CPU) the logits and their
    gradient exist in fp32 only, and fp32 copies of the weight and of the input
    are made; the weight's gradient is accumulated in fp32 and rounded once.
    """
    tokens, t = _microbatch_tokens(layout), layout.tp
    chunk = min(tokens, layout.loss_chunk_tokens)
    vocab, d = cfg.vocab_size / t, layout.dtype_bytes
    low = d if d != 4 else 0
    hidden = d * tokens * cfg.hidden_size * (1 + (1 / t if t > 1 else 0))
    if low and layout.fp32_matmul:
        return chunk * vocab * 4 + vocab * cfg.hidden_size * (4 + 4 + d) + hidden + 4 * tokens * cfg.hidden_size
    logits = chunk * vocab * 4
    summed = low and -(-tokens // chunk) > 2  # bf16 over three or more chunks: the fp32 running sum
    weight_grad = vocab * cfg.hidden_size * (4 if summed else d)
    if low and tokens > chunk and cfg.hidden_size > chunk:  # too few spent bytes: each product in its own buffer
        weight_grad += vocab * cfg.hidden_size * d
    rounding = vocab * cfg.hidden_size * (4 + d) if summed else 0  # sum and its rounded copy, logits freed
    return max(logits + weight_grad, rounding) + hidden


def _moments(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> dict[str, dict[str, float]]:
    """Bytes per component at each candidate peak moment of the step.

    FSDP units are gathered one or two at a time (the head and the last layer
    around the loss; two layers, one computing and one prefetched, in
    backward), except the root unit: it holds the final norm, the first thing
    backward needs, so it is gathered right after the head's backward and
    stays gathered to the end, embedding included. Gathering a unit briefly
    takes its all-gather input, output and the unsharded copy. A unit's
    gradient appears in the compute dtype and, when the weights are sharded,
    an fp32 reduce-scatter input; with one shard the reduced gradient is that
    buffer's size again (FSDP copies it out; the weight and the compute-dtype
    gradient freed by then hold the same bytes; no divide factor is set on one
    rank, whose division made a third copy: ``parallel/parallelize.py``;
    measured: ``bench/plan_validate.py``). Under pipeline
    parallelism a unit stays gathered after its backward (the schedule sets
    ``reshard_after_backward=False``) but not after its forward.
    """
    sp = stage_params(cfg, layout, shape)
    d, m = layout.dtype_bytes, layout.num_microbatches
    shard = layout.shards
    master, sharded_grads, adam = 4 * sp.total / shard, 4 * sp.total / shard, 8 * sp.total / shard
    resident = layout.pp > 1 or layout.keep_params_gathered

    def gathered(*units: float) -> float:
        return master + d * (sp.held if resident else sum(units))

    # FSDP copies weights into an all-gather input (and gradients into a reduce-scatter
    # input) when it casts them or shards them; fp32 on one shard uses them in place.
    cast = layout.mixed_precision == "bf16"
    copies = cast or shard > 1

    def gathering(unit: float) -> float:
        return 0.0 if resident else d * unit * (1 + (1 / shard if copies else 0))

    g = layout.grad_bytes

    def unit_grad(unit: float) -> float:
        return ((d if cast else 0) + (g if shard > 1 else 0)) * unit

    inflight = F.inflight_microbatches(layout.pp_schedule, layout.pp, shape.stage, m, layout.stages_per_rank)
    accumulated = g * sp.held if layout.accumulates_unsharded else 0.0
    # Earlier micro-batches' gradients coexist with the peak activations once a steady state exists:
    # unsharded, or already reduced to their shards when that happens every micro-batch.
    before = (accumulated or sharded_grads) if m > inflight else 0.0
    if sp.tied_head:
        # The loss's gradient of the head is the first term of the embedding's gathered gradient,
        # in the compute dtype, until the end of backward; the weight is gathered all step long.
        head_weight, head_grad, head_copy, root_gathering = sp.root, d * sp.root, 0.0, 0.0
    else:
        head_weight, root_gathering = sp.head, gathering(sp.root)
        head_grad = 0.0 if accumulated and before else sp.head * (g if accumulated else 4 / shard)
        head_copy = d * sp.head if copies else 0.0
    held = _held_activations(cfg, layout, shape)
    step_temp = {"fused": 0.0, "foreach": 4 * _largest_group(cfg, layout, shape, sp) / shard,
                 "for-loop": 2 * 4 * sp.largest_tensor / shard}[layout.optimizer_impl]
    # With the multi-token-prediction layer its pass of the fused loss comes first and keeps the head's
    # weight gradient it computed (in the compute dtype) while the main pass runs.
    mtp_head = d * cfg.vocab_size * cfg.hidden_size / layout.tp if shape.has_head and mtp_trained(cfg, layout) else 0
    moments = {
        "loss": dict(parameters=gathered(head_weight, sp.layer), gradients=before, optimizer=adam, activations=held,
                     logits=loss_working_bytes(cfg, layout) + mtp_head if shape.has_head else 0.0),
        "backward start": dict(parameters=gathered(sp.root) + root_gathering, optimizer=adam,
                               gradients=before + head_grad + head_copy, activations=held, logits=0.0),
        "layer backward": dict(parameters=gathered(sp.root, sp.pair), optimizer=adam,
                               gradients=before + head_grad + unit_grad(sp.layer),
                               activations=held + _backward_working(cfg, layout, shape), logits=0.0),
        # The stage's first layer, the last backward reaches: every other unit's gradient is already
        # reduced (or accumulated), its own is produced; two layers gathered, one layer's activations left.
        "last layer backward": dict(parameters=gathered(sp.root, sp.pair), optimizer=adam,
                                    gradients=(accumulated or sharded_grads) + unit_grad(sp.layer),
                                    activations=_backward_working(cfg, layout, shape)
                                    + held * _first_layer_share(cfg, layout, shape), logits=0.0),
        "end of backward": dict(parameters=gathered(sp.root or sp.layer), optimizer=adam,
                                gradients=(accumulated or sharded_grads) + unit_grad(sp.root or sp.layer),
                                activations=0.0, logits=0.0),
        "optimizer step": dict(parameters=master, gradients=sharded_grads, optimizer=adam + step_temp,
                               activations=0.0, logits=0.0),
    }
    if layout.pp > 1:
        del moments["last layer backward"]  # the schedule reduces after the last backward (``_pipelined``)
    if layout.pp > 1 and not layout.keep_params_gathered:
        _pipelined(moments, cfg, layout, shape, head_weight, head_grad, accumulated or sharded_grads)
    return moments


def _pipelined(moments: dict[str, dict[str, float]], cfg: Qwen3Config, layout: Layout, shape: StageShape,
               head_weight: float, head_grad: float, accumulated: float) -> None:
    """The moments of a pipeline stage, in place. The schedule keeps a unit gathered after its backward,
    but a layer still frees its weights after its forward: at the loss, which follows the layers' forward
    on the last stage, and when a backward follows a forward, only the head and the root (the final norm,
    or the embedding) are gathered; backward gathers the layers again one by one and keeps them.

    * A layer's backward: the larger of two moments. A backward right after a forward starts with all
      in-flight micro-batches held and two layers gathered; a backward right after another (the
      cool-down, on stages that hold more than one micro-batch) finds the whole stage gathered, one
      micro-batch fewer held and an earlier one's gradients accumulated. Gradients are not reduced until
      the step's end: a layer adds only its compute-dtype gradient to the accumulation.
    * The end of backward: the schedule reduces the units one by one after the last backward, each
      freeing its weights first; the largest unit's reduce-scatter input and output (fp32) beside the
      other units' weights and all accumulated gradients.
    """
    sp, d, shard = stage_params(cfg, layout, shape), layout.dtype_bytes, layout.shards
    master = 4 * sp.total / shard
    few = master + d * (head_weight + sp.root)
    moments["loss"]["parameters"] = moments["backward start"]["parameters"] = few
    if layout.pp_schedule != "interleaved":
        grad = d * sp.layer if layout.mixed_precision == "bf16" else 0.0
        step = moments["layer backward"]
        first = dict(step, parameters=few + d * sp.pair, gradients=moments["loss"]["gradients"] + head_grad + grad)
        inflight = F.inflight_microbatches(layout.pp_schedule, layout.pp, shape.stage, layout.num_microbatches)
        earlier = accumulated if inflight >= 2 else moments["loss"]["gradients"]
        cooldown = dict(step, gradients=earlier + head_grad + grad,
                        activations=step["activations"] - _microbatch_activations(cfg, layout, shape))
        moments["layer backward"] = max(first, cooldown, key=lambda parts: sum(parts.values()))
    if shard > 1 and layout.accumulates_unsharded:
        big = max(sp.layer if shape.num_layers else 0.0, sp.root, sp.head)
        moments["end of backward"].update(parameters=master + d * (sp.held - big),
                                          gradients=accumulated + layout.grad_bytes * big * (1 + 1 / shard))


def _fp8_weights(moments: dict[str, dict[str, float]], cfg: Qwen3Config, layout: Layout, shape: StageShape) -> None:
    """FP8's change to the gathered weights at each moment, in place (``fp8.gathered_weight_delta``): the
    decoder layers gathered then (all of the stage's with the weights kept gathered; under pipelining the
    pair in backward and all but the largest unit at its end; else one at the loss and two in backward),
    without FP8 all-gather only where a layer computes (its FP8 copy)."""
    n = shape.num_layers
    if layout.keep_params_gathered:
        gathered = {name: n for name in moments if name != "optimizer step"}
    elif layout.pp > 1:
        gathered = {"layer backward": 2, "end of backward": max(n - 1, 0)}
    else:
        gathered = {"loss": 1, "layer backward": 2, "last layer backward": 2}
    computing = ("layer backward", "last layer backward")
    for name, layers in gathered.items():
        if name in moments and (layout.fp8_all_gather or name in computing):
            moments[name]["parameters"] += FP8.gathered_weight_delta(cfg, layout, shape, min(layers, n))


def _stage_breakdown(cfg: Qwen3Config, layout: Layout, shape: StageShape, overhead_fraction: float,
                     runtime_reserved_bytes: float) -> MemoryBreakdown:
    moments = _moments(cfg, layout, shape)
    if layout.fp8 != "off":
        _fp8_weights(moments, cfg, layout, shape)
    moment, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    allocated = sum(parts.values())
    overhead = overhead_fraction * allocated + runtime_reserved_bytes
    return MemoryBreakdown(**parts, overhead=overhead, total=allocated + overhead, stage=shape.stage, moment=moment)


def predict_memory(cfg: Qwen3Config, layout: Layout, stage: int | None = None,
                   overhead_fraction: float = OVERHEAD_FRACTION,
                   runtime_reserved_bytes: float = 0.0) -> MemoryBreakdown:
    """Peak memory per device of pipeline rank ``stage`` (default: the rank with the largest peak).

    ``overhead_fraction`` covers allocator fragmentation; ``runtime_reserved_bytes``
    the device runtime's own memory (see ``Hardware.runtime_reserved_gib``),
    which allocator statistics do not see. Compare a measured allocator peak
    (``torch.cuda.max_memory_allocated``, ``MemoryTracker``) with ``.allocated``.
    """
    check_model_fits_layout(cfg, layout)
    shapes = stage_shapes(cfg, layout)
    if stage is not None:
        if not 0 <= stage < layout.pp:
            raise ValueError(f"stage {stage} is not a pipeline rank of pp={layout.pp}")
        shapes = [shapes[stage]]
    results = [_stage_breakdown(cfg, layout, s, overhead_fraction, runtime_reserved_bytes) for s in shapes]
    return max(results, key=lambda b: b.total)
