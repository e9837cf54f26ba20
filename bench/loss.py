"""Peak memory and time of the LM head + cross-entropy: naive full logits vs chunked.

    python bench/loss.py                        # vocab 151,936, hidden 1024, 4 x 2048 tokens, bf16
    python bench/loss.py --hidden 256 --seq 1024 --variants naive,fused

Each variant runs forward + backward in a fresh process, so its peak resident
memory (``ru_maxrss``) is its own; the table shows it next to the process's
memory before the first step (inputs, weight, libraries), and the time of one
step after a warm-up one (wall and CPU seconds: on a shared machine the
CPU time is the steadier figure). Both variants do the same three matmuls (logits,
grad of the hidden states, grad of the weight); the naive one also keeps the
fp32 logits, their log-softmax and its gradient at full size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from qwen3_pretrain.models.ops.loss import fused_linear_cross_entropy

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=4096, help="tokens per chunk of the fused loss")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--variants", default="naive,fused", help="comma-separated: naive, fused")
    parser.add_argument("--worker", choices=["naive", "fused"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def cpu_seconds() -> float:
    """User + system time of this process, all threads: steadier than wall time on a shared machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def loss_fn(variant: str, args: argparse.Namespace):
    if variant == "fused":
        return lambda h, w, y: fused_linear_cross_entropy(h, w, y, chunk_tokens=args.chunk_tokens)
    return lambda h, w, y: F.cross_entropy(F.linear(h, w).float().flatten(0, 1), y.flatten(), reduction="sum")


def worker(args: argparse.Namespace) -> dict:
    """One variant in this process: one warm-up step, then ``args.steps`` timed ones."""
    gen = torch.Generator().manual_seed(0)
    dtype = DTYPES[args.dtype]
    h = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    fn = loss_fn(args.worker, args)
    before = max_rss_gib()
    times = []
    for _ in range(args.steps + 1):
        h.grad = w.grad = None
        start, start_cpu = time.perf_counter(), cpu_seconds()
        loss = fn(h, w, labels)
        (loss / labels.numel()).backward()
        times.append((time.perf_counter() - start, cpu_seconds() - start_cpu))
    step_s, cpu_s = min(times[1:] or times)
    return {"variant": args.worker, "loss": loss.item() / labels.numel(), "before_gib": before,
            "peak_gib": max_rss_gib(), "step_s": step_s, "cpu_s": cpu_s}


def run_variant(variant: str, argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv, "--worker", variant],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    tokens = args.batch * args.seq
    flops = 6 * tokens * args.vocab * args.hidden  # three matmuls, forward + backward
    print(f"vocab {args.vocab}, hidden {args.hidden}, {args.batch} x {args.seq} tokens, {args.dtype}, "
          f"chunk_tokens {args.chunk_tokens}, {torch.get_num_threads()} threads; "
          f"full fp32 logits = {tokens * args.vocab * 4 / 2**30:.2f} GiB")
    print(f"{'variant':<8} {'loss':>9} {'before GiB':>11} {'peak GiB':>9} {'added GiB':>10} "
          f"{'step s':>7} {'CPU s':>6} {'tokens/s':>9} {'TFLOP/s':>8}")
    for variant in args.variants.split(","):
        r = run_variant(variant, argv)
        added = r["peak_gib"] - r["before_gib"]
        print(f"{variant:<8} {r['loss']:>9.5f} {r['before_gib']:>11.2f} {r['peak_gib']:>9.2f} {added:>10.2f} "
              f"{r['step_s']:>7.2f} {r['cpu_s']:>6.1f} {tokens / r['step_s']:>9.0f} "
              f"{flops / r['step_s'] / 1e12:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
