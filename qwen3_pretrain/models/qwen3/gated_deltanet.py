"""Gated DeltaNet, the linear-attention layer of the Qwen3.5 and Qwen3-Next hybrids, in plain torch.

Per token: project q, k, v (and the output gate z, the write strength b, the
decay input a); run q, k, v through a depthwise causal convolution (kernel 4)
and SiLU; L2-normalise q and k; then the gated delta rule
(models/ops/gated_delta.py) updates a [key_dim, value_dim] state per value head,
decayed by ``exp(g)`` with ``g = -exp(A_log) * softplus(a + dt_bias)`` and
written with strength ``beta = sigmoid(b)``; its read-out goes through a gated
RMSNorm (``weight * norm(o) * silu(z)``) and ``out_proj``.

Exact on packed documents: ``starts`` (where positions restart at 0) restarts
the state at zero and hides the previous document from the convolution, so a
packed row computes each document as if it ran alone.

Two layouts of the input projections, each read and written under its own
names: Qwen3.5's four (``in_proj_qkv`` = [q | k | v], ``in_proj_z``,
``in_proj_b``, ``in_proj_a``) and Qwen3-Next's two fused ones, grouped per key
head (``in_proj_qkvz``: for each key head its q, k, then its value heads' v and
z; ``in_proj_ba``: for each key head its value heads' b then a). The layer
computes in the unfused order. Head counts come from the projected shapes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qwen3_pretrain.models.ops.causal_conv import causal_conv1d
from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule
from qwen3_pretrain.models.qwen3.config import Qwen3Config


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * silu(z)`` over the last dim, as transformers' ``Qwen3_5RMSNormGated``: normalized
    in fp32, cast back before the weight, the gate applied in fp32, the result in ``x``'s dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen3Config, linear: type[nn.Linear] = nn.Linear, split=None) -> None:
        super().__init__()
        # context parallelism (model.py: SequenceSplit): the layer runs on the whole sequence, gathered
        self.split = split
        h = cfg.hidden_size
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.group = cfg.linear_num_value_heads // cfg.linear_num_key_heads  # value heads per key head
        self.fused = cfg.fused_linear_projections
        key_dim, value_dim, heads = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        if self.fused:
            self.in_proj_qkvz = linear(h, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = linear(h, 2 * heads, bias=False)
        else:
            self.in_proj_qkv = linear(h, 2 * key_dim + value_dim, bias=False)
            self.in_proj_z = linear(h, value_dim, bias=False)
            self.in_proj_b = linear(h, heads, bias=False)
            self.in_proj_a = linear(h, heads, bias=False)
        conv_dim = 2 * key_dim + value_dim
        # nn.Conv1d's layout [channels, 1, kernel] (HF's name and shape); applied channel-last, causally.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = linear(value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [batch, seq, hidden]; ``starts`` [batch, whole seq] (bool): where packed documents begin."""
        if self.split is not None:
            x = self.split.gather(x)
        bsz, seq, _ = x.shape
        q, k, v, z, b, a = self.project(x)
        # q, k and v share one convolution, channel-concatenated as the weight is laid out: [q | k | v].
        qkv = causal_conv1d(torch.cat([q, k, v], dim=-1), self.conv1d.weight.squeeze(1), starts=starts)
        q, k, v = qkv.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
        q, k = q.view(bsz, seq, -1, self.dk), k.view(bsz, seq, -1, self.dk)
        v = v.view(bsz, seq, -1, self.dv)  # [batch, seq, value heads, dv]
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log decay, <= 0
        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, use_qk_l2norm=True)
        out = self.norm(out, z.view(bsz, seq, -1, self.dv)).reshape(bsz, seq, -1)
        if self.split is not None:
            out = self.split.local(out)
        return self.out_proj(out)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v, z [batch, seq, local width] and b, a [batch, seq, local value heads], in the head order
        of the unfused layout whichever layout the weights have."""
        if not self.fused:
            q, k, v = self.in_proj_qkv(x).split(self._qkv_split(), dim=-1)
            return q, k, v, self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        bsz, seq, _ = x.shape
        per_key_head = 2 * self.dk + 2 * self.group * self.dv
        qkvz = self.in_proj_qkvz(x).view(bsz, seq, -1, per_key_head)  # [batch, seq, key heads, ...]
        q, k, v, z = qkvz.split([self.dk, self.dk, self.group * self.dv, self.group * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, seq, -1, 2 * self.group).split(self.group, dim=-1)
        return tuple(t.reshape(bsz, seq, -1) for t in (q, k, v, z, b, a))

    def _qkv_split(self) -> list[int]:
        """The widths of q, k and v in ``in_proj_qkv``'s (local) output: key heads * dk twice, then their
        value heads * dv."""
        rows = self.in_proj_qkv.weight.shape[0]
        key_heads = rows // (2 * self.dk + self.group * self.dv)
        return [key_heads * self.dk, key_heads * self.dk, key_heads * self.group * self.dv]

    @staticmethod
    def init_a_log(num_heads: int, generator: torch.Generator) -> torch.Tensor:
        """``log(A)`` with ``A`` uniform in [1, 16] as the releases' recipe (decay rates spread over heads)."""
        return torch.empty(num_heads).uniform_(1, 16, generator=generator).log()


def conv_init_bound(kernel: int) -> float:
    """A depthwise convolution's default init bound (PyTorch's: fan-in = kernel)."""
    return 1.0 / math.sqrt(kernel)
