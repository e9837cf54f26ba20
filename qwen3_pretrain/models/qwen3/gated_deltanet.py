"""Gated DeltaNet, the linear-attention layer of the Qwen3.5 and Qwen3-Next hybrids, in plain torch.

Per token: project q, k, v (and the output gate z, the write strength b, the
decay input a); run q, k, v through a depthwise causal convolution (kernel 4)
and SiLU; L2-normalise q and k; then the gated delta rule (models/ops/gated_delta.py,
or a device's kernel: delta_rule.py) updates a [key_dim, value_dim] state per
value head, decayed by ``exp(g)`` with ``g = -exp(A_log) * softplus(a + dt_bias)``
and written with strength ``beta = sigmoid(b)``; its read-out goes through a
gated RMSNorm (``weight * norm(o) * silu(z)``) and ``out_proj``.

The layer holds its [q | k | v] channels grouped per key head: for each key head its q, its k, then its value
heads' v (the rows of Qwen3.5's ``in_proj_qkv`` and of the convolution; ``hf_row_order`` maps them to the HF
files' [q of all heads | k of all heads | v of all heads]). So any contiguous share of the rows is a share of
the heads with everything they need, and tensor parallelism splits every parameter of the layer by heads
(the gated norm's weight, shared by the heads, aside) with plain row shards; the files keep HF's layout.

Under tensor or context parallelism (``split``, model.py: ``HeadSplit``) a rank runs a share of the heads.
Tensor parallelism: the projections are column-parallel, so a rank projects its heads of the whole sequence.
Context parallelism: a rank holds a share of the sequence; the layer projects its own tokens, then trades them
(two all-to-alls: [q | k | v], [b, a]) for the whole sequence of its share of the heads, runs the convolution and the delta rule on
those, and trades the outputs back (Megatron's scheme). Both are exact, each rank doing its share of the work;
under both, cp splits each tp rank's heads further.

Exact on packed documents: ``starts`` (where positions restart at 0) restarts
the state at zero and hides the previous document from the convolution, so a
packed row computes each document as if it ran alone.

Two layouts of the input projections, each read and written under its own
names: Qwen3.5's four (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``) and Qwen3-Next's two fused ones, grouped per key head in its
files already (``in_proj_qkvz``: for each key head its q, k, then its value
heads' v and z; ``in_proj_ba``: for each key head its value heads' b then a).
Head counts come from the projected shapes.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from qwen3_pretrain.models.ops.causal_conv import causal_conv1d
from qwen3_pretrain.models.ops.delta_rule import DeltaRuleKernel, TorchDeltaRule
from qwen3_pretrain.models.ops.precision import LinearChoice, projection
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
    """``split``: the heads' split over tp or cp ranks (model.py: ``HeadSplit``), None on one rank; ``kernel``: the
    delta rule's (models/ops/delta_rule.py), ours in plain torch when None; ``recompute``: the delta rule runs
    again in backward (selective recompute)."""

    def __init__(self, cfg: Qwen3Config, linear: LinearChoice = nn.Linear, split=None,
                 kernel: DeltaRuleKernel | None = None, recompute: bool = False) -> None:
        super().__init__()
        # the delta rule keeps only its inputs and runs again in backward (selective recompute, as attention's
        # kernel call): its fp32 chunk terms are most of what the layer keeps
        self.recompute = recompute
        self.kernel = kernel or TorchDeltaRule()  # models/ops/delta_rule.py, chosen for the device
        # tensor or context parallelism (model.py: HeadSplit): this rank's share of the heads
        self.split = split
        h = cfg.hidden_size
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.group = cfg.linear_num_value_heads // cfg.linear_num_key_heads  # value heads per key head
        self.fused = cfg.fused_linear_projections
        key_dim, value_dim, heads = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        if self.fused:
            self.in_proj_qkvz = projection(linear, "in_proj_qkvz", h, 2 * key_dim + 2 * value_dim)
            self.in_proj_ba = projection(linear, "in_proj_ba", h, 2 * heads)
        else:
            self.in_proj_qkv = projection(linear, "in_proj_qkv", h, 2 * key_dim + value_dim)
            self.in_proj_z = projection(linear, "in_proj_z", h, value_dim)
            self.in_proj_b = projection(linear, "in_proj_b", h, heads)
            self.in_proj_a = projection(linear, "in_proj_a", h, heads)
        conv_dim = 2 * key_dim + value_dim
        # nn.Conv1d's layout [channels, 1, kernel] (HF's name and shape); applied channel-last, causally.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = projection(linear, "out_proj", value_dim, h)

    def forward(self, x: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [batch, seq, hidden]; ``starts`` [batch, whole seq] (bool): where packed documents begin."""
        bsz, seq, _ = x.shape
        qkv, z, b, a = self.project(x)
        ba = torch.stack([b, a], dim=-1)  # [batch, seq, value heads, 2]: one trade under cp, not two
        conv, a_log, dt_bias = self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias
        if self.split is not None:  # this rank's heads (over the whole sequence under cp)
            qkv, ba = self.split.to_heads(qkv), self.split.to_heads(ba)
            conv, a_log, dt_bias = (self.split.rank_rows(t) for t in (conv, a_log, dt_bias))
        out = self.mix(qkv, ba[..., 0], ba[..., 1], conv, a_log, dt_bias, starts)
        if self.split is not None:
            out = self.split.to_sequence(out)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(bsz, seq, -1))

    def mix(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor, a_log: torch.Tensor,
            dt_bias: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
        """The convolution and the gated delta rule over heads: ``qkv`` [batch, seq, key heads, 2 dk + group
        dv] (per key head its q, k and value heads' v), ``b``, ``a`` [batch, seq, value heads], with those
        heads' ``conv`` rows and decay parameters -> [batch, seq, value heads, dv]."""
        bsz, seq, key_heads, width = qkv.shape
        widths = [self.dk, self.dk, self.group * self.dv]
        # convolved as [q | k | v] of these heads, so that q, k and v are views of its output: the input and
        # the (small) weight reordered to that first (the convolution is per channel)
        x = torch.cat([t.flatten(2) for t in qkv.split(widths, dim=-1)], dim=-1)
        conv = torch.cat([t.flatten(0, 1) for t in conv.view(key_heads, width, -1).split(widths, dim=1)])
        mixed = causal_conv1d(x, conv, starts=starts)
        q, k, v = (t.view(bsz, seq, -1, d) for t, d in zip(mixed.split([key_heads * w for w in widths], dim=-1),
                                                              (self.dk, self.dk, self.dv)))
        beta = b.sigmoid()
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)  # log decay, <= 0
        if self.recompute:
            return checkpoint(self.kernel, q, k, v, g, beta, starts, use_reentrant=False)
        return self.kernel(q, k, v, g, beta, starts)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``qkv`` [batch, seq, local key heads, 2 dk + group dv] (grouped per key head), ``z`` [batch, seq,
        local value heads, dv], ``b``, ``a`` [batch, seq, local value heads], whichever layout the weights
        have."""
        bsz, seq, _ = x.shape
        qkv_width = 2 * self.dk + self.group * self.dv
        if not self.fused:
            qkv = self.in_proj_qkv(x).view(bsz, seq, -1, qkv_width)
            return qkv, self.in_proj_z(x).view(bsz, seq, -1, self.dv), self.in_proj_b(x), self.in_proj_a(x)
        qkvz = self.in_proj_qkvz(x).view(bsz, seq, -1, qkv_width + self.group * self.dv)
        qkv, z = qkvz.split([qkv_width, self.group * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, seq, -1, 2 * self.group).split(self.group, dim=-1)
        return qkv, z.reshape(bsz, seq, -1, self.dv), b.reshape(bsz, seq, -1), a.reshape(bsz, seq, -1)

    @staticmethod
    def init_a_log(num_heads: int, generator: torch.Generator) -> torch.Tensor:
        """``log(A)`` with ``A`` uniform in [1, 16], Megatron-core's range (decay rates spread over heads;
        transformers draws from [0, 16]: models/qwen3/init.py says why we keep Megatron's)."""
        return torch.empty(num_heads).uniform_(1, 16, generator=generator).log()


def hf_row_order(cfg: Qwen3Config) -> torch.Tensor:
    """For each row of the layer's [q | k | v] channels as it holds them (grouped per key head: its q, its k,
    its value heads' v), the row of the HF files' layout (q of all heads, then k, then v) it is: the order of
    the convolution's rows, and of Qwen3.5's ``in_proj_qkv``'s. (Shared between calls: not to be modified.)"""
    values = cfg.linear_num_value_heads // cfg.linear_num_key_heads * cfg.linear_value_head_dim
    return _row_order(cfg.linear_num_key_heads, cfg.linear_key_head_dim, values)


@functools.lru_cache(maxsize=8)
def _row_order(key_heads: int, dk: int, values: int) -> torch.Tensor:
    key_dim = key_heads * dk
    return torch.cat([torch.cat([torch.arange(h * dk, (h + 1) * dk), key_dim + torch.arange(h * dk, (h + 1) * dk),
                                 2 * key_dim + torch.arange(h * values, (h + 1) * values)])
                      for h in range(key_heads)])


def conv_init_bound(kernel: int) -> float:
    """A depthwise convolution's default init bound (PyTorch's: fan-in = kernel)."""
    return 1.0 / math.sqrt(kernel)
