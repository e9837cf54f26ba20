"""Which gated-delta-rule kernel a Gated DeltaNet layer runs, chosen when the model is built (as attention's).

``TorchDeltaRule``: this project's chunked rule in plain torch (gated_delta.py), exact on packed documents;
every device, the reference of the tests. ``FlaDeltaRule``: flash-linear-attention's Triton kernel
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``; CUDA, and NPUs through its Ascend backend), an
optional dependency, never needed on a CPU; packed documents reach it as ``cu_seqlens`` over the batch
flattened into one row, its variable-length mode. ``bench/device_check.sh`` compares the two on a device.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule


class DeltaRuleKernel(Protocol):
    """``q``, ``k`` [batch, seq, k_heads, dk] (L2-normalised inside), ``v`` [batch, seq, v_heads, dv], ``g``
    (log decay) and ``beta`` [batch, seq, v_heads], ``starts`` [batch, seq] (bool, where documents begin; None:
    each row one sequence) -> [batch, seq, v_heads, dv]."""

    name: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 starts: torch.Tensor | None) -> torch.Tensor: ...


class TorchDeltaRule:
    name = "torch"

    def __call__(self, q, k, v, g, beta, starts):
        return chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, use_qk_l2norm=True)[0]


class FlaDeltaRule:
    name = "fla"

    def __call__(self, q, k, v, g, beta, starts):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        batch, seq, v_heads = v.shape[:3]
        group = v_heads // q.shape[2]
        if group > 1:  # each key head serves consecutive value heads
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        flat = [t.reshape(1, batch * seq, *t.shape[2:]) for t in (q, k, v, g, beta)]
        out, _ = fla_chunk(*flat, cu_seqlens=cu_seqlens(starts, batch, seq, q.device), use_qk_l2norm_in_kernel=True)
        return out.view(batch, seq, v_heads, -1)


def cu_seqlens(starts: torch.Tensor | None, batch: int, seq: int, device: torch.device | None = None
               ) -> torch.Tensor:
    """The offsets (int32, from 0 to batch * seq, on ``device``) of the sequences of a batch flattened into one
    row: every row starts one, and so does every document start."""
    first = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    first[:, 0] = True
    if starts is not None:
        first |= starts.to(first.device)
    bounds = first.flatten().nonzero().flatten()
    end = torch.tensor([batch * seq], device=bounds.device)
    return torch.cat([bounds, end]).to(torch.int32)


def delta_rule_kernel(device_type: str) -> DeltaRuleKernel:
    """flash-linear-attention's kernel on a CUDA device or an NPU where it is installed, else ours."""
    if device_type in ("cuda", "npu") and importlib.util.find_spec("fla") is not None:
        return FlaDeltaRule()
    return TorchDeltaRule()
