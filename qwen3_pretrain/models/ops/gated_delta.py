"""The gated delta rule of Qwen3.5 / Qwen3-Next linear-attention layers, chunked, exact on packed documents.

Per value head the layer keeps a state ``S`` [dk, dv]. Token ``t`` first decays it, ``S *= exp(g_t)``, then
writes the part of ``v_t`` that ``S`` does not already predict, ``S += k_t beta_t (v_t - S^T k_t)^T``, and
reads ``o_t = S^T q_t``. Token by token that is a loop of ``seq`` small steps; here the sequence is cut into
chunks of ``chunk_size`` tokens and, within a chunk, the writes are found all at once: each token's
correction depends on the earlier tokens' corrections through a unit lower-triangular system (the UT
transform of DeltaNet), solved by one triangular solve per chunk. Only the state carried from chunk to chunk
is a sequential loop, of ``seq / chunk_size`` steps of matrix products.

Packed documents: ``starts`` marks where a document begins, and the state restarts at zero before that
token. Inside a chunk each token gets the index of its document counted from the chunk's start (0 for the
tokens continuing the document that was running when the chunk began). Decays are summed only over a
token's own document, so no boundary ever enters a sum, every pairwise decay across documents is masked to
zero *before* its exponential (no large negative sentinels, no ``inf * 0`` in backward), only the tokens of
document 0 read the carried state, and only the chunk's last document leaves a state for the next chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per chunk: flash-linear-attention's chunk too; the planner's FLOP and operator counts read it here.
CHUNK_SIZE = 64


def document_starts(positions: torch.Tensor) -> torch.Tensor:
    """Where packed documents begin, from position ids that restart at 0 at each document: ``positions == 0``.

    ``positions`` is [batch, seq]. A row whose first position is not 0 begins inside a document that started
    earlier (on a previous context-parallel rank, say): its first tokens continue the ``initial_state`` given to
    :func:`chunk_gated_delta_rule` rather than starting from zero.
    """
    return positions == 0


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # the epsilon sits inside the root, as in transformers' (and FLA's) l2norm, so values match theirs
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _masked_exp(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` where ``mask``, else 0. Masked entries are zeroed before the exponential: a positive
    difference of decays across a boundary would overflow to inf, and inf * 0 is nan in backward."""
    return torch.where(mask, torch.where(mask, x, 0.0).exp(), 0.0)


