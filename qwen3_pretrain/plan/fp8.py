"""FP8 training in the planner: which matmuls run in FP8, at what speed, with what casts, memory and bytes.

The training config's ``fp8`` recipe (torchao's float8 training) swaps the
decoder layers' projections for FP8 ones when the model is built; the LM head,
the embedding and the MoE router stay in bf16 (the planner's ``head_flops``
and parameters of those are untouched here). What the planner prices:

* **matmuls**: the FP8 projections' FLOPs (attention's q, k, v, o; a Gated
  DeltaNet's input and output projections; a dense MLP's gate, up, down; a MoE
  block's shared expert; its routed experts' grouped matmuls under the recipes
  of ``layout.FP8_EXPERT_RECIPES``, rowwise-scaled whatever the projections'
  recipe, MXFP8 under ``mxfp8``: ``expert_recipe``) at the device's FP8 peak x the bf16 efficiency x
  ``FP8_EFFICIENCY_RATIO`` (FP8 GEMMs reach a smaller share of their peak, and
  the scaling's small kernels are not in the FLOPs; calibrated below).
  ``rowwise_with_gw_hp`` keeps the weight-gradient matmul (one of the three
  of training) in bf16. The multi-token-prediction layer's projections are
  priced in bf16 (the engine's ``fp8_filter`` may include them; one layer);
  the ``fp8_filter`` is not read: every decoder projection counts;
* **casts**, priced as bytes at the device's memory bandwidth: per token and
  FP8 linear, its input and output gradient cast twice (once per operand
  layout the forward, the input-gradient and the weight-gradient matmuls
  need: ``2 (in + out)`` elements; the forward input once more under full
  recompute); per micro-batch each FP8 weight twice (forward and backward,
  once more under full recompute). An element costs 3 bytes compiled (read
  bf16, write FP8: the absolute-maximum reduction fuses into the read) and 5
  eager (the maximum is a read of its own);
* **all-gather**: with ``fp8_all_gather`` (tensorwise only) FSDP gathers the
  FP8 projections' weights at one byte per weight (their scales precomputed
  by one all-reduce of one value per weight per step), the other weights in
  bf16;
* **memory**: without FP8 all-gather, the FP8 copy of the weights of the layer
  computing (1 B per weight, and its scales: one fp32 per tensor, or per
  row and column for the rowwise recipes) beside its bf16 gathered copy; with
  it, the gathered projections take 1 B per weight in place of 2. The
  activations kept for backward are not changed (torchao keeps the
  high-precision inputs and casts again in backward, as priced above).

Devices without FP8 matmuls (no ``fp8_tflops`` in the device table: the 910B,
the A100, the CPU) are refused with a line naming the device and the key;
MXFP8 needs Blackwell (``mxfp8_tflops``).
"""

from __future__ import annotations

from typing import Any

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.hardware import Hardware
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan.layers import _attention_widths
from qwen3_pretrain.plan.layout import LayerKind, Layout, StageShape

# Achieved share of the FP8 peak over the bf16 one's (``Hardware.compute_efficiency``), per recipe.
# Calibrated on torchao's published Llama3-8B runs with torchtitan on 8 x H100 (FSDP, seq 8192, compiled):
# 5,760 tokens/s in bf16, 7,186 with tensorwise scaling and FP8 all-gather (+25%), 6,424 with rowwise
# (+12%). This model, with the casts above priced at the memory bandwidth, gives those ratios for Qwen3-8B on
# the planner's calibration layout (8 x H100, FSDP, seq 8192, micro-batch 1, MLP recompute, compiled: 5,731
# tokens/s in bf16) at 0.70 (7,191, +25.5%) and 0.60 (6,359, +11.0%). MXFP8 has no comparable published
# figure: it takes tensorwise's until one is measured.
FP8_EFFICIENCY_RATIO: dict[str, float] = {"tensorwise": 0.70, "rowwise": 0.60, "rowwise_with_gw_hp": 0.60,
                                          "mxfp8": 0.70}


def fp8_peak_tflops(hw: Hardware, recipe: str) -> float:
    """The device's dense FP8 (MXFP8 for ``mxfp8``) peak in TFLOP/s; a UserError where it has none."""
    if recipe == "mxfp8":
        peak = getattr(hw, "mxfp8_tflops", None)
        if not peak:
            raise UserError(f"fp8 mxfp8: the {hw.name} has no MXFP8 matmuls (Blackwell: b200); use fp8 "
                            "tensorwise or rowwise on Hopper, or fp8 off")
        return float(peak)
    peak = getattr(hw, "fp8_tflops", None)
    if not peak:
        raise UserError(f"fp8 {recipe}: the {hw.name} has no FP8 matmuls (no FP8 peak in the device table); "
                        "plan it with --fp8 off (fp8: off in the training config)")
    return float(peak)


