"""The norm and SwiGLU that keep less for backward compute what autograd computes for the plain expressions
(HuggingFace's RMSNorm, ``silu(gate) * up``), bit for bit where the casts fix the order, and keep only
their inputs and per-row statistics."""

import pytest
import torch
import torch.nn.functional as F

from qwen3_pretrain.models.ops.norm import rms_norm
from qwen3_pretrain.models.ops.swiglu import swiglu


def plain_rms_norm(x, weight, eps):
    dtype = x.dtype
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def plain_swiglu(gate, up, scale=None):
    out = F.silu(gate) * up
    return out if scale is None else out * scale


def grads(fn, inputs, grad_out_seed=1):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed)).to(out.dtype)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves]


def saved_bytes(fn, inputs):
    """Bytes of the storages ``fn`` saves for backward that are not its inputs."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    skip = {t.untyped_storage()._cdata for t in leaves}
    saved = {}

    def pack(t):
        if t.untyped_storage()._cdata not in skip:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return sum(saved.values())


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_rms_norm_equals_the_plain_expression(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 33, 64, generator=gen) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(weight_dtype)
    ours, plain = grads(lambda a, b: rms_norm(a, b, 1e-6), [x, w]), grads(lambda a, b: plain_rms_norm(a, b, 1e-6), [x, w])
    assert torch.equal(ours[0], plain[0])
    if dtype == torch.bfloat16 or weight_dtype == torch.bfloat16:  # a cast to bf16 fixes the order of the terms
        assert torch.equal(ours[1][0], plain[1][0])
    else:
        torch.testing.assert_close(ours[1][0], plain[1][0], rtol=1e-6, atol=1e-7)
    assert torch.equal(ours[1][1], plain[1][1])
    # kept: nothing but the input (skipped) and the fp32 reciprocal root per row
    assert saved_bytes(lambda a, b: rms_norm(a, b, 1e-6), [x, w]) == 2 * 33 * 4
    assert saved_bytes(lambda a, b: plain_rms_norm(a, b, 1e-6), [x, w]) > 2 * 33 * 64 * 4


@pytest.mark.parametrize("dtype, scale_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                                (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.float32, torch.bfloat16)])
def test_swiglu_equals_the_plain_expression(dtype, scale_dtype):
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(40, 96, generator=gen).to(dtype) for _ in range(2))
    scaled = scale_dtype is not None
    inputs = [gate, up] + ([torch.rand(40, 1, generator=gen).to(scale_dtype)] if scaled else [])
    ours, plain = grads(swiglu, inputs), grads(plain_swiglu, inputs)
    assert torch.equal(ours[0], plain[0])
    for a, b in zip(ours[1], plain[1]):
        assert torch.equal(a, b)
    assert saved_bytes(swiglu, inputs) == 0  # its inputs only
    assert saved_bytes(plain_swiglu, inputs) >= 40 * 96 * dtype.itemsize * (2 if scaled else 1)
