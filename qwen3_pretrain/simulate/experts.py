"""The target device's MoE expert kernel, played on fake tensors for the scale simulation.

A fake tensor has shapes, not values, so a kernel that reads how many tokens
each expert received (the per-expert loop: one matmul per expert) cannot run
as built. The simulation plays it with the tokens split evenly over the
experts (the round-robin routing of a benchmark run): the same tensors, of the
same total size, are kept for backward, which is what memory depends on. The
grouped kernel reads no counts and runs as built.
"""

from __future__ import annotations

import torch

from qwen3_pretrain.models.ops.moe import ExpertLoop, ExpertsKernel


class EvenExpertLoop(ExpertLoop):
    """``ExpertLoop`` with the tokens split evenly over the experts instead of read from the counts."""

    def sizes(self, counts: torch.Tensor, num_tokens: int) -> list[int]:
        experts = counts.shape[0]
        return [num_tokens // experts + (e < num_tokens % experts) for e in range(experts)]


def play_experts(kernel: ExpertsKernel) -> ExpertsKernel:
    """The engine's ``play_experts`` for the simulation."""
    return EvenExpertLoop(kernel.linear) if isinstance(kernel, ExpertLoop) else kernel
