"""``qwen3-pretrain plan``: predicted memory and throughput of every parallel layout of a cluster.

Layouts that fit in device memory come first, fastest first. Fix any degree
(``--tp``, ``--pp``, ``--micro-batch-size`` ...) to narrow the search; read
them from the training config with ``--config``. When nothing fits, the
smallest change that would is named.

This module reads the command line and the training config into a base layout
and the fixed degrees; the search and its ranking are ``plan/search.py``, the
printed table and notes ``plan/report.py``, the measured inputs (``--roofline``,
``--commbench``) ``plan/calibrate.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.config.loader import coerce, nearest, read_yaml
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.hardware import DEVICES, Hardware, default_chunk_tokens, get_device, with_overrides
from qwen3_pretrain.models.qwen3.config import Qwen3Config, get_preset, is_preset_name
from qwen3_pretrain.parallel.dims import check_expert_split, check_model_split, sequence_split_problem
from qwen3_pretrain.plan.calibrate import fit_efficiency, read_commbench, read_roofline
from qwen3_pretrain.plan.fp8 import fp8_peak_tflops
from qwen3_pretrain.plan.layout import CHECKPOINTING, FP8_RECIPES, PP_SCHEDULES, PRECISIONS, Cluster, Layout
from qwen3_pretrain.plan.report import days_to_train, efficiency_source, format_notes, format_table, parse_tokens
# evaluate: the search's ranking, imported from this module before it had one of its own
from qwen3_pretrain.plan.search import (DEFAULT_MEMORY_MARGIN, DEFAULT_TIE_TOLERANCE, evaluate,  # noqa: F401
                                        search, suggest, ties)

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


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (``--nodes 0`` is refused, not read as the default)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser("plan", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("model and training config")
    src.add_argument("--model", help="preset name (qwen3-0.6b ... qwen3-32b) or a HuggingFace model directory")
    src.add_argument("--config", help="training config YAML (pretrain_config.yaml): its model and layout keys")
    _cluster_arguments(p.add_argument_group("cluster"))
    lay = p.add_argument_group("layout (fixed when given; searched otherwise)")
    _degree_arguments(lay)
    _training_arguments(lay)
    _ranking_arguments(p)
    return p


def _cluster_arguments(cl: argparse._ArgumentGroup) -> None:
    cl.add_argument("--nodes", type=positive_int, help="number of nodes (default 1)")
    cl.add_argument("--devices-per-node", type=positive_int, help="devices per node (default: the config's rank_size, or 8)")
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


def _degree_arguments(lay: argparse._ArgumentGroup) -> None:
    """The layout's degrees and memory trades: each fixed when given, searched otherwise."""
    lay.add_argument("--seq-length", type=positive_int, help="tokens per sample (default: config, else 4096)")
    lay.add_argument("--global-batch-size", type=positive_int, help="samples per optimizer step (default: micro-batch x dp "
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


def _training_arguments(lay: argparse._ArgumentGroup) -> None:
    """The engine's settings of the same names (never searched): precision, MTP, MoE routing, FP8, pipeline."""
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


def _ranking_arguments(p: argparse.ArgumentParser) -> None:
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
    out.add_argument("--top", type=positive_int, default=10, help="rows to show")


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


def resolve_hardware(args: argparse.Namespace) -> Hardware:
    hw = with_overrides(get_device(args.device), memory_gib=args.device_memory_gib, peak_tflops=args.peak_tflops,
                        intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                        compute_efficiency=args.efficiency)
    if hw.compute_efficiency > 1:
        raise UserError(f"--efficiency is a share of the peak, at most 1; got {hw.compute_efficiency}")
    if args.commbench:
        hw = with_overrides(hw, **read_commbench(args.commbench))
    return hw


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
        # left empty, the key follows the config's conventions (train/config.py CONVENTION_KEYS)
        embedding_decay=bool(conf.get("weight_decay_embeddings") if conf.get("weight_decay_embeddings") is not None
                             else conf.get("conventions", "default") == "megatron"),
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
