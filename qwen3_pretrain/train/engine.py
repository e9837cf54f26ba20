"""What one training step runs on this rank: the model parts, their optimizers, the pipeline schedule,
forward/backward over the rank's micro-batches and the optimizer step.

The ``Trainer`` adds data, checkpoints, logging and the loop around it;
``qwen3-pretrain simulate`` runs the same engine on fake tensors to measure
memory and communication at a scale no machine here has.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from qwen3_pretrain.hardware import optimizer_impl
from qwen3_pretrain.models.qwen3.attention import attention_kernel
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from qwen3_pretrain.parallel.context_parallel import sequence_positions, shard_sequence
from qwen3_pretrain.parallel.dims import ParallelDims, padded_vocab_size, stage_layer_ranges
from qwen3_pretrain.parallel.grads import TiedWeights, clip_grads, global_grad_norm
from qwen3_pretrain.parallel.parallelize import (
    KernelFactory,
    PartSpec,
    build_stage,
    choose_attention,
    local_stage_indices,
    materialize,
    parallelize_stage,
)
from qwen3_pretrain.parallel.pipeline import build_schedule
from qwen3_pretrain.plan.layout import Layout
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.model_source import ModelSource
from qwen3_pretrain.train.optim import build_optimizer, set_lr

Batch = dict[str, torch.Tensor]
# engine -> per local stage (example inputs, example outputs) of the pipeline messages
StageIO = Callable[["Engine"], list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]]


class Engine:
    """This rank's share of the model and of every training step.

    ``allocate`` replaces allocating and filling each part's parameters (the
    simulation allocates fake tensors whose values are never read); ``stage_io`` gives the pipeline
    stages their message shapes up front instead of exchanging them at the
    first step.
    """

    def __init__(self, cfg: TrainConfig, source: ModelSource, dims: ParallelDims, mesh: DeviceMesh,
                 device: torch.device, stages_per_rank: int, fp32_matmul: bool, loss_chunk_tokens: int,
                 allocate: Callable[[nn.Module], None] | None = None, stage_io: StageIO | None = None,
                 target_device_type: str | None = None, make_attention: KernelFactory = attention_kernel) -> None:
        # The device type whose kernels are chosen; the simulation builds for an accelerator on CPU tensors
        # (and plays that device's attention kernels there: ``make_attention``).
        self.target_device_type = target_device_type or device.type
        self.make_attention = make_attention
        self.cfg, self.source, self.dims, self.mesh, self.device = cfg, source, dims, mesh, device
        self.stages_per_rank, self.fp32_matmul, self.loss_chunk_tokens = stages_per_rank, fp32_matmul, loss_chunk_tokens
        self.local_samples = cfg.batch_size * cfg.gradient_accumulation_steps
        self.num_microbatches = self.local_samples // cfg.pp_microbatch_size
        self.global_batch = cfg.batch_size * dims.dp * cfg.gradient_accumulation_steps
        self.global_tokens = self.global_batch * cfg.seq_length
        # Each rank's loss is its token sum over the global batch's token count, times dp x cp because
        # FSDP averages gradients over the dp and cp ranks: together they give the global token mean.
        self.loss_scale = dims.dp * dims.cp / self.global_tokens
        self.tp_mesh = mesh["tp"]
        self.cp_rank = mesh.get_local_rank("cp")
        self._build_model(allocate, stage_io)

    # --- set-up ------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return self.dims.pp * self.stages_per_rank

    def build_part(self, idx: int, allocate: Callable[[nn.Module], None] | None = None) -> Qwen3Model:
        """Pipeline stage ``idx`` of the model, parallelized and allocated on this rank's device."""
        cfg, model_cfg = self.cfg, self.source.config
        stage_cfg = type(model_cfg)(**{**model_cfg.__dict__, "vocab_size": self.padded_vocab})
        ranges = stage_layer_ranges(model_cfg.num_hidden_layers, self.num_stages)
        cp_mesh = self.mesh["cp"] if self.dims.cp > 1 else None
        attention = choose_attention(self.target_device_type, self.fp32_matmul, cp_mesh, self.make_attention)
        part = build_stage(stage_cfg, PartSpec(idx, self.num_stages, ranges[idx]), model_cfg.vocab_size,
                           self.loss_chunk_tokens, attention=attention, fp32_matmul=self.fp32_matmul,
                           ac_mode=cfg.ac_mode, document_mask=cfg.document_mask, cp_mesh=cp_mesh)
        parallelize_stage(part, self.mesh, self.dp_mesh, cfg.mixed_precision, cfg.compile,
                          reduce_scatter_device=self.target_device_type)
        if allocate is None:
            materialize(part, self.device, self.source.tensor_source(self.padded_vocab, cfg.seed))
        else:
            allocate(part)
        return part

    def _build_model(self, allocate: Callable[[nn.Module], None] | None, stage_io: StageIO | None) -> None:
        cfg, model_cfg, dims = self.cfg, self.source.config, self.dims
        self.padded_vocab = padded_vocab_size(model_cfg.vocab_size, dims.tp)
        num_stages = self.num_stages
        self.stage_indices = local_stage_indices(self.mesh.get_local_rank("pp"), dims.pp, self.stages_per_rank)
        self.dp_mesh = dims.dp_mesh(self.mesh)
        self.parts = [self.build_part(idx, allocate) for idx in self.stage_indices]
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
        if dims.pp > 1:
            io = stage_io(self) if stage_io is not None else None
            self.schedule = build_schedule(self.parts, self.stage_indices, num_stages, self.device, self.pp_group,
                                           cfg.pp_schedule, self.num_microbatches, self.loss_fn, io)

    # --- one step -------------------------------------------------------------------

    def loss_fn(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head = self.parts[-1].lm_head
        if self.dims.tp > 1:
            hidden = DTensor.from_local(hidden, self.tp_mesh, [Shard(1)])
        return head(hidden, labels) * self.loss_scale

    @property
    def uses_positions(self) -> bool:
        # Under cp a rank's tokens are not 0..n-1: each carries its own position.
        return self.cfg.reset_position_ids or self.cfg.document_mask or self.dims.cp > 1

    def tokens(self, mb: Batch, key: str) -> torch.Tensor:
        """``mb[key]`` [batch, seq] on the device, this cp rank's part of each sequence."""
        return shard_sequence(mb[key], self.dims.cp, self.cp_rank).to(self.device)

    def positions(self, mb: Batch) -> torch.Tensor | None:
        """Per-document (or, under cp, global) RoPE positions; None means 0..seq-1 in every sample."""
        if not self.uses_positions:
            return None
        if self.cfg.reset_position_ids or self.cfg.document_mask:
            return self.tokens(mb, "positions")
        return sequence_positions(mb["input_ids"].shape, self.dims.cp, self.cp_rank, self.device)

    def forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """Sum over this rank's micro-batches of the scaled loss (zero where the rank holds no head)."""
        if self.dims.pp > 1:
            return self.run_pipeline(self.schedule.step, batches)
        total = torch.zeros((), device=self.device)
        part = self.parts[0]
        for i, mb in enumerate(batches):
            part.set_requires_gradient_sync(self.cfg.reduce_grads_every_microbatch or i == len(batches) - 1)
            loss = self.loss_fn(part(self.tokens(mb, "input_ids"), self.positions(mb)), self.tokens(mb, "labels"))
            loss.backward()
            total += loss.detach()
        return total

    def run_pipeline(self, run, batches: list[Batch]) -> torch.Tensor:
        """One pass of the schedule (``step`` or ``eval``) over this rank's micro-batches, re-cut into
        pipeline micro-batches; returns the sum of the scaled losses (zero off the last stage)."""
        inputs = torch.cat([self.tokens(mb, "input_ids") for mb in batches])
        labels = torch.cat([self.tokens(mb, "labels") for mb in batches])
        losses: list[torch.Tensor] = []
        args: tuple[torch.Tensor, ...] = ()
        if self.has_first:  # per-document positions enter with the ids and travel with the hidden states
            args = (inputs, torch.cat([self.positions(mb) for mb in batches])) if self.uses_positions else (inputs,)
        kwargs = {"target": labels, "losses": losses} if self.has_last else {}
        run(*args, return_outputs=False, **kwargs)
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss.detach()
        return total

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> torch.Tensor:
        """This rank's scaled loss over ``batches`` without backward."""
        if self.dims.pp > 1:
            return self.run_pipeline(self.schedule.eval, batches)
        local = torch.zeros((), device=self.device)
        for mb in batches:
            hidden = self.parts[0](self.tokens(mb, "input_ids"), self.positions(mb))
            local += self.loss_fn(hidden, self.tokens(mb, "labels"))
        return local

    def reshard(self) -> None:
        """Without a backward pass, units kept gathered after forward (the embedding of a tied head)
        stay gathered: give the memory back, and let checkpoints see the sharded parameters."""
        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm, after a tied head's and embedding's gradients are summed."""
        if self.tied is not None:
            self.tied.sync_grads()
        return global_grad_norm(self.norm_params, self.pp_group)

    def optimizer_step(self, lr: float, grad_norm: float | None) -> None:
        """Clip to ``grad_norm`` and step; ``None`` skips the update. Gradients are dropped either way."""
        if grad_norm is not None:
            clip_grads(self.params, self.cfg.clip_grad, grad_norm)
            for opt in self.optimizers:
                set_lr(opt, lr)
                opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)


def engine_layout(cfg: TrainConfig, dims: ParallelDims, stages_per_rank: int, loss_chunk_tokens: int,
                  device_type: str, fp32_matmul: bool) -> Layout:
    """The planner's description of the engine that ``cfg`` builds on ``device_type``."""
    return Layout(tp=dims.tp, pp=dims.pp, dp=dims.dp, cp=dims.cp, micro_batch_size=cfg.batch_size,
                  gradient_accumulation_steps=cfg.gradient_accumulation_steps, seq_length=cfg.seq_length,
                  activation_checkpointing=cfg.ac_mode, distributed_optimizer=cfg.distributed_optimizer,
                  dp_shard=cfg.dp_shard,
                  mixed_precision=cfg.mixed_precision, pp_schedule=cfg.pp_schedule,
                  virtual_stages=stages_per_rank, loss_chunk_tokens=loss_chunk_tokens,
                  pp_microbatch_size=cfg.pp_microbatch_size, document_mask=cfg.document_mask,
                  device_type=device_type,
                  reduce_grads_every_microbatch=cfg.reduce_grads_every_microbatch,
                  optimizer_impl=optimizer_impl(device_type), fp32_matmul=fp32_matmul)
