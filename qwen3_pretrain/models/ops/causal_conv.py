"""The short depthwise causal convolution in front of Qwen3.5 / Qwen3-Next linear-attention layers, on packed
documents.

Token ``t`` of channel ``c`` gets ``sum_j weight[c, j] * x[t - (width - 1) + j, c]`` (the current token meets
the last tap, as in ``F.conv1d`` with left padding), then SiLU. A token never sees the previous document:
taps that would reach before its document's first token read zeros, exactly as if the document were run
alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _tokens_since_start(starts: torch.Tensor, width: int) -> torch.Tensor:
    """For each token, how many tokens back its document began ([batch, seq] int); ``width - 1`` for tokens
    whose whole window lies in their document, including those before the row's first start (they continue
    the document of the prefix)."""
    index = torch.arange(starts.shape[1], device=starts.device)
    last_start = torch.where(starts.bool(), index, -1).cummax(dim=1).values
    return torch.where(last_start >= 0, index - last_start, width - 1).clamp(max=width - 1)


def _depthwise(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[batch, channels, width - 1 + seq] -> [batch, channels, seq], no padding of its own."""
    return F.conv1d(padded, weight[:, None, :], groups=weight.shape[0])


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    starts: torch.Tensor | None = None,
    prefix: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` [batch, seq, channels] (channels last) with ``weight``
    [channels, width] (``conv1d.weight.squeeze(1)``, no bias), then ``activation`` ("silu" or None).

    ``starts`` (bool [batch, seq]) marks the first token of each document; the tokens of a document never
    see the tokens before it. ``prefix`` [batch, width - 1, channels] is what came before the first token
    (the previous context-parallel rank's last tokens; zeros when None) and reaches only the tokens before
    the row's first start. Computes in ``weight``'s dtype and returns ``x``'s, as transformers'
    ``causal_conv1d_fn`` does; differentiable w.r.t. x, weight and prefix.
    """
    batch, seq, channels = x.shape
    width = weight.shape[-1]
    if prefix is None:
        prefix = x.new_zeros(batch, width - 1, channels)
    padded = torch.cat([prefix.to(x.dtype), x], dim=1).to(weight.dtype).transpose(1, 2)
    out = _depthwise(padded, weight)  # [batch, channels, seq]
    if starts is not None:
        since = _tokens_since_start(starts, width)[:, None, :]
        taps_back = torch.arange(width - 1, -1, -1, device=weight.device)  # how far back each tap reaches
        # a token d tokens into its document (d < width - 1) is the convolution with the taps that reach
        # further back than d zeroed: a few whole-sequence convolutions, kept only at those tokens, rather
        # than gathering the tokens near starts (a host sync and a data-dependent shape)
        for d in range(width - 1):
            truncated = _depthwise(padded, weight * (taps_back <= d))
            out = torch.where(since == d, truncated, out)
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return out.transpose(1, 2).to(x.dtype)
