"""Attention kernels: causal self-attention, optionally kept within each packed document.

A kernel is chosen when the model is built, for the device it will run on
(``attention_kernel``), and used by every layer. Every call is causal with the
queries aligned to the *end* of the keys: ``q_len == kv_len`` for a whole
sequence, ``q_len < kv_len`` for a context-parallel chunk (the queries of
chunk ``i`` against the keys of chunks ``0..i``: parallel/context_parallel.py).
A kernel has three parts:

* ``mask(document_ids, q_len, dtype)``: from the document index of every key
  position [batch, kv_len], what the kernel needs to keep the last ``q_len``
  positions' queries within their documents; built once per forward (per
  query chunk under cp) and shared by all layers. ``prepare(positions, dtype)``
  is the whole sequence's (documents start where the positions restart at 0);
* ``kernel(q, k, v, mask)`` on [batch, heads, seq, head_dim] tensors (k and v
  may have fewer heads: grouped-query attention); ``mask`` None is plain causal;
* ``describe(...)``: the call it makes for given shapes, as an ``AttentionCall``
  (``attention_calls.py``: which API, which mask, which dtype), for the
  device's kernel rules (``hardware.attention_backend``): the planner and the
  simulation ask which fused kernel, or the math fallback, the device will run.

Per device, because no single call both takes a per-document mask and avoids
``seq x seq`` memory everywhere:

* CPU: SDPA (its flash kernel takes a mask, with GQA). Documents and the causal
  mask of a chunk (q_len < kv_len) are additive masks in the compute dtype
  (a bool mask would be converted to a float copy in every layer, which each
  layer would keep for backward): the document mask [batch, 1, q_len, kv_len]
  built per forward (the planner counts it: ``Layout.dense_document_mask``),
  the chunk's causal mask once for good.
* CUDA: SDPA for causal attention: ``is_causal`` for a whole sequence, the
  lower-right ``CausalBias`` for a chunk (both served by the flash kernel in
  bf16, with GQA; a dense mask would send GQA to the math kernel, which keeps
  fp32 probabilities); FlexAttention (compiled) for documents, with a block
  mask from the document ids (no ``seq x seq`` tensor; blocks wholly outside a
  document are skipped).
* NPU: ``torch_npu.npu_fusion_attention``: a chunk with its lower-right causal
  mode, documents in the variable-length layout (``TND``) with one segment per
  document (the queries of the document, against its keys up to the chunk's
  end); a whole sequence's plain causal attention through SDPA, which
  torch_npu serves with the same fused kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from qwen3_pretrain.models.qwen3.attention_calls import AttentionCall, describe_call, kernel_name

LOW_PRECISION = (torch.bfloat16, torch.float16)


Observer = Callable[[AttentionCall], None]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[batch, seq] -> the index of each token's document within its sample (a new one at each position 0)."""
    return torch.cumsum(positions == 0, dim=-1)


