"""The device kernel rules (``hardware.attention_backend``) say what torch itself chooses.

On a CPU, torch's own dispatcher answers (``torch._fused_sdp_choice``); on a GPU (marked ``device``),
torch's checks ``can_use_flash_attention`` / ``can_use_efficient_attention``, tried in SDPA's order. The
calls are those the project's kernels make (``models/qwen3/attention_calls.py``): plain causal, the
lower-right causal mask of a context-parallel chunk (a ``CausalBias`` on CUDA, which asks flash with no
mask, then efficient), and an additive mask.
"""

from __future__ import annotations

import pytest
import torch

from qwen3_pretrain.hardware import attention_backend
from qwen3_pretrain.models.qwen3 import attention as attn
from qwen3_pretrain.models.qwen3.attention_calls import AttentionCall, describe_call

HEADS = [(4, 2), (2, 1), (4, 4), (6, 4)]  # GQA, a tp shard of it, multi-head, heads that do not group
DTYPES = [torch.float32, torch.bfloat16]
MASKS = ["causal", "lower_right", "dense"]
BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def _call(mask: str, dtype: torch.dtype, heads: tuple[int, int], head_dim: int = 64) -> AttentionCall:
    q_len, kv_len = (16, 16) if mask == "causal" else (16, 48)
    return AttentionCall("sdpa", mask, str(dtype).removeprefix("torch."), 2, heads[0], heads[1], q_len, kv_len,
                         head_dim)


def _tensors(call: AttentionCall, device: str):
    dtype = getattr(torch, call.dtype)
    make = lambda h, n: torch.randn(call.batch, h, n, call.head_dim, device=device, dtype=dtype)  # noqa: E731
    return make(call.q_heads, call.q_len), make(call.kv_heads, call.kv_len), make(call.kv_heads, call.kv_len)


def _mask(call: AttentionCall, device: str) -> torch.Tensor:
    """The tensor a call passes: the CPU kernel's additive mask (also what CausalBias materializes)."""
    allowed = attn.allowed(None, call.q_len, call.kv_len, torch.device(device))
    return torch.zeros(allowed.shape, dtype=getattr(torch, call.dtype), device=device).masked_fill_(~allowed, -1e30)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_cpu_rules_are_torchs_choice(heads, dtype, mask):
    call = _call(mask, dtype, heads)
    q, k, v = _tensors(call, "cpu")
    gqa = heads[0] != heads[1]
    attn_mask = None if mask == "causal" else _mask(call, "cpu")
    choice = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, mask == "causal", scale=None, enable_gqa=gqa)
    assert attention_backend("cpu", call) == BACKEND_NAMES[int(choice)]


def test_a_chunk_on_cuda_is_flash_in_bf16_and_the_dense_mask_it_replaces_was_math():
    """The finding this table exists for: context-parallel attention with GQA and an additive mask falls to
    the math kernel on CUDA (fp32 probabilities: ~8.5 GiB per layer per rank for Qwen3-8B at seq 32K, cp 8),
    while the lower-right causal call is served by flash."""
    for kv_len, q_len in [(34816, 2048)]:
        shapes = dict(batch=1, q_heads=32, kv_heads=8, q_len=q_len, kv_len=kv_len, head_dim=128)
        chunk = describe_call("cuda", "bfloat16", documents=False, **shapes)
        assert (chunk.api, chunk.mask) == ("sdpa", "lower_right")
        assert attention_backend("cuda", chunk) == "flash"
        dense = AttentionCall("sdpa", "dense", "bfloat16", **shapes)
        assert attention_backend("cuda", dense) == "math"
        # documents under cp: FlexAttention's block mask, compiled
        assert attention_backend("cuda", describe_call("cuda", "bfloat16", documents=True, **shapes)) == "flex"
    # fp32 training with GQA has no fused kernel on CUDA (flash wants half precision, efficient equal heads)
    fp32 = describe_call("cuda", "float32", 1, 32, 8, 4096, 4096, 128, documents=False)
    assert attention_backend("cuda", fp32) == "math"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_every_kernel_describes_the_call_it_makes(monkeypatch):
    """The table the planner reads is the kernels' own account: each kernel, run on the CPU, reports through
    its observer the call ``describe_call`` gives for the same shapes."""
    import sys
    import types

    from tests.test_attention import fake_npu_fusion_attention

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=fake_npu_fusion_attention))
    positions = torch.arange(48).expand(2, 48)
    for name in ("sdpa", "cuda", "npu"):
        for documents in (False, True):
            for q_len in (48, 16):
                seen: list[AttentionCall] = []
                kernel = {"sdpa": attn.SdpaAttention, "cuda": lambda observe: attn.CudaAttention(False, observe),
                          "npu": attn.NpuAttention}[name](observe=seen.append)
                q, k, v = (torch.randn(2, h, n, 16) for h, n in ((4, q_len), (2, 48), (2, 48)))
                mask = kernel.mask(attn.document_ids(positions), q_len, q.dtype) if documents else None
                with torch.no_grad():
                    kernel(q, k, v, mask)
                assert seen == [describe_call(name, "float32", 2, 4, 2, q_len, 48, 16, documents)], (name, documents)


