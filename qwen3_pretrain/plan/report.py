"""What ``qwen3-pretrain plan`` prints: the ranked table, and the notes under it that a decision needs
(tight rows, near-ties, what limits a row, what the figures rest on and leave out, the time to train, the
best row as training config keys). ``--json`` rows are ``Candidate.to_json`` (plan/search.py)."""

from __future__ import annotations

import argparse
from typing import Any

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.hardware import Hardware
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan.fp8 import FP8_EFFICIENCY_RATIO, fp8_peak_tflops
from qwen3_pretrain.plan.layout import Cluster, Layout
from qwen3_pretrain.plan.memory import OVERHEAD_FRACTION
from qwen3_pretrain.plan.search import Candidate, ties

def efficiency_source(args: argparse.Namespace, fitted: str = "") -> str:
    """Where the compute efficiency comes from, in words."""
    if fitted:
        return fitted
    if args.efficiency is not None:
        return "--efficiency"
    return ("the device table's compute_efficiency, calibrated on one published run: torchtitan's Llama-3.1-8B on "
            "8 x H100; --efficiency overrides")


def _dp_mode(lay: Layout) -> str:
    """How the data-parallel ranks hold the weights and reduce the gradients: ``replica`` (no distributed
    optimizer), ``fsdp`` (gathered per unit and micro-batch), ``gathered`` (once per step, Megatron's); ``/mb``
    where gradients are reduced every micro-batch."""
    mode = "replica" if not lay.distributed_optimizer else "gathered" if lay.keep_params_gathered else "fsdp"
    return mode + ("/mb" if lay.reduce_grads_every_microbatch and lay.pp == 1 else "")


def format_table(cfg: Qwen3Config, cluster: Cluster, hw: Hardware, candidates: list[Candidate], top: int) -> str:
    lines = [
        f"model: {cfg.num_params() / 1e9:.2f}B parameters, {cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size}; seq {candidates[0].layout.seq_length}, "
        f"{candidates[0].layout.mixed_precision}",
        f"cluster: {cluster.nodes} node(s) x {cluster.devices_per_node} {hw.name}: {hw.memory_gib:.1f} GiB, "
        f"{hw.peak_tflops_of(candidates[0].layout.mixed_precision):g} TFLOP/s peak x "
        f"{hw.compute_efficiency:.2f} efficiency, links {hw.intra_node_gbps:g} GB/s "
        f"intra / {hw.inter_node_gbps:g} GB/s inter node",
        f"memory overhead: {OVERHEAD_FRACTION:.0%} of allocations + {hw.runtime_reserved_gib:g} GiB runtime; "
        f"{len(candidates)} layout(s), {sum(c.fits for c in candidates)} fit",
        *([_routing_line(candidates[0].layout)] if cfg.is_moe else []),
        "",
        " #  tp cp pp dp shard ep  mbs gas recompute dp-mode  | params  grads  optim    act logits    ovh |  total fits "
        "| bubble  step s tok/s/dev   MFU   HFU  limit     "
        "| comm GB tp/cp/pp/ep/dp cross-node",
    ]
    for i, c in enumerate(candidates[:top], 1):
        lay, gib, step = c.layout, c.memory.gib(), c.step
        comm = "/".join(f"{v / 1e9:.1f}" for v in step.comm_bytes_per_axis.values())
        lines.append(
            f"{i:2d} {lay.tp:3d} {lay.cp:2d} {lay.pp:2d} {lay.dp:2d} {lay.shards:5d} {lay.ep:2d} "
            f"{lay.micro_batch_size:4d} "
            f"{lay.gradient_accumulation_steps:3d} "
            f"{lay.activation_checkpointing:9s} {_dp_mode(lay):8s} |"
            + "".join(f" {gib[k]:6.2f}" for k in ("parameters", "gradients", "optimizer", "activations", "logits",
                                                   "overhead"))
            + f" | {gib['total']:6.2f} {_fits(c):5s}| {step.bubble_fraction:6.1%} "
            f"{step.step_time_s:7.3f} {step.tokens_per_sec_per_device:9.1f} {step.mfu:5.1%} {step.hfu:5.1%}"
            f"{'+' if step.host_bound else ' '} {step.bottleneck:9s} | {comm} {step.cross_node_bytes / 1e9:.1f}")
    if any(c.step.host_bound for c in candidates[:top]):
        lines.append("+ host-bound: the host issues the layers' operators slower than the device computes them "
                     "(eager DTensor under tp, a Gated DeltaNet layer's loop over the sequence's chunks; "
                     "--compile)")
    if any(c.fits_if_balanced for c in candidates[:top]):
        lines.append("bal: fits only if the routing were perfectly balanced, not at the imbalance above; set "
                     "moe_capacity_factor to bound it, or choose a larger ep")
    if candidates[0].layout.mtp and cfg.mtp_num_hidden_layers:
        lines.append("the multi-token-prediction layer is trained: counted on the last stage, its FLOPs (time, "
                     "MFU, HFU) and its parameters, gradients, optimizer state and activations (memory)")
    return "\n".join(lines)


