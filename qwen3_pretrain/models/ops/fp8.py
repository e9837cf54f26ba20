"""FP8 projections through torchao: the class a decoder layer's projections are built with under ``fp8``.

FP8 is a projection class chosen when the model is built, as ``Fp32Linear``
is for numerics (``models/ops/precision.py``): ``ModelOptions.projections`` is
an ``Fp8Projections``, asked for each decoder-layer projection by its module
path (``layers.3.attn.q_proj``, ``layers.3.mlp.down_proj``,
``mtp.layers.0.mlp.shared_expert.up_proj``, ``layers.0.linear_attn.out_proj``)
and answering with the class that builds it. Nothing is swapped afterwards, so
FSDP, tensor parallelism and compile see the final modules.

Recipes (``fp8`` in the training config), all torchao's dynamic scaling (the
scale of a cast is computed from the tensor being cast, never from history):

- ``tensorwise``: one scale per tensor for the input, the weight and the output
  gradient; all three matmuls (output, input gradient, weight gradient) in FP8
  (e4m3 forward, e5m2 gradients). The fastest on Hopper, and the only recipe
  whose weights FSDP2 can all-gather in FP8 (``fp8_all_gather``: one byte a
  weight on the wire instead of two; the scales of every weight are computed
  in one all-reduce per step after the optimizer step, ``precompute_scales``).
- ``rowwise``: one scale per row (per token for activations and gradients, per
  output row for the weight), scales rounded to powers of two; e4m3 everywhere.
  More accurate than tensorwise where a few rows carry outliers; slower.
- ``rowwise_with_gw_hp``: rowwise, with the weight gradient computed in high
  precision (its operands are the least FP8-friendly: torchao's recommended
  accuracy recipe).
- ``mxfp8``: MX blocks of 32 elements sharing a power-of-two scale (torchao's
  ``MXFP8Linear``); Blackwell only (its block-scaled matmuls are sm_100's).

Which projections: those of the decoder layers (attention's q/k/v/o, the MLP's
and a shared expert's gate/up/down, a Gated DeltaNet layer's input and output
projections, the multi-token-prediction layer's) whose two dimensions are
multiples of 16 (32 for mxfp8): what the FP8 matmul kernels accept
(``fp8_accepts``). Never the LM head, the embedding, a MoE router or the
shared expert's 1-wide gate (they stay in the base class); the routed experts'
grouped matmuls are the MoE kernel's business (``models/ops/moe.py``).
``fp8_filter`` narrows the choice by module path (``Fp8Filter``).

Parameters, their names and their dtype are ``nn.Linear``'s: the weights stay
in high precision (fp32 master weights, bf16 compute copies under FSDP's mixed
precision), so checkpoints, optimizer state, merge and HF export are the same
with FP8 on or off, and a run can switch FP8 on or off at a resume. Only the
matmuls' operands are cast, in forward and backward.

Devices: FP8 tensor cores exist on CUDA devices of compute capability 8.9 and
above (Ada, Hopper: H100, H200), MXFP8 on 10.0 and above (Blackwell: B200).
Elsewhere (Ascend 910B, A100, the CPU) ``check_device`` refuses ``fp8`` unless
``fp8_emulate`` is set: torchao then dequantizes and multiplies in high
precision, so the numerics are FP8's (every operand rounded to e4m3/e5m2 with
its scale) but the speed is not (slower than bf16). That is what the CPU tests
run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from qwen3_pretrain.errors import UserError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
# The torchao release whose APIs this module uses (Float8LinearConfig.from_recipe_name with these names,
# Float8Linear(config=...), WeightWithDynamicFloat8CastTensor, precompute_float8_dynamic_scale_for_fsdp,
# prototype.moe_training's MXFP8Linear).
TORCHAO_MIN = (0, 18)
# Compute capabilities with FP8 tensor cores (Ada/Hopper) and with MX block-scaled FP8 (Blackwell).
FP8_CAPABILITY = (8, 9)
MXFP8_CAPABILITY = (10, 0)


def torchao_version() -> tuple[int, int] | None:
    """torchao's (major, minor), or None when it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        text = version("torchao")
    except PackageNotFoundError:
        return None
    parts = [int("".join(ch for ch in part if ch.isdigit()) or 0) for part in text.split(".")[:2]]
    return parts[0], parts[1] if len(parts) > 1 else 0


def require_torchao() -> None:
    """UserError unless a torchao recent enough for ``fp8`` is installed."""
    found = torchao_version()
    need = ".".join(map(str, TORCHAO_MIN))
    if found is None:
        raise UserError(f"fp8 needs torchao >= {need}: pip install 'qwen3-pretrain[fp8]' (or pip install torchao)")
    if found < TORCHAO_MIN:
        raise UserError(f"fp8 needs torchao >= {need}, found {found[0]}.{found[1]}: pip install -U torchao")


