"""``qwen3-pretrain plan``: predicted memory and throughput of every parallel layout of a cluster.

Layouts that fit in device memory come first, fastest first. Fix any degree
(``--tp``, ``--pp``, ``--micro-batch-size`` ...) to narrow the search; read
them from the training config with ``--config``. When nothing fits, the
smallest change that would is named.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.config.loader import coerce, nearest, read_yaml
from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.hardware import DEVICES, Hardware, default_chunk_tokens, get_device, with_overrides
from qwen3_pretrain.models.qwen3.config import Qwen3Config, get_preset, is_preset_name
from qwen3_pretrain.parallel.dims import check_expert_split, check_model_split, sequence_split_problem
from qwen3_pretrain.plan.fp8 import fp8_peak_tflops
from qwen3_pretrain.plan.layout import (CHECKPOINTING, FP8_RECIPES, PP_SCHEDULES, PRECISIONS, Cluster, Layout,
                                        enumerate_layouts)
from qwen3_pretrain.plan.memory import GiB, OVERHEAD_FRACTION, MemoryBreakdown, predict_memory
from qwen3_pretrain.plan.step import StepEstimate, predict_step

# The default --moe-imbalance: the heaviest expert's load over the mean measured in a MoE model's first
# training steps (docs/planner.md, "Routing imbalance"); the heaviest ep rank, which holds E / ep experts,
# averages several and is below it, so this errs on the safe side.
DEFAULT_MOE_IMBALANCE = 2.0

# Training-config keys the planner reads, with their types; every other key is ignored.
CONFIG_KEYS: dict[str, Any] = {
    "model_name": str, "model_path": str | None, "model_overrides": dict, "rank_size": int | None,
    "tp": int, "pp": int, "cp": int, "ep": int, "seq_length": int, "batch_size": int, "gradient_accumulation_steps": int,
    "mixed_precision": str, "distributed_optimizer": bool, "gradient_checkpointing": bool,
    "activation_checkpointing": str | None, "pp_schedule": str, "pp_virtual_stages": int,
    "pp_microbatch_size": int, "loss_chunk_tokens": int | None, "document_mask": bool,
    "reduce_grads_every_microbatch": bool, "keep_params_gathered": bool, "grad_reduce_dtype": str, "compile": bool,
    "dp_shard": int | None, "mtp_loss_weight": float, "moe_capacity_factor": float | None,
    "moe_pad_to_capacity": bool, "fp8": str | None, "fp8_all_gather": bool,
}

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


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser("plan", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("model and training config")
    src.add_argument("--model", help="preset name (qwen3-0.6b ... qwen3-32b) or a HuggingFace model directory")
    src.add_argument("--config", help="training config YAML (pretrain_config.yaml): its model and layout keys")
    cl = p.add_argument_group("cluster")
    cl.add_argument("--nodes", type=int, help="number of nodes (default 1)")
    cl.add_argument("--devices-per-node", type=int, help="devices per node (default: the config's rank_size, or 8)")
    cl.add_argument("--device", default="h100", help=f"device kind: {', '.join(DEVICES)}")
    cl.add_argument("--device-memory-gib", type=float, help="override the device's memory")
    cl.add_argument("--peak-tflops", type=float, help="override the dense bf16 peak")
    cl.add_argument("--efficiency", type=float, help="override the achieved share of peak (0-1]")
    cl.add_argument("--intra-node-gbps", type=float, help="override the intra-node bus bandwidth, GB/s")
    cl.add_argument("--inter-node-gbps", type=float, help="override the per-device inter-node bus bandwidth, GB/s")
    cl.add_argument("--roofline", help="JSON of the roofline's predicted step time for one or more layouts of this "
                                       "model and device: the compute efficiency is fitted to it (docs/planner.md)")
    cl.add_argument("--commbench", help="JSON from 'qwen3-pretrain commbench --json': measured bandwidths and "
                                        "latencies replace the device table's")
    lay = p.add_argument_group("layout (fixed when given; searched otherwise)")
    lay.add_argument("--seq-length", type=int, help="tokens per sample (default: config, else 4096)")
    lay.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: micro-batch x dp "
                                                           "x gradient accumulation of each layout)")
    for name in ("tp", "pp", "dp", "micro-batch-size", "gradient-accumulation-steps"):
        lay.add_argument(f"--{name}", type=int)
    lay.add_argument("--cp", type=int, help="context-parallel degree (default: searched, with chunks of at least "
                                            "512 tokens)")
    lay.add_argument("--ep", type=int, help="expert-parallel degree of a MoE model, borrowed from dp_shard x cp x tp "
                                            "(default: searched, powers of two dividing the experts)")
    lay.add_argument("--activation-checkpointing", choices=CHECKPOINTING)
    lay.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None)
    lay.add_argument("--dp-shard", type=int, help="HSDP: shard over this many dp ranks (e.g. one node's), "
                                                   "replicate across them; must divide dp (default: all dp ranks)")
    lay.add_argument("--reduce-grads-every-microbatch", action=argparse.BooleanOptionalAction, default=None,
                     help="with gradient accumulation and pp 1: keep only sharded gradients between micro-batches")
    lay.add_argument("--keep-params-gathered", action=argparse.BooleanOptionalAction, default=None,
                     help="Megatron's accumulation: weights gathered once per step and kept through its "
                          "micro-batches, gradients reduced once (default: both searched)")
    lay.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="decoder layers compiled (compile: true): the host issues fewer operators")
    lay.add_argument("--grad-reduce-dtype", choices=PRECISIONS,
                     help="what gradients accumulate and are reduced in under bf16 (default fp32)")
    lay.add_argument("--mixed-precision", choices=PRECISIONS)
    lay.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                     help="the multi-token-prediction layer is trained (mtp_loss_weight > 0): count its FLOPs "
                          "and memory (default: the config's mtp_loss_weight, else off)")
    lay.add_argument("--moe-imbalance", type=float, default=DEFAULT_MOE_IMBALANCE,
                     help="MoE routing imbalance: the heaviest expert-parallel rank's received pairs over its "
                          f"even share (default {DEFAULT_MOE_IMBALANCE:g}, early training's measured skew: "
                          "docs/planner.md; 1 = perfect balance); a config's moe_capacity_factor bounds it")
    lay.add_argument("--moe-capacity-factor", type=float,
                     help="the training's moe_capacity_factor (default: the config's; none: dropless)")
    lay.add_argument("--moe-pad-to-capacity", action=argparse.BooleanOptionalAction, default=None,
                     help="the training's moe_pad_to_capacity (default: the config's)")
    lay.add_argument("--fp8", choices=FP8_RECIPES,
                     help="the training's fp8 recipe: the decoder layers' projections in FP8 (default: the "
                          "config's, else off); refused on devices without FP8 matmuls")
    lay.add_argument("--fp8-all-gather", action=argparse.BooleanOptionalAction, default=None,
                     help="FSDP all-gathers the FP8 projections' weights at one byte each (fp8 tensorwise; "
                          "default: the config's fp8_all_gather, else off)")
    lay.add_argument("--pp-schedule", choices=PP_SCHEDULES)
    lay.add_argument("--virtual-stages", type=int, help="stages per pipeline rank (interleaved schedule)")
    lay.add_argument("--pp-microbatch-size", type=int, help="samples per pipeline micro-batch")
    lay.add_argument("--loss-chunk-tokens", type=int,
                     help="tokens per chunk of the fused LM head + loss (default 4096; 1024 with --device cpu)")
    rank = p.add_argument_group("ranking")
    rank.add_argument("--memory-margin", type=float, default=DEFAULT_MEMORY_MARGIN,
                      help="share of the device's memory a layout must leave free to rank as fitting (default "
                           f"{DEFAULT_MEMORY_MARGIN:g}: the memory model's error on the CPU; those inside it are "
                           "'tight' and rank after)")
    rank.add_argument("--tie-tolerance", type=float, default=DEFAULT_TIE_TOLERANCE,
                      help="rows within this share of the best row's predicted tokens/s are reported as a tie "
                           f"(default {DEFAULT_TIE_TOLERANCE:g}: the step model's own uncertainty)")
    rank.add_argument("--tokens", help="a token budget (e.g. 1T, 300B, 2.5e12): the days the best row takes to "
                                       "train it")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print a JSON list, best first")
    out.add_argument("--top", type=int, default=10, help="rows to show")
    return p


# --- inputs -------------------------------------------------------------------------


def read_train_config(path: str) -> dict[str, Any]:
    """The planner's keys of a training config, coerced to their types (other keys are ignored)."""
    data = read_yaml(path)
    if data.get("fp8") is False:  # YAML reads an unquoted off as false
        data["fp8"] = None
    return {key: coerce(value, CONFIG_KEYS[key], f"{path}: {key}") for key, value in data.items()
            if key in CONFIG_KEYS}