def parse_tokens(text: str) -> float:
    """A token budget: a number with an optional K, M, B (or G) or T suffix (``1T``, ``300B``, ``2.5e12``)."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(text.strip()[-1:].lower(), 1.0)
    number = text.strip()[:-1] if scale != 1.0 else text.strip()
    try:
        value = float(number) * scale
    except ValueError:
        raise UserError(f"--tokens {text!r} is not a token count: give a number with an optional K, M, B or T "
                        "suffix, e.g. 1T or 300B") from None
    if not value > 0:
        raise UserError(f"--tokens must be positive, got {text!r}")
    return value


def days_to_train(c: Candidate, tokens: float) -> float:
    """Days the layout takes for ``tokens`` at its predicted throughput (every device, no pauses)."""
    return tokens / (c.step.tokens_per_sec_per_device * c.layout.world_size) / 86400


def _yaml_value(value: Any) -> str:
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def format_notes(cfg: Qwen3Config, hw: Hardware, candidates: list[Candidate], top: int, args: argparse.Namespace,
                 fixed: dict[str, Any], efficiency_source: str) -> str:
    """What a reader needs beside the table to decide: the tight rows, the near-ties, what limits each row,
    what FSDP's traffic costs the best one, what the figures rest on and leave out, the time to train, and
    the best row as training config keys."""
    best, lay = candidates[0], candidates[0].layout
    lines = []
    if any(c.fits and not c.headroom for c in candidates[:top]):
        lines.append(f"tight: fits, but leaves less than {args.memory_margin:.0%} of the device's memory "
                     f"({args.memory_margin * hw.memory_gib:.1f} GiB) free (--memory-margin; the memory model is "
                     "within 5% of measured peaks on the CPU, unmeasured on devices): ranked after those that do")
    n = ties(candidates, args.tie_tolerance)
    if n > 1:
        lines.append(f"near-tie: rows 1-{n} are within {args.tie_tolerance:.0%} of row 1's predicted tokens/s "
                     "(--tie-tolerance), about the prediction's own uncertainty: it does not rank them; choose by "
                     "memory headroom and simplicity, or measure them")
    lines.append("limit: the largest term of a row's step time: matmul (FLOPs at the efficiency below), bandwidth "
                 "(FP8 casts, optimizer step), host (operators issued slower than computed), comm <axis> "
                 "(communication the compute does not hide), bubble (pipeline fill and drain)")
    step = best.step
    if step.dp_total_s:
        lines.append(f"row 1's FSDP traffic: {sum(step.dp_bytes_per_group.values()) / 1e9:.1f} GB per device per "
                     f"step ({step.cross_node_bytes / 1e9:.1f} GB of all its traffic across nodes), "
                     f"{step.dp_total_s:.3f} s of collectives, {step.comm_time_s['dp']:.3f} s of them exposed "
                     "(each hides only behind the compute running while it is in flight: docs/planner.md)")
    searched = [k for k in ("tp", "pp", "dp", "cp", "ep", "micro_batch_size", "activation_checkpointing",
                            "distributed_optimizer", "dp_shard", "keep_params_gathered")
                if k not in fixed and not (k == "ep" and not cfg.is_moe)
                and not (k == "dp" and all(d in fixed for d in ("tp", "pp", "cp")))]  # dp is then the rest
    lines.append("searched: " + (", ".join(searched) or "nothing") + "; fixed: "
                 + (", ".join(f"{k} {_yaml_value(v)}" for k, v in fixed.items()) or "nothing")
                 + (f" (from {args.config} and the flags)" if args.config else ""))
    lines += _basis_lines(cfg, hw, lay, args.commbench, efficiency_source)
    if args.tokens:
        tokens = parse_tokens(args.tokens)
        per_second = step.tokens_per_sec_per_device * lay.world_size
        lines.append(f"time to train {args.tokens} tokens at row 1: {lay.world_size} devices x "
                     f"{step.tokens_per_sec_per_device:,.0f} tokens/s = {per_second:,.0f} tokens/s: "
                     f"{days_to_train(best, tokens):,.1f} days (the predicted throughput, without restarts, "
                     "evaluation or checkpoint pauses)")
    lines.append("row 1 as training config keys (pretrain_config.yaml; JSON rows carry each row's as 'config'):")
    lines += [f"  {key}: {_yaml_value(value)}".rstrip() for key, value in best.config_keys().items()]
    return "\n".join(lines)


def _basis_lines(cfg: Qwen3Config, hw: Hardware, lay: Layout, commbench: str | None,
                 efficiency_source: str) -> list[str]:
    """What the figures rest on (the efficiency's source, FP8's calibration, datasheet or measured links) and
    what the step model leaves out for this model."""
    rests = [f"rests on: compute at {hw.compute_efficiency:.2f} of the {hw.peak_tflops_of(lay.mixed_precision):g} "
             f"TFLOP/s {lay.mixed_precision} peak ({efficiency_source})"]
    if lay.fp8 != "off":
        rests.append(f"FP8 projections at {FP8_EFFICIENCY_RATIO[lay.fp8]:.2f} x that share of the "
                     f"{fp8_peak_tflops(hw, lay.fp8):g} TFLOP/s FP8 peak (calibrated on torchao's published "
                     "tensorwise and rowwise speed-ups), casts at the memory bandwidth; routed experts rowwise")
    rests.append(f"{hw.name}'s peaks, memory bandwidth and links are datasheet figures, not measured on a device"
                 + (f"; links measured by commbench ({commbench})" if commbench else
                    " (--commbench FILE puts measured links in)"))
    lines = ["; ".join(rests)]
    unmodelled = ["compute slowed by the collectives it overlaps", "stragglers", "the data loader",
                  "checkpoint saves and evaluation"]
    if cfg.is_hybrid:
        unmodelled.append("the delta rule's kernel choice (priced as flash-linear-attention's chunked matmuls; "
                          "without it the engine's own chunk loop is slower)")
    if cfg.is_moe:
        unmodelled.append(f"routing skew beyond --moe-imbalance {lay.moe_imbalance:g} (priced: the heaviest ep "
                          "rank's memory, expert FLOPs and all-to-all time)")
    if cfg.mtp_num_hidden_layers and not lay.mtp:
        unmodelled.append("the multi-token-prediction layer (not trained here; --mtp counts it)")
    return [*lines, "not modelled: " + "; ".join(unmodelled)]


def _fits(c: Candidate) -> str:
    return ("yes" if c.headroom else "tight") if c.fits else "bal" if c.fits_if_balanced else "NO"


def _routing_line(lay: Layout) -> str:
    """How the memory columns take the MoE routing: the imbalance, and the capacity that bounds it."""
    line = (f"MoE routing: imbalance {lay.moe_imbalance:g} (the heaviest expert-parallel rank's pairs over its "
            "even share; --moe-imbalance, docs/planner.md)")
    if lay.moe_capacity_factor is not None:
        line += (f", capacity factor {lay.moe_capacity_factor:g}" + (" padded" if lay.moe_pad_to_capacity else "")
                 + f": the memory columns hold {lay.moe_rank_load:g}x an ep rank's even share")
    return line