@pytest.mark.device
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_cuda_rules_are_torchs_checks(test_device, heads, dtype, mask):
    if test_device.type != "cuda":
        pytest.skip("torch's CUDA kernel checks need a CUDA device")
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    call = _call(mask, dtype, heads, head_dim=128)
    q, k, v = _tensors(call, "cuda")
    gqa = heads[0] != heads[1]
    if mask == "lower_right":  # CausalBias asks these two, with these parameters, in this order
        params = SDPAParams(q, k, v, None, 0.0, False, gqa)
        flash, efficient = can_use_flash_attention(params), can_use_efficient_attention(params)
    else:
        attn_mask = None if mask == "causal" else _mask(call, "cuda")
        params = SDPAParams(q, k, v, attn_mask, 0.0, mask == "causal", gqa)
        flash, efficient = can_use_flash_attention(params), can_use_efficient_attention(params)
    torch_choice = "flash" if flash else "efficient" if efficient else "math"
    assert attention_backend("cuda", call) == torch_choice


@pytest.mark.device
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_context_parallel_chunks_run_on_fused_kernels(test_device, documents):
    """A cp chunk of Qwen3-8B's attention (32 query / 8 KV heads of 128, the queries the last 256 of 1,024
    keys) in bf16, forward and backward: plain causal on flash alone (SDPA may use no other kernel here, so
    a fallback to math or efficient raises), documents on compiled FlexAttention; both equal a float64
    reference."""
    if test_device.type != "cuda":
        pytest.skip("CUDA's kernels")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 32, 256, 128, generator=gen)
    k, v = (torch.randn(2, 8, 1024, 128, generator=gen) for _ in range(2))
    # documents that end before the chunk (at 300) and inside it (at 900): the block mask's offset is seen
    positions = torch.cat([torch.arange(300), torch.arange(600), torch.arange(124)]).expand(2, 1024)
    doc_ids = attn.document_ids(positions)
    allowed = attn.allowed(doc_ids if documents else None, 256, 1024, torch.device("cpu"))
    allowed = allowed if documents else allowed[None, None]
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    groups = 32 // 8
    rk, rv = (t.repeat_interleave(groups, dim=1) for t in ref_leaves[1:])
    scores = (ref_leaves[0] @ rk.transpose(-1, -2) / 128 ** 0.5).masked_fill(~allowed, float("-inf"))
    ref = scores.softmax(-1) @ rv
    ref.sum().backward()

    kernel = attn.CudaAttention()
    leaves = [t.to(test_device, torch.bfloat16).requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        mask = kernel.mask(doc_ids.to(test_device), 256, torch.bfloat16) if documents else None
        out = kernel(*leaves, mask)
        out.float().sum().backward()
    for got, want in [(out, ref), *((leaf.grad, r.grad) for leaf, r in zip(leaves, ref_leaves))]:
        rel = ((got.double().cpu() - want).norm() / want.norm()).item()
        assert rel < 2e-2, rel
