"""``qwen3-pretrain simulate``: the training engine at full size on fake tensors, rank by rank, beside the
planner's prediction.

    qwen3-pretrain simulate --config pretrain_config.yaml [--nodes N] [--devices-per-node D] [--device NAME]
                            [--ranks all|stages|LIST] [--steps 1] [--jobs N] [--each] [--whole-step]
                            [key=value ...] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.data.pool import available_cores
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.simulate.run import RankResult, World, make_world, simulate_ranks
from qwen3_pretrain.train.config import TrainConfig

GiB = 2**30


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = CommandParser("simulate", description=(
        "Run the training engine for chosen ranks of the configured world on fake tensors (no data, weights or "
        "devices needed): peak memory by category per rank beside the planner's prediction, and the bytes each "
        "rank sends per step per mesh axis."))
    parser.add_argument("--config", help="training config YAML (the one 'train' takes)")
    parser.add_argument("--nodes", type=int, help="nodes of the simulated world (with --devices-per-node)")
    parser.add_argument("--devices-per-node", type=int, help="devices per node")
    parser.add_argument("--device", default="h100", help="the target device (a name of the planner's device "
                        "table: h100, h200, b200, a100, 910b, ...): the engine is built with its kernel choices "
                        "(its device type: cuda, npu) and the op trace is priced with its figures (default h100)")
    parser.add_argument("--ranks", default="all", help="all, stages (the first rank of each pipeline stage), "
                        "or a comma-separated list of ranks")
    parser.add_argument("--steps", type=int, default=1, help="training steps per rank, figures of the last "
                        "(the optimizer state exists before the first, so one step is the steady state)")
    parser.add_argument("--jobs", type=int, help="ranks simulated at once, one process each (default: the "
                        "cores this process may use)")
    parser.add_argument("--each", action="store_true", help="simulate every chosen rank, not one per pipeline "
                        "stage standing for the others of its stage")
    parser.add_argument("--whole-step", action="store_true", help="simulate every micro-batch of the step; by "
                        "default a step of more than a + b micro-batches (a = max(2, pp), b = a + 1; not under GPipe "
                        "or the interleaved schedule) is simulated at a and b and extrapolated, exact where each "
                        "further micro-batch runs the same ops (simulate/microbatches.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    return parser.parse_args(argv)


def world_size(args: argparse.Namespace, cfg: TrainConfig) -> int:
    if (args.nodes is None) != (args.devices_per_node is None):
        raise UserError("--nodes and --devices-per-node go together; give both or neither")
    if args.nodes is not None:
        if args.nodes < 1 or args.devices_per_node < 1:
            raise UserError("--nodes and --devices-per-node must be at least 1")
        return args.nodes * args.devices_per_node
    if cfg.rank_size is None:
        raise UserError("the world size is unknown: set rank_size in the config (or rank_size=N) or give "
                        "--nodes and --devices-per-node")
    return cfg.rank_size


def select_ranks(spec: str, world: World) -> list[int]:
    size = world.dims.world_size
    if spec == "all":
        return list(range(size))
    if spec == "stages":
        return world.dims.first_rank_of_stages()
    ranks = []
    for item in spec.split(","):
        if not item.strip().isdigit() or not 0 <= int(item) < size:
            raise UserError(f"--ranks: {item.strip()!r} is not a rank of this {size}-rank world (0..{size - 1}); "
                            "give all, stages or a comma-separated list of ranks")
        ranks.append(int(item))
    return ranks


def to_json(results: list[RankResult], seconds: float) -> dict:
    ranks = [{"rank": r.rank, "stage": r.coords["pp"], "coords": r.coords,
              "peak_gib": round(r.peak["total"] / GiB, 3),
              "predicted_gib": round(r.predicted.allocated / GiB, 3),
              "predicted_with_overhead_gib": round(r.predicted.total / GiB, 3),
              "categories": {k: round(v / GiB, 3) for k, v in r.peak.items() if k != "total"},
              "predicted_categories": {k: v for k, v in r.predicted.gib().items()
                                       if k not in ("total", "overhead")},
              "comm_bytes_per_step": r.comm, "attention_kernels_per_step": r.attention,
              "unfused_attention": [dict(dataclasses.asdict(call), kernel=kernel)
                                    for call, kernel in r.unfused_attention],
              "seconds": round(r.seconds, 1), "roofline": r.roofline,
              "extrapolated_from_microbatches": list(r.extrapolated_from) if r.extrapolated_from else None,
              **({"simulated_as": r.simulated_as} if r.simulated_as is not None else {})} for r in results]
    # The rank of each stage that sends most stands for the axis (ranks of a stage send alike).
    comm: dict[str, dict[str, float]] = {}
    for r in results:
        for axis, kinds in r.comm.items():
            if sum(kinds.values()) > sum(comm.get(axis, {}).values()):
                comm[axis] = dict(kinds)
    return {"ranks": ranks, "comm_bytes_per_step": {a: comm.get(a, {}) for a in ("tp", "pp", "dp", "cp", "ep")},
            "seconds": round(seconds, 1)}


def format_table(world: World, results: list[RankResult], seconds: float) -> str:
    cfg, d = world.cfg, world.dims
    lines = [f"simulated {cfg.model_name} ({world.source.description}) on {d.world_size} ranks: tp {d.tp} x pp "
             f"{d.pp} x dp {d.dp}" + (f" (dp_shard {d.dp_shard})" if d.dp_replicate > 1 else "")
             + (f" x cp {d.cp}" if d.cp > 1 else "") + (f", ep {d.ep}" if d.ep > 1 else "") + f", seq {cfg.seq_length}, batch_size {cfg.batch_size}, recompute {cfg.ac_mode}; "
             f"fake tensors on the CPU device type, engine built as for {world.hardware.name} ({world.target})",
             f"{'rank':>5} {'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'temps':>8} "
             f"{'peak':>8} {'planner':>8} {'diff':>7}  (GiB)"]
    for r in results:
        p = {k: v / GiB for k, v in r.peak.items()}
        pred = r.predicted.allocated / GiB
        diff = (pred - p["total"]) / p["total"] if p["total"] else 0.0
        lines.append(f"{r.rank:>5} {r.coords['pp']:>5} {p['parameters']:>8.2f} {p['gradients']:>8.2f} "
                     f"{p['optimizer']:>8.2f} {p['activations']:>8.2f} {p['temporaries']:>8.2f} {p['total']:>8.2f} "
                     f"{pred:>8.2f} {diff:>+7.1%}")
    lines.append("bytes sent per rank per step (MiB), by mesh axis and collective:")
    for axis, kinds in to_json(results, seconds)["comm_bytes_per_step"].items():
        text = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(kinds.items())) or "none"
        lines.append(f"  {axis}: {text}")
    lines += attention_lines(world, results)
    lines += roofline_lines(world, results)
    simulated = sum(r.simulated_as is None for r in results)
    short = next((r.extrapolated_from for r in results if r.extrapolated_from), None)
    if short:
        lines.append(f"{world.layout.num_microbatches} micro-batches per step: simulated at {short[0]} and {short[1]}, "
                     "the figures extrapolated (each further micro-batch runs the same ops; --whole-step simulates "
                     "them all)")
    lines.append(f"{len(results)} rank(s), {simulated} simulated (one per stage stands for its stage unless "
                 f"--each), in {seconds:.1f} s")
    return "\n".join(lines)


def roofline_lines(world: World, results: list[RankResult]) -> list[str]:
    """Each simulated rank's step priced on the target device, eager and compiled (simulate/roofline)."""
    hw = world.hardware
    lines = [f"predicted step on {hw.name} (roofline of each rank's op trace; seconds: matmul / attention / "
             "elementwise / exposed comm / host / pipeline bubble):"]
    for r in results:
        if r.simulated_as is not None or not r.roofline:
            continue
        for mode in ("eager", "compiled"):
            e = r.roofline[mode]
            b = e["breakdown_s"]
            lines.append(f"  rank {r.rank:>4} {mode:>8}: {e['step_s']:.3f} s, {e['tokens_per_s_per_device']:,.0f} "
                         f"tokens/s/device, MFU {e['mfu']:.1%}, HFU {e['hfu']:.1%}  ({b['matmul']:.3f} / "
                         f"{b['attention']:.3f} / {b['elementwise']:.3f} / {b['communication']:.3f} / "
                         f"{b['host']:.3f} / {b['bubble']:.3f})")
    lines.append(f"  figures rest on {hw.name}'s peaks x matmul efficiency {hw.matmul_efficiency} (shape classes "
                 f"lower), fused attention at {hw.attention_efficiency} of the peak, bandwidth x "
                 f"{hw.bandwidth_efficiency}, {hw.launch_latency_us:g} us per eager op; compiled = the fusion model "
                 "on the eager trace inside the compiled scope; not measured on a device")
    return lines


