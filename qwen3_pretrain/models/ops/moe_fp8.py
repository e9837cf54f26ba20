"""A MoE layer's routed experts in FP8: an ``ExpertsKernel`` (``models/ops/moe.py``) whose three grouped
matmuls per layer cast their operands to FP8 with dynamic scales (torchao's MoE training path).

Recipes (chosen from the run's ``fp8``, ``fp8_experts_recipe``):

- ``rowwise``: e4m3 operands, one power-of-two scale per row of each operand along the matmul's contraction
  (per token for activations and output gradients, per output column of each expert for the weights; in the
  weight gradient per column within each expert's run of tokens). torchao's FP8 grouped GEMM
  (``_to_fp8_rowwise_then_scaled_grouped_mm``: Triton casts and ``torch._scaled_grouped_mm``), on Hopper
  (compute capability 9.0). Each expert's run is padded to a multiple of 16 rows (the kernel's rule). The
  experts of every dense recipe (tensorwise included: torchao has no tensorwise grouped GEMM) take it.
- ``mxfp8``: blocks of 32 elements along the contraction sharing a power-of-two scale (torchao's
  ``_to_mxfp8_then_scaled_grouped_mm``), Blackwell (compute capability 10.0); runs padded to 32 rows.

Emulation (``fp8_emulate``; the CPU, A100, NPUs): ``rowwise`` is computed here in plain torch with the same
casts (scaled, rounded to e4m3, scaled back; exact in bf16 and fp32) and the grouped matmul of the
device in the operands' dtype, so the numerics are the recipe's and the CPU tests exercise them; torchao's
emulated MXFP8 grouped GEMM does not run its backward on the CPU (it asserts a contiguous gradient), so under
emulation ``mxfp8`` experts take the rowwise casts too (the start-up table names the kernel).

Where the device has no FP8 grouped GEMM and emulation is off (Ada, compute capability 8.9, has FP8 matmuls
for the projections but torch's scaled grouped GEMM is Hopper's and Blackwell's), ``fp8_experts_kernel``
returns None and the experts keep their high-precision kernel: the start-up table's ``experts`` row says
which. The expert weights stay high precision in any case (checkpoints unchanged), as the projections'.
"""

from __future__ import annotations

import torch

from qwen3_pretrain.models.ops.moe import _padded_call
from qwen3_pretrain.models.ops.swiglu import swiglu

E4M3_MAX = 448.0
# Rows each expert's run is padded to a multiple of: torch._scaled_grouped_mm's 16-byte rule for FP8 rows
# (rowwise), MXFP8's 32-element scale blocks along the tokens in the weight gradient.
ROWWISE_ALIGN, MXFP8_ALIGN = 16, 32
ROWWISE_CAPABILITY, MXFP8_CAPABILITY = (9, 0), (10, 0)


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """e4m3's largest value over ``amax``, rounded down to a power of two (torchao's rowwise rule)."""
    scale = E4M3_MAX / amax.float().clamp(min=1e-12)
    return torch.exp2(torch.floor(torch.log2(scale)))


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 at ``scale`` (broadcast), back in ``x``'s dtype: every value an FP8 value times a
    power of two, so exact in bf16."""
    return ((x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / scale).to(x.dtype)


def fp8_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` cast with one scale per slice along ``dim`` (the contraction): per row for dim -1."""
    return _cast(x, _pow2_scale(x.abs().amax(dim=dim, keepdim=True)))