def resolve_model(name: str | None, conf: dict[str, Any]) -> Qwen3Config:
    """``--model`` (preset or HF directory), else the config's model_name / model_path (+ model_overrides)."""
    name = name or conf.get("model_name")
    if name and (is_preset_name(name) or not Path(name).exists()):
        model = get_preset(name)
    elif name:
        model = Qwen3Config.from_json_file(name)
    elif conf.get("model_path"):
        model = Qwen3Config.from_json_file(conf["model_path"])
    else:
        raise UserError("no model: give --model (e.g. qwen3-8b) or --config with a model_name")
    overrides = conf.get("model_overrides") or {}
    names = {f.name for f in dataclasses.fields(Qwen3Config)}
    for key in overrides:
        if key not in names:
            hint = nearest(key, names)
            raise UserError(f"model_overrides: unknown key {key!r}" + (f"; did you mean {hint!r}?" if hint else ""))
    return dataclasses.replace(model, **overrides)


def efficiency_source(args: argparse.Namespace, fitted: str = "") -> str:
    """Where the compute efficiency comes from, in words."""
    if fitted:
        return fitted
    if args.efficiency is not None:
        return "--efficiency"
    return ("the device table's compute_efficiency, calibrated on one published run: torchtitan's Llama-3.1-8B on "
            "8 x H100; --efficiency overrides")


