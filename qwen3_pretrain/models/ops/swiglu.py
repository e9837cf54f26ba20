"""SwiGLU that keeps for backward only its two inputs (and a row scale), not the activation and product.

``silu(gate) * up`` written with autograd's operators keeps gate (for SiLU's
gradient), SiLU(gate) and up (for the product's): three intermediate-wide
tensors, and a fourth when the product is scaled (a MoE pair's routing
weight: the product is kept for the weight's gradient). Megatron's fused
SwiGLU keeps only the projection outputs gate and up; so does this, with the
scale, and computes SiLU and the product again in backward.

Forward and backward run autograd's own operators (``silu``, its
``silu_backward``, the products) in the same order and dtypes, so values and
gradients are bit-for-bit those of the unfused expression. Works on DTensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(gate, up, scale)
        out = F.silu(gate) * up
        return out if scale is None else out * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, scale = ctx.saved_tensors
        grad_gate = grad_up = grad_scale = None
        if scale is not None:
            if ctx.needs_input_grad[2]:
                grad_scale = (grad * (F.silu(gate) * up)).sum_to_size(scale.shape).to(scale.dtype)
            grad = (grad * scale).to(up.dtype)
        # one intermediate-wide temporary at a time beside the gradients
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward((grad * up).to(gate.dtype), gate)
        if ctx.needs_input_grad[1]:
            grad_up = (grad * F.silu(gate)).to(up.dtype)
        return grad_gate, grad_up, grad_scale

def swiglu(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``, times ``scale`` (broadcast over the last dim, e.g. [N, 1]) when given."""
    return _SwiGLU.apply(gate, up, scale)
