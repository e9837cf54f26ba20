"""The planner's search: every layout's predicted memory and step, ranked (fitting with a margin first, then
tight, then not fitting; each by throughput), the rows within the model's noise of the best, and the cheapest
change that makes a layout fit when none does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qwen3_pretrain.hardware import Hardware
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan.layout import Cluster, Layout, enumerate_layouts
from qwen3_pretrain.plan.memory import GiB, MemoryBreakdown, predict_memory
from qwen3_pretrain.plan.step import StepEstimate, predict_step

# A layout must leave this share of the device's memory free to count as fitting: the memory model is within
# 5% of measured peaks on the CPU (docs/planner.md, "Validation"), and nothing of it is measured on a device yet.
DEFAULT_MEMORY_MARGIN = 0.05
# Rows whose predicted tokens/s are within this share of the best row's are not ranked by the prediction:
# each term of the step model carries an error of that order (a compute efficiency calibrated on one run,
# the host term, datasheet link figures), so the order among them is the model's noise, not a finding.
DEFAULT_TIE_TOLERANCE = 0.05


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    step: StepEstimate
    fits: bool
    fits_if_balanced: bool = False  # does not fit at the layout's routing imbalance, would at perfect balance
    headroom: bool = True  # fits with the memory margin left free (``--memory-margin``)

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep,
            "micro_batch_size": lay.micro_batch_size,
            "gradient_accumulation_steps": lay.gradient_accumulation_steps,
            "activation_checkpointing": lay.activation_checkpointing,
            "distributed_optimizer": lay.distributed_optimizer, "dp_shard": lay.shards,
            "reduce_grads_every_microbatch": lay.reduce_grads_every_microbatch,
            "keep_params_gathered": lay.keep_params_gathered, "grad_reduce_dtype": lay.grad_reduce_dtype,
            "compile": lay.compile, "host_bound": self.step.host_bound, "memory_gib": self.memory.gib(),
            "bubble_fraction": round(self.step.bubble_fraction, 4), "step_time_s": round(self.step.step_time_s, 4),
            "tokens_per_sec_per_device": round(self.step.tokens_per_sec_per_device, 1),
            "mfu": round(self.step.mfu, 4), "hfu": round(self.step.hfu, 4),
            "mfu_full_square": round(self.step.mfu_full_square, 4), "fits": self.fits,
            "moe_imbalance": lay.moe_imbalance, "moe_rank_load": lay.moe_rank_load,
            "fits_if_balanced": self.fits_if_balanced, "fits_with_margin": self.fits and self.headroom,
            "bottleneck": self.step.bottleneck,
            "breakdown_s": {k: round(v, 4) for k, v in self.step.breakdown.items()},
            "dp_total_s": round(self.step.dp_total_s, 4), "dp_exposed_s": round(self.step.comm_time_s["dp"], 4),
            "fp8": self.layout.fp8, "fp8_all_gather": self.layout.fp8_all_gather,
            "global_batch_size": lay.global_batch_size, "peak_stage": self.memory.stage,
            "peak_moment": self.memory.moment,
            "comm_gb_per_step": {k: round(v / 1e9, 3) for k, v in self.step.comm_bytes_per_axis.items()},
            "dp_comm_gb_per_step": {k: round(v / 1e9, 3) for k, v in self.step.dp_bytes_per_group.items()},
            "cross_node_gb_per_step": round(self.step.cross_node_bytes / 1e9, 3),
            "config": self.config_keys(),
        }

    def config_keys(self) -> dict[str, Any]:
        """The training config keys (pretrain_config.yaml) that realise this layout on its cluster."""
        lay = self.layout
        keys: dict[str, Any] = {
            "rank_size": lay.world_size, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep,
            "batch_size": lay.micro_batch_size, "gradient_accumulation_steps": lay.gradient_accumulation_steps,
            "seq_length": lay.seq_length, "mixed_precision": lay.mixed_precision,
            "activation_checkpointing": lay.activation_checkpointing,
            "distributed_optimizer": lay.distributed_optimizer, "dp_shard": lay.dp_shard,
            "reduce_grads_every_microbatch": lay.reduce_grads_every_microbatch and lay.pp == 1,
            "keep_params_gathered": lay.keep_params_gathered, "grad_reduce_dtype": lay.grad_reduce_dtype,
            "compile": lay.compile}
        if lay.fp8 != "off":
            keys.update(fp8=lay.fp8, fp8_all_gather=lay.fp8_all_gather and lay.distributed_optimizer)
        if lay.moe_capacity_factor is not None:
            keys.update(moe_capacity_factor=lay.moe_capacity_factor, moe_pad_to_capacity=lay.moe_pad_to_capacity)
        if lay.pp > 1:
            keys.update(pp_schedule=lay.pp_schedule, pp_microbatch_size=lay.pp_microbatch_size)
            if lay.pp_schedule == "interleaved":
                keys["pp_virtual_stages"] = lay.virtual_stages
        return keys


def evaluate(cfg: Qwen3Config, layouts: list[Layout], hw: Hardware, cluster: Cluster,
             memory_margin: float = DEFAULT_MEMORY_MARGIN) -> list[Candidate]:
    """Predictions for every layout: those fitting with ``memory_margin`` of the device's memory left free
    first, then those fitting only inside it (tight), then the rest; each group by throughput to three digits
    (the model's precision), then by the bytes moved per step (what an overlap that falls short costs), those
    crossing nodes, then memory."""
    limit = hw.memory_gib * GiB
    out = []
    for layout in layouts:
        memory = predict_memory(cfg, layout, runtime_reserved_bytes=hw.runtime_reserved_gib * GiB)
        fits, balanced = memory.total <= limit, False
        headroom = memory.total <= limit * (1 - memory_margin)
        if not fits and layout.moe_rank_load > 1:  # would it fit were the routing perfectly even?
            even = layout.replace(moe_imbalance=1.0, moe_capacity_factor=None, moe_pad_to_capacity=False)
            balanced = predict_memory(cfg, even, runtime_reserved_bytes=hw.runtime_reserved_gib * GiB).total <= limit
        out.append(Candidate(layout, memory, predict_step(cfg, layout, hw, cluster), fits, balanced, headroom))
    return sorted(out, key=_rank)


def _rank(c: Candidate) -> tuple:
    return (not c.fits, not c.headroom, -float(f"{c.step.tokens_per_sec_per_device:.3g}"),
            sum(c.step.comm_bytes_per_axis.values()),
            c.step.cross_node_bytes, c.memory.total)


def search(cfg: Qwen3Config, cluster: Cluster, base: Layout, fixed: dict[str, Any], hw: Hardware,
           global_batch_size: int | None, memory_margin: float = DEFAULT_MEMORY_MARGIN) -> list[Candidate]:
    layouts = list(enumerate_layouts(cfg, cluster, base, global_batch_size, fixed))
    return evaluate(cfg, layouts, hw, cluster, memory_margin)


def suggest(cfg: Qwen3Config, cluster: Cluster, base: Layout, fixed: dict[str, Any], hw: Hardware,
            global_batch_size: int | None) -> str:
    """The smallest change that makes some layout fit, cheapest first: gradients kept sharded between
    micro-batches (no extra compute, the same fp32 sums), then relaxing one fixed setting, then more nodes."""
    options = []
    if not base.reduce_grads_every_microbatch:
        options.append((base.replace(reduce_grads_every_microbatch=True),
                        "with gradients reduced every micro-batch (--reduce-grads-every-microbatch)"))
    if base.grad_bytes == 4 and base.mixed_precision == "bf16":
        options.append((base.replace(grad_reduce_dtype="bf16"),
                        "with gradients accumulated and reduced in bf16 (--grad-reduce-dtype bf16)"))
    # each setting's best fitting layout; the better of them by the search's own order
    found = [(c, words) for layout, words in options
             for c in search(cfg, cluster, layout, fixed, hw, global_batch_size)[:1] if c.fits]
    if found:
        best, words = min(found, key=lambda cw: _rank(cw[0]))
        return f"{words} it fits, e.g. {_describe(best)}"
    relaxations = [("activation_checkpointing", "recompute (drop --activation-checkpointing)"),
                   ("micro_batch_size", "a smaller micro-batch (drop --micro-batch-size)"),
                   ("distributed_optimizer", "the distributed optimizer (--distributed-optimizer)"),
                   ("dp_shard", "sharding over all dp ranks (drop --dp-shard)"),
                   ("tp", "another tp (drop --tp)"), ("cp", "another cp (drop --cp)"), ("pp", "another pp (drop --pp)"),
                   ("dp", "drop --dp")]
    for key, words in relaxations:
        if key not in fixed:
            continue
        relaxed = {k: v for k, v in fixed.items() if k != key}
        fitting = [c for c in search(cfg, cluster, base, relaxed, hw, global_batch_size) if c.fits]
        if fitting:
            return f"with {words} it fits, e.g. {_describe(fitting[0])}"
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = Cluster(cluster.nodes * factor, cluster.devices_per_node)
        free = {k: v for k, v in fixed.items() if k not in ("dp",)}
        fitting = [c for c in search(cfg, bigger, base, free, hw, global_batch_size) if c.fits]
        if fitting:
            return f"with {bigger.nodes} nodes it fits, e.g. {_describe(fitting[0])}"
    return "no layout fits even on 64x the nodes; choose a smaller model or a device with more memory"


def _describe(c: Candidate) -> str:
    lay = c.layout
    shard = f" dp_shard {lay.shards}" if lay.replicas > 1 and lay.shards > 1 else ""
    ep = f" ep {lay.ep}" if lay.ep > 1 else ""
    kept = " weights kept gathered" if lay.keep_params_gathered else ""
    return (f"tp {lay.tp} cp {lay.cp} pp {lay.pp} dp {lay.dp}{shard}{ep}{kept} micro-batch {lay.micro_batch_size} "
            f"recompute {lay.activation_checkpointing} at {c.memory.total / GiB:.1f} GiB")


def ties(candidates: list[Candidate], tolerance: float) -> int:
    """How many rows from the top are within ``tolerance`` of the best row's predicted tokens/s, among those
    ranked alike on memory (fitting with the margin, tight, not fitting)."""
    best = candidates[0]
    n = 1
    for c in candidates[1:]:
        if (c.fits, c.headroom) != (best.fits, best.headroom) or \
                c.step.tokens_per_sec_per_device < (1 - tolerance) * best.step.tokens_per_sec_per_device:
            break
        n += 1
    return n
