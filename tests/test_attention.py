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
    out, _ = run(attn.CudaAttention(compile=False), q, k, v)
    torch.testing.assert_close(out, reference_attention(q, k, v, reference_mask(SAMPLES)), rtol=0, atol=2e-6)


def lower_right(q_len: int, kv_len: int) -> torch.Tensor:
    """Bool [q_len, kv_len]: causal with the queries the last q_len of the keys."""
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)


def fake_npu_fusion_attention(query, key, value, head_num, input_layout, *, atten_mask, scale, sparse_mode,
                              actual_seq_qlen=None, actual_seq_kvlen=None):
    """What torch_npu documents for sparse_mode 3 (right-down causal): in layout BNSD, queries aligned to
    the end of the keys; in layout TND, the same within each segment, segment i being the queries
    [q_end_{i-1}, q_end_i) and the keys [kv_end_{i-1}, kv_end_i) of the flattened tokens."""
    assert sparse_mode == 3 and atten_mask.shape == (2048, 2048) and bool(atten_mask[0, 1])
    assert scale == pytest.approx(query.shape[-1] ** -0.5)
    if input_layout == "BNSD":
        assert query.shape[1] == head_num and actual_seq_qlen is None
        return reference_attention(query, key, value, lower_right(query.shape[2], key.shape[2])), None
    assert input_layout == "TND" and query.shape[1] == head_num and len(actual_seq_qlen) == len(actual_seq_kvlen)
    out, q_start, kv_start = torch.empty_like(query), 0, 0
    for q_end, kv_end in zip(actual_seq_qlen, actual_seq_kvlen):
        q = query[q_start:q_end].transpose(0, 1)[None]
        k, v = (t[kv_start:kv_end].transpose(0, 1)[None] for t in (key, value))
        out[q_start:q_end] = reference_attention(q, k, v, lower_right(q_end - q_start, kv_end - kv_start))[0].transpose(0, 1)
        q_start, kv_start = q_end, kv_end
    return out, None, None, None, 0, 0, 0


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_npu_kernel_hands_the_fused_kernel_the_document_segments(heads, monkeypatch):
    """The NPU kernel's layout and arguments, against a stand-in for torch_npu with its documented
    semantics (no NPU here: the real kernel is checked only on Ascend hardware)."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=fake_npu_fusion_attention))
    q, k, v = inputs(*heads)
    out, _ = run(attn.NpuAttention(), q, k, v)
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
    assert isinstance(attn.attention_kernel("cuda"), attn.CudaAttention)
    assert isinstance(attn.attention_kernel("npu"), attn.NpuAttention)
    assert attn.attention_kernel("cpu").dense_document_mask and not attn.attention_kernel("cuda").dense_document_mask
    assert not attn.attention_kernel("npu").dense_document_mask
    assert isinstance(attn.attention_kernel("cuda", compute_dtype=torch.float32), attn.SdpaAttention)


# --- a query chunk against a longer prefix of keys (context parallelism) ------------------------------------


CHUNK = 16  # the last 16 of the 40 positions, as a cp rank's second chunk attends


def chunk_inputs(heads: int, kv_heads: int, dtype=torch.float32, grad: bool = False):
    q, k, v = inputs(heads, kv_heads, dtype)
    q = q[:, :, -CHUNK:].contiguous()
    return [t.detach().requires_grad_(grad) for t in (q, k, v)]


def chunk_reference(q, k, v, documents: bool):
    if documents:
        mask = reference_mask(SAMPLES)[:, :, -CHUNK:]
    else:
        mask = lower_right(CHUNK, SEQ)[None, None]
    return reference_attention(q, k, v, mask)


def run_chunk(kernel, q, k, v, documents: bool):
    mask = kernel.mask(attn.document_ids(batch_positions()), CHUNK, q.dtype) if documents else None
    return kernel(q, k, v, mask)


KERNELS = {"cpu": lambda: attn.SdpaAttention(), "cuda": lambda: attn.CudaAttention(compile=False),
           "npu": lambda: attn.NpuAttention()}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("device", KERNELS)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_every_kernel_attends_a_chunk_to_the_keys_before_its_end(heads, device, documents, monkeypatch):
    """Queries that are the last positions of the keys (a cp chunk) see exactly the keys up to themselves,
    within their documents: the CPU's masks, CUDA's lower-right bias and block mask, the NPU's right-down
    causal modes (through the stand-in for torch_npu)."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=fake_npu_fusion_attention))
    q, k, v = chunk_inputs(*heads)
    out = run_chunk(KERNELS[device](), q, k, v, documents)
    torch.testing.assert_close(out, chunk_reference(q, k, v, documents), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_the_lower_right_bias_is_bit_identical_to_the_cpu_mask_with_gradients(heads, dtype):
    """CUDA's chunk call (SDPA with ``causal_lower_right``), run on a CPU, gives bit for bit the outputs
    and gradients of the CPU kernel's additive mask: one computation, two ways to ask for it."""
    results = []
    for kernel in (attn.SdpaAttention(), attn.CudaAttention(compile=False)):
        q, k, v = chunk_inputs(*heads, dtype=dtype, grad=True)
        out = run_chunk(kernel, q, k, v, documents=False)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype))
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_cpu_chunk_masks_are_built_once_and_shared():
    kernel = attn.SdpaAttention()
    q, k, v = chunk_inputs(4, 2)
    kernel(q, k, v, None)
    kernel(q, k, v, None)
    assert len(kernel._causal) == 1


def test_document_segments_of_a_chunk():
    """Sample 0 (pieces 7, 20, 1, 12; the chunk is positions 24..39): the 20-token piece's last 3 queries
    see its 20 keys; the 1-token piece itself; the 12-token piece its own. The chunk's keys start where
    the first piece with queries starts (position 7)."""
    segments = attn.document_segments(attn.document_ids(batch_positions()), CHUNK)
    # sample 0: (q 3, kv 20), (1, 1), (12, 12); sample 1: one 40-token piece, (16, 40);
    # sample 2 (pieces 5, 35): (16, 35)
    q_lens, kv_lens = [3, 1, 12, 16, 16], [20, 1, 12, 40, 35]
    assert segments.q_ends == torch.tensor(q_lens).cumsum(0).tolist()
    assert segments.kv_ends == torch.tensor(kv_lens).cumsum(0).tolist()
    assert segments.kv_starts == [7, 0, 5]
