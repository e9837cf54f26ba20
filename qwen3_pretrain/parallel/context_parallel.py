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
against the prefix of keys up to that chunk with the device's kernel, whose
every call is causal with the queries aligned to the end of the keys (and,
under document masking, within the documents of the whole sequence). RoPE needs
nothing more: each token carries its own global (or per-document) position.

The trainer slices each batch with ``shard_sequence``; FSDP shards over dp x cp
(the cp ranks hold the same weights and their gradients must be summed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from qwen3_pretrain.models.qwen3.attention import AttentionCall, AttentionKernel, document_ids
from qwen3_pretrain.parallel.tensor_parallel import local_tensor


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


def sequence_positions(shape: tuple[int, int], cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """The global positions [batch, seq / cp] of this cp rank's tokens of ``shape`` [batch, seq] samples,
    made on ``device`` (no copy from the host every micro-batch)."""
    return shard_sequence(torch.arange(shape[1], device=device).expand(shape), cp, rank)


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


class ContextParallelAttention(AttentionKernel):
    """Causal attention over a sequence split across the cp ranks (see the module docstring), on the
    device's kernel ``inner`` (``models/qwen3/attention.py``).

    Each of the rank's two query chunks attends to the prefix of the gathered keys that ends with it: a
    call of ``inner`` with the queries aligned to the end of the keys, which the device's kernel serves
    with its own causal mode (the CPU's cached additive mask, CUDA's lower-right ``CausalBias`` on the
    flash kernel, the NPU's lower-right fused mode) and, under document masking, with its own document
    mask for that chunk (built per forward by ``prepare`` from the whole sequence's document ids). K and V
    are gathered once, in the dtype ``inner`` computes in.
    """

    def __init__(self, inner: AttentionKernel, mesh: DeviceMesh) -> None:
        super().__init__(inner.observe)
        self.inner = inner
        self.name, self.dense_document_mask = inner.name, inner.dense_document_mask
        self.group = mesh.get_group()
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.inner.compute_dtype(dtype)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Any]:
        """The two query chunks' document masks, from the whole sequence's document ids (a document starts
        where its positions restart, on whichever rank that is)."""
        parts = [torch.empty_like(positions) for _ in range(self.cp)]
        dist.all_gather(parts, positions.contiguous(), group=self.group)
        doc_ids = document_ids(unshard_sequence(parts, dim=1))  # [batch, seq]
        chunk = positions.shape[1] // 2
        return [self.inner.mask(doc_ids[:, :(index + 1) * chunk], chunk, dtype)
                for index in local_chunks(self.cp, self.rank)]

    def describe(self, *args, **kwargs) -> AttentionCall:
        return self.inner.describe(*args, **kwargs)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: list[Any] | None) -> torch.Tensor:
        dtype = self.inner.compute_dtype(q.dtype)
        k_all = gather_sequence(k, self.group, dim=2).to(dtype)  # [batch, kv_heads, seq, head_dim]
        v_all = gather_sequence(v, self.group, dim=2).to(dtype)
        chunk = q.shape[2] // 2
        outs = []
        for half, index, mask in zip(q.split(chunk, dim=2), local_chunks(self.cp, self.rank), masks or (None, None)):
            end = (index + 1) * chunk  # keys up to the end of this query chunk
            outs.append(self.inner(half, k_all[:, :, :end], v_all[:, :, :end], mask))
        return torch.cat(outs, dim=2)


class ContextParallelHeads:
    """The cp split as a hybrid's Gated DeltaNet layer sees it (``models/qwen3/model.py``: ``HeadSplit``): its
    recurrence and convolution run over every earlier token, so, as Megatron does, a rank trades its tokens
    of all heads for the whole sequence of ``1 / cp`` of the heads (an all-to-all per tensor traded), runs the
    layer's core on those, and trades the outputs back. Each rank does ``1 / cp`` of the work; the heads must divide by cp
    (by tp x cp under tensor parallelism, which gives each tp rank its heads first)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, heads, dim = x.shape
        send = x.reshape(batch, seq, self.size, heads // self.size, dim).movedim(2, 0)  # [cp, ...] by destination
        recv = all_to_all_single_autograd(send.contiguous().flatten(0, 1), None, None, self.group)
        return unshard_sequence(list(recv.view(self.size, batch, seq, heads // self.size, dim)), dim=1)

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        send = torch.stack([shard_sequence(x, self.size, r, dim=1) for r in range(self.size)])
        recv = all_to_all_single_autograd(send.flatten(0, 1), None, None, self.group)
        recv = recv.view(self.size, *send.shape[1:])  # [cp (the source's heads), batch, seq, heads / cp, dim]
        return recv.movedim(0, 2).flatten(2, 3)

    def rank_rows(self, t: torch.Tensor) -> torch.Tensor:
        # under tp too, the tp rank's rows (a DTensor sharded by heads), then this cp rank's share of them
        return local_tensor(t).chunk(self.size)[self.rank]

    def gather_positions(self, positions: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(positions) for _ in range(self.size)]
        dist.all_gather(parts, positions.contiguous(), group=self.group)
        return unshard_sequence(parts, dim=1)
