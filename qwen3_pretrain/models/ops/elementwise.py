"""Which elementwise kernels the model runs (RMSNorm, the zero-centred norm, RoPE, SwiGLU), chosen per device
when the model is built, as the attention kernel is (``elementwise_kernels``; ``ModelOptions.elementwise``).

* CPU, and CUDA under ``compile``: ours (norm.py, rope.py, swiglu.py), the operators transformers runs, in
  its order and dtypes, keeping for backward only what the planner counts; inductor fuses them on CUDA.
* CUDA eager: the RMSNorm is torch's fused kernel (``aten._fused_rms_norm``, one pass forward and one
  backward) normalizing without the weight, which is then applied in the input's dtype, as transformers does
  (the fused kernel with the weight multiplies it in fp32 before the one cast: in bf16 a quarter of the
  values differ from transformers' by one unit in the last place). Forward values differ from ours only in
  the order of the fp32 sum of squares; the backward runs torch's fused backward in fp32 with one cast at
  the end where ours casts after each step (differences at the bf16 rounding). It keeps the input and one
  fp32 statistic per row, as ours. The zero-centred norm, fp32 throughout in transformers, is torch's
  fused norm on the fp32 input with ``1 + weight`` (keeps the fp32 input: half of what ours keeps). No
  torch operator fuses RoPE or SwiGLU: ours.
* NPU: torch_npu's fused operators, imported when first called: ``npu_rms_norm`` (weight in the input's
  dtype; the zero-centred form on the fp32 input), ``npu_rotary_mul`` (its "half" mode is our layout) in
  an autograd function of ours that keeps only cos and sin (the operator's own backward keeps its input
  too, more than ours), ``npu_swiglu`` on [gate | up] (SiLU of the first half times the second).

Under tp every norm's input is a DTensor split over rows (the sequence, or the q/k norms' heads) with its
weight replicated, and the fused norms take it: CUDA's through torch's sharding rules for
``aten._fused_rms_norm`` and its backward (each rank normalizes its rows; the weight's gradient is a partial
sum, reduced over tp as any sequence-parallel weight's), the NPU's on each rank's local rows, its weight's
gradient marked as the same partial sum. Any other DTensor layout (the normalized dim split) runs ours.
``tests/test_elementwise_kernels.py`` compares every kernel with the plain expression, on DTensors over two
ranks too (the device ones on the device, ``pytest -m device``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from qwen3_pretrain.models.ops.norm import rms_norm, zero_centered_rms_norm
from qwen3_pretrain.models.ops.rope import apply_rope
from qwen3_pretrain.models.ops.swiglu import swiglu

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps) -> normalized x
Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, cos, sin) -> rotated x
Swiglu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> silu(gate) * up


def _rowwise(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a fused norm takes ``x`` as it is: a plain tensor, or a DTensor split over rows only (never
    over the normalized last dim, never a partial sum) whose weight is replicated on the same mesh: the
    layouts torch's sharding rule for ``aten._fused_rms_norm`` keeps without moving data (every norm's under
    tp). Another subclass or layout runs ours."""
    if not isinstance(x, DTensor):
        return type(x) is torch.Tensor
    last = x.ndim - 1
    return (isinstance(weight, DTensor) and weight.device_mesh == x.device_mesh
            and all(p.is_replicate() for p in weight.placements)
            and all(p.is_replicate() or (p.is_shard() and p.dim != last) for p in x.placements))


@dataclass(frozen=True)
class ElementwiseKernels:
    """The kernels of one device; the defaults are ours (every device's reference)."""

    norm: Norm = rms_norm
    zero_centered_norm: Norm = zero_centered_rms_norm
    rope: Rope = apply_rope
    swiglu: Swiglu = swiglu

    def describe(self, zero_centered: bool = False) -> dict[str, str]:
        """Block -> the kernel's name, for the start-up table; ``zero_centered``: the model's norms are (the
        hybrids')."""
        norm = self.zero_centered_norm if zero_centered else self.norm
        return {"norms": norm.__name__, "rope": self.rope.__name__, "swiglu": self.swiglu.__name__}


# --- CUDA eager: torch's fused RMSNorm ----------------------------------------------------------------------

class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)  # rstd: [..., 1] fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * normed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
        backward = _fused_rms_norm_backward(x.device.type)
        grad_x, grad_weight = backward(grad.contiguous(), x, [x.shape[-1]], rstd, weight, mask)
        return grad_x, grad_weight, None


