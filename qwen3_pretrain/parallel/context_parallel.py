"""Context parallelism: every sequence split over the ``cp`` ranks, attention gathering keys and values.

Causal attention costs a query at position ``i`` work in proportion to ``i``,
so a plain split of the sequence into ``cp`` pieces would leave the last rank
with most of the work. As Megatron and torchtitan do, the sequence is cut into
``2 cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (one early,
one late): every rank then attends over ``(2 cp + 1)`` chunks of keys.

Everything outside attention is per token (norms, projections, MLP, the loss),
so only attention needs the other ranks: ``ContextParallelAttention`` wraps the
device's kernel, all-gathers K and V over the cp axis (the Llama 3 paper's
all-gather variant; the backward reduce-scatters their gradients, summing what
every rank's queries sent back) and computes each of its two query chunks
against the prefix of keys up to that chunk, masked from the tokens' global
indices (and their document ids under document masking). RoPE needs nothing
more: each token carries its own global (or per-document) position.

The trainer slices each batch with ``shard_sequence``; FSDP shards over dp x cp
(the cp ranks hold the same weights and their gradients must be summed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from qwen3_pretrain.models.qwen3.attention import AttentionKernel, document_ids


def local_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of the ``2 cp`` sequence chunks that cp rank ``rank`` holds, in order."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of ``t`` along ``dim`` (the sequence): its two chunks, concatenated."""
    if cp == 1:
        return t
    chunks = t.chunk(2 * cp, dim=dim)
    first, second = local_chunks(cp, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every cp rank's part (``parts[r]`` from rank ``r``), in global order."""
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather of the sequence dim over the cp group; backward sums the gradients and keeps this rank's
    part (a reduce-scatter; on gloo an all-reduce, which every backend has)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return unshard_sequence(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        if dist.get_backend(ctx.group) == "gloo":
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return shard_sequence(grad, cp, rank, ctx.dim), None, None
        inputs = [shard_sequence(grad, cp, r, ctx.dim).contiguous() for r in range(cp)]
        out = torch.empty_like(inputs[rank])
        dist.reduce_scatter(out, inputs, group=ctx.group)
        return out, None, None


def gather_sequence(t: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    return _GatherSequence.apply(t, group, dim)


class ContextParallelAttention:
    """Causal attention over a sequence split across the cp ranks (see the module docstring).

    ``inner``: the device's kernel (``models/qwen3/attention.py``), whose
    compute dtype it keeps (fp32 attention for bf16 on CPUs). Each query chunk
    runs SDPA with a boolean mask ``[chunk, prefix]`` from the global token
    indices: exact on every device; on CUDA a masked SDPA uses the
    memory-efficient kernel rather than flash. The two masks are additive, in
    the compute dtype (SDPA would convert a boolean mask in every layer, and
    every layer would keep its copy), built once and shared by all layers: per
    forward under document masking (``[batch, 1, chunk, prefix]``, from
    ``prepare``), else once for good.
    """

    dense_document_mask = False

    def __init__(self, inner: AttentionKernel, mesh: DeviceMesh) -> None:
        self.inner = inner
        self.group = mesh.get_group()
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()
        self._causal: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """The two query chunks' masks, causal and within documents, from the whole sequence's document ids
        (a document starts where its positions restart, on whichever rank that is)."""
        parts = [torch.empty_like(positions) for _ in range(self.cp)]
        dist.all_gather(parts, positions.contiguous(), group=self.group)
        docs = document_ids(unshard_sequence(parts, dim=1))  # [batch, seq]
        return self._masks(positions.shape[1] // 2, positions.device, self._dtype(dtype), docs)

    def _masks(self, chunk: int, device: torch.device, dtype: torch.dtype,
               docs: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Additive masks of the two query chunks, 0 where attention is allowed and -inf elsewhere: [chunk,
        prefix] or, with document ids [batch, seq], [batch, 1, chunk, prefix]; ``prefix`` runs to the end of
        the chunk."""
        masks = []
        for index in local_chunks(self.cp, self.rank):
            start, end = index * chunk, (index + 1) * chunk
            allowed = torch.arange(start, end, device=device)[:, None] >= torch.arange(end, device=device)[None, :]
            if docs is not None:
                allowed = (allowed & (docs[:, start:end, None] == docs[:, None, :end]))[:, None]
            masks.append(torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf")))
        return masks

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Any) -> torch.Tensor:
        dtype = self._dtype(q.dtype)
        k_all = gather_sequence(k, self.group, dim=2).to(dtype)  # [batch, kv_heads, seq, head_dim]
        v_all = gather_sequence(v, self.group, dim=2).to(dtype)
        chunk = q.shape[2] // 2
        if docs is None:
            key = (chunk, q.device, dtype)
            if key not in self._causal:
                self._causal[key] = self._masks(*key)
            docs = self._causal[key]
        outs = []
        for half, mask in zip(q.split(chunk, dim=2), docs):
            end = mask.shape[-1]  # keys up to the end of this query chunk
            outs.append(F.scaled_dot_product_attention(half.to(dtype), k_all[:, :, :end], v_all[:, :, :end],
                                                       attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]))
        return torch.cat(outs, dim=2).to(q.dtype)

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        compute = getattr(self.inner, "compute_dtype", None)
        return compute if compute is not None and dtype in (torch.bfloat16, torch.float16) else dtype
