"""A MoE layer's experts as the scale simulation runs them on fake tensors.

A fake tensor has shapes, not values, so whatever reads how many tokens each
expert received cannot run as built: the per-expert loop (one matmul per
expert) and expert parallelism's dispatch (the splits of its all-to-all). The
simulation plays both with the tokens split evenly over the experts (the
round-robin routing of a benchmark run, and the balance the load-balancing
loss aims at): the same collectives and the same tensors, of the same total
sizes, kept for backward, which is what memory and bytes depend on. The
grouped kernel reads no counts and runs as built.

Skewed routing is played as the planner counts it (``Layout.moe_rank_load``):
the simulated rank receives ``load`` times its even share of the pairs, spread
evenly over its experts and senders, while what it sends stays even (the
heaviest rank's memory, not a consistent world). With a capacity, the kept
pairs are all of them (even routing fills no expert past a factor >= 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from qwen3_pretrain.models.ops.moe import Capacity, ExpertLoop, GroupedExperts
from qwen3_pretrain.parallel.expert_parallel import ExpertParallel


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


class EvenExpertLoop(ExpertLoop):
    """``ExpertLoop`` with the tokens split evenly over the experts instead of read from the counts."""

    def sizes(self, counts: torch.Tensor, num_tokens: int) -> list[int]:
        return _even(num_tokens, counts.shape[0])


class EvenExpertParallel(ExpertParallel):
    """``ExpertParallel`` whose counts all-to-all runs (its bytes are counted) but whose splits are even:
    every rank sends and receives the same number of pairs for every expert."""

    def __init__(self, played: ExpertParallel, load: float = 1.0) -> None:
        self.group, self.size, self.load = played.group, played.size, load

    def exchange_counts(self, counts: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, list[int], list[int]]:
        send = counts.view(self.size, -1)
        dist.all_to_all_single(torch.empty_like(send), send, group=self.group)
        local = send.shape[1]
        sent = _even(num_rows, self.size * local)
        send_splits = [sum(sent[r * local:(r + 1) * local]) for r in range(self.size)]
        flat = _even(round(num_rows * self.load), self.size * local)  # the heaviest rank's arrivals
        recv_splits = [sum(flat[r * local:(r + 1) * local]) for r in range(self.size)]
        return torch.tensor(flat, device=counts.device).view(self.size, local), send_splits, recv_splits


class EvenCapacity(Capacity):
    """``Capacity`` whose kept pairs are not read from the counts: all of them (even routing)."""

    def __init__(self, played: Capacity) -> None:
        super().__init__(played.factor, pad=played.pad, gather=played.gather, group_size=played.group_size,
                         senders=played.senders)

    def kept_rows(self, counts: torch.Tensor, num_pairs: int) -> int:
        return num_pairs


def play_experts(experts: GroupedExperts, load: float = 1.0) -> None:
    """The engine's ``play_experts`` for the simulation: in place, on each MoE layer's experts; ``load``: the
    heaviest ep rank's pairs over its even share (``Layout.moe_rank_load``)."""
    if isinstance(experts.kernel, ExpertLoop):
        experts.kernel = EvenExpertLoop(experts.kernel.linear, experts.kernel.align)
    if isinstance(experts.dispatch, ExpertParallel):
        experts.dispatch = EvenExpertParallel(experts.dispatch, load)
    if experts.capacity is not None:
        experts.capacity = EvenCapacity(experts.capacity)
