"""Gated delta rule on CPU, forward + backward: the project's chunked kernel vs transformers' own
``torch_chunk_gated_delta_rule``, on the same inputs (fp32, batch 1, no document boundaries, since
transformers' kernel has none).

Each (case, implementation) runs in a fresh subprocess: it builds the inputs and runs a tiny case (loading
the libraries), then one forward + backward ("first": it also pays for first-touching its memory) that gives
the peak memory (growth of the process's peak RSS over that run, so inputs and libraries are not counted),
then ``--repeats`` timed runs, of which the median is shown. The machine's load
average is printed beside the table: on a shared machine the times move with it.

    python bench/gated_delta_cpu.py                  # the default cases below, about 2 minutes on 2 cores
    python bench/gated_delta_cpu.py --cases 8192:16:32   # seq:k_heads:v_heads[:impl+impl], comma-separated

A case is ``seq:k_heads:v_heads`` with dk = dv = ``--dim``, optionally ``:ours`` (or ``:transformers``) to
run one implementation. The defaults: Qwen3.5-9B's heads (16 key, 32 value heads of 128) at seq 2048 for
both; at seq 8192 both with 4 key / 8 value heads, since transformers' kernel takes minutes per run there
with all heads (its backward copies a whole-sequence tensor per chunk, so its time grows faster than seq x
heads); and ours alone with all heads.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

IMPLS = ("ours", "transformers")
DEFAULT_CASES = "2048:16:32,8192:4:8,8192:16:32:ours"


def _inputs(seq: int, k_heads: int, v_heads: int, dim: int):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, seq, k_heads, dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, seq, k_heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, seq, v_heads, dim, generator=gen)
    # Qwen3.5's decay: g = -exp(A_log) * softplus(a + dt_bias), A between 1 and 16 as initialized
    a_log = torch.linspace(0.0, 2.77, v_heads)
    g = -a_log.exp() * F.softplus(torch.randn(1, seq, v_heads, generator=gen) - 2.0)
    beta = torch.randn(1, seq, v_heads, generator=gen).sigmoid()
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _step(impl: str, tensors, chunk_size: int) -> None:
    """One forward + backward, gradients dropped afterwards."""
    if impl == "ours":
        from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule

        out, state = chunk_gated_delta_rule(*tensors, chunk_size=chunk_size)
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        out, state = torch_chunk_gated_delta_rule(*tensors, chunk_size=chunk_size, output_final_state=True)
    (out.sum() + state.sum()).backward()
    for x in tensors:
        x.grad = None


def _child(args) -> None:
    tensors = _inputs(args.seq, args.k_heads, args.v_heads, args.dim)
    # a small run first loads the libraries and their kernels, so that their memory is in the baseline
    _step(args.child, _inputs(64, args.k_heads, args.v_heads, args.dim), args.chunk_size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    _step(args.child, tensors, args.chunk_size)
    first = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        _step(args.child, tensors, args.chunk_size)
        times.append(time.perf_counter() - start)
    print(json.dumps({"times": times, "first": first, "peak_mib": peak / 1024}))


def _run_case(impl: str, seq: int, k_heads: int, v_heads: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--seq", str(seq), "--repeats", str(args.repeats),
           "--k-heads", str(k_heads), "--v-heads", str(v_heads), "--dim", str(args.dim),
           "--chunk-size", str(args.chunk_size)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="seq:k_heads:v_heads[:impl+impl],...")
    parser.add_argument("--dim", type=int, default=128, help="dk = dv")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--k-heads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--v-heads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    print(f"fp32, batch 1, dk = dv = {args.dim}, chunk {args.chunk_size}, {os.cpu_count()} CPUs, "
          f"load average before {os.getloadavg()[0]:.2f}")
    print(f"{'seq':>6} {'heads k/v':>9} {'impl':>13} {'median s':>9} {'runs s':>20} {'first s':>8} {'peak MiB':>9}")
    for case in args.cases.split(","):
        seq, k_heads, v_heads, *impls = case.split(":")
        for impl in (impls[0].split("+") if impls else IMPLS):
            r = _run_case(impl, int(seq), int(k_heads), int(v_heads), args)
            runs = " ".join(f"{t:.2f}" for t in r["times"])
            print(f"{seq:>6} {k_heads + '/' + v_heads:>9} {impl:>13} {statistics.median(r['times']):>9.2f} "
                  f"{runs:>20} {r['first']:>8.2f} {r['peak_mib']:>9.0f}", flush=True)
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
