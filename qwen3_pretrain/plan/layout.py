"""A parallel layout, how it splits a Qwen3 model, and which layouts a cluster allows.

The mesh is ``(pp, dp, cp, tp)`` with ``tp`` innermost: the ``tp`` ranks of a group
are consecutive, so they share a node whenever ``tp`` divides the devices of a
node; the ``cp`` ranks (context parallelism: each sequence split over them) come
next. ``dp`` splits into ``dp_replicate`` x ``dp_shard`` (HSDP), ``dp_shard``
inner; FSDP shards over ``dp_shard x cp``, so a shard group of ``tp x dp_shard x
cp`` consecutive ranks can fill a node.
``micro_batch_size`` is the number of samples one data-parallel rank runs per
forward/backward; the global batch is ``micro_batch_size * dp *
gradient_accumulation_steps``. Under pipeline parallelism each of those
samples is cut into pipeline micro-batches of ``pp_microbatch_size``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Literal

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.qwen3.attention_calls import dense_document_mask, kernel_name
from qwen3_pretrain.models.qwen3.config import RECOMPUTE, Qwen3Config
from qwen3_pretrain.parallel.dims import (check_expert_split, check_model_split, sequence_split_problem,
                                          stage_layer_ranges, unsupported_combination, valid_tp_degrees)

Checkpointing = Literal[RECOMPUTE]  # models/qwen3/config.py says what each recomputes
CHECKPOINTING: tuple[str, ...] = RECOMPUTE
PP_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "gpipe")
PRECISIONS: tuple[str, ...] = ("bf16", "fp32")
OPTIMIZER_IMPLS: tuple[str, ...] = ("fused", "foreach", "for-loop")  # how torch's AdamW runs its step
# The training config's ``fp8`` recipes (torchao's float8 training): which projections run their matmuls in
# FP8 and how they are scaled (docs/planner.md, "FP8")
FP8_RECIPES: tuple[str, ...] = ("off", "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
# The recipes under which the engine runs a MoE block's routed experts as FP8 grouped matmuls
# (models/ops/moe_fp8.py): all of them, rowwise-scaled (torchao has no tensorwise grouped GEMM) or MXFP8 under
# mxfp8; on a device without an FP8 grouped GEMM (Ada) the engine keeps them in bf16, which the planner does not
# distinguish.
FP8_EXPERT_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")


@dataclass(frozen=True)
class Layout:
    """Everything about a training run that decides its memory and speed, besides the model."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism: every sequence split over this many ranks
    ep: int = 1  # expert parallelism: a MoE layer's experts split over this many of the dp_shard x cp x tp ranks
    micro_batch_size: int = 1  # samples per data-parallel rank per forward/backward
    gradient_accumulation_steps: int = 1
    seq_length: int = 4096
    activation_checkpointing: Checkpointing = "full"
    distributed_optimizer: bool = True  # shard master weights, gradients and Adam state over dp (FSDP)
    dp_shard: int | None = None  # HSDP: shard over this many dp ranks, replicate across; None: see ``shards``
    mixed_precision: Literal["bf16", "fp32"] = "bf16"
    pp_schedule: Literal["1f1b", "interleaved", "gpipe"] = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline rank (used by the interleaved schedule only)
    loss_chunk_tokens: int = 4096  # tokens per chunk of the LM head + cross-entropy
    pp_microbatch_size: int = 1  # samples per pipeline micro-batch
    # Megatron's accumulation: weights gathered once per step and kept through its micro-batches (FSDP frees
    # them after each unit's forward and backward otherwise)
    keep_params_gathered: bool = False
    # what gradients accumulate across micro-batches and are reduced in under bf16 (fp32: FSDP's and Megatron's
    # --accumulate-allreduce-grads-in-fp32; bf16: half the bytes, rounded sums)
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    compile: bool = False  # decoder layers compiled (torch.compile): fewer operators for the host to issue
    optimizer_impl: Literal["fused", "foreach", "for-loop"] = "fused"  # AdamW kernel: its step's temporaries
    # weight_decay_embeddings: the embedding (and a tied head) in AdamW's decayed group, beside the matrices:
    # the foreach step's temporary is the larger group's (plan/memory.py ``_largest_group``)
    embedding_decay: bool = False
    document_mask: bool = False  # attention kept within each packed document
    # The device type the engine runs on: its attention kernel (models/qwen3/attention_calls.py) and what
    # the kernel keeps (hardware.attention_backend: a fused kernel, or the math fallback's probabilities)
    device_type: str = "cuda"
    reduce_grads_every_microbatch: bool = False  # reduce-scatter per micro-batch (pp 1), not once per step
    fp32_matmul: bool = False  # bf16 matmuls on fp32 copies (a CPU without native bf16: models/ops/precision.py)
    # the multi-token-prediction layer is trained (mtp_loss_weight > 0): its FLOPs and memory (parameters, their
    # gradients and optimizer state, activations) counted on the head's stage; ignored for a model without one
    mtp: bool = False
    # Routing imbalance: the heaviest expert-parallel rank receives this many times its even share of the
    # (token, expert) pairs (1: perfectly balanced routing); bounded by a capacity factor where one is set, and
    # exactly the capacity with pad-to-capacity (``moe_rank_load``)
    moe_imbalance: float = 1.0
    moe_capacity_factor: float | None = None  # each expert takes at most this many times its even share
    moe_pad_to_capacity: bool = False  # each expert's group padded to its capacity (fixed shapes)
    # FP8 matmuls of the decoder layers' projections (never the LM head, the embedding or the router): the
    # recipe, and whether FSDP all-gathers their weights in FP8 (one byte per weight; tensorwise only)
    fp8: str = "off"
    fp8_all_gather: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch_size", "gradient_accumulation_steps", "seq_length",
                     "virtual_stages", "loss_chunk_tokens", "pp_microbatch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"layout: {name} must be a positive integer, got {value!r}")
        if self.dp_shard is not None:
            if self.dp_shard < 1 or self.dp % self.dp_shard:
                raise UserError(f"layout: dp_shard {self.dp_shard} must be a positive divisor of dp {self.dp}")
            if self.dp_shard > 1 and not self.distributed_optimizer:
                raise UserError(f"layout: dp_shard {self.dp_shard} shards the optimizer state: it needs the "
                                "distributed optimizer")
        if (self.shards * self.tp) % self.ep:
            raise UserError(f"layout: ep {self.ep} must divide the ranks it borrows, dp_shard x cp x tp = "
                            f"{self.shards * self.tp}")
        problem = sequence_split_problem(self.seq_length, self.cp, self.tp)
        if problem:
            raise UserError(f"layout: {problem}")
        if not self.moe_imbalance >= 1:
            raise UserError(f"layout: moe_imbalance {self.moe_imbalance} is the heaviest expert rank's load over "
                            "the mean: at least 1 (1 = perfect balance)")
        _check_choice("activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)
        _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _check_choice("mixed_precision", self.mixed_precision, PRECISIONS)
        _check_choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        _check_choice("grad_reduce_dtype", self.grad_reduce_dtype, PRECISIONS)
        _check_choice("fp8", self.fp8, FP8_RECIPES)
        if self.fp8 != "off" and self.mixed_precision != "bf16":
            raise UserError(f"layout: fp8 {self.fp8} needs mixed_precision bf16 (the projections' other "
                            "matmuls and the high-precision weights it casts from)")
        if self.fp8_all_gather and self.fp8 != "tensorwise":
            raise UserError(f"layout: the FP8 all-gather of FSDP's weights needs fp8 tensorwise (one scale per "
                            f"weight, precomputed before the gather), got fp8 {self.fp8}")
        if self.grad_reduce_dtype == "bf16" and self.mixed_precision != "bf16":
            raise UserError("layout: grad_reduce_dtype bf16 needs mixed_precision bf16")

    @property
    def fp8_experts(self) -> bool:
        """Whether a MoE block's routed experts run FP8 grouped matmuls (``FP8_EXPERT_RECIPES``)."""
        return self.fp8 in FP8_EXPERT_RECIPES

    @property
    def attention_kernel(self) -> str:
        """The engine's attention kernel on ``device_type`` (fp32 copies where bf16 matmuls run in fp32)."""
        return kernel_name(self.device_type, self.fp32_matmul)

    @property
    def dense_document_mask(self) -> bool:
        """Whether document masking materializes an additive [seq, seq] mask per sample (the CPU's kernel;
        accelerators' kernels take the document boundaries instead)."""
        return dense_document_mask(self.attention_kernel)

    @property
    def attention_dtype(self) -> str:
        """What attention computes in."""
        return "float32" if self.mixed_precision == "fp32" or self.fp32_matmul else "bfloat16"

    @property
    def shards(self) -> int:
        """Ranks that shard weights, gradients and optimizer state (FSDP's shard group): ``dp_shard`` when
        set, else every dp rank with the distributed optimizer and none (full replicas) without; times the cp
        ranks, which always shard with them."""
        if self.dp_shard is not None:
            return self.dp_shard * self.cp
        return (self.dp if self.distributed_optimizer else 1) * self.cp

    @property
    def replicas(self) -> int:
        """Copies of each shard, all-reduced once per gradient reduction (1: plain FSDP)."""
        return self.dp * self.cp // self.shards

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the gradients FSDP accumulates unsharded and reduces."""
        return 2 if self.grad_reduce_dtype == "bf16" and self.mixed_precision == "bf16" else 4

    @property
    def accumulates_unsharded(self) -> bool:
        """Whether FSDP holds the stage's unsharded fp32 gradients between micro-batches of a step."""
        return self.num_microbatches > 1 and not (self.reduce_grads_every_microbatch and self.pp == 1)

    @property
    def moe_tokens_split_by_tp(self) -> bool:
        """Whether a MoE layer runs on each tp rank's share of the sequence (ep borrows the tp ranks)."""
        return self.ep > 1 and self.tp > 1

    @property
    def moe_rank_load(self) -> float:
        """The heaviest expert-parallel rank's received pairs over its even share: the imbalance, at most the
        capacity factor, exactly it with pad-to-capacity (when ep spans the ranks that decide the capacity;
        else the padding is larger); 1 without ep (each rank computes its own pairs, however they spread)."""
        if self.ep == 1:
            return 1.0
        if self.moe_capacity_factor is None:
            return self.moe_imbalance
        if self.moe_pad_to_capacity:
            return self.moe_capacity_factor
        return min(self.moe_imbalance, self.moe_capacity_factor)

    @property
    def moe_tokens(self) -> int:
        """Tokens one rank's MoE layers route per micro-batch: the rank's share of the sequence over cp, and
        over tp when ep borrows the tp ranks (else the whole of it, gathered)."""
        return self.microbatch_tokens // (self.tp if self.moe_tokens_split_by_tp else 1)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.dp * self.gradient_accumulation_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_length

    @property
    def num_microbatches(self) -> int:
        """Forward/backward passes per step on one rank: pipeline micro-batches when pp > 1."""
        if self.pp == 1:
            return self.gradient_accumulation_steps
        return self.micro_batch_size * self.gradient_accumulation_steps // self.pp_microbatch_size

    @property
    def stages_per_rank(self) -> int:
        return self.virtual_stages if self.pp_schedule == "interleaved" and self.pp > 1 else 1

    @property
    def samples_per_microbatch(self) -> int:
        return self.micro_batch_size if self.pp == 1 else self.pp_microbatch_size

    @property
    def microbatch_tokens(self) -> int:
        """Tokens one rank runs per forward/backward: its micro-batch's share of each sequence (1/cp)."""
        return self.samples_per_microbatch * self.seq_length // self.cp

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.mixed_precision == "bf16" else 4

    def replace(self, **changes: object) -> "Layout":
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"layout: {name} {value!r} is not one of {', '.join(choices)}")


