"""RMSNorm that keeps for backward only its input and one fp32 statistic per row.

Written with autograd's operators (``x.float()``, ``pow``, ``mean``,
``rsqrt``, the cast back, the weight's product), the norm keeps an fp32 copy
of its input (4 bytes per element), the normalized value in the input's dtype
(for the weight's gradient) and the reciprocal root: 6 bytes per element in
bf16, beside the output that the next projection keeps anyway. Megatron's
fused norm keeps only the input; so does this one, with the fp32 reciprocal
root (4 bytes per row), and recomputes the rest in backward.

Forward and backward run the same operators, in the same order and dtypes,
as autograd runs for HuggingFace's ``Qwen3RMSNorm`` (fp32 normalization, cast
back, then the weight), so values and gradients are bit-for-bit those of the
unfused norm. Works on DTensors (the norms under sequence parallelism).

``zero_centered_rms_norm`` is the hybrids' form, in plain operators. Which norm runs on which device (the
fused ones of CUDA and NPUs) is chosen in elementwise.py.
"""

from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1] fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        normed = (xf * rstd).to(x.dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).sum_to_size(weight.shape).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        # autograd's chain for the unfused norm: the weight's product, the casts, xf * rstd, rsqrt, mean, pow
        grad_normed = (grad * weight).to(x.dtype).float()
        grad_rstd = (grad_normed * xf).sum(-1, keepdim=True)
        grad_mean = -0.5 * grad_rstd * rstd.pow(3)
        grad_square = grad_mean.expand(xf.shape) / xf.shape[-1]
        return (grad_normed * rstd + grad_square * (2 * xf)).to(x.dtype), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))``, normalized in fp32 and cast back to ``x``'s dtype before the weight."""
    return _RMSNorm.apply(x, weight, eps)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The hybrids' norm (transformers' ``Qwen3_5RMSNorm``): ``x / rms(x) * (1 + weight)``, all in fp32, then
    cast back. Autograd's operators: what it keeps for backward is what the planner counts for it
    (plan/layers.py), so it stays as written until both change together."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