def _linears(cfg: Qwen3Config, layout: Layout, kind: LayerKind) -> list[tuple[float, float, int, str]]:
    """The FP8 linears of one layer of ``kind`` as (in, out, uses per token, part): ``uses`` is 1, or
    ``top_k`` for the routed experts' (one expert's projection, applied per pair); ``part`` is ``mixer``
    (attention's), ``mlp`` (a dense MLP's), ``shared`` (a MoE block's shared expert) or ``experts``."""
    h = cfg.hidden_size
    out: list[tuple[float, float, int, str]] = []
    if not kind.linear:
        q_out, kv_out = _attention_widths(cfg)
        out += [(h, q_out * (2 if cfg.is_hybrid else 1), 1, "mixer"), (h, kv_out, 1, "mixer"),
                (h, kv_out, 1, "mixer"), (q_out, h, 1, "mixer")]
    else:  # a Gated DeltaNet's input projections (q, k, v and z; b and a, one value per head, left out)
        conv, value = 2 * cfg.linear_key_dim + cfg.linear_value_dim, cfg.linear_value_dim
        out += [(h, conv, 1, "mixer"), (h, value, 1, "mixer"), (value, h, 1, "mixer")]
    if not kind.sparse:
        i = cfg.intermediate_size
        return out + [(h, i, 1, "mlp"), (h, i, 1, "mlp"), (i, h, 1, "mlp")]
    if cfg.shared_expert_intermediate_size:
        i = cfg.shared_expert_intermediate_size
        out += [(h, i, 1, "shared"), (h, i, 1, "shared"), (i, h, 1, "shared")]
    if layout.fp8_experts:
        i, k = cfg.moe_intermediate_size, cfg.num_experts_per_tok
        out += [(h, i, k, "experts"), (h, i, k, "experts"), (i, h, k, "experts")]
    return out


def _tp_split(layout: Layout, part: str) -> int:
    """How many ranks split a part's weights and tokens over tp: attention and a dense MLP over tp; a MoE
    block runs whole on every tp rank (``layers.layer_params``)."""
    return layout.tp if part in ("mixer", "mlp") else 1


ALL_PARTS = ("mixer", "mlp", "shared", "experts")
GATHERED_IN_FP8 = ("mixer", "mlp", "shared")  # FP8 all-gather covers the FP8 linears' weights, not the experts'


def fp8_weight_params(cfg: Qwen3Config, layout: Layout, kind: LayerKind, parts: tuple[str, ...] = ALL_PARTS
                      ) -> float:
    """Weights of one layer of ``kind`` on a rank that are FP8 projections (attention's and a dense MLP's
    split over tp, a shared expert whole, the rank's ``1 / ep`` of the routed experts), of ``parts``."""
    if layout.fp8 == "off":
        return 0.0
    return sum(n_in * n_out * (cfg.num_experts / layout.ep if part == "experts" else 1 / _tp_split(layout, part))
               for n_in, n_out, _, part in _linears(cfg, layout, kind) if part in parts)


def expert_recipe(layout: Layout) -> str:
    """The scaling the routed experts' FP8 grouped matmuls use: MXFP8 under ``mxfp8``, rowwise otherwise
    (torchao has no tensorwise grouped GEMM; models/ops/moe_fp8.py)."""
    return "mxfp8" if layout.fp8 == "mxfp8" else "rowwise"


def fp8_expert_flops_per_token(cfg: Qwen3Config, layout: Layout, kind: LayerKind) -> float:
    """Of ``fp8_flops_per_token``, the routed experts' (at ``expert_recipe``'s speed)."""
    return fp8_flops_per_token(cfg, layout, kind, parts=("experts",))


def fp8_flops_per_token(cfg: Qwen3Config, layout: Layout, kind: LayerKind,
                        parts: tuple[str, ...] = ("mixer", "mlp", "shared", "experts")) -> float:
    """Hardware FLOPs of one layer of ``kind`` per local token that run in FP8 (forward, backward and what
    recompute runs again; all tp ranks together, as ``layers.flops_per_token`` counts them, which these are
    part of): 6 per weight and use, 2 more where full recompute reruns a projection (MLP recompute: the
    gate and up ones; a dense MLP's down projection is not rerun, torch's checkpoint stops before it; a MoE
    block's whole on every tp rank counts ``tp`` times, as there); ``rowwise_with_gw_hp``: the weight
    gradient's third in bf16."""
    if layout.fp8 == "off":
        return 0.0
    ac, h = layout.activation_checkpointing, cfg.hidden_size
    repeat = layout.tp if kind.sparse and not layout.moe_tokens_split_by_tp else 1
    total = 0.0
    for n_in, n_out, uses, part in _linears(cfg, layout, kind):
        if part not in parts:
            continue
        tail = part == "mlp" and n_out == h  # the dense MLP's down projection
        rerun = (ac == "full" or (ac == "mlp" and part != "mixer")) and not tail
        high_weight_grad = layout.fp8 == "rowwise_with_gw_hp" and part != "experts"
        passes = (2 if high_weight_grad else 3) + (1 if rerun else 0)
        total += 2.0 * n_in * n_out * uses * passes * (repeat if part in ("shared", "experts") else 1)
    return total