def attention_lines(world: World, results: list[RankResult]) -> list[str]:
    """Which of the target's kernels serve attention, and a warning for every call that falls to an unfused
    one (the math kernel keeps fp32 probabilities, q_len x kv_len per head; the planner counts them)."""
    counts: dict[str, int] = {}
    for r in results:
        if r.simulated_as is None:
            for kernel, n in r.attention.items():
                counts[kernel] = counts.get(kernel, 0) + n
    lines = [f"attention kernels on {world.target} (calls per step, simulated ranks): "
             + ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))]
    seen = set()
    for r in results:
        for call, kernel in r.unfused_attention:
            if call in seen:
                continue
            seen.add(call)
            probs = 4 * call.batch * call.q_heads * call.q_len * call.kv_len / GiB
            lines.append(f"warning: {world.target} serves {call.api} attention ({call.mask} mask, {call.dtype}, "
                         f"{call.q_heads}/{call.kv_heads} heads, {call.q_len} x {call.kv_len}) with the {kernel} "
                         f"kernel, which keeps {probs:.2f} GiB of fp32 probabilities per layer call (counted above)")
    return lines


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = load_config(TrainConfig, args.config, args.overrides)
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    world = make_world(cfg, world_size(args, cfg), hardware=args.device, devices_per_node=args.devices_per_node)
    ranks = select_ranks(args.ranks, world)
    start = time.perf_counter()
    results = simulate_ranks(world, ranks, args.steps, args.jobs or available_cores(), args.each,
                             extrapolate=not args.whole_step)
    seconds = time.perf_counter() - start
    print(json.dumps(to_json(results, seconds), indent=1) if args.json else format_table(world, results, seconds))
    return 0
