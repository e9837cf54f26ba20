"""The experts' FP8 grouped matmul (models/ops/moe_fp8.py) in emulation: each of its three matmuls equals a
per-expert formula written here on operands cast to e4m3 along that matmul's contraction with power-of-two
scales (torchao's rowwise recipe), and the whole kernel stays within FP8's error of the high-precision one;
which kernel the experts get on which device."""

from __future__ import annotations

import pytest
import torch

from qwen3_pretrain.models.ops.moe import GroupedMM
from qwen3_pretrain.models.ops.moe_fp8 import Fp8GroupedMM, _EmulatedRowwiseGroupedMM, fp8_experts_kernel


def _cast_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Independent statement of the cast: scale = 448 / amax along ``dim``, rounded down to 2^n; e4m3."""
    amax = x.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = 2.0 ** torch.floor(torch.log2(448.0 / amax))
    return (x * scale).to(torch.float8_e4m3fn).float() / scale


def test_each_matmul_casts_along_its_contraction():
    g = torch.Generator().manual_seed(0)
    sizes, hidden, out = [5, 0, 9, 6], 32, 16
    x = torch.randn(sum(sizes), hidden, generator=g) * torch.logspace(-2, 1, hidden)  # columns of mixed range
    w = torch.randn(len(sizes), out, hidden, generator=g)
    upstream = torch.randn(sum(sizes), out, generator=g)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x.requires_grad_()
    w.requires_grad_()
    y = _EmulatedRowwiseGroupedMM.apply(x, w, offsets)
    y.backward(upstream)
    want_y, want_gx, want_gw = [], [], torch.zeros_like(w)
    for e, (xs, gs) in enumerate(zip(torch.split(x.detach(), sizes), torch.split(upstream, sizes))):
        want_y.append(_cast_along(xs, 1) @ _cast_along(w[e].detach(), 1).t())   # over hidden
        want_gx.append(_cast_along(gs, 1) @ _cast_along(w[e].detach(), 0))      # over out
        if sizes[e]:
            want_gw[e] = _cast_along(gs, 0).t() @ _cast_along(xs, 0)            # over this expert's tokens
    torch.testing.assert_close(y, torch.cat(want_y), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, torch.cat(want_gx), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, want_gw, rtol=1e-5, atol=1e-5)
    assert w.grad[1].abs().max() == 0  # the expert that got no token
    # the casts matter: the plain fp32 product differs by FP8's rounding
    assert (y - x.detach() @ w[0].detach().t()).abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_within_fp8_error_of_high_precision(dtype):
    """Output and every gradient within 0.25 of the high-precision kernel's largest value (measured
    0.08-0.17: e4m3 keeps 3 mantissa bits, 1/16 relative per operand, on 16-32-term sums), padded to 16 rows
    per expert; and not equal to it."""
    g = torch.Generator().manual_seed(1)
    experts, hidden, inter = 4, 32, 16
    counts = torch.tensor([5, 0, 9, 6])
    n = int(counts.sum())
    leaves = [torch.randn(n, hidden, generator=g), torch.randn(experts, inter, hidden, generator=g) * 0.1,
              torch.randn(experts, inter, hidden, generator=g) * 0.1, torch.randn(experts, hidden, inter, generator=g) * 0.1]
    weights = torch.rand(n, 1, generator=g).to(dtype)
    results = []
    for kernel in (Fp8GroupedMM("rowwise", emulate=True), GroupedMM()):
        inputs = [t.to(dtype, copy=True).requires_grad_() for t in leaves]
        y = kernel(inputs[0], counts, weights, *inputs[1:])
        y.float().pow(2).sum().backward()
        results.append([y.detach().float(), *(t.grad.float() for t in inputs)])
    for got, want in zip(*results):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert 0 < err < 0.25, err


def test_which_kernel_the_experts_get():
    assert fp8_experts_kernel("tensorwise", "cuda", False, capability=(9, 0)).name == "fp8_rowwise_grouped_mm"
    assert fp8_experts_kernel("mxfp8", "cuda", False, capability=(10, 0)).name == "fp8_mxfp8_grouped_mm"
    assert fp8_experts_kernel("mxfp8", "cuda", False, capability=(9, 0)) is None  # Hopper: no MXFP8
    assert fp8_experts_kernel("rowwise", "cuda", False, capability=(8, 9)) is None  # Ada: no grouped FP8 GEMM
    assert fp8_experts_kernel("rowwise", "cpu", False) is None
    assert fp8_experts_kernel("rowwise", "npu", False) is None  # named without torch_npu loaded (simulate)
    emulated = fp8_experts_kernel("mxfp8", "cpu", True)
    assert emulated.name == "fp8_rowwise_grouped_mm (emulated)" and emulated.align == 16
