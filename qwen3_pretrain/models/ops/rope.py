"""Rotary position embedding (RoPE), as transformers' Qwen3 and Qwen3.5 apply it: the tables in fp32, cast to
the activations' dtype, and the "rotate half" layout (the first half of each head's rotated dims pairs with
the second half). A partial rotary (the hybrids) rotates only the first ``rotary_dim`` dims of each head.

``apply_rope`` is the reference and every device's kernel but the NPU's (models/ops/elementwise.py chooses);
written with autograd's operators it keeps for backward only ``cos`` and ``sin``, which every layer shares.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for ``positions`` [batch, seq] -> two [batch, 1, seq, head_dim] tensors; each holds its
    frequencies twice ([f | f]), which the NPU kernel's backward relies on (``elementwise.py``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [batch, seq, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head of ``x`` [batch, heads, seq, head_dim]; the
    rest pass through (partial RoPE)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
