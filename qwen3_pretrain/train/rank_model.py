"""This rank's share of the model, built, and the loss of a micro-batch through it: the model parts
(pipeline stages) parallelized and allocated, their optimizers, the pipeline schedule, and each micro-batch's
inputs (this cp rank's tokens, RoPE positions) and scaled loss (with the multi-token-prediction layer's).

``Engine`` (train/engine.py) runs the training step on it; the model is built once, when the engine is
(meta device, then this rank's shard materialized, drawn or read; a run that resumes or a simulation only
allocates it: ``allocate``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from qwen3_pretrain.models.qwen3.attention import attention_kernel
from qwen3_pretrain.models.ops.delta_rule import delta_rule_kernel
from qwen3_pretrain.models.ops.elementwise import elementwise_kernels
from qwen3_pretrain.models.ops.fp8 import Fp8Filter, Fp8Projections, check_device as check_fp8_device
from qwen3_pretrain.models.ops.fp8 import needs_emulation as needs_fp8_emulation
from qwen3_pretrain.models.ops.fp8 import precompute_scales as precompute_fp8_scales
from qwen3_pretrain.models.ops.loss import IGNORE_INDEX
from qwen3_pretrain.models.ops.moe import Capacity, GroupedExperts
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from qwen3_pretrain.parallel.context_parallel import sequence_positions, shard_sequence
from qwen3_pretrain.parallel.dims import padded_vocab_size, stage_layer_ranges
from qwen3_pretrain.parallel.expert_parallel import gather_over
from qwen3_pretrain.parallel.grads import TiedWeights
from qwen3_pretrain.parallel.parallelize import (
    KernelFactory,
    PartSpec,
    Progress,
    build_stage,
    choose_attention,
    choose_experts,
    local_stage_indices,
    materialize,
    parallelize_stage,
)
from qwen3_pretrain.parallel.pipeline import StageCompute, build_schedule
from qwen3_pretrain.train.balance import RouterBalance
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.model_source import ModelSource
from qwen3_pretrain.train.optim import build_optimizer
from qwen3_pretrain.train.parallelism import Parallelism

Batch = dict[str, torch.Tensor]
# the model -> per local stage (example inputs, example outputs) of the pipeline messages
StageIO = Callable[["RankModel"], list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]]


def mtp_targets(labels: torch.Tensor, input_ids: torch.Tensor, eod_id: int | None = None) -> torch.Tensor:
    """The multi-token-prediction layer's targets [batch, seq]: each position's token after next (``labels``
    moved one on), the last position ignored (its token lies beyond the sample). With ``eod_id`` (packed
    documents with per-document positions) a position is ignored too where its token after next lies in the
    next document, that is where it or the next token ends its document (is ``eod_id``): a document's last
    two positions, whose targets only the next document could tell (Megatron masks them as well). The main
    loss's targets are left as they are (an EOD's label stays the next document's first token)."""
    ahead = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    if eod_id is None:
        return ahead
    ends = input_ids.to(labels.device) == eod_id
    crosses = ends.clone()
    crosses[:, :-1] |= ends[:, 1:]
    return ahead.masked_fill(crosses, IGNORE_INDEX)


