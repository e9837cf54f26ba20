"""Peak memory and time of the LM head + cross-entropy: naive full logits vs chunked.

    python bench/loss.py                        # vocab 151,936, hidden 1024, 4 x 2048 tokens, bf16
    python bench/loss.py --hidden 256 --seq 1024 --variants naive,fused
    python bench/loss.py --hidden 256 --seq 512 --chunk-tokens 1024 --variants fused-twobuf,fused --repeats 5

Each variant runs forward + backward in a fresh process, so its peak resident
memory (``ru_maxrss``) is its own; the table shows it next to the process's
memory before the first step (inputs, weight, libraries), and the time of one
step after a warm-up one (wall and CPU seconds: on a shared machine the
CPU time is the steadier figure). Both variants do the same three matmuls (logits,
grad of the hidden states, grad of the weight); the naive one also keeps the
fp32 logits, their log-softmax and its gradient at full size. ``fused-twobuf``
is the fused kernel as it was before its bf16 matmul output and bf16 logits'
gradient moved into the fp32 logits' bytes: a separate [chunk, vocab] buffer in
the inputs' dtype beside the fp32 one, one copy each way (reproduced here by
patching the kernel's buffer view and conversions; the arithmetic is the same).
``--repeats`` runs the variants that many times, interleaved (A B A B …), and
shows per variant the median step time and the largest peak.
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

import torch
import torch.nn.functional as F

from qwen3_pretrain.models.ops import loss as loss_ops
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
    parser.add_argument("--variants", default="naive,fused", help="comma-separated: naive, fused, fused-twobuf")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per variant, interleaved")
    parser.add_argument("--worker", choices=["naive", "fused", "fused-twobuf"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def cpu_seconds() -> float:
    """User + system time of this process, all threads: steadier than wall time on a shared machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def use_two_buffers() -> None:
    """The fused kernel's former bf16 path in this process: the bf16 matmul output and logits' gradient
    in a [chunk, vocab] buffer of their own beside the fp32 logits, converted with one copy each way."""

    def low_view(self, rows: int, upper: bool) -> torch.Tensor:
        if getattr(self, "separate", None) is None:
            self.separate = torch.empty(self.logits.shape, dtype=self.low_dtype, device=self.logits.device)
        return self.separate[:rows]

    loss_ops._Scratch.low_view = low_view
    loss_ops._upcast_in_place = loss_ops._downcast_in_place = lambda source, out: out.copy_(source)


def loss_fn(variant: str, args: argparse.Namespace):
    if variant == "fused-twobuf":
        use_two_buffers()
    if variant.startswith("fused"):
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
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            runs[variant].append(run_variant(variant, argv))
    print(f"{'variant':<13} {'loss':>9} {'before GiB':>11} {'peak GiB':>9} {'added GiB':>10} "
          f"{'step s':>7} {'CPU s':>6} {'tokens/s':>9} {'TFLOP/s':>8}")
    for variant in variants:
        rs = runs[variant]
        r = max(rs, key=lambda x: x["peak_gib"])
        step_s = statistics.median(x["step_s"] for x in rs)
        cpu_s = statistics.median(x["cpu_s"] for x in rs)
        added = r["peak_gib"] - r["before_gib"]
        print(f"{variant:<13} {r['loss']:>9.5f} {r['before_gib']:>11.2f} {r['peak_gib']:>9.2f} {added:>10.2f} "
              f"{step_s:>7.3f} {cpu_s:>6.2f} {tokens / step_s:>9.0f} {flops / step_s / 1e12:>8.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
