"""The chunked gated delta rule and the causal convolution of Qwen3.5 linear-attention layers equal
transformers' own references (the token-by-token recurrence, ``causal_conv1d_fn``) run on each packed
document alone, in values and in gradients; and a sequence cut in two, the first piece's final state
(or last tokens) handed to the second, equals the whole (what context parallelism relies on)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_recurrent_gated_delta_rule

from qwen3_pretrain.models.ops.causal_conv import causal_conv1d
from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule, document_starts

DIM = 16


def _starts(batch: int, seq: int, rows: list[list[int]]) -> torch.Tensor:
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    for row, positions in enumerate(rows):
        starts[row, positions] = True
    return starts


def _inputs(batch, seq, k_heads=2, v_heads=4, seed=0, normalized=True):
    """q, k, v, g, beta, initial state with Qwen3.5's magnitudes, as leaves that require grad.

    g = -exp(A_log) * softplus(a + dt_bias) with A spread from slow heads (state kept over hundreds of
    tokens) to fast ones (forgotten within a few), beta = sigmoid(b); q and k l2-normalized unless the
    kernel is to do it.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, k_heads, DIM, generator=gen)
    k = torch.randn(batch, seq, k_heads, DIM, generator=gen)
    if normalized:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    v = torch.randn(batch, seq, v_heads, DIM, generator=gen)
    a_log = torch.linspace(math.log(1e-3), math.log(16.0), v_heads)
    a = torch.randn(batch, seq, v_heads, generator=gen)
    dt_bias = torch.randn(v_heads, generator=gen) * 0.5
    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    beta = torch.randn(batch, seq, v_heads, generator=gen).sigmoid()
    state = torch.randn(batch, v_heads, DIM, DIM, generator=gen) * 0.5
    return [x.clone().requires_grad_() for x in (q, k, v, g, beta, state)]


def _reference(q, k, v, g, beta, state, starts, use_qk_l2norm):
    """transformers' token-by-token recurrence, run on each document alone; the row's first document
    continues ``state`` unless the row begins with a start."""
    outs, finals = [], []
    for row in range(q.shape[0]):
        seq = q.shape[1]
        cuts = [0] + [t for t in starts[row].nonzero().flatten().tolist() if t > 0] + [seq]
        pieces = []
        for lo, hi in zip(cuts, cuts[1:]):
            continues = lo == 0 and not starts[row, 0] and state is not None
            out, final = torch_recurrent_gated_delta_rule(
                *(x[row:row + 1, lo:hi] for x in (q, k, v, g, beta)),
                initial_state=state[row:row + 1] if continues else None,
                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
            pieces.append(out)
        outs.append(torch.cat(pieces, dim=1))
        finals.append(final)
    return torch.cat(outs), torch.cat(finals)


def _loss_grads(out, final, leaves, seed=1):
    """Gradients of a fixed random linear function of the output and the final state."""
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen)).sum() + (final * torch.randn(final.shape, generator=gen)).sum()
    return torch.autograd.grad(loss, [x for x in leaves if x is not None], allow_unused=True)


def _assert_close(actual, expected, tol=1e-5, what=""):
    """Absolute tolerance, relative to the largest entry where entries exceed 1."""
    assert torch.isfinite(actual).all(), what
    err = (actual - expected).abs().max().item()
    assert err <= tol * max(1.0, expected.abs().max().item()), f"{what}: max error {err:.3g}"