class RankModel:
    """This rank's share of the model: its parts, optimizers and pipeline schedule, and a micro-batch's loss.

    ``allocate`` replaces allocating and filling each part's parameters (the
    simulation allocates fake tensors whose values are never read); ``stage_io`` gives the pipeline
    stages their message shapes up front instead of exchanging them at the
    first step.
    """

    def __init__(self, cfg: TrainConfig, source: ModelSource, parallelism: Parallelism, mesh: DeviceMesh,
                 device: torch.device, fp32_matmul: bool, loss_chunk_tokens: int,
                 allocate: Callable[[nn.Module], None] | None = None, stage_io: StageIO | None = None,
                 target_device_type: str | None = None, make_attention: KernelFactory = attention_kernel,
                 play_experts: Callable[[GroupedExperts], None] | None = None,
                 init_threads: int = 1, progress: Progress | None = None, eod_id: int | None = None) -> None:
        # The device type whose kernels are chosen; the simulation builds for an accelerator on CPU tensors
        # (and plays that device's attention kernels there, ``make_attention``, and each MoE layer's experts,
        # whose kernel and dispatch read token counts a fake tensor does not have: ``play_experts``).
        self.target_device_type = target_device_type or device.type
        # The norms', RoPE's and SwiGLU's kernels are the tensors' own device's (the simulation's CPU tensors
        # run ours); the start-up table describes these (parallelize.kernel_table).
        self.elementwise = elementwise_kernels(device.type, cfg.compile)
        self.make_attention, self.play_experts = make_attention, play_experts
        # materialize's threads (this rank's share of the node's cores) and what it tells of its progress
        self.init_threads, self.progress = init_threads, progress
        self.cfg, self.source, self.mesh, self.device = cfg, source, mesh, device
        self.dims, self.stages_per_rank = parallelism.dims, parallelism.stages_per_rank
        self.num_stages = parallelism.num_stages
        self.fp32_matmul, self.loss_chunk_tokens = fp32_matmul, loss_chunk_tokens
        self.local_samples = cfg.batch_size * cfg.gradient_accumulation_steps
        self.num_microbatches = self.local_samples // cfg.pp_microbatch_size
        self.global_batch = cfg.batch_size * self.dims.dp * cfg.gradient_accumulation_steps
        self.global_tokens = self.global_batch * cfg.seq_length
        # The loss's one scale: each rank's token sum over the global batch's token count. FSDP sums the
        # gradients over the dp and cp ranks (no average: apply_fsdp), so they are the global mean's.
        self.loss_scale = 1.0 / self.global_tokens
        self.tp_mesh = mesh["tp"]
        self.cp_rank = mesh.get_local_rank("cp")
        self.balance = self._router_balance() if source.config.is_moe else None
        self.capacity = self._capacity() if source.config.is_moe else None
        # The multi-token-prediction loss's weight (0: no MTP layer built) and its sum over this rank's
        # micro-batches in the step, for the log.
        self.mtp_weight = cfg.mtp_loss_weight
        self.mtp_sum = torch.zeros((), device=device)
        # The data's end-of-document token: with per-document positions an MTP target in the next document
        # is ignored (mtp_labels); None (the simulation's data has no documents) ignores none.
        self.eod_id = eod_id
        # FP8 projections (models/ops/fp8.py), refused here on a device without FP8 tensor cores unless emulated
        self.fp8 = self._fp8()
        self._create_model(allocate, stage_io)

    def _fp8(self) -> Fp8Projections | None:
        """The decoder layers' FP8 projection choice under ``fp8`` (None: off), after the device check (on the
        device the run trains on; a simulation builds for another device on CPU tensors and is not refused)."""
        cfg = self.cfg
        if cfg.fp8 is None:
            return None
        real = self.target_device_type == self.device.type
        if real:
            check_fp8_device(cfg.fp8, self.device, cfg.fp8_emulate)
        return Fp8Projections(cfg.fp8, emulate=real and needs_fp8_emulation(cfg.fp8, self.device),
                              all_gather=cfg.fp8_all_gather, filter=Fp8Filter.parse(cfg.fp8_filter))

    def refresh_fp8_scales(self) -> None:
        """Under ``fp8_all_gather``: the FP8 weights' scales for their next all-gathers, from the weights as
        they are, in one all-reduce (after each update and after a checkpoint's weights are loaded; without
        it each weight's gather would reduce its own maximum)."""
        if self.fp8 is not None and self.fp8.all_gather:
            for part in self.parts:
                precompute_fp8_scales(part)

    def _router_balance(self) -> RouterBalance:
        """The MoE layers' observer: balancing losses and expert counts, over the ranks of a micro-batch."""
        cfg, model_cfg = self.cfg, self.source.config
        group_size = self.dims.token_ranks
        reduce = None
        if group_size > 1:
            group = self.dims.token_mesh(self.mesh).get_group()
            reduce = lambda t: dist.all_reduce(t, group=group)  # noqa: E731
        coef = model_cfg.router_aux_loss_coef if cfg.moe_aux_loss_coef is None else cfg.moe_aux_loss_coef
        return RouterBalance(model_cfg, cfg.moe_aux_loss, coef, cfg.moe_z_loss_coef, group_size, reduce,
                             scale=cfg.moe_aux_loss_scale, mtp=cfg.mtp_loss_weight > 0,
                             bias_rate=cfg.moe_bias_update_rate)

    def _capacity(self) -> Capacity | None:
        """The MoE layers' expert capacity (None: dropless), decided over the ranks that split a micro-batch's
        tokens for them (the balancing loss's ``token_mesh``) unless its scope is each rank's own."""
        cfg, dims = self.cfg, self.dims
        if cfg.moe_capacity_factor is None:
            return None
        gather = None
        if cfg.moe_capacity_scope == "micro_batch" and dims.token_ranks > 1:
            gather = gather_over(dims.token_mesh(self.mesh).get_group())
        return Capacity(cfg.moe_capacity_factor, pad=cfg.moe_pad_to_capacity, gather=gather,
                        group_size=dims.token_ranks, senders=dims.ep)

    # --- set-up ------------------------------------------------------------------

    def build_part(self, idx: int, allocate: Callable[[nn.Module], None] | None = None) -> Qwen3Model:
        """Pipeline stage ``idx`` of the model, parallelized and allocated on this rank's device."""
        cfg, model_cfg = self.cfg, self.source.config
        stage_cfg = type(model_cfg)(**{**model_cfg.__dict__, "vocab_size": self.padded_vocab})
        ranges = stage_layer_ranges(model_cfg.num_hidden_layers, self.num_stages)
        cp_mesh = self.mesh["cp"] if self.dims.cp > 1 else None
        attention = choose_attention(self.target_device_type, self.fp32_matmul, cp_mesh, self.make_attention)
        experts = choose_experts(self.target_device_type, cfg.mixed_precision, self.fp32_matmul, self.fp8,
                                 cfg.compile)
        part = build_stage(stage_cfg, PartSpec(idx, self.num_stages, ranges[idx]), model_cfg.vocab_size,
                           self.loss_chunk_tokens, attention=attention, fp32_matmul=self.fp32_matmul,
                           ac_mode=cfg.ac_mode, document_mask=cfg.document_mask, cp_mesh=cp_mesh,
                           experts=experts, router_observer=self.balance, moe_force_balance=cfg.moe_force_balance,
                           multi_token_prediction=self.mtp_weight > 0,
                           delta_rule=delta_rule_kernel(self.target_device_type), elementwise=self.elementwise,
                           moe_router_fp32=cfg.moe_router_dtype == "fp32",
                           moe_expert_bias=cfg.moe_bias_update_rate > 0, moe_capacity=self.capacity,
                           fp8=self.fp8)
        parallelize_stage(part, self.mesh, self.dp_mesh, cfg.mixed_precision, cfg.compile,
                          reduce_scatter_device=self.target_device_type, expert_meshes=self.expert_meshes,
                          keep_params_gathered=cfg.keep_params_gathered, grad_reduce_dtype=cfg.grad_reduce_dtype)
        if self.play_experts is not None:
            for module in part.modules():
                if isinstance(module, GroupedExperts):
                    self.play_experts(module)
        if allocate is None:
            materialize(part, self.device, self.source.tensor_source(self.padded_vocab, cfg.seed),
                        self.init_threads, self.progress)
        else:
            allocate(part)
        return part

    def _create_model(self, allocate: Callable[[nn.Module], None] | None, stage_io: StageIO | None) -> None:
        cfg, model_cfg, dims = self.cfg, self.source.config, self.dims
        self.padded_vocab = padded_vocab_size(model_cfg.vocab_size, dims.tp)
        num_stages = self.num_stages
        self.stage_indices = local_stage_indices(self.mesh.get_local_rank("pp"), dims.pp, self.stages_per_rank)
        self.dp_mesh = dims.dp_mesh(self.mesh)
        self.expert_meshes = dims.expert_meshes(self.mesh) if dims.ep > 1 else None
        self.parts = [self.build_part(idx, allocate) for idx in self.stage_indices]
        if self.balance is not None:
            self.balance.attach_biases(self.parts)
        self.tied = TiedWeights(self.parts, self.mesh) if model_cfg.tie_word_embeddings and dims.pp > 1 else None
        self.params = [p for part in self.parts for p in part.parameters()]
        # The tied head's gradient equals the embedding's: count it once in the global norm.
        skip = {id(self.tied.head)} if self.tied is not None and self.tied.head is not None else set()
        self.norm_params = [p for p in self.params if id(p) not in skip]
        # One optimizer per part, so optimizer state is saved and resharded by parameter name.
        self.optimizers = [build_optimizer([part], cfg, tied=model_cfg.tie_word_embeddings) for part in self.parts]
        self.pp_group = self.mesh["pp"].get_group() if dims.pp > 1 else None
        self.has_first = 0 in self.stage_indices
        self.has_last = num_stages - 1 in self.stage_indices
        self.schedule = None
        # under pp: where each local stage's compute begins and ends, for the observer's busy and idle time
        self.stage_compute = StageCompute() if dims.pp > 1 else None
        if dims.pp > 1:
            io = stage_io(self) if stage_io is not None else self.pipeline_messages()
            self.schedule = build_schedule(self.parts, self.stage_indices, num_stages, self.device, self.pp_group,
                                           cfg.pp_schedule, self.num_microbatches, self.loss_fn, io,
                                           compute=self.stage_compute)

    def pipeline_messages(self) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
        """Per local stage, example (inputs, outputs) of its pipeline messages, from the layout: stage 0 takes
        the token ids (and positions, where they vary), a later stage the hidden states of this rank's share
        of the sequence (1/cp, cut again over tp between layers) and the positions; the last stage returns
        the final hidden states. Given up front, the schedule runs no forward and backward of its own to
        find them (a forward the MoE layers would count as a micro-batch)."""
        cfg, dims = self.cfg, self.dims
        mb, seq = cfg.pp_microbatch_size, cfg.seq_length // dims.cp
        dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
        ids = torch.zeros((mb, seq), dtype=torch.long, device=self.device)
        first_in = (ids, ids) if self.uses_positions else (ids,)
        hidden = torch.zeros((mb, seq // dims.tp, self.source.config.hidden_size), dtype=dtype, device=self.device,
                             requires_grad=True)  # the gradient travels back along it
        io = []
        if self.mtp_weight:  # beside them the next tokens, then their embeddings; the last stage returns two
            first_in, between, last_out = first_in + (ids,), (hidden, ids, hidden), (hidden, hidden)
        else:
            between, last_out = (hidden, ids), (hidden,)
        for idx in self.stage_indices:
            inputs = first_in if idx == 0 else between
            io.append((inputs, last_out if idx == self.num_stages - 1 else between))
        return io

    # --- a micro-batch's inputs and loss ------------------------------------------

    def loss_fn(self, hidden: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor,
                mtp_labels: torch.Tensor | None = None) -> torch.Tensor:
        """The scaled token sum of the loss; with the multi-token-prediction layer's hidden states (``hidden``
        a pair) plus ``mtp_loss_weight`` times its loss on ``mtp_labels`` (each position's token after next),
        scaled alike. The pipeline hands both labels stacked: [batch, seq, 2]."""
        head = self.parts[-1].lm_head
        if labels.dim() == 3:
            labels, mtp_labels = labels.unbind(-1)
        if isinstance(hidden, tuple):
            hidden, mtp_hidden = hidden
            if not torch.is_grad_enabled():  # an evaluation: the LM loss alone
                return self._head_loss(head, hidden, labels)
            mtp = self._head_loss(head, mtp_hidden, mtp_labels)
            self.mtp_sum += mtp.detach()
            return self._head_loss(head, hidden, labels) + self.mtp_weight * mtp
        return self._head_loss(head, hidden, labels)

    def _head_loss(self, head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.dims.tp > 1:
            hidden = DTensor.from_local(hidden, self.tp_mesh, [Shard(1)])
        return head(hidden, labels) * self.loss_scale

    def mtp_labels(self, mb: Batch) -> torch.Tensor:
        """Each position's token after next [batch, seq] (this cp rank's part): the labels moved one on, the
        last position ignored (its token lies beyond the sample); with per-document positions also every
        position whose token after next lies in another document (``mtp_targets``)."""
        eod_id = self.eod_id if self.cfg.per_document_positions else None
        return shard_sequence(mtp_targets(mb["labels"], mb["input_ids"], eod_id), self.dims.cp,
                              self.cp_rank).to(self.device)

    def micro_batch_loss(self, part: nn.Module, mb: Batch) -> torch.Tensor:
        """One micro-batch's scaled loss on a one-stage model (with the MTP layer's, where it has one)."""
        labels = self.tokens(mb, "labels")
        if not self.mtp_weight:
            return self.loss_fn(part(self.tokens(mb, "input_ids"), self.positions(mb)), labels)
        out = part(self.tokens(mb, "input_ids"), self.positions(mb), labels)
        return self.loss_fn(out, labels, self.mtp_labels(mb))

    @property
    def uses_positions(self) -> bool:
        # Under cp a rank's tokens are not 0..n-1: each carries its own position. The MTP layer's input comes
        # after them in a pipeline stage's arguments.
        return self.cfg.per_document_positions or self.dims.cp > 1 or self.mtp_weight > 0

    def tokens(self, mb: Batch, key: str) -> torch.Tensor:
        """``mb[key]`` [batch, seq] on the device, this cp rank's part of each sequence."""
        return shard_sequence(mb[key], self.dims.cp, self.cp_rank).to(self.device)

    def positions(self, mb: Batch) -> torch.Tensor | None:
        """Per-document (or, under cp, global) RoPE positions; None means 0..seq-1 in every sample."""
        if not self.uses_positions:
            return None
        if self.cfg.per_document_positions:
            return self.tokens(mb, "positions")
        return sequence_positions(mb["input_ids"].shape, self.dims.cp, self.cp_rank, self.device)