def resolve_hardware(args: argparse.Namespace) -> Hardware:
    hw = with_overrides(get_device(args.device), memory_gib=args.device_memory_gib, peak_tflops=args.peak_tflops,
                        intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                        compute_efficiency=args.efficiency)
    if hw.compute_efficiency > 1:
        raise UserError(f"--efficiency is a share of the peak, at most 1; got {hw.compute_efficiency}")
    if args.commbench:
        hw = with_overrides(hw, **read_commbench(args.commbench))
    return hw


ROOFLINE_LAYOUT_KEYS = ("tp", "pp", "cp", "ep", "dp", "batch_size", "gradient_accumulation_steps", "seq_length",
                        "activation_checkpointing", "compile", "distributed_optimizer", "dp_shard",
                        "keep_params_gathered", "pp_microbatch_size", "fp8", "fp8_all_gather")


def read_roofline(path: str, compile: bool = False) -> list[tuple[dict[str, Any], float]]:
    """(layout keys, predicted step seconds) of each record of a roofline JSON: an object or a list of objects
    (or an object's ``layouts`` list), each with ``layout`` (or ``config``: plan's row keys, ``rank_size`` or
    ``dp`` for the data-parallel degree) and ``step_time_s`` (or ``step_s``), at the top or under
    ``roofline``; where the record has ``eager`` and ``compiled`` parts, the one of the layout's ``compile``.
    Or what ``simulate --json`` prints: its ranks' ``roofline`` parts, the slowest rank's step (the step ends
    with it), of the layout the plan's own flags and ``--config`` fix (empty keys here), eager or compiled as
    ``compile``."""
    if not os.path.isfile(path):
        raise MissingFileError(f"--roofline file {path!r} does not exist")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: not JSON; --roofline reads the roofline's predicted step times") from None
    out: list[tuple[dict[str, Any], float]] = []
    if isinstance(data, dict) and isinstance(data.get("ranks"), list):  # simulate --json
        mode = "compiled" if compile else "eager"
        steps = [r["roofline"][mode].get("step_s") for r in data["ranks"]
                 if isinstance(r, dict) and isinstance(r.get("roofline"), dict)
                 and isinstance(r["roofline"].get(mode), dict)]
        steps = [x for x in steps if isinstance(x, (int, float)) and x > 0]
        if steps:
            return [({}, float(max(steps)))]
    records = data if isinstance(data, list) else data.get("layouts", [data]) if isinstance(data, dict) else []
    for record in records:
        if not isinstance(record, dict):
            continue
        keys = record.get("layout") or record.get("config")
        if not isinstance(keys, dict):
            continue
        part = record.get("roofline", record)
        if isinstance(part, dict) and ("eager" in part or "compiled" in part):
            part = part.get("compiled" if keys.get("compile") else "eager") or {}
        seconds = part.get("step_time_s", part.get("step_s")) if isinstance(part, dict) else None
        if isinstance(seconds, (int, float)) and seconds > 0:
            out.append(({k: keys[k] for k in (*ROOFLINE_LAYOUT_KEYS, "rank_size") if k in keys}, float(seconds)))
    if not out:
        raise UserError(f"{path}: no record with a 'layout' (or 'config') and a 'step_time_s' (docs/planner.md, "
                        "'Ranking with the roofline')")
    return out