# (rows' document starts, seq, chunk size): starts at a chunk edge (16, 32), inside a chunk (40, 23),
# one-token documents (40, 24, 99 = the last token), a row that does not begin with a start (it continues
# the initial state), seq not a multiple of the chunk
CASES = {
    "no-documents": ([[], []], 100, 16),
    "documents": ([[0, 32, 40, 41, 77], [16, 23, 24, 25, 99]], 100, 16),
    "documents-chunk-32": ([[0, 32, 40, 41, 77], [16, 23, 24, 25, 99]], 100, 32),
    "documents-long": ([[0, 64, 150], [7, 100]], 203, 64),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("with_state", [True, False])
def test_chunked_equals_recurrence_per_document(case, with_state):
    rows, seq, chunk = CASES[case]
    starts = _starts(2, seq, rows)
    q, k, v, g, beta, state = _inputs(2, seq, normalized=False)
    state = state if with_state else None
    leaves = [q, k, v, g, beta, state]

    out, final = chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, initial_state=state,
                                        chunk_size=chunk, use_qk_l2norm=True)
    ref_out, ref_final = _reference(q, k, v, g, beta, state, starts, use_qk_l2norm=True)
    _assert_close(out, ref_out, what="output")
    _assert_close(final, ref_final, what="final state")

    grads = _loss_grads(out, final, leaves)
    ref_grads = _loss_grads(ref_out, ref_final, leaves)
    for name, got, want in zip("q k v g beta state".split(), grads, ref_grads):
        _assert_close(got, want, what=f"grad {name}")


def test_equal_heads_custom_scale_and_prenormalized():
    """k_heads == v_heads, q/k normalized by the caller and a scale other than dk ** -0.5 (the reference
    always scales by dk ** -0.5, so it gets q pre-multiplied by the ratio)."""
    starts = _starts(1, 70, [[0, 20, 21]])
    q, k, v, g, beta, state = _inputs(1, 70, k_heads=3, v_heads=3, seed=3)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, scale=0.1, chunk_size=16)
    ref_out, ref_final = _reference(q * 0.1 * DIM ** 0.5, k, v, g, beta, None, starts, use_qk_l2norm=False)
    _assert_close(out, ref_out, what="output")
    _assert_close(final, ref_final, what="final state")


@pytest.mark.parametrize("cut", [70, 64, 90])
def test_split_sequence_passes_state(cut):
    """Pieces chained by their final states equal the whole, forward and backward; the cut falls inside a
    chunk and a document (70), at a chunk edge (64), and just before a document's start (90)."""
    seq = 150
    starts = _starts(2, seq, [[0, 40, 91], [55, 120]])
    q, k, v, g, beta, state = _inputs(2, seq, seed=2)
    leaves = [q, k, v, g, beta, state]
    whole, whole_final = chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, initial_state=state, chunk_size=32)

    first, mid_state = chunk_gated_delta_rule(*(x[:, :cut] for x in (q, k, v, g, beta)), starts=starts[:, :cut],
                                              initial_state=state, chunk_size=32)
    second, final = chunk_gated_delta_rule(*(x[:, cut:] for x in (q, k, v, g, beta)), starts=starts[:, cut:],
                                           initial_state=mid_state, chunk_size=32)
    pieces = torch.cat([first, second], dim=1)
    _assert_close(pieces, whole, what="output")
    _assert_close(final, whole_final, what="final state")
    for name, got, want in zip("q k v g beta state".split(), _loss_grads(pieces, final, leaves),
                               _loss_grads(whole, whole_final, leaves)):
        _assert_close(got, want, what=f"grad {name}")


def test_strong_decay_stays_finite_and_precise():
    """Decays far beyond the exponent range (g down to -1e4 in a token) give no inf or nan, in values or
    gradients; and a document of such decays does not blur the small decays of the next document in the
    same chunk (a cumulative sum across the boundary would reach -1e4, where fp32 steps are ~1e-3)."""
    starts = _starts(1, 48, [[0, 10, 30]])
    q, k, v, g, beta, _ = _inputs(1, 48, seed=4)
    g = g.detach() * torch.tensor([1.0, 1.0, 100.0, 1000.0])
    g[:, :10] = -1e3
    g = g.clamp(min=-1e4).requires_grad_()
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, chunk_size=48)
    grads = _loss_grads(out, final, [q, k, v, g, beta])
    assert all(torch.isfinite(x).all() for x in (out, final, *grads))
    ref_out, ref_final = _reference(q, k, v, g, beta, None, starts, use_qk_l2norm=False)
    _assert_close(out, ref_out, what="output")
    for name, got, want in zip("q k v g beta".split(), grads, _loss_grads(ref_out, ref_final, [q, k, v, g, beta])):
        _assert_close(got, want, what=f"grad {name}")