def allowed(doc_ids: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bool, True where query ``i`` (the last ``q_len`` of ``kv_len`` positions) may see key ``j``: causal,
    [q_len, kv_len]; and within one document, [batch, 1, q_len, kv_len], when ``doc_ids`` [batch, kv_len]
    is given. The reference the kernels are tested against."""
    offset = kv_len - q_len
    causal = torch.arange(offset, kv_len, device=device)[:, None] >= torch.arange(kv_len, device=device)[None, :]
    if doc_ids is None:
        return causal
    return (causal & (doc_ids[:, offset:, None] == doc_ids[:, None, :]))[:, None]


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """Bool [batch, 1, seq, seq], True where attention is allowed: causal and within one document."""
    return allowed(document_ids(positions), positions.shape[-1], positions.shape[-1], positions.device)


def _additive(allowed_: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed_.shape, dtype=dtype, device=allowed_.device).masked_fill_(~allowed_, float("-inf"))


class AttentionKernel:
    """The interface and what every kernel shares (see the module docstring). ``observe``, when given, is
    told every call the kernel makes (the scale simulation's record of the device's kernels)."""

    name = "sdpa"  # its calls in attention_calls.CALLS
    dense_document_mask = False  # whether a document mask materializes [batch, 1, q_len, kv_len]

    def __init__(self, observe: Observer | None = None) -> None:
        self.observe = observe

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype attention computes in for inputs of ``dtype``."""
        return dtype

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """The whole sequence's document mask, from the positions [batch, seq]."""
        return self.mask(document_ids(positions), positions.shape[-1], dtype)

    def mask(self, doc_ids: torch.Tensor, q_len: int, dtype: torch.dtype) -> Any:
        raise NotImplementedError

    def describe(self, dtype: torch.dtype, batch: int, q_heads: int, kv_heads: int, q_len: int, kv_len: int,
                 head_dim: int, documents: bool) -> AttentionCall:
        """The call this kernel makes for inputs of ``dtype`` and these shapes."""
        return describe_call(self.name, str(self.compute_dtype(dtype)).removeprefix("torch."), batch, q_heads,
                             kv_heads, q_len, kv_len, head_dim, documents)

    def _observe(self, q: torch.Tensor, k: torch.Tensor, mask: Any) -> None:
        if self.observe is not None:
            batch, q_heads, q_len, head_dim = q.shape
            self.observe(self.describe(q.dtype, batch, q_heads, k.shape[1], q_len, k.shape[2], head_dim,
                                       mask is not None))


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[1] != k.shape[1]


class SdpaAttention(AttentionKernel):
    """torch's SDPA with additive masks (the CPU's kernel). ``compute_dtype``: run on copies of the inputs
    in that dtype and return the inputs' dtype (fp32 attention for bf16 on CPUs without native bf16)."""

    dense_document_mask = True

    def __init__(self, compute_dtype: torch.dtype | None = None, observe: Observer | None = None) -> None:
        super().__init__(observe)
        self._compute_dtype = compute_dtype
        self._causal: dict[tuple, torch.Tensor] = {}  # chunks' causal masks, built once and shared

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self._compute_dtype if self._compute_dtype is not None and dtype in LOW_PRECISION else dtype

    def mask(self, doc_ids: torch.Tensor, q_len: int, dtype: torch.dtype) -> torch.Tensor:
        return _additive(allowed(doc_ids, q_len, doc_ids.shape[-1], doc_ids.device), self.compute_dtype(dtype))


    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        self._observe(q, k, mask)
        dtype = self.compute_dtype(q.dtype)
        q_len, kv_len = q.shape[2], k.shape[2]
        if mask is None and q_len != kv_len:
            key = (q_len, kv_len, q.device, dtype)
            if key not in self._causal:
                self._causal[key] = _additive(allowed(None, q_len, kv_len, q.device), dtype)
            mask = self._causal[key]
        args = dict(attn_mask=mask) if mask is not None else dict(is_causal=True)
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), enable_gqa=_gqa(q, k), **args)
        return out.to(q.dtype)


@functools.cache
def _flex_functions(compiled: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not compiled:
        return create_block_mask, flex_attention
    # Uncompiled, FlexAttention computes the full score matrix: only the compiled kernel is the fused one.
    return torch.compile(create_block_mask), torch.compile(flex_attention)


class CudaAttention(AttentionKernel):
    """SDPA for causal attention (``is_causal``, or the lower-right ``CausalBias`` of a chunk), FlexAttention
    with a block mask for documents (compiled where ``compile`` is set: on CUDA)."""

    name = "cuda"

    def __init__(self, compile: bool = True, observe: Observer | None = None) -> None:
        super().__init__(observe)
        self.compile = compile
        self._functions: tuple | None = None  # (create_block_mask, flex_attention), on first use

    def functions(self) -> tuple:
        # Resolved by mask(), outside the decoder layers: a compiled layer then only reads an attribute.
        if self._functions is None:
            self._functions = _flex_functions(self.compile)
        return self._functions

    def mask(self, doc_ids: torch.Tensor, q_len: int, dtype: torch.dtype):
        create_block_mask = self.functions()[0]
        batch, kv_len = doc_ids.shape
        offset = kv_len - q_len

        def same_document_causal(b, h, q_idx, kv_idx):
            return (doc_ids[b, q_idx + offset] == doc_ids[b, kv_idx]) & (q_idx + offset >= kv_idx)

        return create_block_mask(same_document_causal, batch, None, q_len, kv_len, device=doc_ids.device)


    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        self._observe(q, k, mask)
        if mask is not None:
            return self.functions()[1](q, k, v, block_mask=mask, enable_gqa=_gqa(q, k))
        if q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=_gqa(q, k))
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                              enable_gqa=_gqa(q, k))


