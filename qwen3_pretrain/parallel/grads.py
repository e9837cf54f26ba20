"""Gradient bookkeeping across all mesh axes: tied embeddings and the global gradient norm."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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
            dist.all_reduce(_local(mine.grad), group=self.group)


def global_grad_norm(params: list[torch.Tensor], pp_group) -> torch.Tensor:
    """L2 norm of all gradients of the model over every rank, each parameter counted once.

    Gradients sharded or replicated over dp/tp are DTensors: their norm is computed per group of equal
    placement (``full_tensor`` reduces over the mesh correctly for shards and replicas alike); stages
    then add their squares over the pipeline axis.
    """
    groups: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups[key].append(g)
    device = next((_local(p).device for p in params), torch.device("cpu"))
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total_sq += norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


@torch.no_grad()
def clip_grads(params: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    if max_norm <= 0 or not math.isfinite(total_norm) or total_norm <= max_norm:
        return
    coef = max_norm / (total_norm + 1e-6)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