def test_document_starts_from_positions():
    positions = torch.tensor([[5, 6, 0, 1, 2, 0, 0], [0, 1, 2, 3, 0, 1, 2]])
    expected = _starts(2, 7, [[2, 5, 6], [0, 4]])
    assert torch.equal(document_starts(positions), expected)


def test_bf16_inputs_give_bf16_output_and_fp32_state():
    q, k, v, g, beta, state = (x.detach() for x in _inputs(1, 20, seed=5))
    out, final = chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(),
                                        initial_state=state, chunk_size=16)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32


# -- causal convolution -----------------------------------------------------------------------------------

WIDTH, CHANNELS = 4, 6


def _conv_inputs(batch, seq, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen) * 0.5
    prefix = torch.randn(batch, WIDTH - 1, CHANNELS, generator=gen)
    return [t.requires_grad_() for t in (x, weight, prefix)]


def _conv_reference(x, weight, starts, prefix):
    """transformers' ``causal_conv1d_fn`` (channels first) on each document alone; the row's first document
    has ``prefix`` before it unless the row begins with a start."""
    rows = []
    for row in range(x.shape[0]):
        cuts = [0] + [t for t in starts[row].nonzero().flatten().tolist() if t > 0] + [x.shape[1]]
        pieces = []
        for lo, hi in zip(cuts, cuts[1:]):
            doc = x[row:row + 1, lo:hi]
            before = 0
            if lo == 0 and not starts[row, 0] and prefix is not None:
                doc, before = torch.cat([prefix[row:row + 1], doc], dim=1), WIDTH - 1
            out = causal_conv1d_fn(doc.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
            pieces.append(out[:, before:])
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


@pytest.mark.parametrize("with_prefix", [True, False])
def test_conv_equals_per_document_reference(with_prefix):
    # one-token documents (5, 9), two adjacent starts (1, 2), a start at the last token
    starts = _starts(2, 30, [[0, 5, 6, 9, 20], [1, 2, 12, 29]])
    x, weight, prefix = _conv_inputs(2, 30)
    prefix = prefix if with_prefix else None
    out = causal_conv1d(x, weight, starts=starts, prefix=prefix)
    ref = _conv_reference(x, weight, starts, prefix)
    _assert_close(out, ref, tol=1e-6, what="output")
    leaves = [x, weight, prefix]
    gen = torch.Generator().manual_seed(1)
    probe = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * probe).sum(), [t for t in leaves if t is not None])
    ref_grads = torch.autograd.grad((ref * probe).sum(), [t for t in leaves if t is not None])
    for name, got, want in zip(["x", "weight", "prefix"], grads, ref_grads):
        _assert_close(got, want, tol=1e-6, what=f"grad {name}")


def test_conv_without_documents_is_the_plain_convolution():
    x, weight, _ = _conv_inputs(2, 25, seed=2)
    out = causal_conv1d(x, weight)
    ref = causal_conv1d_fn(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
    _assert_close(out, ref, tol=1e-6, what="output")


def test_conv_prefix_equals_prepended_tokens():
    starts = _starts(2, 20, [[7], [0, 2]])
    x, weight, prefix = _conv_inputs(2, 20, seed=3)
    out = causal_conv1d(x, weight, starts=starts, prefix=prefix)
    longer = causal_conv1d(torch.cat([prefix, x], dim=1), weight,
                           starts=torch.cat([torch.zeros(2, WIDTH - 1, dtype=torch.bool), starts], dim=1))
    _assert_close(out, longer[:, WIDTH - 1:], tol=1e-6, what="output")