def cast_bytes_per_token(cfg: Qwen3Config, layout: Layout, kind: LayerKind) -> float:
    """Bytes one rank moves per local token casting one layer's activations and gradients to FP8: ``2 (in +
    out)`` elements per linear and use (the forward input once more under full recompute), on the rank's
    share of each projection's output (column-parallel) or input (row-parallel), 3 bytes each compiled,
    5 eager."""
    if layout.fp8 == "off":
        return 0.0
    per = 3.0 if layout.compile else 5.0
    recompute = layout.activation_checkpointing == "full"
    return per * sum(uses * ((2 + recompute) * n_in + 2 * n_out) / _tp_split(layout, part)
                     for n_in, n_out, uses, part in _linears(cfg, layout, kind))


def weight_cast_bytes(cfg: Qwen3Config, layout: Layout, shape: StageShape) -> float:
    """Bytes one rank moves per micro-batch casting its stage's FP8 weights: twice (forward, backward's
    transposed operand; three times under full recompute), 3 or 5 bytes per weight as above; with FP8
    all-gather the cast runs once per gather on the rank's shard (``1 / shards`` of it) instead."""
    if layout.fp8 == "off":
        return 0.0
    per = 3.0 if layout.compile else 5.0
    casts = 3 if layout.activation_checkpointing == "full" else 2
    weights = sum(n * fp8_weight_params(cfg, layout, kind) for kind, n in shape.layer_kinds)
    if layout.fp8_all_gather:  # the gathered ones cast on the shard, the experts' as without
        gathered = sum(n * fp8_weight_params(cfg, layout, kind, GATHERED_IN_FP8) for kind, n in shape.layer_kinds)
        return per * (2 * gathered / layout.shards + casts * (weights - gathered))
    return per * casts * weights


def scale_bytes(cfg: Qwen3Config, layout: Layout, kind: LayerKind) -> float:
    """The fp32 scales of one layer's FP8 weights: one per tensor (tensorwise), one per row and one per column
    (rowwise, for the two operand layouts), one per 32 values (MXFP8, one byte each)."""
    if layout.fp8 == "off":
        return 0.0
    if layout.fp8 == "mxfp8":
        return fp8_weight_params(cfg, layout, kind) / 32 * 2
    linears = _linears(cfg, layout, kind)
    if layout.fp8 == "tensorwise":
        return 4.0 * len(linears)
    return sum(4.0 * (n_in + n_out) * (cfg.num_experts / layout.ep if part == "experts" else 1)
               / _tp_split(layout, part) for n_in, n_out, _, part in linears)


def gathered_weight_delta(cfg: Qwen3Config, layout: Layout, shape: StageShape, layers_gathered: float) -> float:
    """Bytes FP8 adds to (negative: saves from) the gathered weights of the stage's peak moments with
    ``layers_gathered`` decoder layers gathered (of its largest kind): without FP8 all-gather the layer
    computing has an FP8 copy of its projections and their scales beside its bf16 weights; with it the
    gathered projections are 1 byte per weight in place of the compute dtype's."""
    if layout.fp8 == "off" or not shape.num_layers:
        return 0.0
    kind = max((k for k, _ in shape.layer_kinds), key=lambda k: fp8_weight_params(cfg, layout, k))
    weights, scales = fp8_weight_params(cfg, layout, kind), scale_bytes(cfg, layout, kind)
    if layout.fp8_all_gather:  # the routed experts (not gathered in FP8) keep their FP8 copy
        gathered = fp8_weight_params(cfg, layout, kind, GATHERED_IN_FP8)
        return layers_gathered * ((1 - layout.dtype_bytes) * gathered + scales) + weights - gathered
    return weights + scales


def describe(layout: Layout) -> dict[str, Any]:
    """The FP8 settings a plan row carries (its JSON)."""
    return {"recipe": layout.fp8, "all_gather": layout.fp8_all_gather, "experts": layout.fp8_experts}