def fit_efficiency(cfg: Qwen3Config, hw: Hardware, cluster: Cluster, base: Layout,
                   records: list[tuple[dict[str, Any], float]], fixed: dict[str, Any] | None = None
                   ) -> tuple[float, str]:
    """The compute efficiency at which this planner's step time of each record's layout equals the
    roofline's (bisection: the step time falls as the efficiency rises), averaged over the records; and a
    line saying so. A record the planner cannot reach at any efficiency (its other terms alone are longer)
    takes the highest, 1."""
    fitted, described = [], []
    for keys, seconds in records:
        if not keys:  # simulate's own JSON: the layout the plan's flags and config fix
            keys = {{"micro_batch_size": "batch_size"}.get(k, k): v for k, v in (fixed or {}).items()}
        layout = base.replace(**{name: keys[key] for key, name in (
            ("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("ep", "ep"), ("batch_size", "micro_batch_size"),
            ("gradient_accumulation_steps", "gradient_accumulation_steps"), ("seq_length", "seq_length"),
            ("activation_checkpointing", "activation_checkpointing"), ("compile", "compile"),
            ("distributed_optimizer", "distributed_optimizer"), ("dp_shard", "dp_shard"),
            ("keep_params_gathered", "keep_params_gathered"), ("pp_microbatch_size", "pp_microbatch_size"),
            ("fp8", "fp8"), ("fp8_all_gather", "fp8_all_gather")) if key in keys and keys[key] is not None})
        dp = keys.get("dp") or cluster.devices // (layout.tp * layout.pp * layout.cp)
        layout = layout.replace(dp=dp)

        def step(efficiency: float) -> float:
            return predict_step(cfg, layout, with_overrides(hw, compute_efficiency=efficiency), cluster).step_time_s

        low, high = 1e-3, 1.0
        reachable = step(high) < seconds
        if not reachable:
            low = high
        for _ in range(50 if reachable else 0):
            mid = (low + high) / 2
            low, high = (mid, high) if step(mid) > seconds else (low, mid)
        fitted.append(low)
        described.append(f"tp {layout.tp} pp {layout.pp} cp {layout.cp} dp {dp}: {seconds:g} s"
                         + ("" if reachable else " (shorter than this planner's at any efficiency: 1 taken)"))
    efficiency = sum(fitted) / len(fitted)
    return efficiency, (f"fitted to the roofline's step time of {'; '.join(described)} (--roofline); "
                        f"per layout {', '.join(f'{e:.3f}' for e in fitted)}")


def read_commbench(path: str) -> dict[str, float]:
    """Measured link figures from a commbench JSON: its ``summary`` (GB/s and microseconds)."""
    if not os.path.isfile(path):
        raise MissingFileError(f"--commbench file {path!r} does not exist; write one with "
                               "'qwen3-pretrain commbench --json FILE'")
    try:
        summary = json.loads(Path(path).read_text(encoding="utf-8"))["summary"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise UserError(f"{path}: not a commbench JSON (expected an object with a 'summary'); write one with "
                        "'qwen3-pretrain commbench --json FILE'") from None
    keys = ("intra_node_gbps", "inter_node_gbps", "intra_node_latency_us", "inter_node_latency_us")
    return {k: float(summary[k]) for k in keys if summary.get(k) is not None}


def resolve_cluster(args: argparse.Namespace, conf: dict[str, Any]) -> Cluster:
    """Nodes x devices per node from the flags, completed from the config's rank_size (8 per node by default)."""
    rank_size = conf.get("rank_size")
    if args.devices_per_node:
        per_node = args.devices_per_node
    elif args.nodes and rank_size:
        per_node = max(1, rank_size // args.nodes)
    else:
        per_node = min(rank_size or 8, 8)
    nodes = args.nodes or (-(-rank_size // per_node) if rank_size else 1)
    cluster = Cluster(nodes, per_node)
    if rank_size and rank_size != cluster.devices:
        raise UserError(f"the config's rank_size is {rank_size} but {nodes} node(s) x {per_node} devices = "
                        f"{cluster.devices}; make --nodes and --devices-per-node agree with it")
    return cluster


def fixed_settings(args: argparse.Namespace, conf: dict[str, Any],
                   vocab_size: int | None = None) -> tuple[Layout, dict[str, Any]]:
    """The base layout (settings that are not searched) and the fixed degrees, flags over config."""
    # A training config always decides recompute: activation_checkpointing, else gradient_checkpointing (the
    # training default false: none), as the engine reads them
    ac = conf.get("activation_checkpointing") or (
        ("full" if conf.get("gradient_checkpointing") else "none") if args.config else None)
    fixed = {"tp": conf.get("tp"), "pp": conf.get("pp"), "cp": conf.get("cp"), "ep": conf.get("ep"),
             "micro_batch_size": conf.get("batch_size"),
             "activation_checkpointing": ac, "distributed_optimizer": conf.get("distributed_optimizer"),
             "dp_shard": conf.get("dp_shard"), "keep_params_gathered": conf.get("keep_params_gathered")}
    fixed.update({k: v for k, v in (("tp", args.tp), ("pp", args.pp), ("dp", args.dp), ("cp", args.cp),
                                    ("ep", args.ep),
                                    ("micro_batch_size", args.micro_batch_size),
                                    ("activation_checkpointing", args.activation_checkpointing),
                                    ("distributed_optimizer", args.distributed_optimizer),
                                    ("dp_shard", args.dp_shard),
                                    ("keep_params_gathered", args.keep_params_gathered)) if v is not None})
    fixed = {k: v for k, v in fixed.items() if v is not None}
    def pick(flag: Any, key: str, default: Any) -> Any:
        return flag if flag is not None else conf.get(key, default)

    fp8 = pick(args.fp8, "fp8", "off") or "off"
    if fp8 not in FP8_RECIPES:
        raise UserError(f"fp8 {fp8!r} is not one of {', '.join(FP8_RECIPES)}")

    base = Layout(
        seq_length=pick(args.seq_length, "seq_length", 4096),
        gradient_accumulation_steps=pick(args.gradient_accumulation_steps, "gradient_accumulation_steps", 1),
        mixed_precision=pick(args.mixed_precision, "mixed_precision", "bf16"),
        pp_schedule=pick(args.pp_schedule, "pp_schedule", "1f1b"),
        virtual_stages=pick(args.virtual_stages, "pp_virtual_stages", 2),  # the engine's default
        pp_microbatch_size=pick(args.pp_microbatch_size, "pp_microbatch_size", 1),
        loss_chunk_tokens=(pick(args.loss_chunk_tokens, "loss_chunk_tokens", None)
                           or default_chunk_tokens(args.device, vocab_size)),
        document_mask=conf.get("document_mask", False),
        device_type=get_device(args.device).device_type,
        reduce_grads_every_microbatch=pick(args.reduce_grads_every_microbatch, "reduce_grads_every_microbatch",
                                           False),
        grad_reduce_dtype=pick(args.grad_reduce_dtype, "grad_reduce_dtype", "fp32"),
        compile=pick(args.compile, "compile", False),
        mtp=args.mtp if args.mtp is not None else conf.get("mtp_loss_weight", 0.0) > 0,
        moe_imbalance=args.moe_imbalance,
        moe_capacity_factor=pick(args.moe_capacity_factor, "moe_capacity_factor", None),
        moe_pad_to_capacity=pick(args.moe_pad_to_capacity, "moe_pad_to_capacity", False),
        fp8=fp8,
        fp8_all_gather=pick(args.fp8_all_gather, "fp8_all_gather", False),
        activation_checkpointing=fixed.get("activation_checkpointing", "full"))
    return base, fixed


def check_fixed(cfg: Qwen3Config, cluster: Cluster, fixed: dict[str, Any], seq_length: int) -> None:
    """Refuse fixed degrees the cluster, the model or the sequence cannot take, saying why."""
    tp, pp, dp, cp = fixed.get("tp", 1), fixed.get("pp", 1), fixed.get("dp", 1), fixed.get("cp", 1)
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp)):
        if value < 1:
            raise UserError(f"--{name} must be at least 1, got {value}")
    needed = tp * pp * dp * cp
    if needed > cluster.devices or cluster.devices % needed:
        raise UserError(f"tp x pp x dp x cp = {tp} x {pp} x {dp} x {cp} = {needed} does not divide the cluster's "
                        f"{cluster.devices} devices ({cluster.nodes} node(s) x {cluster.devices_per_node}); "
                        "change the degrees or the cluster")
    if all(k in fixed for k in ("dp", "tp", "pp", "cp")) and needed != cluster.devices:
        raise UserError(f"tp x pp x dp x cp = {needed} but the cluster has {cluster.devices} devices")
    check_model_split(cfg, tp, pp, cp)
    if fixed.get("ep", 1) < 1:
        raise UserError(f"--ep must be at least 1, got {fixed['ep']}")
    check_expert_split(cfg, fixed.get("ep", 1))
    if "ep" in fixed and "dp" in fixed and (dp * cp * tp) % fixed["ep"]:
        raise UserError(f"--ep {fixed['ep']} does not divide dp x cp x tp = {dp * cp * tp}, the ranks expert "
                        "parallelism borrows; choose an ep that divides it")
    if "tp" in fixed or "cp" in fixed:
        problem = sequence_split_problem(seq_length, cp, tp)
        if problem:
            raise UserError(problem)
    shard = fixed.get("dp_shard")
    if shard is not None and (shard < 1 or "dp" in fixed and dp % shard):
        raise UserError(f"--dp-shard {shard} must be a positive divisor of dp {dp}")
    if shard is not None and shard > 1 and fixed.get("distributed_optimizer") is False:
        raise UserError(f"--dp-shard {shard} shards the optimizer state: it needs --distributed-optimizer")


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


def _dp_mode(lay: Layout) -> str:
    """How the data-parallel ranks hold the weights and reduce the gradients: ``replica`` (no distributed
    optimizer), ``fsdp`` (gathered per unit and micro-batch), ``gathered`` (once per step, Megatron's); ``/mb``
    where gradients are reduced every micro-batch."""
    mode = "replica" if not lay.distributed_optimizer else "gathered" if lay.keep_params_gathered else "fsdp"
    return mode + ("/mb" if lay.reduce_grads_every_microbatch and lay.pp == 1 else "")


def _describe(c: Candidate) -> str:
    lay = c.layout
    shard = f" dp_shard {lay.shards}" if lay.replicas > 1 and lay.shards > 1 else ""
    ep = f" ep {lay.ep}" if lay.ep > 1 else ""
    kept = " weights kept gathered" if lay.keep_params_gathered else ""
    return (f"tp {lay.tp} cp {lay.cp} pp {lay.pp} dp {lay.dp}{shard}{ep}{kept} micro-batch {lay.micro_batch_size} "
            f"recompute {lay.activation_checkpointing} at {c.memory.total / GiB:.1f} GiB")


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
    rests = [f"rests on: compute at {hw.compute_efficiency:.2f} of the {hw.peak_tflops_of(lay.mixed_precision):g} "
             f"TFLOP/s {lay.mixed_precision} peak ({efficiency_source})"]
    if lay.fp8 != "off":
        from qwen3_pretrain.plan.fp8 import FP8_EFFICIENCY_RATIO
        rests.append(f"FP8 projections at {FP8_EFFICIENCY_RATIO[lay.fp8]:.2f} x that share of the "
                     f"{fp8_peak_tflops(hw, lay.fp8):g} TFLOP/s FP8 peak (calibrated on torchao's published "
                     "tensorwise and rowwise speed-ups), casts at the memory bandwidth; routed experts rowwise")
    rests.append(f"{hw.name}'s peaks, memory bandwidth and links are datasheet figures, not measured on a device"
                 + (f"; links measured by commbench ({args.commbench})" if args.commbench else
                    " (--commbench FILE puts measured links in)"))
    lines.append("; ".join(rests))
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
    lines.append("not modelled: " + "; ".join(unmodelled))
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


def main(argv: list[str]) -> int:
    """``qwen3-pretrain plan``: print the ranked layouts (or ``--json``); exit 2 on impossible requests."""
    args = build_parser().parse_args(argv)
    if args.top < 1:
        raise UserError(f"--top must be at least 1, got {args.top}")
    conf = read_train_config(args.config) if args.config else {}
    cfg = resolve_model(args.model, conf)
    hw = resolve_hardware(args)
    cluster = resolve_cluster(args, conf)
    base, fixed = fixed_settings(args, conf, cfg.vocab_size)
    base = base.replace(optimizer_impl=hw.optimizer_impl)
    if args.gradient_accumulation_steps is not None or "gradient_accumulation_steps" in conf:
        fixed["gradient_accumulation_steps"] = base.gradient_accumulation_steps
    check_fixed(cfg, cluster, fixed, base.seq_length)
    fitted = ""
    if args.roofline:
        efficiency, fitted = fit_efficiency(cfg, hw, cluster, base, read_roofline(args.roofline, base.compile),
                                            fixed)
        hw = with_overrides(hw, compute_efficiency=efficiency)
    if base.fp8 != "off":
        fp8_peak_tflops(hw, base.fp8)  # refuse a device without FP8 matmuls before searching
    for name, value in (("--memory-margin", args.memory_margin), ("--tie-tolerance", args.tie_tolerance)):
        if not 0 <= value < 1:
            raise UserError(f"{name} is a share, at least 0 and below 1; got {value}")
    tokens = parse_tokens(args.tokens) if args.tokens else None
    candidates = search(cfg, cluster, base, fixed, hw, args.global_batch_size, args.memory_margin)
    if not candidates:
        raise UserError(f"no layout of {cluster.devices} devices matches: check that --global-batch-size "
                        f"({args.global_batch_size}) is divisible by dp and gives pp enough micro-batches")
    if args.json:
        tied = ties(candidates, args.tie_tolerance)
        rows = [{**c.to_json(), "within_noise_of_best": i < tied,
                 **({"days_for_tokens": round(days_to_train(c, tokens), 2)} if tokens else {})}
                for i, c in enumerate(candidates[:args.top])]
        print(json.dumps(rows, indent=1))
    else:
        print(format_table(cfg, cluster, hw, candidates, args.top))
        print(format_notes(cfg, hw, candidates, args.top, args, fixed, efficiency_source(args, fitted)))
    if not candidates[0].fits:
        message = (f"nothing fits in {hw.memory_gib:.1f} GiB per device; "
                   + suggest(cfg, cluster, base, fixed, hw, args.global_batch_size))
        print(message, file=sys.stderr if args.json else sys.stdout)
    return 0