def _fused_rms_norm_backward(device_type: str):
    """torch's fused backward; on a CPU, which torch builds it for only on accelerators, its reference
    formula (torch's decomposition, what inductor compiles), so the tests run the same arithmetic here."""
    if device_type == "cpu":
        from torch._decomp.decompositions import _fused_rms_norm_backward as reference

        return reference
    return torch.ops.aten._fused_rms_norm_backward


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's fused RMSNorm with transformers' order (normalize, cast, then the weight), on a DTensor by
    torch's sharding rules; ours where the weight's dtype is not the input's (transformers' output then takes
    the weight's) or the layout is not ``_rowwise``."""
    if weight.dtype != x.dtype or not _rowwise(x, weight):
        return rms_norm(x, weight, eps)
    return _FusedRMSNorm.apply(x, weight, eps)


def fused_zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The zero-centred norm as torch's fused norm on the fp32 input, with ``1 + weight`` in fp32 (the
    weight's product in fp32 is what the fused operator given the weight computes)."""
    if not _rowwise(x, weight):
        return zero_centered_rms_norm(x, weight, eps)
    return _FusedRMSNorm.apply(x.float(), 1.0 + weight.float(), eps).to(x.dtype)


# --- NPU: torch_npu's fused operators -----------------------------------------------------------------------

def _torch_npu():
    import torch_npu  # only on an NPU, where the engine has imported it already

    return torch_npu


def _on_local_rows(norm: Norm, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm``, an operator without a sharding rule, on this rank's rows of a ``_rowwise`` DTensor ``x``.
    A norm is per row, so the local rows give the local output; the weight's local gradient covers only
    these rows: a partial sum over each mesh axis that splits the rows (whole on an axis that replicates
    them), which FSDP or the next redistribution reduces, as for any sequence-parallel weight."""
    if not isinstance(x, DTensor):
        return norm(x, weight, eps)
    grad_placements = [Partial() if p.is_shard() else Replicate() for p in x.placements]
    out = norm(x.to_local(), weight.to_local(grad_placements=grad_placements), eps)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


def _npu_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _torch_npu().npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]


def _npu_zero_centered_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _torch_npu().npu_rms_norm(x.float(), 1.0 + weight.float(), epsilon=eps)[0].to(x.dtype)


def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch_npu's fused RMSNorm (its gamma takes the input's dtype), on each rank's rows under tp; it keeps
    the input and the fp32 reciprocal root per row, as ours."""
    if not _rowwise(x, weight):
        return rms_norm(x, weight, eps)
    return _on_local_rows(_npu_norm, x, weight, eps)


def npu_zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch_npu's fused RMSNorm on the fp32 input with ``1 + weight`` in fp32, as transformers computes it."""
    if not _rowwise(x, weight):
        return zero_centered_rms_norm(x, weight, eps)
    return _on_local_rows(_npu_zero_centered_norm, x, weight, eps)


def _rotary_mul(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` by torch_npu on [batch, heads, seq, d], handed over in the
    [batch, seq, heads, d] layout (BSND, cos and sin [batch, seq, 1, d]), which the projections' output
    already has: no copy when ``x`` is their transposed view, as in attention."""
    out = _torch_npu().npu_rotary_mul(x.transpose(1, 2).contiguous(), cos.transpose(1, 2), sin.transpose(1, 2))
    return out.transpose(1, 2)


class _NpuRope(torch.autograd.Function):
    """RoPE's gradient is RoPE with ``-sin``: the transpose of ``rotate_half`` is ``-rotate_half``, and
    ``rotate_half(g * sin) = rotate_half(g) * sin`` because each table holds its frequencies twice
    (``rope_cos_sin``). So only cos and sin are kept, which every layer shares."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return _rotary_mul(x, cos, sin)
    return torch.cat((_rotary_mul(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)  # partial rotary


def npu_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` by torch_npu's ``npu_rotary_mul`` (partial rotary included); cos and sin take no
    gradient (positions are data)."""
    return _NpuRope.apply(x, cos, sin)


def npu_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch_npu's fused SwiGLU on [gate | up]: it keeps the concatenation for backward, the bytes of the
    gate and up that ours keeps (the projections' outputs are freed)."""
    return _torch_npu().npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


CPU_KERNELS = ElementwiseKernels()
CUDA_EAGER_KERNELS = ElementwiseKernels(norm=fused_rms_norm, zero_centered_norm=fused_zero_centered_rms_norm)
NPU_KERNELS = ElementwiseKernels(norm=npu_rms_norm, zero_centered_norm=npu_zero_centered_rms_norm,
                                 rope=npu_apply_rope, swiglu=npu_swiglu)


def elementwise_kernels(device_type: str, compiled: bool = False) -> ElementwiseKernels:
    """The kernels for ``device_type`` ("cpu", "cuda", "npu"); ``compiled``: the layers are compiled, so
    inductor fuses our operators on CUDA (keeping transformers' numerics) and no fused operator is needed."""
    if device_type == "npu":
        return NPU_KERNELS
    if device_type == "cuda" and not compiled:
        return CUDA_EAGER_KERNELS
    return CPU_KERNELS
