"""bf16 matmuls computed in fp32, for CPUs that have no bf16 dot-product instructions.

Under ``mixed_precision: bf16`` every matmul takes bf16 operands. GPUs, NPUs
and x86 CPUs with AVX512-BF16 or AMX multiply them natively. Other x86 CPUs
(most laptops, many cloud instances) emulate the bf16 dot product and run it
several times slower than an fp32 matmul (figures in bench/README.md). There the engine upcasts the operands and
multiplies in fp32. A product of two bf16 numbers is exact in fp32, and a
native bf16 matmul accumulates in fp32 too, so the result is the same bf16
matmul up to the order of the summation; parameters, activations and
gradients keep their bf16 dtype, and the tensors saved for backward stay
bf16 (the upcast copies are temporaries). Attention runs on fp32 copies of
q, k, v too (its bf16 kernel is slower there as well). The fused LM head +
cross-entropy goes one step further and keeps its logits and their gradient
in fp32 instead of rounding them to bf16 (see ``models/ops/loss.py``).

``cpu_bf16_matmul`` in the training config chooses: ``auto`` (fp32 on an x86
CPU without AVX512-BF16 and AMX, native elsewhere), ``bf16`` or ``fp32``. The
choice depends only on the CPU's features, so a resumed run makes the same
one and stays bit-exact.
"""

from __future__ import annotations

import platform
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qwen3_pretrain.models.qwen3.attention import LOW_PRECISION, SdpaAttention


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: AVX512-BF16 or AMX on x86; assumed elsewhere (Arm)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: True)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def use_fp32_matmul(device: torch.device, mixed_precision: str, setting: str) -> bool:
    """Whether the engine computes its bf16 matmuls in fp32 on ``device`` (only ever on a CPU)."""
    if device.type != "cpu" or mixed_precision != "bf16" or setting == "bf16":
        return False
    return setting == "fp32" or not cpu_has_native_bf16()


def matmul_dtype(mixed_precision: str, fp32_matmul: bool) -> torch.dtype:
    """The dtype the engine's matmuls multiply in (what a CPU's peak must be measured in)."""
    return torch.bfloat16 if mixed_precision == "bf16" and not fp32_matmul else torch.float32


class _Fp32Linear(torch.autograd.Function):
    """``F.linear(x, w)`` (no bias) multiplied in fp32, returned in the inputs' dtype (in fp32 with
    ``fp32_out``) and differentiated in the inputs' dtypes. Saves the low-precision inputs, not their fp32
    copies. Works on DTensors (tensor parallelism)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        out = F.linear(x.float(), weight.float())
        return out if fp32_out else out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad, weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            flat_grad = grad.flatten(0, -2)  # [tokens, out]
            grad_w = torch.matmul(flat_grad.T, x.float().flatten(0, -2)).to(weight.dtype)
        return grad_x, grad_w, None


def fp32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) multiplied and returned in fp32, differentiated into the inputs'
    dtypes, keeping only the inputs as they are for backward (the MoE router's logits)."""
    return _Fp32Linear.apply(x, weight, True)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` multiplied in fp32 when its operands are in a lower precision (plain ``F.linear`` otherwise)."""
    if x.dtype not in LOW_PRECISION:
        return F.linear(x, weight, bias)
    out = _Fp32Linear.apply(x, weight)
    return out if bias is None else out + bias


class Fp32Linear(nn.Linear):
    """An ``nn.Linear`` that multiplies low-precision operands in fp32 (``fp32_linear``): the class of the
    model's projections when it is built with ``ModelOptions(linear=Fp32Linear)``. Same parameters and
    names as ``nn.Linear``, so tensor-parallel plans, FSDP and checkpoints treat it as one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_linear(x, self.weight, self.bias)


def fp32_attention() -> SdpaAttention:
    """SDPA on fp32 copies of low-precision inputs, returned in their dtype (a document mask is built in
    fp32 once per forward). What it saves for backward is fp32 (twice the bf16 size; a small part of a
    layer's activations)."""
    return SdpaAttention(compute_dtype=torch.float32)


# What a block builds its projections with: one class (or factory) for all of them, or a choice per
# projection, a function of its name within the block returning the class (``ModelOptions.linears``: FP8).
LinearChoice = type[nn.Linear] | Callable[[str], Callable[..., nn.Linear]]


def projection(linear: LinearChoice, name: str, in_features: int, out_features: int) -> nn.Linear:
    """The block's projection ``name`` (``q_proj``), without bias: ``linear(in, out, bias=False)`` when
    ``linear`` is a class (every projection's, as the model has always been built), else built by what
    ``linear(name)`` chooses."""
    make = linear if isinstance(linear, type) else linear(name)
    return make(in_features, out_features, bias=False)