@dataclass(frozen=True)
class Segments:
    """Documents as the NPU's variable-length layout takes them: cumulative ends of the query segments
    and of the key segments over the flattened batch, and where each sample's keys start (its first
    document that reaches the queries)."""

    q_ends: list[int]
    kv_ends: list[int]
    kv_starts: list[int]


def document_segments(doc_ids: torch.Tensor, q_len: int) -> Segments:
    """One segment per (sample, document that has queries): its queries among the last ``q_len`` positions,
    and its keys from the document's start to the end of the keys (one host read of a few integers per
    document)."""
    batch, kv_len = doc_ids.shape
    offset = kv_len - q_len
    position = torch.arange(kv_len, device=doc_ids.device)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_of = torch.cummax(torch.where(starts, position, 0), dim=1).values  # each token's document start
    last = torch.ones_like(starts)
    last[:, :-1] = starts[:, 1:]
    rows, ends = torch.nonzero(last & (position >= offset), as_tuple=True)  # segments' last tokens, in order
    begins = start_of[rows, ends]
    q_ends = (ends + 1 - begins.clamp(min=offset)).cumsum(0)
    kv_ends = (ends + 1 - begins).cumsum(0)
    return Segments(q_ends.tolist(), kv_ends.tolist(), start_of[:, offset].tolist())


def document_ends(positions: torch.Tensor) -> list[int]:
    """Cumulative end offsets of the documents of the flattened batch (every sample starts one), as the
    variable-length kernels take them: [batch, seq] -> [end_1, ..., batch * seq]."""
    return document_segments(document_ids(positions), positions.shape[-1]).q_ends


class NpuAttention(AttentionKernel):
    """``torch_npu.npu_fusion_attention``: lower-right causal (``sparse_mode`` 3, with the kernel's
    compressed 2048 x 2048 causal mask) in layout ``BNSD`` for a chunk, and per document segment in the
    variable-length layout ``TND``; a whole sequence's plain causal attention through SDPA."""

    name = "npu"

    def mask(self, doc_ids: torch.Tensor, q_len: int, dtype: torch.dtype) -> Segments:
        return document_segments(doc_ids, q_len)


    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Segments | None) -> torch.Tensor:
        self._observe(q, k, mask)
        if mask is None and q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=_gqa(q, k))
        import torch_npu  # only on an NPU, where attention_kernel chose this kernel

        batch, heads, q_len, head_dim = q.shape
        common = dict(atten_mask=_npu_causal_mask(q.device), scale=head_dim ** -0.5, sparse_mode=3)
        if mask is None:
            return torch_npu.npu_fusion_attention(q, k, v, heads, "BNSD", **common)[0]

        def tokens_first(t: torch.Tensor, start: int = 0) -> torch.Tensor:  # [heads, seq, d] -> [seq, heads, d]
            return t[:, start:].transpose(0, 1)

        q_flat = torch.cat([tokens_first(q[b]) for b in range(batch)])
        k_flat, v_flat = (torch.cat([tokens_first(t[b], s) for b, s in enumerate(mask.kv_starts)]) for t in (k, v))
        out = torch_npu.npu_fusion_attention(q_flat, k_flat, v_flat, heads, "TND", actual_seq_qlen=mask.q_ends,
                                             actual_seq_kvlen=mask.kv_ends, **common)[0]
        return out.view(batch, q_len, heads, head_dim).transpose(1, 2)


@functools.cache
def _npu_causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed causal mask sparse_mode 3 expects: True above the diagonal (masked out)."""
    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(diagonal=1)


_KERNELS: dict[str, type[AttentionKernel]] = {"sdpa": SdpaAttention, "cuda": CudaAttention, "npu": NpuAttention}


def attention_kernel(device_type: str, compute_dtype: torch.dtype | None = None,
                     observe: Observer | None = None) -> AttentionKernel:
    """The kernel for a model that runs on ``device_type`` ("cpu", "cuda", "npu", ...); ``compute_dtype``
    (CPU only): attention in that dtype for low-precision inputs."""
    name = kernel_name(device_type, compute_dtype is not None)
    if name == "sdpa":
        return SdpaAttention(compute_dtype, observe=observe)
    return _KERNELS[name](observe=observe)
