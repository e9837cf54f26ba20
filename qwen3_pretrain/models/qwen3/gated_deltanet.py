"""Gated DeltaNet, the linear-attention layer of the Qwen3.5 and Qwen3-Next hybrids, in plain torch.

Per token: project q, k, v (and the output gate z, the write strength b, the
decay input a); run q, k, v through a depthwise causal convolution (kernel 4)
and SiLU; L2-normalise q and k; then the gated delta rule (models/ops/gated_delta.py,
or a device's kernel: delta_rule.py) updates a [key_dim, value_dim] state per
value head, decayed by ``exp(g)`` with ``g = -exp(A_log) * softplus(a + dt_bias)``
and written with strength ``beta = sigmoid(b)``; its read-out goes through a
gated RMSNorm (``weight * norm(o) * silu(z)``) and ``out_proj``.

Under context parallelism (``split``, model.py: ``HeadSplit``) a rank holds a share of the sequence: the
layer projects its own tokens, then trades them (one all-to-all) for the whole sequence of its share of the
heads, runs the convolution and the delta rule on those, and trades the outputs back (Megatron's scheme):
exact, each rank doing 1 / cp of the work.

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
from torch.utils.checkpoint import checkpoint

from qwen3_pretrain.models.ops.causal_conv import causal_conv1d
from qwen3_pretrain.models.ops.delta_rule import DeltaRuleKernel, TorchDeltaRule
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
    """``split``: the cp split (model.py: ``HeadSplit``), None without context parallelism; ``kernel``: the
    delta rule's (models/ops/delta_rule.py), ours in plain torch when None; ``recompute``: the delta rule runs
    again in backward (selective recompute)."""

    def __init__(self, cfg: Qwen3Config, linear: type[nn.Linear] = nn.Linear, split=None,
                 kernel: DeltaRuleKernel | None = None, recompute: bool = False) -> None:
        super().__init__()
        # the delta rule keeps only its inputs and runs again in backward (selective recompute, as attention's
        # kernel call): its fp32 chunk terms are most of what the layer keeps
        self.recompute = recompute
        self.kernel = kernel or TorchDeltaRule()  # models/ops/delta_rule.py, chosen for the device
        # context parallelism (model.py: HeadSplit): the sequence's tokens traded for heads and back
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
        bsz, seq, _ = x.shape
        q, k, v, z, b, a = self.project(x)
        q, k = q.view(bsz, seq, -1, self.dk), k.view(bsz, seq, -1, self.dk)
        v, b, a = v.view(bsz, seq, -1, self.dv), b.unsqueeze(-1), a.unsqueeze(-1)  # [batch, seq, heads, ...]
        conv, a_log, dt_bias = self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias
        if self.split is not None:  # context parallelism: this rank's heads over the whole sequence
            q, k, v, b, a = (self.split.to_heads(t) for t in (q, k, v, b, a))
            conv, a_log, dt_bias = self._rank_parameters(q.shape[2], v.shape[2])
        out = self.mix(q, k, v, b.squeeze(-1), a.squeeze(-1), conv, a_log, dt_bias, starts)
        if self.split is not None:
            out = self.split.to_sequence(out)
        out = self.norm(out, z.view(bsz, seq, -1, self.dv))
        return self.out_proj(out.reshape(bsz, seq, -1))

    def mix(self, q, k, v, b, a, conv: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
            starts: torch.Tensor | None) -> torch.Tensor:
        """The convolution and the gated delta rule over heads ``q``, ``k`` [batch, seq, key heads, dk], ``v``
        [batch, seq, value heads, dv], ``b``, ``a`` [batch, seq, value heads] with those heads' ``conv`` rows
        ([q | k | v] channels) and decay parameters -> [batch, seq, value heads, dv]."""
        shapes = [t.shape for t in (q, k, v)]
        # q, k and v share one convolution, channel-concatenated as the weight is laid out: [q | k | v].
        qkv = causal_conv1d(torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1), conv, starts=starts)
        q, k, v = (t.view(shape) for t, shape in zip(qkv.split([s[2] * s[3] for s in shapes], dim=-1), shapes))
        beta = b.sigmoid()
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)  # log decay, <= 0
        if self.recompute:
            return checkpoint(self.kernel, q, k, v, g, beta, starts, use_reentrant=False)
        return self.kernel(q, k, v, g, beta, starts)

    def _rank_parameters(self, key_heads: int, value_heads: int) -> tuple[torch.Tensor, ...]:
        """The convolution rows and decay parameters of this cp rank's ``key_heads`` and ``value_heads`` (the
        rank's contiguous share of each)."""
        rank, size = self.split.rank, self.split.size
        conv = self.conv1d.weight.squeeze(1)
        q_rows = key_heads * self.dk  # per rank; the weight's rows are [q | k | v] of all heads
        v_rows = value_heads * self.dv
        rows = [conv[rank * q_rows:(rank + 1) * q_rows],
                conv[(size + rank) * q_rows:(size + rank + 1) * q_rows],
                conv[2 * size * q_rows + rank * v_rows:2 * size * q_rows + (rank + 1) * v_rows]]
        heads = slice(rank * value_heads, (rank + 1) * value_heads)
        return torch.cat(rows), self.A_log[heads], self.dt_bias[heads]

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
