"""The chunked gated delta rule after strong decay, against a token-by-token recurrence in fp64.

Within a chunk the rule works with each token's decay summed from its document's start (``cum``) and takes
differences of those sums for the decay between two tokens. After strong decays the sums are large (g = -300
over 32 tokens: -9600, where fp32's steps are ~1e-3) while the differences that matter are small, so sums
accumulated in fp32 blurred every later decay of the chunk by ~1e-3 (an output error of 1.25e-3 measured;
transformers' chunked reference 4.6e-4). The sums are accumulated in fp64 and the differences taken there.
The reference here is written independently of both (a plain loop in fp64).
"""

from __future__ import annotations

import pytest
import torch

from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule

DK, DV = 16, 16


def _recurrence_fp64(q, k, v, g, beta, starts):
    """The rule token by token in fp64: per value head ``S *= exp(g)``, ``S += k beta (v - S^T k)^T``,
    ``o = S^T q`` (q already scaled, q and k already normalized); the state restarts at each start."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    batch, seq, k_heads, _ = q.shape
    v_heads = v.shape[2]
    group = v_heads // k_heads
    out = torch.zeros(batch, seq, v_heads, DV, dtype=torch.float64)
    for b in range(batch):
        for h in range(v_heads):
            state = torch.zeros(DK, DV, dtype=torch.float64)
            for t in range(seq):
                if starts is not None and starts[b, t]:
                    state = torch.zeros_like(state)
                kt, qt = k[b, t, h // group], q[b, t, h // group]
                state = state * g[b, t, h].exp()
                state = state + beta[b, t, h] * torch.outer(kt, v[b, t, h] - state.T @ kt)
                out[b, t, h] = state.T @ qt
    return out


def _inputs(seq: int, strong: list[tuple[int, int]], k_heads=1, v_heads=2, seed=0, strength=-300.0):
    """Normalized q, k (q scaled), v, beta = sigmoid, small decays (g in [-0.1, 0]) except ``strength`` on the
    token ranges ``strong``: the state is wiped there, then decays slowly again."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, seq, k_heads, DK, generator=gen), dim=-1)
            for _ in range(2))
    q = q * DK ** -0.5
    v = torch.randn(1, seq, v_heads, DV, generator=gen)
    g = -0.1 * torch.rand(1, seq, v_heads, generator=gen)
    for lo, hi in strong:
        g[:, lo:hi] = strength
    beta = torch.randn(1, seq, v_heads, generator=gen).sigmoid()
    return q, k, v, g, beta


def _error(seq, strong, starts=None, **kwargs) -> float:
    q, k, v, g, beta = _inputs(seq, strong, **kwargs)
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, scale=1.0, chunk_size=64)
    return (out.double() - _recurrence_fp64(q, k, v, g, beta, starts)).abs().max().item()


@pytest.mark.parametrize("strong", [[(0, 32)], [(0, 8), (20, 40)], [(5, 6), (10, 50)]])
def test_strong_decay_then_slow_decay_matches_fp64_recurrence(strong):
    """32 tokens at g = -300 (the cumulative decay reaches -9600), then the chunk's other tokens at small
    decays: the output equals the fp64 recurrence to fp32's precision (1.25e-3 with fp32 sums)."""
    assert _error(64, strong) < 2e-6


def test_strong_decay_across_chunks_and_documents():
    """Strong decays in several chunks of a longer sequence with documents starting inside chunks and at
    their edges, and two key heads serving four value heads."""
    seq = 160
    starts = torch.zeros(1, seq, dtype=torch.bool)
    starts[0, [0, 45, 64, 100]] = True
    assert _error(seq, [(3, 40), (70, 90), (110, 150)], starts, k_heads=2, v_heads=4, seed=1) < 2e-6


def test_gradients_after_strong_decay_match_fp64_recurrence():
    """The gradients of q, k, v, g and beta too (the fp64 sums' backward reaches g in fp64 and comes back in
    g's dtype)."""
    seq = 64
    leaves = [x.requires_grad_() for x in _inputs(seq, [(0, 32)], seed=2)]
    out, _ = chunk_gated_delta_rule(*leaves, scale=1.0, chunk_size=64)
    ref = _recurrence_fp64(*leaves, None)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * weight).sum(), leaves)
    want = torch.autograd.grad((ref * weight).sum(), leaves)
    for name, a, b in zip("q k v g beta".split(), got, want):
        assert a.dtype == torch.float32, name
        scale = max(1.0, b.abs().max().item())
        assert (a.double() - b).abs().max().item() < 2e-5 * scale, name
