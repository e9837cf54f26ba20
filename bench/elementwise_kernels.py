"""The elementwise kernels, forward + backward, ours against the device's (models/ops/elementwise.py), at one
model's widths: each block's median time over ``--repeats`` runs and, on CUDA, the peak memory each adds.

    python bench/elementwise_kernels.py                       # this machine's device, Qwen3-8B widths, 8192 tokens
    python bench/elementwise_kernels.py --tokens 2048 --dtype float32 --device cpu

On a CPU "device" is CUDA's set (torch's fused RMSNorm; its backward runs torch's reference formula here,
not a kernel), so the CPU rows say what the CPU would gain, not what a GPU does. An NPU needs torch_npu
imported first (``--device npu`` does). The machine's load average is printed beside the table: on a shared
machine the times move with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from qwen3_pretrain.models.ops.elementwise import CPU_KERNELS, CUDA_EAGER_KERNELS, elementwise_kernels
from qwen3_pretrain.models.ops.rope import rope_cos_sin


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def _cases(kernels, tokens: int, args, dtype, device):
    """(block, kernel, function of the inputs, inputs) for one kernel set: the layer norm, a q norm (per head),
    RoPE on q, SwiGLU."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    hidden, heads, head_dim = args.hidden, args.heads, args.head_dim
    positions = torch.arange(tokens, device=device)[None]
    cos, sin = rope_cos_sin(positions, head_dim, 1e6, dtype)
    norm, zero = kernels.norm, kernels.zero_centered_norm
    return [
        ("norm", norm, lambda x, w: norm(x, w, 1e-6), [rand(1, tokens, hidden), rand(hidden)]),
        ("zero-centred norm", zero, lambda x, w: zero(x, w, 1e-6), [rand(1, tokens, hidden), rand(hidden) * 0.1]),
        ("q norm", norm, lambda x, w: norm(x, w, 1e-6), [rand(1, tokens, heads, head_dim), rand(head_dim)]),
        ("rope (q)", kernels.rope, lambda x: kernels.rope(x, cos, sin),
         [rand(1, tokens, heads, head_dim).transpose(1, 2)]),
        ("swiglu", kernels.swiglu, kernels.swiglu, [rand(tokens, args.intermediate), rand(tokens, args.intermediate)]),
    ]


def _time(fn, inputs, device, repeats: int) -> tuple[float, float]:
    """Median seconds of forward + backward, and the peak bytes one run adds (CUDA only, else nan)."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    grad = None
    times = []
    for i in range(repeats + 1):
        for t in leaves:
            t.grad = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        _sync(device)
        start = time.perf_counter()
        out = fn(*leaves)
        grad = torch.ones_like(out) if grad is None else grad
        out.backward(grad)
        _sync(device)
        if i:  # the first run pays for first touches
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.device == "npu":
        import torch_npu  # noqa: F401  (registers the device)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    theirs = elementwise_kernels(device.type) if device.type != "cpu" else CUDA_EAGER_KERNELS
    print(f"{device.type}, {args.dtype}, {args.tokens} tokens, hidden {args.hidden}, {args.heads} x "
          f"{args.head_dim} heads, intermediate {args.intermediate}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'block':<18} {'ours ms':>9} {'device ms':>10} {'ours MB':>9} {'device MB':>10}  device kernel")
    ours_cases, their_cases = (_cases(k, args.tokens, args, dtype, device) for k in (CPU_KERNELS, theirs))
    for (block, _, fn, inputs), (_, kernel, their_fn, their_inputs) in zip(ours_cases, their_cases):
        ours_s, ours_b = _time(fn, inputs, device, args.repeats)
        their_s, their_b = _time(their_fn, their_inputs, device, args.repeats)
        print(f"{block:<18} {ours_s * 1e3:9.2f} {their_s * 1e3:10.2f} {ours_b / 2**20:9.1f} {their_b / 2**20:10.1f}"
              f"  {kernel.__name__}")


if __name__ == "__main__":
    main()
