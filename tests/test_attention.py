"""The attention kernels keep packed documents apart exactly as a dense per-document mask does.

The reference is written here from the documents' lengths: attention scores in
float64, masked to "causal and same document", softmax, times v. Shapes cover
grouped-query attention (Qwen3's), plain multi-head attention and the head
counts of one tensor-parallel shard (tp 2: half the query and half the KV heads).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from qwen3_pretrain.models.qwen3 import attention as attn
from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model

# (query heads, KV heads): GQA 4/2; a tp-2 shard of it, 2/1; multi-head 3/3.
HEADS = {"gqa": (4, 2), "gqa-tp2-shard": (2, 1), "mha": (3, 3)}
# Per sample: the lengths of its pieces; a sample may start inside a document (positions not from 0).
SAMPLES = [((7, 20, 1, 12), 3), ((40,), 0), ((5, 35), 11)]  # (lengths, offset of the first piece)
SEQ = 40


def positions_of(lengths: tuple[int, ...], first_offset: int) -> torch.Tensor:
    parts = [torch.arange(first_offset, first_offset + lengths[0])] + [torch.arange(n) for n in lengths[1:]]
    return torch.cat(parts)


def reference_mask(samples) -> torch.Tensor:
    """[batch, 1, seq, seq] bool from the lengths: query i sees key j iff j <= i in the same piece."""
    masks = []
    for lengths, _ in samples:
        piece = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        masks.append((piece[:, None] == piece[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril())
    return torch.stack(masks)[:, None]


def reference_attention(q, k, v, mask) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).to(q.dtype)


def inputs(heads: int, kv_heads: int, dtype=torch.float32, head_dim: int = 16, grad: bool = False):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    shapes = [(len(SAMPLES), h, SEQ, head_dim) for h in (heads, kv_heads, kv_heads)]
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(grad) for s in shapes]


def batch_positions() -> torch.Tensor:
    return torch.stack([positions_of(*s) for s in SAMPLES])


def run(kernel, q, k, v, grad_out=None):
    out = kernel(q, k, v, kernel.prepare(batch_positions(), q.dtype))
    if grad_out is None:
        return out, None
    out.backward(grad_out)
    return out, [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_cpu_kernel_matches_the_dense_reference_with_gradients(heads):
    q, k, v = inputs(*heads, grad=True)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    out, grads = run(attn.SdpaAttention(), q, k, v, grad_out)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, reference_mask(SAMPLES))
    ref.backward(grad_out)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=2e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_flex_kernel_forward_matches_the_dense_reference(heads):
    """FlexAttention's block mask from the document ids (the CUDA kernel). torch runs it uncompiled on a
    CPU for forward only (no CPU backward), so its gradients are torch's to get right, on the GPU."""
    q, k, v = inputs(*heads)
    out, _ = run(attn.FlexDocumentAttention(compile=False), q, k, v)
    torch.testing.assert_close(out, reference_attention(q, k, v, reference_mask(SAMPLES)), rtol=0, atol=2e-6)


def fake_npu_fusion_attention(query, key, value, head_num, input_layout, *, atten_mask, scale, sparse_mode,
                              actual_seq_qlen, actual_seq_kvlen):
    """What torch_npu documents for layout TND with sparse_mode 3: causal attention within each segment
    [end_{i-1}, end_i) of the flattened tokens (``actual_seq_*len`` are cumulative ends)."""
    assert input_layout == "TND" and sparse_mode == 3 and actual_seq_qlen == actual_seq_kvlen
    assert query.shape[1] == head_num and atten_mask.shape == (2048, 2048) and bool(atten_mask[0, 1])
    assert scale == pytest.approx(query.shape[-1] ** -0.5)
    out, start = torch.empty_like(query), 0
    for end in actual_seq_qlen:
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
        mask = torch.ones(end - start, end - start, dtype=torch.bool).tril()[None, None]
        out[start:end] = reference_attention(q, k, v, mask)[0].transpose(0, 1)
        start = end
    return out, None, None, None, 0, 0, 0


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_npu_kernel_hands_the_fused_kernel_the_document_segments(heads, monkeypatch):
    """The NPU kernel's layout and arguments, against a stand-in for torch_npu with its documented
    semantics (no NPU here: the real kernel is checked only on Ascend hardware)."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=fake_npu_fusion_attention))
    q, k, v = inputs(*heads)
    out, _ = run(attn.NpuFusedDocumentAttention(), q, k, v)
    torch.testing.assert_close(out, reference_attention(q, k, v, reference_mask(SAMPLES)), rtol=0, atol=2e-6)


def test_document_ends_are_cumulative_over_the_flattened_batch():
    ends, total = [], 0
    for lengths, _ in SAMPLES:
        for n in lengths:
            total += n
            ends.append(total)
    assert attn.document_ends(batch_positions()) == ends


def test_fp32_kernel_builds_its_mask_in_fp32_and_returns_bf16():
    q, k, v = inputs(4, 2, dtype=torch.bfloat16)
    kernel = attn.SdpaAttention(compute_dtype=torch.float32)
    docs = kernel.prepare(batch_positions(), torch.bfloat16)
    assert docs.dtype == torch.float32
    out = kernel(q, k, v, docs)
    ref = reference_attention(q.float(), k.float(), v.float(), reference_mask(SAMPLES))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.bfloat16(), rtol=0, atol=0)


def test_one_dense_mask_per_forward_shared_by_every_layer(tiny_config):
    """What the planner counts for the CPU kernel: one [batch, 1, seq, seq] mask in the compute dtype per
    forward, the only seq x seq tensor autograd keeps, however many layers there are."""
    model = Qwen3Model(tiny_config(num_hidden_layers=3), ModelOptions(document_mask=True))
    saved: dict[int, torch.Tensor] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t
        return t

    ids = torch.randint(0, 256, (len(SAMPLES), SEQ), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(ids, positions=batch_positions())
    square = [t for t in saved.values() if t.dim() >= 2 and t.shape[-2:] == (SEQ, SEQ)]
    assert len(square) == 1 and square[0].shape == (len(SAMPLES), 1, SEQ, SEQ)
    assert square[0].dtype == torch.float32


def test_each_device_gets_its_kernel():
    assert isinstance(attn.attention_kernel("cpu"), attn.SdpaAttention)
    assert isinstance(attn.attention_kernel("cuda"), attn.FlexDocumentAttention)
    assert isinstance(attn.attention_kernel("npu"), attn.NpuFusedDocumentAttention)
    assert attn.dense_document_mask("cpu") and not attn.dense_document_mask("cuda")
    assert not attn.dense_document_mask("npu")