def fp8_grouped_rows(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] cast with one scale per column within each group of rows (groups end at ``offsets``): the
    weight gradient's operands, whose contraction runs over one expert's tokens."""
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
    group = torch.repeat_interleave(torch.arange(sizes.numel(), device=x.device), sizes, output_size=x.shape[0])
    amax = x.new_zeros(sizes.numel(), x.shape[1], dtype=torch.float32).scatter_reduce(
        0, group.unsqueeze(1).expand(-1, x.shape[1]), x.abs().float(), "amax")
    return _cast(x, _pow2_scale(amax)[group])


class _EmulatedRowwiseGroupedMM(torch.autograd.Function):
    """Rows ``offsets[e-1]:offsets[e]`` of ``x`` [M, K] times ``weight[e]`` [N, K] transposed, each of the
    three matmuls (output, input gradient, weight gradient) on operands cast to e4m3 along its contraction."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        return torch._grouped_mm(fp8_rows(x, -1), fp8_rows(weight, -1).transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(fp8_rows(grad, -1), fp8_rows(weight, -2), offs=offsets)  # over N
        # [E, N, K]: each expert's grad rows^T times its x rows, over its tokens
        grad_w = torch._grouped_mm(fp8_grouped_rows(grad, offsets).t(), fp8_grouped_rows(x, offsets),
                                   offs=offsets)
        return grad_x, grad_w, None


def _rowwise_device(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    return _to_fp8_rowwise_then_scaled_grouped_mm(x, weight.transpose(-2, -1), offsets, out_dtype=x.dtype,
                                                  pad_token_groups_for_grouped_mm=False)


def _mxfp8_device(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    return _to_mxfp8_then_scaled_grouped_mm(x, weight.transpose(-2, -1), offsets, out_dtype=x.dtype)


class Fp8GroupedMM:
    """The experts' ``ExpertsKernel`` in FP8: ``recipe`` ``rowwise`` or ``mxfp8`` on the device's kernels, or
    ``rowwise`` emulated (``emulate``). Each expert's run padded to the kernel's alignment."""

    def __init__(self, recipe: str, emulate: bool = False) -> None:
        if recipe not in ("rowwise", "mxfp8"):
            raise ValueError(f"FP8 experts take rowwise or mxfp8, not {recipe!r}")
        self.recipe, self.emulate = ("rowwise" if emulate else recipe), emulate
        self.align = MXFP8_ALIGN if self.recipe == "mxfp8" else ROWWISE_ALIGN
        self.name = f"fp8_{self.recipe}_grouped_mm" + (" (emulated)" if emulate else "")
        self._mm = _EmulatedRowwiseGroupedMM.apply if emulate else \
            _mxfp8_device if self.recipe == "mxfp8" else _rowwise_device

    __call__ = _padded_call

    def compute(self, tokens, counts, weights, gate, up, down):
        offsets = counts.cumsum(0).to(torch.int32)
        h = swiglu(self._mm(tokens, gate, offsets), self._mm(tokens, up, offsets), weights)
        return self._mm(h.contiguous(), down, offsets)


def experts_recipe(recipe: str) -> str:
    """The experts' FP8 recipe under the run's ``fp8 <recipe>``: mxfp8's own, else rowwise (torchao's one FP8
    grouped GEMM; tensorwise has none)."""
    return "mxfp8" if recipe == "mxfp8" else "rowwise"


def fp8_experts_kernel(recipe: str, device: torch.device | str, emulate: bool,
                       capability: tuple[int, int] | None = None) -> Fp8GroupedMM | None:
    """The experts' FP8 kernel under ``fp8 <recipe>`` on ``device``, or None where the device has no FP8
    grouped GEMM for it and ``emulate`` is off (the experts keep their high-precision kernel)."""
    experts = experts_recipe(recipe)
    # the type by name: torch.device("npu") raises unless torch_npu is loaded (simulate --device 910b is not)
    device_type = str(device).split(":")[0]
    if device_type == "cuda" and not emulate:
        if capability is None:
            if not torch.cuda.is_available():
                # the scale simulation, building for a CUDA device on a host without one: torchao's kernels
                # cannot run on its fake CPU tensors, the emulated casts (same shapes, grouped matmuls) can
                return Fp8GroupedMM(experts, emulate=True)
            capability = torch.cuda.get_device_capability(device)
        need = MXFP8_CAPABILITY if experts == "mxfp8" else ROWWISE_CAPABILITY
        return Fp8GroupedMM(experts) if tuple(capability) >= need else None
    return Fp8GroupedMM(experts, emulate=True) if emulate else None
