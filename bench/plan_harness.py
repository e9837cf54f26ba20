"""Measure a single-process training step, to check the planner's predictions against
(``bench/plan_validate.py``). A measuring harness, so it lives beside the benchmarks, outside the package.

The step runs the engine's own stage: ``build_stage`` (the fused chunked LM
head, the layout's recompute, precision and document masking chosen at
construction), ``parallelize_stage`` (FSDP2 units and mixed precision as in
training) over a one-process mesh, then AdamW, gradient accumulation without
gradient sync until the last micro-batch, gradient clipping.
``MemoryTracker`` measures the allocator-level peak of whole steps after the
first (so AdamW's state exists, as in the steady state the planner describes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qwen3_pretrain.models.ops.precision import use_fp32_matmul
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.init import init_param
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from qwen3_pretrain.parallel.dims import ParallelDims
from qwen3_pretrain.parallel.parallelize import (PartSpec, build_stage, choose_attention, choose_experts, materialize,
                                                  parallelize_stage)
from qwen3_pretrain.plan.layout import Layout
from qwen3_pretrain.plan.memory import MemoryBreakdown, predict_memory
from qwen3_pretrain.simulate.memtrack import MemoryTracker


@dataclass(frozen=True)
class Measurement:
    measured_peak_bytes: int
    predicted: MemoryBreakdown
    step_time_s: float | None  # one step without the tracker (its bookkeeping slows every operator)

    @property
    def error(self) -> float:
        """(predicted - measured) / measured, on the allocator-level peak (overhead excluded)."""
        return (self.predicted.allocated - self.measured_peak_bytes) / self.measured_peak_bytes


def build_model(cfg: Qwen3Config, layout: Layout) -> Qwen3Model:
    """The engine's one-stage model for ``layout`` on one process (the process group must exist)."""
    if layout.world_size != 1:
        raise ValueError(f"validation runs one process; got tp={layout.tp}, pp={layout.pp}, dp={layout.dp}")
    dims = ParallelDims.resolve(world_size=1, distributed_optimizer=layout.distributed_optimizer)
    mesh = dims.build_mesh("cpu")
    model = build_stage(cfg, PartSpec(0, 1, range(cfg.num_hidden_layers)), cfg.vocab_size, layout.loss_chunk_tokens,
                        attention=choose_attention("cpu", layout.fp32_matmul), fp32_matmul=layout.fp32_matmul,
                        ac_mode=layout.activation_checkpointing, document_mask=layout.document_mask,
                        experts=choose_experts("cpu", layout.mixed_precision, layout.fp32_matmul))
    parallelize_stage(model, mesh, dims.dp_mesh(mesh), layout.mixed_precision)
    materialize(model, torch.device("cpu"), lambda name, shape, slices: init_param(name, shape, cfg, 0, slices))
    return model


def train_step(model: Qwen3Model, optimizer: torch.optim.Optimizer, layout: Layout, vocab: int,
               generator: torch.Generator) -> float:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the loss."""
    total = 0.0
    shape = (layout.micro_batch_size, layout.seq_length)
    for i in range(layout.gradient_accumulation_steps):
        model.set_requires_gradient_sync(i == layout.gradient_accumulation_steps - 1)
        ids = torch.randint(0, vocab, shape, generator=generator)
        labels = torch.randint(0, vocab, shape, generator=generator)
        loss = model.lm_head(model(ids), labels) / labels.numel()
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _ensure_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def measure(cfg: Qwen3Config, layout: Layout, steps: int = 1, time_one_step: bool = False) -> Measurement:
    """Peak bytes over ``steps`` steps after a first one, with the planner's prediction for the same layout."""
    _ensure_process_group()
    gen = torch.Generator().manual_seed(0)
    # the engine's AdamW on CPU, and its way with bf16 matmuls on this CPU
    layout = layout.replace(optimizer_impl="fused", device_type="cpu",
                            fp32_matmul=use_fp32_matmul(torch.device("cpu"), layout.mixed_precision, "auto"))
    with MemoryTracker("cpu") as mem:
        model = build_model(cfg, layout)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        train_step(model, optimizer, layout, cfg.vocab_size, gen)
        mem.reset()
        for _ in range(steps):
            train_step(model, optimizer, layout, cfg.vocab_size, gen)
    elapsed = None
    if time_one_step:
        start = time.perf_counter()
        train_step(model, optimizer, layout, cfg.vocab_size, gen)
        elapsed = time.perf_counter() - start
    return Measurement(mem.peak_bytes, predict_memory(cfg, layout), elapsed)
