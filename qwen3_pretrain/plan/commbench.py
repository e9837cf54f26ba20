"""``qwen3-pretrain commbench``: latency and bandwidth of collectives on each axis of the training mesh.

Builds the training engine's mesh (``parallel/dims.py::ParallelDims``) from
``--tp`` and ``--pp`` (``dp`` is what is left of the world, every dp rank in
one FSDP group) and times, on its ``tp``, ``dp`` and ``pp`` groups of more
than one rank, all-reduce, all-gather, reduce-scatter and a ring of
point-to-point send/recv over a range of message sizes. Bandwidths follow
nccl-tests' conventions: algorithm bandwidth = bytes / time, bus bandwidth =
algorithm bandwidth x (2(n-1)/n for all-reduce, (n-1)/n for all-gather and
reduce-scatter, 1 for send/recv), where bytes is the whole buffer. ``--json``
writes a file that ``qwen3-pretrain plan --commbench`` reads.

Launch under torchrun or mpirun like training, or let ``--nproc N`` start N
local processes (gloo on CPU, for a quick look or a test).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.fsutil import write_json_atomic
from qwen3_pretrain.parallel import env, launch
from qwen3_pretrain.parallel.dims import ParallelDims
from qwen3_pretrain.plan.formulas import bus_bandwidth_factor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
_UNITS = {"": 1, "B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}


def parse_sizes(text: str) -> list[int]:
    """``"1KB,64KB,1MB"`` -> bytes (binary units: 1KB = 1024 bytes)."""
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", item.upper())
        if not match or int(match.group(1)) < 1:
            raise UserError(f"--sizes: {item.strip()!r} is not a size like 1KB, 64KB, 16MB")
        sizes.append(int(match.group(1)) * _UNITS[match.group(2)])
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser("commbench", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the mesh")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree of the mesh")
    p.add_argument("--sizes", default="1KB,64KB,1MB,16MB", help="message sizes (whole buffer), comma-separated")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per size (after 2 warm-up ones)")
    p.add_argument("--ops", default=",".join(OPS), help="operations to time, comma-separated")
    p.add_argument("--nproc", type=int, help="start this many local processes instead of using a launcher's")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "npu"),
                   help="auto: cuda, then npu, then cpu (gloo)")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address under mpirun")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port under mpirun")
    p.add_argument("--json", help="write the results here (read by 'qwen3-pretrain plan --commbench')")
    return p


def _check_args(args: argparse.Namespace) -> list[str]:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise UserError(f"--ops: unknown operation(s) {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(OPS)}")
    for name in ("tp", "pp", "iters"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    if args.nproc and ("RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ):
        raise UserError("--nproc starts its own processes; do not combine it with torchrun or mpirun")
    parse_sizes(args.sizes)
    return ops


def axis_meshes(world: int, tp: int, pp: int, device_type: str) -> dict[str, DeviceMesh]:
    """The groups training talks over, as the engine builds them: tp, dp (FSDP's) and pp."""
    dims = ParallelDims.resolve(world_size=world, tp=tp, pp=pp)
    mesh = dims.build_mesh(device_type)
    return {"tp": mesh["tp"], "dp": dims.dp_mesh(mesh), "pp": mesh["pp"]}


# --- timing -------------------------------------------------------------------------


def _operation(op: str, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> Callable[[], None]:
    """A closure running one ``op`` on a buffer of ``nbytes`` (fp32) over ``group``."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    numel = max(n, nbytes // 4 // n * n)  # divisible by the group size
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_single(full, shard, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, full, group=group)
    peers = dist.get_process_group_ranks(group)
    send_to, recv_from = peers[(me + 1) % n], peers[(me - 1) % n]
    received = torch.empty_like(full)

    def ring() -> None:
        ops = [dist.P2POp(dist.isend, full, send_to, group), dist.P2POp(dist.irecv, received, recv_from, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return ring


def _time(run: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds per call, the slowest rank's (a collective is as fast as its slowest member)."""
    sync = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    for _ in range(2):
        run()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _axis_is_intra_node(mesh: DeviceMesh, hosts: list[str]) -> bool:
    ranks = dist.get_process_group_ranks(mesh.get_group())
    return len({hosts[r] for r in ranks}) == 1


def bench_axis(mesh: DeviceMesh, ops: list[str], sizes: list[int], iters: int,
               device: torch.device) -> list[dict[str, Any]]:
    """Every op and size on the group of 1-D ``mesh``."""
    group, rows = mesh.get_group(), []
    n = dist.get_world_size(group)
    for op in ops:
        for nbytes in sizes:
            real = max(n, nbytes // 4 // n * n) * 4
            seconds = _time(_operation(op, nbytes, group, device), iters, device)
            algbw = real / seconds / 1e9
            rows.append({"op": op, "bytes": real, "time_us": _sig(seconds * 1e6), "algbw_gbps": _sig(algbw),
                         "busbw_gbps": _sig(algbw * bus_bandwidth_factor(op, n))})
    return rows


def _sig(value: float) -> float:
    return float(f"{value:.6g}")


def summarize(axes: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Intra- and inter-node figures for the planner: the median bus bandwidth of the largest messages
    and the median latency of the smallest, over the axes of each kind."""
    out: dict[str, float | None] = {}
    for where, intra in (("intra_node", True), ("inter_node", False)):
        rows = [r for a in axes.values() if a["intra_node"] == intra for r in a["results"]]
        if not rows:
            out[f"{where}_gbps"] = out[f"{where}_latency_us"] = None
            continue
        big, small = max(r["bytes"] for r in rows), min(r["bytes"] for r in rows)
        out[f"{where}_gbps"] = statistics.median(r["busbw_gbps"] for r in rows if r["bytes"] == big)
        out[f"{where}_latency_us"] = statistics.median(r["time_us"] for r in rows if r["bytes"] == small)
    return out


def run_bench(args: argparse.Namespace, ops: list[str]) -> dict[str, Any] | None:
    """Time every axis; rank 0 returns the report (other ranks None)."""
    device = env.pick_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    meshes = axis_meshes(world, args.tp, args.pp, device.type)
    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, socket.gethostname())
    axes = {}
    for axis, mesh in meshes.items():
        if mesh.size() > 1:
            axes[axis] = {"size": mesh.size(), "intra_node": _axis_is_intra_node(mesh, hosts),
                          "results": bench_axis(mesh, ops, parse_sizes(args.sizes), args.iters, device)}
    if dist.get_rank() != 0:
        return None
    return {"world_size": world, "backend": dist.get_backend(), "device": device.type,
            "mesh": {axis: meshes[axis].size() for axis in ("pp", "dp", "tp")},
            "nodes": len(set(hosts)), "axes": axes, "summary": summarize(axes)}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['world_size']} processes on {report['nodes']} node(s), backend {report['backend']}, "
             f"mesh pp {report['mesh']['pp']} x dp {report['mesh']['dp']} x tp {report['mesh']['tp']}"]
    if not report["axes"]:
        lines.append("every mesh axis has one rank: nothing to measure (raise --tp/--pp or the world size)")
    lines.append(f"{'axis':4s} {'n':>3s} {'where':5s} {'op':14s} {'bytes':>10s} {'time us':>10s} "
                 f"{'algbw GB/s':>10s} {'busbw GB/s':>10s}")
    for axis, data in report["axes"].items():
        where = "intra" if data["intra_node"] else "inter"
        for r in data["results"]:
            lines.append(f"{axis:4s} {data['size']:3d} {where:5s} {r['op']:14s} {r['bytes']:10d} {r['time_us']:10.1f} "
                         f"{r['algbw_gbps']:10.3f} {r['busbw_gbps']:10.3f}")
    summary = ", ".join(f"{k} {v:g}" for k, v in report["summary"].items() if v is not None)
    lines.append(f"summary: {summary or 'none'}")
    return "\n".join(lines)


def _worker(args: argparse.Namespace, ops: list[str], info: launch.LaunchInfo) -> None:
    device = env.pick_device(args.device, info.local_rank, info.local_world_size)
    env.init_process_group(info, device, timeout_s=300, init_timeout_s=60)
    try:
        report = run_bench(args, ops)
    finally:
        env.destroy()
    if report is not None:
        print(format_report(report), flush=True)
        if args.json:
            write_json_atomic(args.json, report, indent=1)



def _spawned(rank: int, args: argparse.Namespace, ops: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc))
    _worker(args, ops, launch.LaunchInfo(rank, args.nproc, rank, "spawn", args.nproc))


def main(argv: list[str]) -> int:
    """``qwen3-pretrain commbench``; rank 0 prints the table (and writes ``--json``)."""
    args = build_parser().parse_args(argv)
    ops = _check_args(args)
    if args.nproc:
        if args.nproc % (args.tp * args.pp):
            raise UserError(f"tp x pp = {args.tp} x {args.pp} does not divide --nproc {args.nproc}")
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(launch.free_port())
        torch.multiprocessing.spawn(_spawned, args=(args, ops), nprocs=args.nproc, join=True)
        return 0
    _worker(args, ops, launch.detect_launch(args.master_addr, args.master_port))
    return 0
