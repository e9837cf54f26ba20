"""Attention kernels: causal self-attention, optionally kept within each packed document.

A kernel is chosen when the model is built, for the device it will run on
(``attention_kernel``), and used by every layer. It has two parts:

* ``prepare(positions, dtype)``, called once per forward by the model: turns the
  per-document positions [batch, seq] (a document starts where they restart at
  0) into what the kernel needs to mask across documents, shared by all layers;
* ``kernel(q, k, v, docs)`` on [batch, heads, seq, head_dim] tensors (k and v
  may have fewer heads: grouped-query attention); ``docs`` is None for plain
  causal attention, or what ``prepare`` returned.

Plain causal attention is torch's SDPA everywhere (flash kernels on CUDA and on
CPU). Document masking differs per device because no single kernel both
accepts a per-document mask and avoids ``seq x seq`` memory everywhere: CUDA's
flash SDPA takes no mask at all and its memory-efficient kernel no GQA, so a
dense mask falls back to the math kernel (``seq x seq`` fp32 scores per head).

* CPU: SDPA with a dense additive mask [batch, 1, seq, seq] in the compute
  dtype, built once per forward (CPU's flash kernel accepts a mask; a bool mask
  would be converted to a float copy in every layer, which each layer would
  keep for backward). ``batch * seq^2`` elements per micro-batch: the planner
  counts them (``Layout.dense_document_mask``).
* CUDA: FlexAttention (compiled) with a block mask built from the document ids:
  no ``seq x seq`` tensor, and blocks wholly outside a document are skipped.
* NPU: ``torch_npu.npu_fusion_attention`` in its variable-length layout
  (``TND``) with the cumulative document ends, causal within each document.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
import torch.nn.functional as F

LOW_PRECISION = (torch.bfloat16, torch.float16)


class AttentionKernel(Protocol):
    dense_document_mask: bool  # whether document masking materializes [batch, 1, seq, seq]

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> Any: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Any) -> torch.Tensor: ...


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[batch, seq] -> the index of each token's document within its sample (a new one at each position 0)."""
    return torch.cumsum(positions == 0, dim=-1)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """Bool [batch, 1, seq, seq], True where attention is allowed: causal and within one document.
    The reference the kernels are tested against, and the CPU kernel's mask before it is made additive."""
    doc = document_ids(positions)
    same_doc = doc[:, :, None] == doc[:, None, :]
    seq = positions.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return (same_doc & causal)[:, None]


def _is_gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[1] != k.shape[1]


class SdpaAttention:
    """torch's SDPA; documents through a dense additive mask. ``compute_dtype``: run on copies of the inputs
    in that dtype and return the inputs' dtype (fp32 attention for bf16 on CPUs without native bf16)."""

    dense_document_mask = True

    def __init__(self, compute_dtype: torch.dtype | None = None) -> None:
        self.compute_dtype = compute_dtype

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.compute_dtype if self.compute_dtype is not None and dtype in LOW_PRECISION else dtype

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        allowed = document_causal_mask(positions)
        mask = torch.zeros(allowed.shape, dtype=self._dtype(dtype), device=positions.device)
        return mask.masked_fill_(~allowed, float("-inf"))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
        dtype = self._dtype(q.dtype)
        args = dict(attn_mask=docs) if docs is not None else dict(is_causal=True)
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), enable_gqa=_is_gqa(q, k), **args)
        return out.to(q.dtype)


@functools.cache
def _flex_functions(compiled: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not compiled:
        return create_block_mask, flex_attention
    # Uncompiled, FlexAttention computes the full score matrix: only the compiled kernel is the fused one.
    return torch.compile(create_block_mask), torch.compile(flex_attention)


class FlexDocumentAttention:
    """FlexAttention with a block mask from the document ids (compiled where ``compile`` is set: CUDA);
    plain causal attention stays on SDPA's flash kernel."""

    dense_document_mask = False

    def __init__(self, compile: bool = True) -> None:
        self.compile = compile
        self._functions: tuple | None = None  # (create_block_mask, flex_attention), on first use

    def functions(self) -> tuple:
        # Resolved by prepare, outside the decoder layers: a compiled layer then only reads an attribute.
        if self._functions is None:
            self._functions = _flex_functions(self.compile)
        return self._functions

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype):
        create_block_mask = self.functions()[0]
        doc = document_ids(positions)

        def same_document_causal(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

        batch, seq = positions.shape
        return create_block_mask(same_document_causal, batch, None, seq, seq, device=positions.device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs) -> torch.Tensor:
        if docs is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=_is_gqa(q, k))
        return self.functions()[1](q, k, v, block_mask=docs, enable_gqa=_is_gqa(q, k))


def document_ends(positions: torch.Tensor) -> list[int]:
    """Cumulative end offsets of the documents of the flattened batch (every sample starts one), as the
    variable-length kernels take them: [batch, seq] -> [end_1, ..., batch * seq]."""
    starts = positions == 0
    starts[:, 0] = True
    flat = torch.nonzero(starts.flatten()).flatten()
    return [*flat[1:].tolist(), positions.numel()]


class NpuFusedDocumentAttention:
    """``torch_npu.npu_fusion_attention`` over the flattened batch (layout ``TND``), causal within each
    document (``sparse_mode`` 3 with the kernel's compressed 2048 x 2048 causal mask). Plain causal
    attention stays on SDPA, which torch_npu serves with the same fused kernel."""

    dense_document_mask = False

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> list[int]:
        return document_ends(positions)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: list[int] | None) -> torch.Tensor:
        if docs is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=_is_gqa(q, k))
        import torch_npu  # only on an NPU, where attention_kernel chose this kernel

        batch, heads, seq, head_dim = q.shape

        def tokens_first(t: torch.Tensor) -> torch.Tensor:  # [batch, heads, seq, d] -> [batch * seq, heads, d]
            return t.transpose(1, 2).reshape(batch * seq, t.shape[1], head_dim)

        out = torch_npu.npu_fusion_attention(
            tokens_first(q), tokens_first(k), tokens_first(v), heads, "TND",
            atten_mask=_npu_causal_mask(q.device), scale=head_dim ** -0.5, sparse_mode=3,
            actual_seq_qlen=docs, actual_seq_kvlen=docs)[0]
        return out.view(batch, seq, heads, head_dim).transpose(1, 2)


@functools.cache
def _npu_causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed causal mask sparse_mode 3 expects: True above the diagonal (masked out)."""
    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(diagonal=1)


_KERNELS = {"cuda": FlexDocumentAttention, "npu": NpuFusedDocumentAttention}


def attention_kernel(device_type: str) -> AttentionKernel:
    """The kernel for a model that runs on ``device_type`` ("cpu", "cuda", "npu", ...)."""
    return _KERNELS.get(device_type, SdpaAttention)()


def dense_document_mask(device_type: str) -> bool:
    """Whether document masking on ``device_type`` materializes a [batch, 1, seq, seq] mask (for the planner)."""
    return _KERNELS.get(device_type, SdpaAttention).dense_document_mask