def fp8_accepts(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether the FP8 kernels take a projection of these dimensions: both multiples of 16 (torch._scaled_mm's
    rule for its operands' dimensions), of 32 for mxfp8 (its scale blocks span 32 elements)."""
    multiple = 32 if recipe == "mxfp8" else 16
    return in_features % multiple == 0 and out_features % multiple == 0


@dataclass(frozen=True)
class Fp8Filter:
    """Which projections ``fp8_filter`` leaves in FP8, by module path (``layers.3.mlp.down_proj``).

    A plain entry excludes every projection whose path contains it (torchtitan's ``filter_fqns``
    convention: ``down_proj``, ``layers.0.``, ``shared_expert``). Entries starting with ``+`` restrict FP8 to
    the paths containing one of them (``+mlp.``: only the MLPs); exclusions apply after. Empty: every
    projection the kernels accept."""

    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: list[str] | tuple[str, ...]) -> Fp8Filter:
        include = tuple(e[1:] for e in entries if e.startswith("+"))
        return cls(exclude=tuple(e for e in entries if not e.startswith("+")), include=include)

    def keeps(self, name: str) -> bool:
        if self.include and not any(part in name for part in self.include):
            return False
        return not any(part in name for part in self.exclude)


def float8_config(recipe: str, emulate: bool = False, all_gather: bool = False):
    """torchao's ``Float8LinearConfig`` for ``recipe`` (not mxfp8). ``emulate``: the matmuls dequantize and
    multiply in high precision (devices without FP8 tensor cores); ``all_gather``: FSDP2 gathers the
    weights in FP8 (tensorwise only)."""
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig
    config = Float8LinearConfig.from_recipe_name(recipe)
    return replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


@functools.cache
def _fp8_linear_class() -> type[nn.Linear]:
    """``Fp8Linear``, defined on first use so that importing this module does not import torchao."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    class Fp8Linear(Float8Linear):
        """torchao's ``Float8Linear`` built as an ``nn.Linear`` is (``Fp8Linear(in, out, bias=False,
        config=...)``), with the FSDP2 FP8 all-gather weight wrapper applied at construction when the config
        asks for it. Its parameters are ``nn.Linear``'s (``weight``, ``bias``), in high precision."""

        def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                     config) -> None:
            super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype, config=config)
            if config.enable_fsdp_float8_all_gather:
                # The weight as a tensor subclass whose FSDP2 all-gather casts the local shard to FP8 first (with
                # the scale precompute_scales computed over the whole weight) and gathers one byte a weight.
                self.weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(
                    self.weight, self.linear_mm_config, config.cast_config_weight.target_dtype),
                    requires_grad=self.weight.requires_grad)

    Fp8Linear.__module__ = __name__
    return Fp8Linear


@functools.cache
def _mxfp8_linear_class() -> type[nn.Linear]:
    """``Mxfp8Linear``, defined on first use (torchao's prototype module)."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    class Mxfp8Linear(MXFP8Linear):
        """torchao's ``MXFP8Linear`` (blocks of 32 sharing a power-of-two scale), built as an ``nn.Linear``."""

    Mxfp8Linear.__module__ = __name__
    return Mxfp8Linear


def fp8_linear_class() -> type[nn.Linear]:
    """The FP8 projection class (tensorwise/rowwise recipes): a subclass of torchao's ``Float8Linear``."""
    return _fp8_linear_class()