def _to_chunks(x: torch.Tensor, chunk_size: int, k_heads: int) -> torch.Tensor:
    """[batch, seq, heads, *rest] -> fp32 [chunks, batch, k_heads, heads // k_heads, chunk_size, *rest].

    The sequence is zero-padded to whole chunks: a padded token has beta = 0 and g = 0, so it writes nothing
    and decays nothing, and the final state is the one after the last real token. Head ``h`` lands at
    ``[h // group, h % group]``, so a key head's group is its consecutive value heads.
    """
    batch, seq, heads = x.shape[:3]
    rest = x.shape[3:]
    pad = (-seq) % chunk_size
    x = F.pad(x.float(), (0, 0) * len(rest) + (0, 0, 0, pad))
    x = x.reshape(batch, -1, chunk_size, k_heads, heads // k_heads, *rest)
    return x.permute(1, 0, 3, 4, 2, *range(5, x.dim())).contiguous()


def _documents_in_chunks(starts: torch.Tensor | None, batch: int, seq: int, chunk_size: int,
                         device: torch.device) -> torch.Tensor:
    """Each token's document index counted from its chunk's start: [chunks, batch, 1, 1, chunk_size] int.

    0 marks the tokens continuing the document that was running when the chunk began (they read the carried
    state); a start at the chunk's first token makes every token of the chunk 1 or more.
    """
    if starts is None:
        starts = torch.zeros(batch, seq, dtype=torch.long, device=device)
    starts = F.pad(starts.long(), (0, (-seq) % chunk_size))
    return starts.view(batch, -1, chunk_size).cumsum(-1).transpose(0, 1)[:, :, None, None, :]


def _unit_lower_inverse(system: torch.Tensor) -> torch.Tensor:
    """``(I + strictly_lower(system)) ** -1`` over any leading dims.

    Solving against the identity (chunk_size columns) and then multiplying is cheaper than solving against
    the values and keys (dv + dk columns), in backward too. The batch is flattened first: on CPU the solve
    over several batch dims takes a much slower path than the same solve over one.
    """
    flat = system.flatten(0, -3)
    eye = torch.eye(flat.shape[-1], dtype=flat.dtype, device=flat.device).expand_as(flat)
    return torch.linalg.solve_triangular(flat, eye, upper=False, unitriangular=True).view(system.shape)


def _chunk_terms(q, k, v, g, beta, doc):
    """The quantities of each chunk that do not depend on the carried state, all chunks at once.

    Inputs as :func:`_to_chunks` lays them out (q, k with a group axis of 1) and ``doc`` from
    :func:`_documents_in_chunks`. Returns ``u`` (the writes if the carried state were zero) and ``w`` (how the
    carried state changes them: the writes are ``u - w @ S``), the decayed causal ``attn`` within the chunk,
    ``q_carried`` and ``k_to_end`` (queries and keys decayed from / to the chunk's edges) and ``chunk_decay``
    (what is left of the carried state at the chunk's end: 0 if a document starts in the chunk).
    """
    size = g.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    same_doc = (doc[..., :, None] == doc[..., None, :]) & causal  # [.., i, j]: j <= i, in i's document
    # decay summed from the start of the token's document (or chunk) to the token, over that document only, in
    # fp64: after strong decays the sums are large (g = -300 over 32 tokens: -9600, where fp32's steps are
    # ~1e-3) while the differences between them that the pairs below need are small, so sums and differences
    # in fp32 blurred each later decay of the chunk by ~1e-3 (tests/test_delta_rule_precision.py); only this
    # [.., chunk] tensor and its differences are fp64, each cast back before its exponential
    cum = (g.double()[..., None, :] * same_doc).sum(-1)  # [chunks, batch, k_heads, group, chunk]
    pair = _masked_exp((cum[..., :, None] - cum[..., None, :]).float(), same_doc)  # decay from j's write to i
    carried = doc == 0
    from_start = _masked_exp(cum.float(), carried)

    ut = (k @ k.transpose(-1, -2)) * beta[..., :, None] * pair  # diagonal ignored: the solve is unitriangular
    inverse = _unit_lower_inverse(ut)
    u = inverse @ (v * beta[..., None])
    w = inverse @ (k * (beta * from_start)[..., None])

    attn = (q @ k.transpose(-1, -2)) * pair
    q_carried = q * from_start[..., None]
    in_last_doc = doc == doc[..., -1:]
    k_to_end = k * _masked_exp((cum[..., -1:] - cum).float(), in_last_doc)[..., None]
    chunk_decay = _masked_exp(cum[..., -1:].float(), carried[..., -1:])  # [chunks, batch, k_heads, group, 1]
    return u, w, attn, q_carried, k_to_end, chunk_decay


def _scan(u, w, k_to_end, chunk_decay, state):
    """Carries the state from chunk to chunk (the only sequential part).

    Returns the state entering each chunk [chunks, batch, k_heads, group, dk, dv], each chunk's corrected
    writes [chunks, batch, k_heads, group, chunk, dv] and the state after the last chunk.
    """
    entering, writes = [], []
    # unbind, not indexing in the loop: indexing's backward would build a full-size gradient per chunk
    for u_n, w_n, k_n, decay_n in zip(u.unbind(0), w.unbind(0), k_to_end.unbind(0), chunk_decay.unbind(0)):
        entering.append(state)
        writes_n = u_n - w_n @ state
        writes.append(writes_n)
        state = state * decay_n[..., None] + k_n.transpose(-1, -2) @ writes_n
    return torch.stack(entering), torch.stack(writes), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    starts: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over packed documents, computed in fp32 by chunks; differentiable.

    q, k: [batch, seq, k_heads, dk]; v: [batch, seq, v_heads, dv]; g (log decay, <= 0) and beta:
    [batch, seq, v_heads]. Each key head serves ``v_heads // k_heads`` consecutive value heads. ``starts``
    (bool [batch, seq], see :func:`document_starts`) marks the first token of each document: the state is zero
    before it. ``initial_state`` [batch, v_heads, dk, dv] is the state before the first token and reaches only
    the tokens before the row's first start. ``scale`` multiplies the queries (default ``dk ** -0.5``), after
    the l2 normalization of q and k if ``use_qk_l2norm``.

    Returns the output [batch, seq, v_heads, dv] in q's dtype and the fp32 state after the last token
    [batch, v_heads, dk, dv], which a following piece of the same sequence takes as its ``initial_state``.
    """
    batch, seq, k_heads, dk = k.shape
    v_heads, dv = v.shape[-2:]
    if v_heads % k_heads:
        raise ValueError(f"v_heads ({v_heads}) must be a multiple of k_heads ({k_heads})")
    out_dtype = q.dtype
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (dk ** -0.5 if scale is None else scale)

    q, k, v, g, beta = (_to_chunks(x, chunk_size, k_heads) for x in (q, k, v, g, beta))
    doc = _documents_in_chunks(starts, batch, seq, chunk_size, q.device)
    u, w, attn, q_carried, k_to_end, chunk_decay = _chunk_terms(q, k, v, g, beta, doc)

    group = v_heads // k_heads
    if initial_state is None:
        state = q.new_zeros(batch, k_heads, group, dk, dv)
    else:
        state = initial_state.float().reshape(batch, k_heads, group, dk, dv)
    entering, writes, state = _scan(u, w, k_to_end, chunk_decay, state)

    out = q_carried @ entering + attn @ writes  # [chunks, batch, k_heads, group, chunk, dv]
    out = out.permute(1, 0, 4, 2, 3, 5).reshape(batch, -1, v_heads, dv)[:, :seq]
    return out.to(out_dtype), state.reshape(batch, v_heads, dk, dv)
