"""Measure a single-process training step, to check the planner's predictions against
(``bench/plan_validate.py``). A measuring harness, so it lives beside the benchmarks, outside the package.

The step is built the way the engine builds a stage, in a few plain lines:
``Qwen3Model`` with the fused chunked LM head, activation checkpointing by
``torch.utils.checkpoint`` (each layer for ``full``, each MLP for
``selective``), FSDP2 ``fully_shard`` on each layer, the head and the root with
the layout's mixed precision over a one-process group, AdamW, gradient
accumulation without gradient sync until the last micro-batch, gradient
clipping. ``MemoryTracker`` measures the allocator-level peak of whole steps
after the first (so AdamW's state exists, as in the steady state the planner
describes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from qwen3_pretrain.models.ops.loss import ChunkedLMHead, TiedLMHead
from qwen3_pretrain.models.ops.precision import compute_in_fp32, use_fp32_matmul
from qwen3_pretrain.models.qwen3 import Qwen3Config, Qwen3Model
from qwen3_pretrain.plan.layout import Layout
from qwen3_pretrain.plan.memory import MemoryBreakdown, predict_memory
from qwen3_pretrain.plan.memtrack import MemoryTracker


@dataclass(frozen=True)
class Measurement:
    measured_peak_bytes: int
    predicted: MemoryBreakdown
    step_time_s: float | None  # one step without the tracker (its bookkeeping slows every operator)

    @property
    def error(self) -> float:
        """(predicted - measured) / measured, on the allocator-level peak (overhead excluded)."""
        return (self.predicted.allocated - self.measured_peak_bytes) / self.measured_peak_bytes


def _checkpointed(module: nn.Module) -> None:
    forward = module.forward
    module.forward = lambda *args, **kw: checkpoint(forward, *args, use_reentrant=False, **kw)


def build_model(cfg: Qwen3Config, layout: Layout) -> Qwen3Model:
    """A one-process stage: fused loss head, recompute, FSDP2 with the layout's precision."""
    if layout.world_size != 1:
        raise ValueError(f"validation runs one process; got tp={layout.tp}, pp={layout.pp}, dp={layout.dp}")
    torch.manual_seed(0)
    model = Qwen3Model(cfg)  # torch's default initialization: the values do not matter here
    if cfg.tie_word_embeddings:  # as in the engine: the head applies the embedding's weight
        head = TiedLMHead(model.embed_tokens, chunk_tokens=layout.loss_chunk_tokens)
    else:
        head = ChunkedLMHead.from_linear(model.lm_head, chunk_tokens=layout.loss_chunk_tokens)
    model.lm_head, model.return_hidden = head, True
    if layout.fp32_matmul:
        compute_in_fp32(model)
    model.document_mask = layout.document_mask
    for layer in model.layers.values():
        if layout.activation_checkpointing != "none":
            _checkpointed(layer if layout.activation_checkpointing == "full" else layer.mlp)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if layout.mixed_precision == "bf16" else MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (1,))
    if cfg.tie_word_embeddings:  # gathered from its forward to its backward, for the head (as in the engine)
        fully_shard(model.embed_tokens, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    units = [*model.layers.values(), *([] if cfg.tie_word_embeddings else [model.lm_head]), model]
    for module in units:
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=layout.reshard_after_forward)
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
    layout = layout.replace(optimizer_impl="fused",
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