def mxfp8_linear_class() -> type[nn.Linear]:
    """The MXFP8 projection class: a subclass of torchao's ``MXFP8Linear``."""
    return _mxfp8_linear_class()


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` multiplies in FP8 (an FP8 or MXFP8 projection)."""
    if torchao_version() is None:
        return False
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    return isinstance(module, (Float8Linear, MXFP8Linear))


@dataclass(frozen=True)
class Fp8Projections:
    """The per-projection class choice under ``fp8`` (``ModelOptions.projections``): called with a decoder
    layer projection's module path, returns what builds it (called as ``make(in, out, bias=False)``).

    ``recipe``: one of ``RECIPES``; ``base``: the class of the projections left in high precision (the
    engine's ``nn.Linear`` or ``Fp32Linear``); ``emulate``: the FP8 matmuls dequantize and multiply in high
    precision (no FP8 tensor cores here); ``all_gather``: FSDP2 gathers the FP8 weights in FP8
    (tensorwise); ``filter``: ``Fp8Filter``."""

    recipe: str
    base: type[nn.Linear] = nn.Linear
    emulate: bool = False
    all_gather: bool = False
    filter: Fp8Filter = field(default_factory=Fp8Filter)

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise UserError(f"fp8: {self.recipe!r} is not one of {', '.join(RECIPES)}")
        if self.all_gather and self.recipe != "tensorwise":
            raise UserError(f"fp8_all_gather needs fp8 tensorwise (it is {self.recipe}): only one scale per "
                            "weight can be computed before the gather")
        require_torchao()

    def __call__(self, name: str) -> Callable[..., nn.Linear]:
        if not self.filter.keeps(name):
            return self.base
        return functools.partial(self._make, name)

    def _make(self, name: str, in_features: int, out_features: int, bias: bool = True, **kwargs) -> nn.Linear:
        if not fp8_accepts(in_features, out_features, self.recipe):
            return self.base(in_features, out_features, bias=bias, **kwargs)
        if self.recipe == "mxfp8":
            from torchao.quantization.quantize_.common import KernelPreference
            preference = KernelPreference.EMULATED if self.emulate else KernelPreference.AUTO
            return mxfp8_linear_class()(in_features, out_features, bias=bias, kernel_preference=preference,
                                        **kwargs)
        config = _float8_config_cached(self.recipe, self.emulate, self.all_gather)
        return fp8_linear_class()(in_features, out_features, bias=bias, config=config, **kwargs)

    def describe(self) -> str:
        """One log line's worth: the recipe and its modifiers."""
        extras = [e for e, on in (("FP8 all-gather", self.all_gather), ("emulated", self.emulate)) if on]
        return self.recipe + (f" ({', '.join(extras)})" if extras else "")


@functools.cache
def _float8_config_cached(recipe: str, emulate: bool, all_gather: bool):
    return float8_config(recipe, emulate, all_gather)


def fp8_device_problem(recipe: str, device: torch.device | str, emulate: bool,
                       capability: tuple[int, int] | None = None) -> str | None:
    """Why ``fp8 <recipe>`` cannot run on ``device`` (one line naming the device and the key), or None.
    ``capability``: the CUDA device's compute capability (asked of torch when None). ``emulate``
    (``fp8_emulate``) allows every device: the FP8 numerics, computed in high precision."""
    if emulate:
        return None
    # the type by name: "npu" is a device type only once torch_npu is imported
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    fix = "set fp8_emulate true to run FP8's numerics in emulation (slower than bf16), or leave fp8 unset"
    if kind != "cuda":
        name = {"npu": "Ascend NPU (910B)", "cpu": "the CPU"}.get(kind, kind)
        return f"fp8 {recipe}: {name} has no FP8 tensor cores; {fix}"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    label = f"{torch.cuda.get_device_name(device) if torch.cuda.is_available() else 'CUDA device'} " \
            f"(compute capability {capability[0]}.{capability[1]})"
    need = MXFP8_CAPABILITY if recipe == "mxfp8" else FP8_CAPABILITY
    if tuple(capability) < need:
        what = "MXFP8 matmuls (they need compute capability 10.0: Blackwell)" if recipe == "mxfp8" \
            else "FP8 tensor cores (they need compute capability 8.9: Ada, Hopper)"
        return f"fp8 {recipe}: {label} has no {what}; {fix}"
    return None


def check_device(recipe: str, device: torch.device | str, emulate: bool,
                 capability: tuple[int, int] | None = None) -> None:
    """UserError where ``fp8 <recipe>`` cannot run on ``device`` (``fp8_device_problem``)."""
    problem = fp8_device_problem(recipe, device, emulate, capability)
    if problem:
        raise UserError(problem)


def needs_emulation(recipe: str, device: torch.device | str, capability: tuple[int, int] | None = None) -> bool:
    """Whether ``device`` lacks the recipe's FP8 matmuls, so that torchao must emulate them."""
    return fp8_device_problem(recipe, device, False, capability) is not None


def precompute_scales(model: nn.Module) -> None:
    """Under ``fp8_all_gather``: every FP8 weight's scale for the next step's FP8 all-gathers, from the
    updated weights, in one all-reduce of the per-shard maxima (call after each optimizer step)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    precompute_float8_dynamic_scale_for_fsdp(model)


def describe(projections: Fp8Projections, parts: list[nn.Module]) -> str:
    """The start-up log line under ``fp8``: the recipe, how many of the decoder layers' linear modules
    multiply in FP8 and their share of those modules' weights (the FP8 share of the layers' matmul FLOPs,
    routed experts aside); the rest (routers, narrow gates, projections the filter or the kernels' size rule
    keep out) stay in high precision."""
    fp8 = fp8_weights = other = other_weights = 0
    for part in parts:
        for name, module in part.named_modules():
            if not isinstance(module, nn.Linear) or not (name.startswith("layers.") or name.startswith("mtp.")):
                continue
            if is_fp8_linear(module):
                fp8, fp8_weights = fp8 + 1, fp8_weights + module.weight.numel()
            else:
                other, other_weights = other + 1, other_weights + module.weight.numel()
    share = fp8_weights / max(fp8_weights + other_weights, 1)
    return (f"fp8: {projections.describe()} | {fp8} projections in FP8 ({share:.1%} of the decoder layers' linear "
            f"weights), {other} in high precision (routers, narrow gates, filtered)")
