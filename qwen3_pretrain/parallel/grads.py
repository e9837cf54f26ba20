"""Gradient bookkeeping across all mesh axes: tied embeddings and the global gradient norm."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from qwen3_pretrain.parallel.tensor_parallel import local_tensor


class TiedWeights:
    """Keeps a tied LM head equal to the embedding under pp > 1 (with one stage the head applies the
    embedding's weight itself: ``TiedLMHead``). The embedding lives on the first stage and the head, a
    parameter of its own, on the last; both start equal and receive the same, summed gradient (the
    ranks holding the same shard of both, same dp and tp coordinates, sum over a two-rank group), so
    their identical updates keep them equal."""

    def __init__(self, parts: list[nn.Module], mesh: DeviceMesh) -> None:
        pp = mesh["pp"].size()
        if pp == 1:
            raise ValueError("TiedWeights is for pp > 1; one stage ties with TiedLMHead")
        self.embed = next((p.embed_tokens.weight for p in parts if p.embed_tokens is not None), None)
        self.head = next((p.lm_head.weight for p in parts if p.lm_head is not None), None)
        self.group = None
        ranks = mesh.mesh.reshape(pp, -1)
        for first, last in zip(ranks[0].tolist(), ranks[-1].tolist()):
            group = dist.new_group([first, last])  # every rank creates every group, in the same order
            if dist.get_rank() in (first, last):
                self.group = group

    def sync_grads(self) -> None:
        mine = self.embed if self.embed is not None else self.head
        if mine is not None and self.group is not None:
            dist.all_reduce(local_tensor(mine.grad), group=self.group)


def global_grad_norm(params: list[torch.Tensor], ranks_per_stage: int) -> torch.Tensor:
    """L2 norm of all gradients of the model over every rank, each parameter counted once, in one all-reduce
    over the world.

    Each rank adds the squares of its gradients' local shards, each divided by the number of ranks of its
    pipeline stage that hold an identical copy of that shard (the stage's ``ranks_per_stage`` over the
    shards the gradient is cut into: replicas over dp, tp ranks of a replicated norm weight, ...); the
    pipeline stages hold different parameters. Summed over the world, every element counts once. (A
    DTensor's own norm would reduce over its mesh axes one after the other: as many all-reduces, and
    torch's warning that they may disagree between ranks.)
    """
    by_copies: dict[int, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_copies[ranks_per_stage // _num_shards(p.grad)].append(local_tensor(p.grad))
    device = next((local_tensor(p).device for p in params), torch.device("cpu"))
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for copies, grads in by_copies.items():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total_sq += torch.stack(norms).pow(2).sum() / copies
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total_sq)
    return total_sq.sqrt()


def _num_shards(t: torch.Tensor) -> int:
    """Into how many distinct pieces a (DTensor) gradient is cut over its mesh."""
    if not isinstance(t, DTensor):
        return 1
    assert not any(p.is_partial() for p in t.placements), "a gradient is reduced before its norm is taken"
    # every placement but Replicate cuts it: Shard, and the strided shard FSDP makes of a tp-sharded dim
    return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if not p.is_replicate())


@torch.no_grad()
def clip_grads(params: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    if max_norm <= 0 or not math.isfinite(total_norm) or total_norm <= max_norm:
        return
    coef = max_norm / (total_norm + 1e-6)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
