"""FP8 projections (``models/ops/fp8.py``) on the parallel layouts: the tensor-parallel styles, FSDP2's FP8
all-gather on every backend, the per-step scale precompute, and what cannot be combined.

The FP8 projections are built into the model (a subclass of torchao's ``Float8Linear`` or ``MXFP8Linear``),
so pipeline stages, context parallelism (the projections see this rank's tokens, their weights whole),
expert parallelism (the dense projections around the experts are unchanged), activation checkpointing (a
recompute casts again, from the same values) and compile see them as they see ``nn.Linear``. Two things
need the layouts' help:

- Tensor parallelism: under ``tensorwise`` the column- and row-parallel projections take torchao's FP8 styles
  (``Float8ColwiseParallel``, ``Float8RowwiseParallel``): the input is cast to FP8 as a DTensor (its scale
  from the amax over the tp ranks, so every rank casts with the one scale the unsplit tensor has) and the
  output gradient is cast in backward before it travels. The row-wise recipes and MXFP8 keep the plain
  styles: their scales are per row or per block of 32 along the contraction, which torchao computes on the
  DTensors as on the whole tensors (torchao's FP8 styles assume one scale per tensor). On a CPU mesh every
  recipe keeps the plain styles (gloo cannot move FP8 tensors; ``float8_tensor_parallel_plan``).
- FSDP2's FP8 all-gather (``fp8_all_gather``, tensorwise): each weight is a ``WeightWithDynamicFloat8CastTensor``
  (built so by ``models/ops/fp8.py``) whose shard FSDP casts to FP8 before gathering, one byte a weight, with
  the scale the engine precomputes after each optimizer step over the whole weight (one all-reduce of the
  shards' maxima for all of them: ``Engine.refresh_fp8_scales``). gloo has no FP8 dtype, but a unit here is
  a decoder layer whose norms stay fp32 beside its FP8 weights, and FSDP2 gathers a unit of mixed dtypes as
  one uint8 buffer: the same bits, so the CPU layouts gather FP8 too.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from qwen3_pretrain.errors import ConfigError

# MXFP8's scale blocks span 32 elements along every matmul's contraction, the tokens' too (the weight gradient)
MX_BLOCK = 32


def check_fp8_layout(recipe: str | None, micro_batch_size: int, seq_length: int, cp: int) -> None:
    """ConfigError where ``fp8 <recipe>`` cannot run on the layout: under ``mxfp8`` the tokens one rank's
    projections see in a micro-batch (``micro_batch_size * seq_length / cp``) must fill whole blocks of 32,
    the contraction of the weight gradient's matmul. The other recipes take any token count."""
    if recipe != "mxfp8":
        return
    tokens = micro_batch_size * seq_length // cp
    if tokens % MX_BLOCK:
        raise ConfigError(f"fp8 mxfp8: a micro-batch gives each rank {tokens} tokens (micro-batch "
                          f"{micro_batch_size} x seq_length {seq_length} / cp {cp}), not a multiple of {MX_BLOCK} "
                          "(MXFP8's scale block, along the tokens in the weight gradient); choose seq_length or "
                          "the micro-batch so that it is, or fp8 rowwise")


def is_tensorwise(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao FP8 projection casting with one scale per tensor (the ``tensorwise``
    recipe), the scaling torchao's FP8 tensor-parallel styles assume."""
    config = getattr(module, "config", None)
    if config is None or not _is_float8_linear(module):
        return False
    from torchao.float8.config import ScalingGranularity
    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    return all(c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts)


def _is_float8_linear(module: nn.Module) -> bool:
    # The class's module path, so that a model without FP8 never imports torchao.
    if not any(cls.__module__.startswith("torchao.float8") for cls in type(module).__mro__):
        return False
    from torchao.float8.float8_linear import Float8Linear
    return isinstance(module, Float8Linear)


def float8_tensor_parallel_plan(model: nn.Module, plan: dict[str, ParallelStyle],
                                device_type: str) -> dict[str, ParallelStyle]:
    """``plan`` (module path -> style, ``parallel/tensor_parallel.py``) with the column- and row-parallel
    styles of ``tensorwise`` FP8 projections replaced by torchao's FP8 styles (same layouts); every other
    entry as it was. Not on a CPU mesh: the FP8 styles move FP8 tensors through DTensor's functional
    collectives (the output gradient's all-gather after a row-parallel projection), whose gloo backend has no
    FP8 dtype ("Invalid scalar type"); there the plain styles cast the same DTensors with the same global
    scales (torchao's DTensor rules reduce the maxima over tp), communicating in high precision."""
    swapped = [name for name, style in plan.items() if type(style) in (ColwiseParallel, RowwiseParallel)
               and is_tensorwise(model.get_submodule(name))]
    if device_type == "cpu" or not swapped:  # (a model without FP8 needs no torchao)
        return plan
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    out = dict(plan)
    for name in swapped:
        style = plan[name]
        fp8_style = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
        out[name] = fp8_style(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                              use_local_output=style.use_local_output)
    return out

