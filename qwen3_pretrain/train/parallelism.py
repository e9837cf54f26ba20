"""What a run's config makes of its world, before any process group exists: the mesh's degrees and the
pipeline stages each rank runs (``Parallelism``), every check of the layout against the world and the model
(``resolve_parallelism``), and the planner's description of the engine that the config builds
(``engine_layout``). The trainer and the scale simulation both start here, so a bad config stops either
before heavy work, with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen3_pretrain.errors import ConfigError
from qwen3_pretrain.hardware import optimizer_impl
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.parallel.dims import ParallelDims, check_expert_split
from qwen3_pretrain.parallel.fp8 import check_fp8_layout
from qwen3_pretrain.plan.layout import Layout, check_pipeline_feed
from qwen3_pretrain.train.config import TrainConfig


@dataclass(frozen=True)
class Parallelism:
    """What a run's config makes of its world: the mesh's degrees, and the pipeline stages each rank runs."""

    dims: ParallelDims
    stages_per_rank: int

    @property
    def num_stages(self) -> int:
        return self.dims.pp * self.stages_per_rank


def resolve_parallelism(cfg: TrainConfig, world_size: int, model: Qwen3Config) -> Parallelism:
    """Every check of the layout against the world and the model that needs no process group, so a bad
    config stops before any heavy work: the trainer's and the scale simulation's one set-up."""
    if cfg.seq_length > model.max_position_embeddings:
        raise ConfigError(f"seq_length {cfg.seq_length} exceeds the model's max_position_embeddings "
                          f"{model.max_position_embeddings}; lower seq_length to at most that, or raise "
                          "max_position_embeddings (model_overrides for a preset, config.json of model_path)")
    check_expert_split(model, cfg.ep)  # before the degrees: "this model has no experts" says more
    if cfg.mtp_loss_weight and not model.mtp_num_hidden_layers:
        raise ConfigError(f"mtp_loss_weight {cfg.mtp_loss_weight} trains a multi-token-prediction layer, but the "
                          "model has none (mtp_num_hidden_layers 0 in the preset or the checkpoint's config.json); "
                          "set mtp_loss_weight 0, or mtp_num_hidden_layers 1 (model_overrides of a preset, "
                          "config.json of model_path; a layer the files lack starts from random init)")
    dims = ParallelDims.resolve(world_size=world_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp,
                                distributed_optimizer=cfg.distributed_optimizer, dp_shard=cfg.dp_shard, ep=cfg.ep)
    stages_per_rank = cfg.pp_virtual_stages if cfg.pp_schedule == "interleaved" and cfg.pp > 1 else 1
    dims.validate(model, cfg.pp * stages_per_rank)
    check_pipeline_feed(cfg.pp, cfg.pp_schedule, cfg.batch_size, cfg.gradient_accumulation_steps,
                        cfg.pp_microbatch_size, batch_key="batch_size")
    check_fp8_layout(cfg.fp8, cfg.pp_microbatch_size if cfg.pp > 1 else cfg.batch_size, cfg.seq_length, cfg.cp)
    return Parallelism(dims, stages_per_rank)


def engine_layout(cfg: TrainConfig, parallelism: Parallelism, loss_chunk_tokens: int, device_type: str,
                  fp32_matmul: bool) -> Layout:
    """The planner's description of the engine that ``cfg`` builds on ``device_type``."""
    dims, stages_per_rank = parallelism.dims, parallelism.stages_per_rank
    return Layout(tp=dims.tp, pp=dims.pp, dp=dims.dp, cp=dims.cp, ep=dims.ep, micro_batch_size=cfg.batch_size,
                  gradient_accumulation_steps=cfg.gradient_accumulation_steps, seq_length=cfg.seq_length,
                  activation_checkpointing=cfg.ac_mode, distributed_optimizer=cfg.distributed_optimizer,
                  dp_shard=cfg.dp_shard,
                  mixed_precision=cfg.mixed_precision, pp_schedule=cfg.pp_schedule,
                  virtual_stages=stages_per_rank, loss_chunk_tokens=loss_chunk_tokens,
                  pp_microbatch_size=cfg.pp_microbatch_size, document_mask=cfg.document_mask,
                  device_type=device_type,
                  reduce_grads_every_microbatch=cfg.reduce_grads_every_microbatch,
                  keep_params_gathered=cfg.keep_params_gathered, grad_reduce_dtype=cfg.grad_reduce_dtype,
                  compile=cfg.compile,
                  optimizer_impl=optimizer_impl(device_type), fp32_matmul=fp32_matmul,
                  embedding_decay=bool(cfg.weight_decay_embeddings),
                  moe_capacity_factor=cfg.moe_capacity_factor, moe_pad_to_capacity=cfg.moe_pad_to_capacity,
                  # the planner prices FP8 with bf16 compute (its FP8 model); an fp32 run's FP8 is left out
                  fp8=(cfg.fp8 or "off") if cfg.mixed_precision == "bf16" else "off",
                  fp8_all_gather=bool(cfg.fp8 and cfg.fp8_all_gather and cfg.mixed_precision == "bf16"))
