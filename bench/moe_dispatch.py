"""Expert-parallel dispatch on CPU processes against one process computing the same tokens.

    python bench/moe_dispatch.py                      # ep 2, bf16 and fp32
    python bench/moe_dispatch.py --ep 4 --tokens 2048 --dtype fp32

One MoE block's experts (hidden 512, 16 experts of 256, top-4, the router's
choices drawn at random and fixed), forward and backward:

* ``single``: one process with ``ep`` threads computes all ``ep x tokens``
  tokens on all experts (the layer's own experts, no dispatch);
* ``ep``: ``ep`` processes (gloo, one thread each) each route ``tokens`` tokens
  and send the pairs to the rank of their expert (``parallel/expert_parallel.py``).

Both process the same tokens with the same routing. Per variant: milliseconds per
step (median of the timed steps), microseconds per token, and for ``ep`` the share
of the step spent in the all-to-alls (the counts', the pairs' and the outputs', in
forward and backward: CPU time of the collectives in torch's profiler, rank 0).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 512, 16, 4, 256


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, default=2, help="processes (the expert-parallel degree)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per process")
    p.add_argument("--dtype", choices=("bf16", "fp32", "both"), default="both")
    p.add_argument("--steps", type=int, default=5, help="timed steps after 2 warm-up steps")
    return p.parse_args(argv)


def make_inputs(rank: int, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens, their chosen experts and routing weights (the same on every run)."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    chosen = torch.rand(tokens, EXPERTS, generator=g).topk(TOP_K, dim=-1).indices
    weights = torch.rand(tokens, TOP_K, generator=g).softmax(-1).to(dtype)
    return x, chosen, weights


def make_experts(dtype: torch.dtype):
    from qwen3_pretrain.models.ops.moe import GroupedExperts, experts_kernel

    experts = GroupedExperts(EXPERTS, HIDDEN, INTERMEDIATE, experts_kernel("cpu", dtype))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return experts.to(dtype)


def timed(step, steps: int) -> list[float]:
    for _ in range(2):
        step()
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def run_single(args: argparse.Namespace, dtype: torch.dtype) -> float:
    torch.set_num_threads(args.ep)
    experts = make_experts(dtype)
    parts = [make_inputs(r, args.tokens, dtype) for r in range(args.ep)]
    x = torch.cat([p[0] for p in parts]).requires_grad_()
    chosen, weights = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])

    def step() -> None:
        experts(x, chosen, weights).float().pow(2).mean().backward()

    return statistics.median(timed(step, args.steps))


def _ep_worker(rank: int, args: argparse.Namespace, dtype: torch.dtype, port: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from qwen3_pretrain.parallel.expert_parallel import apply_expert_parallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ep)
    mesh = init_device_mesh("cpu", (args.ep,), mesh_dim_names=("ep",))
    full = make_experts(dtype)
    holder = torch.nn.Module()
    holder.experts = full
    apply_expert_parallel(holder, mesh["ep"])  # the stacked tensors become this rank's rows, as DTensors
    with torch.no_grad():
        rows = slice(rank * EXPERTS // args.ep, (rank + 1) * EXPERTS // args.ep)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(full, name).to_local().copy_(getattr(make_experts(dtype), name)[rows])
    x, chosen, weights = make_inputs(rank, args.tokens, dtype)
    x.requires_grad_()

    def step() -> None:
        full(x, chosen, weights).float().pow(2).mean().backward()

    times = timed(step, args.steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    comm = sum(e.cpu_time_total for e in prof.key_averages()
               if "alltoall" in e.key.lower() or "all_to_all" in e.key.lower()) / 1e6
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    if rank == 0:
        out.put((statistics.median(times), comm / total if total else 0.0))
    dist.barrier()  # neither rank leaves while the other still talks to it
    dist.destroy_process_group()


def run_ep(args: argparse.Namespace, dtype: torch.dtype) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ep_worker, args=(r, args, dtype, port, queue)) for r in range(args.ep)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join()
    return result


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    cpu = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    print(f"machine: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"experts: hidden {HIDDEN}, {EXPERTS} experts of {INTERMEDIATE}, top-{TOP_K}; {args.tokens} tokens per "
          f"process, ep {args.ep} ({args.ep * args.tokens} tokens per step in all)")
    print(f"{'dtype':<6} {'variant':<28} {'ms/step':>8} {'us/token':>9} {'all-to-all':>11}")
    dtypes = {"bf16": [torch.bfloat16], "fp32": [torch.float32],
              "both": [torch.bfloat16, torch.float32]}[args.dtype]
    for dtype in dtypes:
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        tokens = args.ep * args.tokens
        single = run_single(args, dtype)
        ep_time, share = run_ep(args, dtype)
        print(f"{name:<6} {f'single, {args.ep} threads':<28} {1e3 * single:>8.1f} {1e6 * single / tokens:>9.2f} "
              f"{'-':>11}")
        print(f"{name:<6} {f'ep {args.ep}, {args.ep} x 1 thread':<28} {1e3 * ep_time:>8.1f} "
              f"{1e6 * ep_time / tokens:>9.2f} {share:>10.0%}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