def check_model_fits_layout(cfg: Qwen3Config, layout: Layout) -> None:
    """Raise UserError when ``layout`` cannot split ``cfg`` or feed its pipeline."""
    check_model_split(cfg, layout.tp, layout.pp * layout.stages_per_rank, layout.cp)
    check_expert_split(cfg, layout.ep)
    check_pipeline_feed(layout.pp, layout.pp_schedule, layout.micro_batch_size, layout.gradient_accumulation_steps,
                        layout.pp_microbatch_size)


def check_pipeline_feed(pp: int, schedule: str, micro_batch_size: int, gradient_accumulation_steps: int,
                        pp_microbatch_size: int, batch_key: str = "micro_batch_size") -> None:
    """Raise UserError when a rank's samples per step cannot feed a ``pp``-stage ``schedule`` (the
    planner and the training engine both ask; ``batch_key`` is the user's name for the micro-batch)."""
    if pp == 1:
        return
    local = micro_batch_size * gradient_accumulation_steps
    if local % pp_microbatch_size:
        raise UserError(f"{batch_key} x gradient_accumulation_steps ({local}) is not a multiple of "
                        f"pp_microbatch_size {pp_microbatch_size}")
    count = local // pp_microbatch_size
    how = f"{batch_key} x gradient_accumulation_steps / pp_microbatch_size = {local} / {pp_microbatch_size}"
    if count < pp:
        raise UserError(f"pp={pp} needs at least {pp} pipeline micro-batches per step, got {count} ({how}); "
                        "raise the batch or lower pp")
    rounds = max(1, count // pp)  # the interleaved schedule runs whole rounds of pp micro-batches
    if schedule == "interleaved" and count % rounds:
        raise UserError(f"pp_schedule interleaved cannot split {count} pipeline micro-batches ({how}) into "
                        f"{rounds} equal rounds; make it a multiple of pp, e.g. {count // pp * pp}")


@dataclass(frozen=True)
class LayerKind:
    """What a decoder layer is made of (models/qwen3/model.py ``DecoderLayer``): its token mixer and its MLP."""

    linear: bool = False  # a hybrid's Gated DeltaNet (linear attention) in place of attention
    sparse: bool = False  # a mixture of experts in place of the dense MLP

    @classmethod
    def of(cls, cfg: Qwen3Config, index: int) -> "LayerKind":
        return cls(linear=cfg.is_linear_layer(index), sparse=cfg.is_sparse_layer(index))


@dataclass(frozen=True)
class StageShape:
    """What pipeline rank ``stage`` holds: its layers and whether it has the embedding or the head."""

    stage: int
    num_layers: int
    has_embedding: bool
    has_head: bool
    max_chunk_layers: int  # layers of its largest chunk (one chunk unless interleaved)
    # (kind, how many of its layers are of that kind); () for plain attention-and-MLP layers only
    kinds: tuple[tuple[LayerKind, int], ...] = ()

    @property
    def layer_kinds(self) -> tuple[tuple[LayerKind, int], ...]:
        return self.kinds or (((LayerKind(), self.num_layers),) if self.num_layers else ())

    @property
    def sparse_layers(self) -> int:
        """Of its layers, those with a mixture of experts in place of the MLP."""
        return sum(n for kind, n in self.layer_kinds if kind.sparse)

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.sparse_layers

    @property
    def linear_layers(self) -> int:
        """Of its layers, a hybrid's Gated DeltaNet ones."""
        return sum(n for kind, n in self.layer_kinds if kind.linear)


def stage_shapes(cfg: Qwen3Config, layout: Layout) -> list[StageShape]:
    """One StageShape per pipeline rank; rank ``r`` holds chunks ``r, r + pp, r + 2 pp, ...``."""
    p, v = layout.pp, layout.stages_per_rank
    split = stage_layer_ranges(cfg.num_hidden_layers, p * v)
    shapes = []
    for rank in range(p):
        mine = [split[rank + k * p] for k in range(v)]
        counts = Counter(LayerKind.of(cfg, i) for chunk in mine for i in chunk)
        shapes.append(StageShape(rank, sum(map(len, mine)), has_embedding=rank == 0, has_head=rank == p - 1,
                                 max_chunk_layers=max(map(len, mine)),
                                 kinds=tuple(sorted(counts.items(), key=lambda kn: (kn[0].linear, kn[0].sparse)))))
    return shapes


@dataclass(frozen=True)
class Cluster:
    nodes: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise UserError(f"cluster: nodes ({self.nodes}) and devices per node ({self.devices_per_node}) "
                            "must be positive")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def axis_is_intra_node(self, layout: Layout,
                           axis: Literal["tp", "cp", "ep", "dp", "dp_shard", "dp_replicate", "pp"]) -> bool:
        """Whether every group of mesh axis ``axis`` stays inside one node (mesh order pp, dp_replicate,
        dp_shard, cp, tp; ``dp`` is the two dp axes together, ``dp_shard`` FSDP's shard group with cp; ``ep``
        the innermost ``ep`` of the dp_shard x cp x tp ranks, consecutive)."""
        dp_span = layout.tp * layout.cp * layout.dp
        span = {"tp": layout.tp, "cp": layout.tp * layout.cp, "ep": layout.ep, "dp": dp_span,
                "dp_shard": layout.tp * layout.shards, "dp_replicate": dp_span, "pp": layout.world_size}[axis]
        size = {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "dp": layout.dp, "dp_shard": layout.shards,
                "dp_replicate": layout.replicas, "pp": layout.pp}[axis]
        if size == 1:
            return True
        return span <= self.devices_per_node and self.devices_per_node % span == 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out


def enumerate_layouts(cfg: Qwen3Config, cluster: Cluster, base: Layout, global_batch_size: int | None = None,
                      fixed: dict[str, object] | None = None, max_micro_batch: int = 8) -> Iterator[Layout]:
    """Every layout of ``cluster``'s devices for ``cfg``, starting from ``base``'s settings.

    ``fixed`` pins fields (``tp``, ``pp``, ``dp``, ``ep``, ``micro_batch_size``,
    ``gradient_accumulation_steps``, ``activation_checkpointing``,
    ``distributed_optimizer``, ``dp_shard``: layouts whose dp it does not divide are
    skipped; unfixed, a node's worth of dp ranks is tried besides all of them when dp spans nodes). With a
    ``global_batch_size`` the micro-batch sizes are the powers of two dividing
    each data-parallel rank's share and the rest is gradient accumulation;
    without one every micro-batch size up to ``max_micro_batch`` is tried with
    ``base``'s gradient accumulation.
    """
    fixed = dict(fixed or {})
    for tp in [t for t in valid_tp_degrees(cfg) if cluster.devices % t == 0]:
        for cp in _cp_choices(base.seq_length, cluster.devices // tp, fixed):
            if sequence_split_problem(base.seq_length, cp, tp):
                continue  # the sequence does not split over these cp and tp ranks
            for pp in [p for p in _divisors(cluster.devices // (tp * cp)) if p <= cfg.num_hidden_layers]:
                dp = cluster.devices // (tp * cp * pp)
                if any(fixed.get(k, v) != v for k, v in (("tp", tp), ("pp", pp), ("dp", dp))):
                    continue
                layout = base.replace(tp=tp, pp=pp, dp=dp, cp=cp)
                yield from _batch_variants(cfg, layout, global_batch_size, fixed, max_micro_batch,
                                           _shard_choices(layout, cluster, fixed))


# Shorter chunks than this make cp's per-layer gathers latency-bound for little memory saved.
MIN_CP_CHUNK_TOKENS = 512


def _cp_choices(seq_length: int, devices: int, fixed: dict[str, object]) -> list[int]:
    """cp degrees to try: the fixed one, else the powers of two dividing ``devices`` that split the sequence
    into ``2 cp`` chunks of at least ``MIN_CP_CHUNK_TOKENS``."""
    if "cp" in fixed:
        return [int(fixed["cp"])]  # type: ignore[call-overload]
    return [c for c in _powers_of_two(devices) if devices % c == 0 and seq_length % (2 * c) == 0
            and (c == 1 or seq_length // (2 * c) >= MIN_CP_CHUNK_TOKENS)]


def _shard_choices(layout: Layout, cluster: Cluster, fixed: dict[str, object]) -> list[int | None]:
    """dp_shard values to try with the distributed optimizer: the fixed one; else all dp ranks, and, when the
    dp ranks span nodes, one node's worth of them (HSDP, whose shard groups then stay on a node)."""
    if "dp_shard" in fixed:
        return [fixed["dp_shard"]]  # type: ignore[list-item]
    inner = layout.tp * layout.cp  # the ranks of one dp rank
    per_node = cluster.devices_per_node // inner if cluster.devices_per_node % inner == 0 else 0
    if 1 < per_node < layout.dp and layout.dp % per_node == 0:
        return [None, per_node]
    return [None]


def _batch_variants(cfg: Qwen3Config, layout: Layout, global_batch_size: int | None, fixed: dict[str, object],
                    max_micro_batch: int, shard_choices: list[int | None]) -> Iterator[Layout]:
    if global_batch_size is not None:
        if global_batch_size % layout.dp:
            return
        per_rank = global_batch_size // layout.dp
        # Under pipeline parallelism only the samples per rank matter (they are re-cut into
        # pipeline micro-batches), so one split of them is enough.
        sizes = [per_rank] if layout.pp > 1 and "micro_batch_size" not in fixed \
            else [b for b in _powers_of_two(per_rank) if per_rank % b == 0]
    else:
        per_rank = None
        sizes = _powers_of_two(max_micro_batch)
    if "micro_batch_size" in fixed:
        sizes = [b for b in sizes if b == fixed["micro_batch_size"]] if per_rank is not None \
            else [int(fixed["micro_batch_size"])]  # type: ignore[arg-type]
    ac_choices = [fixed["activation_checkpointing"]] if "activation_checkpointing" in fixed else list(CHECKPOINTING)
    opt_choices = [fixed["distributed_optimizer"]] if "distributed_optimizer" in fixed else [True, False]
    for mbs in sizes:
        gas = per_rank // mbs if per_rank is not None else layout.gradient_accumulation_steps
        if fixed.get("gradient_accumulation_steps", gas) != gas:
            continue
        for ac in ac_choices:
            for dist_opt in opt_choices:
                if dist_opt is False and layout.dp == 1 and "distributed_optimizer" not in fixed:
                    continue  # identical to True on one data-parallel rank
                for shard in shard_choices if dist_opt else [fixed.get("dp_shard")]:
                    for ep, keep in itertools.product(_ep_choices(cfg, fixed), _keep_choices(dist_opt, fixed)):
                        try:
                            candidate = layout.replace(micro_batch_size=mbs, gradient_accumulation_steps=gas,
                                                       activation_checkpointing=ac, distributed_optimizer=dist_opt,
                                                       dp_shard=shard, ep=ep, keep_params_gathered=keep)
                            check_model_fits_layout(cfg, candidate)
                        except UserError:
                            continue
                        if keep and candidate.shards == 1 and "keep_params_gathered" not in fixed:
                            continue  # nothing is sharded: the same layout as without
                        if unsupported_combination(
                                compile=candidate.compile, tp=candidate.tp, cp=candidate.cp, ep=candidate.ep,
                                recompute=candidate.activation_checkpointing,
                                keep_params_gathered=candidate.keep_params_gathered,
                                distributed_optimizer=candidate.distributed_optimizer):
                            continue  # the training config refuses it
                        yield candidate


def _keep_choices(distributed_optimizer: bool, fixed: dict[str, object]) -> list[bool]:
    """Whether weights stay gathered through a step: the fixed choice; else both where they are sharded."""
    if "keep_params_gathered" in fixed:
        return [bool(fixed["keep_params_gathered"])]
    return [False, True] if distributed_optimizer else [False]


def _ep_choices(cfg: Qwen3Config, fixed: dict[str, object]) -> list[int]:
    """ep degrees to try: the fixed one; 1 for a dense model; else every power of two dividing the experts
    (the layout's own check drops those its dp_shard x cp ranks cannot lend)."""
    if "ep" in fixed:
        return [int(fixed["ep"])]  # type: ignore[call-overload]
    if not cfg.is_moe:
        return [1]
    return [e for e in _powers_of_two(cfg.num_experts) if cfg.num_experts % e == 0]
