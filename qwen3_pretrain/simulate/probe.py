"""Measure the host CPU's own roofline numbers: matmul throughput per dtype and shape, memory bandwidth,
and the host latency of one tiny op, in a few seconds.

The device table (``hardware.DEVICES``) carries datasheet figures for accelerators; for a CPU no datasheet
says what torch's kernels achieve on this machine's cores at this moment (AMX or AVX-512 bf16, cache sizes,
how many cores the process may use, other processes' load). ``measure_cpu`` times the kernels the engine
dispatches in the process that will train, at its thread count, so the op trace of a CPU training step can
be priced with figures of the same machine (bench/roofline_cpu.py compares that price with the measured
step). Each figure is the median of a few repeats, each repeat long enough (``min_seconds``) for the
timer: the median, not the best, because the step time it predicts is a median under the same load.

Shape classes: ``square`` (an n x n x n product, what datasheets quote), ``skinny`` (many tokens through a
narrow layer, [tokens, k] @ [k, n] with k, n small: the projections of a small model), ``tiny`` (a batch of
64 x 64 x 64 products: the Gated DeltaNet's chunk products, whose smallest side is under the roofline's
128), and whatever exact shapes the caller names (``shapes``: the model's own projections, forward and the
two backward products).

``CpuProbe.hardware`` turns a probe into the roofline's device (``hardware.measured_cpu``): the matmul peaks
at the priced trace's own shapes, shape classes, the grouped matmul's and fused attention's measured rates,
the bandwidth, and the host cost per op. That host cost is not an op's dispatch alone: an eager training
step spends the engine's Python, autograd's bookkeeping and the hooks around every op, which no
microbenchmark of one op sees (bench/roofline_cpu.py measured 0.1-0.5 s outside ops per tiny-model step
against 0.001-0.017 s at the tiny op's latency). The caller measures it on the training step itself at
tiny shapes, where the arithmetic is negligible (``host_us_per_op``), and hands it in (``engine_op_us``).
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}  # a trace's dtype names -> the probe's


@dataclass(frozen=True)
class CpuProbe:
    """What ``measure_cpu`` found: TFLOP/s by (dtype, shape class), GB/s by kernel, microseconds per tiny op."""

    cpu: str  # /proc/cpuinfo's model name
    threads: int  # torch's intra-op threads while measuring
    matmul_tflops: dict[tuple[str, str], float] = field(default_factory=dict)
    # bytes read + written per second, GB/s (1e9): "copy" (fp32 copy_), "add_fp32", "add_bf16" (a + b -> out)
    memory_gbps: dict[str, float] = field(default_factory=dict)
    op_latency_us: float = 0.0  # one tiny eager op (a + b on 8 elements): dispatch and allocation, no compute
    # one tiny op of a training step: its forward under autograd (graph recording) and its backward node's op
    # run by the autograd engine, per op dispatched
    autograd_op_latency_us: float = 0.0
    load_average: float = 0.0  # the 1-minute load average when the probe ran
    # host microseconds per op of the training step itself (``host_us_per_op`` at tiny shapes), eager and,
    # per compiled kernel, compiled; None: unmeasured (the autograd chain's and the tiny op's figures stand in)
    engine_op_us: float | None = None
    engine_compiled_us: float | None = None
    # ``bandwidth_curve``'s figures: {kind: GB/s at each of ``curve_mib``'s working sets}; empty: unmeasured
    # (every memory-bound op at ``bandwidth_gbps``)
    bandwidth_by_size: dict[str, list[float]] = field(default_factory=dict)
    curve_mib: tuple[float, ...] = ()
    # the link between the processes of a multi-process run (``link_figures`` on its own group, at its own
    # message size): bus bandwidth GB/s and latency us; None: unmeasured (half the copy bandwidth, no latency)
    link_gbps: float | None = None
    link_latency_us: float | None = None
    # per collective kind the step ran, its own link where measured (``link_figures`` at the kind's own
    # message): {kind: (bus GB/s, latency us)}; a kind not in it at ``link_gbps`` / ``link_latency_us``
    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the stragglers' share of a multi-process run (``straggler_share`` on its own group, at its step's own
    # time between collectives); 0: one process, or unmeasured
    straggler_share: float = 0.0
    # microseconds a fresh 4 KiB page's first touch costs beyond a second, and its release (``page_costs``);
    # 0: unmeasured
    page_fault_us: float = 0.0
    page_release_us: float = 0.0
    # a transparent huge page's fault (2 MiB; ``page_costs``); 0: unmeasured, or the kernel gives none
    huge_page_fault_us: float = 0.0
    # TFLOP/s of the triangular solves the caller asked for (``solve_tflops``, at a trace's own shapes); None:
    # none asked (a solve priced as a matmul of the smallest shape class)
    solve_tflops: float | None = None

    @property
    def bandwidth_gbps(self) -> float:
        """The streaming bandwidth elementwise work is priced at: the fp32 add's (reads two, writes one)."""
        return self.memory_gbps["add_fp32"]

    def tflops(self, dtype: str, shape_class: str = "square") -> float:
        return self.matmul_tflops[(dtype, shape_class)]

    def hardware(self, trace=None, name: str = "cpu (measured)"):
        """The roofline's device for this CPU (``hardware.measured_cpu``), from the probe's figures:

        * matmul peaks: the bf16 and fp32 rates at the trace's own matmul shapes where the probe timed them
          (``shapes``), else at ``skinny`` (the rate over the FLOPs of every matmul whose smallest side is 128
          or more, ``trace_rate``); without a trace, ``skinny``;
        * shape classes: a product whose smallest side is under 128 at ``tiny``'s share of that peak, per
          dtype (the delta rule's chunk products); no class below the peak otherwise (on these cores a
          2048 x 256 x 256 product runs as fast as a square 1024^3: a GPU's tiles-and-waves shares do not
          apply);
        * a grouped matmul at the probe's expert-layer rate over the bf16 peak (torch runs it on a CPU as a
          loop of per-group products); fused attention at the probe's SDPA rate;
        * memory bandwidth: the streaming fp32 add (reads two, writes one); by working-set size where the
          probe measured ``bandwidth_curve`` (``curve_points``: each op priced at its own size's rate where
          the caches hold its data, within ``cache_bytes`` of traffic, else at the streaming rate);
        * host per eager op: ``engine_op_us`` (the training step's own), else the autograd chain's; per
          compiled kernel ``engine_compiled_us``, else one bare op's dispatch;
        * the link between two processes (gloo): measured on their own group at the step's message size
          where the caller did (``link_figures``: ``link_gbps``, ``link_latency_us``), else a ring step
          copying each byte out of and into a socket buffer, half the copy bandwidth; per collective kind
          its own figures where measured (``links``: gloo reduces on the CPU);
        * a fresh page's fault and release (``page_fault_us``, ``page_release_us``), a huge page's fault
          (``huge_page_fault_us``);
        * a triangular solve's rate where the caller measured one (``solve_tflops``);
        * the stragglers' share, where the caller measured it (``straggler_share``)."""
        from qwen3_pretrain.hardware import measured_cpu

        peaks = {d: self.trace_rate(trace, d) for d in DTYPES}
        classes = {d: ((128, min(1.0, self.matmul_tflops[(d, "tiny")] / peaks[d])),)
                   if (d, "tiny") in self.matmul_tflops else () for d in DTYPES}
        grouped = [v for (_, c), v in self.matmul_tflops.items() if c.startswith("grouped")]
        curve = curve_points(self.bandwidth_by_size, self.curve_mib) if self.bandwidth_by_size else ()
        class_curves = tuple((cls, curve_points(self.bandwidth_by_size, self.curve_mib, (kind,)))
                             for cls, kind in CLASS_KINDS.items() if kind in self.bandwidth_by_size)
        return measured_cpu(
            peaks["bf16"], peaks["fp32"], self.bandwidth_gbps, self.engine_op_us or self.autograd_op_latency_us,
            name=name, source=f"measured by simulate.probe: {self.cpu}, {self.threads} thread(s), load "
                              f"{self.load_average:.1f}",
            attention_tflops=self.matmul_tflops.get(("bf16", "attention")), shape_classes=classes["bf16"],
            fp32_shape_classes=classes["fp32"],
            grouped_matmul_share=min(grouped) / peaks["bf16"] if grouped else 1.0,
            compiled_launch_us=self.engine_compiled_us or self.op_latency_us,
            intra_node_gbps=self.link_gbps or self.memory_gbps["copy"] / 2,
            intra_node_latency_us=self.link_latency_us,
            bandwidth_curve=curve, cache_bytes=cache_bytes(curve), class_curves=class_curves,
            straggler_share=self.straggler_share,
            collective_links=tuple((kind, gbps, us) for kind, (gbps, us) in sorted(self.links.items())),
            page_fault_us=self.page_fault_us, page_release_us=self.page_release_us,
            huge_page_fault_us=self.huge_page_fault_us,
            solve_tflops=self.solve_tflops)

    def trace_rate(self, trace, dtype: str) -> float:
        """TFLOP/s of ``trace``'s ``dtype`` ("bf16"/"fp32") matmuls with no side under 128 and one group: each
        at the rate the probe timed for a linear layer of the same three sizes, else at ``skinny``; the total
        FLOPs over the total time (``skinny`` where the trace has none)."""
        skinny = self.tflops(dtype, "skinny")
        rates = {tuple(sorted(map(int, c.split("x")))): v for (d, c), v in self.matmul_tflops.items()
                 if d == dtype and c[0].isdigit()}
        flops = seconds = 0.0
        for (_, dt, m, n, k, groups), calls in (trace.matmuls.items() if trace is not None else ()):
            if _SHORT.get(dt) != dtype or groups > 1 or min(m, n, k) < 128:
                continue
            work = 2.0 * m * n * k * calls
            flops += work
            seconds += work / rates.get(tuple(sorted((m, n, k))), skinny)
        return flops / seconds if seconds else skinny

    def rows(self) -> list[str]:
        """The probe as printable lines."""
        lines = [f"cpu: {self.cpu}, {self.threads} thread(s), load average {self.load_average:.1f}"]
        lines += [f"matmul {dtype} {shape}: {value:.3f} TFLOP/s" for (dtype, shape), value in
                  sorted(self.matmul_tflops.items())]
        lines += [f"memory {name}: {value:.1f} GB/s" for name, value in self.memory_gbps.items()]
        lines += [f"memory {kind} at " + ", ".join(f"{mib:g}" for mib in self.curve_mib) + " MiB: "
                  + ", ".join(f"{v:.1f}" for v in rates) + " GB/s" for kind, rates in self.bandwidth_by_size.items()]
        lines.append(f"tiny op: {self.op_latency_us:.1f} us, under autograd (forward and backward, per op): "
                     f"{self.autograd_op_latency_us:.1f} us")
        if self.solve_tflops:
            lines.append(f"triangular solve: {self.solve_tflops:.4f} TFLOP/s")
        if self.page_fault_us:
            lines.append(f"fresh 4 KiB page: {self.page_fault_us:.2f} us its fault, "
                         f"{self.page_release_us:.2f} its release")
        if self.huge_page_fault_us:
            lines.append(f"fresh 2 MiB huge page: {self.huge_page_fault_us:.1f} us its fault")
        if self.engine_op_us is not None:
            lines.append(f"training step's host per op: {self.engine_op_us:.1f} us eager"
                         + (f", {self.engine_compiled_us:.1f} us per compiled kernel" if self.engine_compiled_us else ""))
        return lines


def cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                "unknown CPU")


def seconds_per_call(fn: Callable[[], object], min_seconds: float = 0.02, repeats: int = 3) -> float:
    """Median over ``repeats`` of the mean time of ``fn`` over a run of at least ``min_seconds``."""
    fn()  # first call: oneDNN primitive creation, page faults of fresh outputs
    start, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - start < min_seconds / 4:  # one call at least (a preempted start)
        fn()
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    n = max(1, int(min_seconds / max(per_call, 1e-9)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n)
    return statistics.median(samples)


def matmul_tflops(m: int, k: int, n: int, dtype: torch.dtype, min_seconds: float = 0.02) -> float:
    """TFLOP/s of [m, k] @ [k, n] in ``dtype`` (2 m k n FLOPs), the layout of ``F.linear``'s forward."""
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    return 2 * m * k * n / seconds_per_call(lambda: a @ w.t(), min_seconds) / 1e12


def linear_tflops(tokens: int, k: int, n: int, dtype: torch.dtype, min_seconds: float = 0.02) -> float:
    """TFLOP/s of a linear layer's three products (forward, input gradient, weight gradient) together."""
    x, w, g = (torch.randn(tokens, k, dtype=dtype), torch.randn(n, k, dtype=dtype),
               torch.randn(tokens, n, dtype=dtype))

    def fwd_bwd() -> None:
        x @ w.t()
        g @ w
        g.t() @ x

    return 3 * 2 * tokens * k * n / seconds_per_call(fwd_bwd, min_seconds) / 1e12


def tiny_tflops(batch: int, side: int, dtype: torch.dtype, min_seconds: float = 0.02) -> float:
    """TFLOP/s of a batch of ``side``-cubed products (``bmm``, 2 batch side^3 FLOPs)."""
    a, b = torch.randn(batch, side, side, dtype=dtype), torch.randn(batch, side, side, dtype=dtype)
    return 2 * batch * side**3 / seconds_per_call(lambda: torch.bmm(a, b), min_seconds) / 1e12


def solve_tflops(batch: int, n: int, k: int, dtype: torch.dtype = torch.float32,
                 min_seconds: float = 0.02) -> float:
    """TFLOP/s (``n^2 k`` FLOPs a system) of ``linalg_solve_triangular`` over a batch of ``batch`` unit-lower
    ``n x n`` systems against ``k`` right-hand sides: the identity expanded over the batch where ``k == n``, as
    the Gated DeltaNet's chunk inverse solves (models/ops/gated_delta.py)."""
    a = torch.randn(batch, n, n).tril(-1).mul_(0.1).to(dtype)
    b = torch.eye(n, dtype=dtype).expand(batch, n, n) if k == n else torch.randn(batch, n, k, dtype=dtype)
    seconds = seconds_per_call(lambda: torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True),
                               min_seconds)
    return float(batch) * n * n * k / seconds / 1e12


def host_us_per_op(step: Callable[[], object], ops: int, repeats: int = 3) -> float:
    """Microseconds per op of ``step`` (a training step at tiny shapes, which dispatches ``ops`` ops): its
    median wall time over ``repeats`` calls over ``ops``. At tiny shapes the arithmetic is negligible, so this is
    the host's cost per op: the dispatcher, autograd, the engine's Python and hooks. A multi-process step's
    collectives are in it: the caller takes them off (the CPU bench at their price on the measured links)."""
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls) / max(ops, 1) * 1e6


def grouped_tflops(rows: int, experts: int, k: int, n: int, min_seconds: float = 0.02,
                   counts: Iterable[Iterable[int]] = (), dtype: torch.dtype = torch.bfloat16) -> float:
    """TFLOP/s of an expert layer's three grouped products (forward, input and weight gradients) together:
    ``rows`` tokens through [experts, n, k] weights, as models/ops/moe.py calls ``torch._grouped_mm`` (bf16;
    fp32 on CPUs where the engine runs it grouped). ``counts``: per-group row counts as routing gave them
    (one list per expert layer call; the operands grow to the largest sum, padding included), timed one
    after the other; without them, ``experts`` equal groups of ``rows``.

    On a CPU the kernel is a loop of one matmul per group (oneDNN, a kernel per row count). On the bench's
    tiny MoE (groups of 192 to 928 rows where equal ones would be 512, padded to row buckets) a real step's
    36 grouped calls took 0.127 s in the step and 0.092 s replayed alone at the same operands, 0.090 s with
    equal groups: the group sizes barely matter once their kernels exist, the caches the step leaves do
    (2-core AMX Xeon, one thread). Timing the routing's own sizes keeps the probe on the kernels the step
    runs."""
    runs = [torch.tensor(list(c), dtype=torch.int64) for c in counts] or [torch.full((experts,), rows // experts)]
    rows = max(rows, *(int(c.sum()) for c in runs))
    x, g = torch.randn(rows, k, dtype=dtype), torch.randn(rows, n, dtype=dtype)
    w = torch.randn(experts, n, k, dtype=dtype)
    offsets = [c.cumsum(0).to(torch.int32) for c in runs]
    flops = 3 * 2 * k * n * sum(int(c.sum()) for c in runs)

    def fwd_bwd() -> None:
        for offs in offsets:
            torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
            torch._grouped_mm(g, w, offs=offs)
            torch._grouped_mm(g.t(), x, offs=offs)

    return flops / seconds_per_call(fwd_bwd, min_seconds) / 1e12


def attention_tflops(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                     min_seconds: float = 0.02) -> float:
    """TFLOP/s of causal bf16 SDPA forward and backward at these sizes, counted as the roofline counts it:
    the causal half of the square, 4 b h s^2 d / 2 forward and 2.5 times that backward (it recomputes the
    scores)."""
    def qkv(h: int) -> torch.Tensor:
        return torch.randn(batch, h, seq, head_dim, dtype=torch.bfloat16, requires_grad=True)

    q, k, v = qkv(heads), qkv(kv_heads), qkv(kv_heads)
    grad = torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16)

    def fwd_bwd() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
        torch.autograd.grad(out, (q, k, v), grad)

    flops = 4 * batch * heads * seq * seq * head_dim / 2 * 3.5
    return flops / seconds_per_call(fwd_bwd, min_seconds) / 1e12


def memory_gbps(min_seconds: float = 0.05, mib: int = 128) -> dict[str, float]:
    """Streaming bandwidth of a copy and an add over tensors of ``mib`` MiB (well beyond the caches)."""
    numel = mib * 2**20 // 4
    src, dst = torch.ones(numel), torch.empty(numel)
    a16, b16, out16 = torch.ones(numel, dtype=torch.bfloat16), torch.ones(numel, dtype=torch.bfloat16), \
        torch.empty(numel, dtype=torch.bfloat16)
    out32 = torch.empty(numel)
    return {
        "copy": 2 * 4 * numel / seconds_per_call(lambda: dst.copy_(src), min_seconds) / 1e9,
        "add_fp32": 3 * 4 * numel / seconds_per_call(lambda: torch.add(src, dst, out=out32), min_seconds) / 1e9,
        "add_bf16": 3 * 2 * numel / seconds_per_call(lambda: torch.add(a16, b16, out=out16), min_seconds) / 1e9,
    }


# the working-set sizes of ``bandwidth_curve``, MiB: two inside a core's L2, one across it, two from memory
CURVE_MIB = (0.5, 2.0, 8.0, 32.0, 128.0)


def bandwidth_curve(sizes_mib: Iterable[float] = CURVE_MIB, min_seconds: float = 0.02) -> dict[str, list[float]]:
    """GB/s (bytes read + written per second) of the memory-bound kernels a training step runs most, each at
    working sets of ``sizes_mib`` MiB (the bytes one call moves): an fp32 copy, a bf16 add, an fp32 multiply
    and an fp32 -> bf16 cast (their median is the device's one curve), and one kernel per op class of the
    roofline's trace that streams at its own rate (``CLASS_KINDS``): a gather of bf16 rows in a random order
    (routing's), an fp32 multiply in place (the optimizer's), a bf16 SiLU (transcendental functions), an fp32
    exponential (the loss's, of its fp32 logits), an
    fp32 multiply and a bf16 SiLU backward of views whose last dim is strided (non-contiguous operands:
    scalar loops, 1 GB/s for the SiLU on the 2-core AMX Xeon) and the hybrid's depthwise bf16 convolution
    of a transposed input (about 1 GB/s there, 2-4x slower than of a contiguous one). A repeated call finds
    what the previous one left in the caches, as a step's kernel finds what the kernel before it wrote: a few
    MiB stream from L2 / L3, hundreds from memory.
    {kind: [GB/s per size]}; ``curve_points`` makes the device's curves of it."""
    out: dict[str, list[float]] = {k: [] for k in ("copy", "add_bf16", "mul_fp32", "cast", "index", "mul_inplace",
                                                   "silu_bf16", "exp_fp32", "strided", "strided_silu_bf16",
                                                   "conv_bf16")}
    for mib in sizes_mib:
        nbytes = mib * 2**20
        n32 = max(1, int(nbytes / 8))  # copy and cast move 4 + 4 or 4 + 2 bytes an element: numel from the copy's
        src, dst = torch.ones(n32), torch.empty(n32)
        n16 = max(1, int(nbytes / 6))  # a + b -> out in bf16: 6 bytes an element
        a16, b16, o16 = torch.ones(n16, dtype=torch.bfloat16), torch.ones(n16, dtype=torch.bfloat16), \
            torch.empty(n16, dtype=torch.bfloat16)
        m32 = max(1, int(nbytes / 12))  # a * b -> out in fp32
        a32, b32, o32 = torch.ones(m32), torch.ones(m32), torch.empty(m32)
        c16 = torch.empty(n32, dtype=torch.bfloat16)
        e32 = torch.full((n32,), -1.0)  # the loss exponentiates logits less their maximum: at most 0
        # routing's row moves: bf16 rows of 256 (512 bytes) gathered in a random order, each row read and
        # written once, and its int64 index read
        rows = max(1, int(nbytes / (2 * 512 + 8)))
        r16, idx = torch.ones(rows, 256, dtype=torch.bfloat16), torch.randperm(rows)
        g16 = torch.empty(rows, 256, dtype=torch.bfloat16)
        # arithmetic on a view whose last dim is strided: 64 x 64 blocks transposed (the contiguous layout's
        # vector loops do not apply; a transpose of outer dims vectorizes and streams as fast as contiguous)
        blocks = max(1, m32 // 4096)
        t32, u32, d32 = torch.ones(blocks, 64, 64), torch.ones(blocks, 64, 64), torch.empty(blocks, 64, 64)
        t16, grad16 = torch.ones(blocks, 64, 64, dtype=torch.bfloat16), torch.ones(blocks, 64, 64, dtype=torch.bfloat16)
        # the hybrid's short convolution: depthwise, kernel 4, causal padding, bf16, its input [batch 4, time,
        # channels 512] viewed as [batch, channels, time] (as the model calls it)
        steps = max(4, int(nbytes / (2 * 2 * 4 * 512)))
        conv_x = torch.ones(4, steps, 512, dtype=torch.bfloat16).transpose(1, 2)
        conv_w = torch.ones(512, 1, 4, dtype=torch.bfloat16)
        for kind, moved, fn in (
                ("copy", 8 * n32, lambda: dst.copy_(src)),
                ("add_bf16", 6 * n16, lambda: torch.add(a16, b16, out=o16)),
                ("mul_fp32", 12 * m32, lambda: torch.mul(a32, b32, out=o32)),
                ("cast", 6 * n32, lambda: c16.copy_(src)),
                ("index", rows * (2 * 512 + 8), lambda: torch.index_select(r16, 0, idx, out=g16)),
                ("mul_inplace", 12 * m32, lambda: a32.mul_(b32)),
                ("silu_bf16", 4 * n16, lambda: torch.ops.aten.silu.out(a16, out=o16)),
                ("exp_fp32", 8 * n32, lambda: torch.exp(e32, out=dst)),
                ("strided", 12 * t32.numel(), lambda: torch.mul(t32.transpose(1, 2), u32, out=d32)),
                ("strided_silu_bf16", 6 * t16.numel(),
                 lambda: torch.ops.aten.silu_backward(grad16, t16.transpose(1, 2))),
                ("conv_bf16", 2 * 2 * conv_x.numel(),
                 lambda: torch.nn.functional.conv1d(conv_x, conv_w, padding=3, groups=512))):
            out[kind].append(moved / seconds_per_call(fn, min_seconds) / 1e9)
    return out


# the roofline's op classes (``simulate.roofline.trace.op_class``) -> the ``bandwidth_curve`` kind that times
# one of them; a fused region (compiled) keeps the median curve
CLASS_KINDS = {"fp32": "mul_fp32", "bf16": "add_bf16", "copy": "copy", "cast": "cast", "index": "index",
               "inplace": "mul_inplace", "bf16_math": "silu_bf16", "fp32_math": "exp_fp32", "strided": "strided",
               "strided_math": "strided_silu_bf16", "conv": "conv_bf16"}
# the kinds whose median per size is the device's one curve (a compiled region's, and any op class without
# its own): the others time classes of their own, not a step's typical kernel
MEDIAN_KINDS = ("copy", "add_bf16", "mul_fp32", "cast")


def curve_points(curve: dict[str, list[float]], sizes_mib: Iterable[float] = CURVE_MIB,
                 kinds: Iterable[str] = MEDIAN_KINDS) -> tuple[tuple[float, float], ...]:
    """``Hardware.bandwidth_curve`` from ``bandwidth_curve``'s figures: (bytes, GB/s) per size, the median
    of the kinds at that size (a step mixes them; on the 2-core AMX Xeon they spread up to 4x at 0.5 MiB, the
    bf16 add slowest: it converts through fp32, and 1.5-2x at 128 MiB)."""
    sizes = list(sizes_mib)
    rates = [curve[k] for k in kinds if k in curve]
    return tuple((mib * 2**20, statistics.median(r[i] for r in rates)) for i, mib in enumerate(sizes))


def cache_bytes(points: tuple[tuple[float, float], ...]) -> float:
    """The traffic a CPU's caches hold (``Hardware.cache_bytes``), read off its curve: the largest working set
    that still streams 1.5x faster than the largest (memory) one, 0 where none does. On the 2-core AMX Xeon
    32 MiB (21-23 GB/s against 8-11 at 128 MiB; its L2 is 2 MiB a core, its L3 a shared 300 MiB): the same
    multiply rotated over buffers of 64 MiB in all ran at 9 GB/s at every size, so the speed is the caches',
    and only for data touched within about that much traffic."""
    if len(points) < 2:
        return 0.0
    streaming = points[-1][1]
    return max((size for size, rate in points[:-1] if rate >= 1.5 * streaming), default=0.0)


def op_latency_us(calls: int = 2000) -> float:
    """Microseconds per tiny eager op (dispatch, allocation of its output): the floor of an op's host time."""
    a, b = torch.ones(8), torch.ones(8)
    return seconds_per_call(lambda: a + b, min_seconds=calls * 2e-6) * 1e6


def autograd_op_latency_us(length: int = 32) -> float:
    """Microseconds per op of a chain of ``length`` tiny multiplications run forward and backward: each
    forward op records its autograd node, and the engine runs one op per node in backward."""
    x = torch.ones(8, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(length):
            y = y * 1.0001
        y.sum().backward()

    return seconds_per_call(chain, min_seconds=length * 2e-4) / (2 * length) * 1e6


def measure_cpu(shapes: Iterable[tuple[int, int, int]] = (), threads: int | None = None,
                grouped: Iterable[tuple[int, int, int, int]] = (), group_counts: Iterable[Iterable[int]] = (),
                attention: tuple[int, int, int, int, int] | None = None,
                solves: Iterable[tuple[str, int, int, int]] = (),
                square: int = 1024, skinny: tuple[int, int, int] = (2048, 256, 256), tiny: tuple[int, int] = (32, 64),
                min_seconds: float = 0.02, memory_mib: int = 128,
                curve_mib: Iterable[float] = CURVE_MIB) -> CpuProbe:
    """Measure this CPU at ``threads`` intra-op threads (default: torch's current setting).

    ``shapes``: (tokens, in, out) of linear layers whose forward and backward products are timed together,
    recorded as shape class ``"tokens x in x out"``; ``grouped``: (rows, experts, in, out) of expert layers,
    timed as ``grouped_tflops`` and recorded as bf16 shape class ``"grouped rows x experts x in x out"``, at
    ``group_counts`` (per-group row counts as the model's routing gave them: those of ``experts`` groups are
    timed; equal groups where none has);
    ``attention``: (batch, heads, kv heads, seq, head_dim) of causal SDPA, bf16 shape class ``"attention"``;
    ``solves``: (dtype, batch, n, k) of triangular solves (``solve_tflops``; the rate over them all:
    their FLOPs over their time); ``tiny``: (batch, side) of the ``"tiny"`` class's batched products;
    ``curve_mib``: the working sets of ``bandwidth_curve`` (empty: not measured).
    About 15 s at ``min_seconds`` 0.01 on the 2-core Xeon at load 4, most of it the bandwidth curves (10 kernels
    at 5 sizes; 4-6 s idle with the defaults before the op classes' kernels).
    Measure at the thread count the priced work runs at: with more threads than the cores free at the
    moment, every parallel region waits for a descheduled thread, a cost per op that grows with the load.
    """
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        tflops: dict[tuple[str, str], float] = {}
        for name, dtype in DTYPES.items():
            tflops[(name, "square")] = matmul_tflops(square, square, square, dtype, min_seconds)
            tflops[(name, "skinny")] = matmul_tflops(*skinny, dtype, min_seconds)
            tflops[(name, "tiny")] = tiny_tflops(*tiny, dtype, min_seconds)
            for tokens, k, n in shapes:
                tflops[(name, f"{tokens}x{k}x{n}")] = linear_tflops(tokens, k, n, dtype, min_seconds)
        group_counts = [list(c) for c in group_counts]
        for rows, experts, k, n in grouped:
            counts = [c for c in group_counts if len(c) == experts]
            tflops[("bf16", f"grouped {rows}x{experts}x{k}x{n}")] = grouped_tflops(rows, experts, k, n, min_seconds,
                                                                                 counts)
        if attention:
            tflops[("bf16", "attention")] = attention_tflops(*attention, min_seconds=min_seconds)
        solve_rate = None
        flops = seconds = 0.0
        for dtype, batch, n, k in sorted(set(solves)):
            work = float(batch) * n * n * k
            flops += work
            seconds += work / (solve_tflops(batch, n, k, getattr(torch, dtype), min_seconds) * 1e12)
        if seconds:
            solve_rate = flops / seconds / 1e12
        curve_mib = tuple(curve_mib)
        costs = page_costs()
        return CpuProbe(cpu=cpu_name(), threads=torch.get_num_threads(), matmul_tflops=tflops,
                        memory_gbps=memory_gbps(min_seconds, memory_mib), op_latency_us=op_latency_us(),
                        autograd_op_latency_us=autograd_op_latency_us(),
                        load_average=os.getloadavg()[0],
                        bandwidth_by_size=bandwidth_curve(curve_mib, min_seconds) if curve_mib else {},
                        curve_mib=curve_mib, page_fault_us=costs.fault_us, page_release_us=costs.release_us,
                        huge_page_fault_us=costs.huge_fault_us,
                        solve_tflops=solve_rate)
    finally:
        torch.set_num_threads(before)


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``); 0 where the platform has no ``resource``."""
    try:
        import resource
    except ImportError:  # not Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


HUGE_PAGE = 2**21  # a transparent huge page of x86-64 and arm64 (4 KiB base pages)


def huge_page_faults() -> int:
    """The transparent huge pages faulted in so far on this machine (``/proc/vmstat``'s ``thp_fault_alloc``):
    every process's, not this one's alone (Linux counts no process's own); a huge page's fault is also one of
    the process's minor faults (``minor_faults``). 0 where the kernel does not say (not Linux, no huge pages)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("thp_fault_alloc "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def huge_resident_bytes() -> int | None:
    """This process's resident memory in transparent huge pages now (``AnonHugePages`` of
    ``/proc/self/smaps_rollup``); None where the kernel does not say."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class PageCosts:
    """Microseconds a fresh 4 KiB page of memory costs at its first touch beyond a second touch (the OS maps and
    zeroes it: a minor page fault) and handing it back (``madvise(MADV_DONTNEED)``, what ``malloc_trim`` and
    ``free`` of a mapped buffer do); a transparent huge page's fault (2 MiB, where the kernel gives them to a
    mapping that asks, as torch's CPU allocator does for its large buffers under ``THP_MEM_ALLOC_ENABLE``).
    Not a huge page's release: the trim hands back ranges of the heap, and the kernel splits a huge page a
    range cuts into small pages to release them. 0: not measured."""

    fault_us: float = 0.0
    release_us: float = 0.0
    huge_fault_us: float = 0.0


def page_costs(mib: int = 32, repeats: int = 3) -> PageCosts:
    """``PageCosts`` measured: an anonymous mapping of ``mib`` MiB with huge pages declined, filled twice and
    released; then one of as many huge pages with them asked for (the huge pages its first fill faulted in:
    the growth of this process's ``huge_resident_bytes`` over the fill, or where the kernel does not say, the
    machine's ``huge_page_faults``, at most the mapping's whole huge pages); the medians of ``repeats``. On a
    2-core EPYC VM: about 0.75-1.8 and 0.25 us a 4 KiB page, a huge page's fault 110-200 us (a fifth of its 512
    small pages'). A huge page's
    fault cost 2.5 ms where the machine's memory was fresh to it (the first mapping of a process; a
    hypervisor backing the page), or as the kernel compacted memory for one: the median keeps the common
    case. Zeros where the platform counts no minor faults or cannot decline huge pages (not Linux, or a
    kernel without them); the huge page's zeros where the kernel gave the mapping none."""
    import mmap

    if not hasattr(mmap, "MADV_NOHUGEPAGE") or not hasattr(mmap, "MADV_DONTNEED") or not minor_faults():
        return PageCosts()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a parallel fill waits for any of its threads a busy machine deschedules
    try:
        small = _page_costs(mib, repeats, huge=False)
        if small is None:
            return PageCosts()
        huge = (_page_costs(mib, repeats, huge=True) if hasattr(mmap, "MADV_HUGEPAGE") else None) or (0.0, 0.0)
        return PageCosts(*small, huge_fault_us=huge[0])
    finally:
        torch.set_num_threads(threads)


def _own_huge_pages() -> int:
    """This process's transparent huge pages now, or where the kernel does not say, the machine's faulted in so
    far (``_page_costs`` takes the difference over one fill)."""
    resident = huge_resident_bytes()
    return resident // HUGE_PAGE if resident is not None else huge_page_faults()


def _page_costs(mib: int, repeats: int, huge: bool) -> tuple[float, float] | None:
    """(fault, release) microseconds per page of a mapping of ``mib`` MiB with huge pages declined, or asked
    for (``huge``: per huge page faulted in); None where the kernel refuses the advice or faulted no page."""
    import mmap

    faults_us, release_us = [], []
    size = mib * 2**20 + (HUGE_PAGE if huge else 0)  # room to align whole huge pages in
    for _ in range(repeats):
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            region.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
            # huge: the whole huge pages only (a small page's fault at an unaligned end is not a huge one's)
            offset = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE if huge else 0
            view = torch.frombuffer(region, dtype=torch.float32, offset=offset, count=mib * 2**20 // 4)
            count = _own_huge_pages if huge else minor_faults
            faults, start = count(), time.perf_counter()
            view.fill_(1.0)
            cold, faults = time.perf_counter() - start, count() - faults
            if huge:
                faults = min(faults, mib * 2**20 // HUGE_PAGE)
            warm = math.inf
            for value in (2.0, 3.0):  # the faster of two warm fills: one preempted fill would read no fault cost
                start = time.perf_counter()
                view.fill_(value)
                warm = min(warm, time.perf_counter() - start)
            del view
            start = time.perf_counter()
            region.madvise(mmap.MADV_DONTNEED)
            released = time.perf_counter() - start
        except OSError:  # a kernel built without transparent huge pages refuses the advice
            return None
        finally:
            region.close()
        if faults > 0:
            faults_us.append(max(0.0, cold - warm) / faults * 1e6)
            release_us.append(released / faults * 1e6)
    return (statistics.median(faults_us), statistics.median(release_us)) if faults_us else None


def collective_seconds_measured(group, kind: str, nbytes: int, dtype: torch.dtype = torch.bfloat16,
                                iters: int = 10, statistic: str = "median") -> float:
    """Seconds per call of one collective of ``kind`` ("all_reduce", "all_gather", "reduce_scatter") on a whole
    buffer of ``nbytes`` in ``dtype`` over ``group`` (every rank of it calls this at once), the slowest rank's
    ``statistic`` ("median" or "mean") over ``iters`` calls, each call opened by a barrier so that a rank's late
    start is not timed as the transfer (what ``commbench`` measures for the planner, here at a step's own
    message sizes and dtype). The mean holds the calls' slow tail (gloo's worker threads scheduled late on
    busy cores), which a step that runs many of them pays; the median does not."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    numel = max(n, nbytes // torch.empty(0, dtype=dtype).element_size() // n * n)
    full, shard = torch.ones(numel, dtype=dtype), torch.ones(numel // n, dtype=dtype)
    run = {"all_reduce": lambda: dist.all_reduce(full, group=group),
           "all_gather": lambda: dist.all_gather_single(full, shard, group=group),
           "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full, group=group)}[kind]
    run()
    samples = []
    for _ in range(iters):
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    slowest = torch.tensor([{"median": statistics.median, "mean": statistics.fmean}[statistic](samples)],
                           dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest)


def link_figures(group, kind: str, nbytes: int, dtype: torch.dtype = torch.bfloat16,
                 iters: int = 10, statistic: str = "median") -> tuple[float, float]:
    """(bus bandwidth GB/s, latency us) of ``group``'s link, fitted to the planner's model (``plan.formulas.
    collective_seconds``: bytes x the kind's bus factor / bandwidth + latency) from two timed sizes: 4 KiB
    (the latency) and ``nbytes`` (a step's message); a message under 4 KiB is timed at its own size for the
    latency, and one under 64 KiB at 64 KiB for the bandwidth. On gloo both are the host's: loopback TCP,
    and the reduction computed on the CPU in ``dtype``."""
    from qwen3_pretrain.plan.formulas import bus_bandwidth_factor

    small_bytes, large_bytes = min(4096, nbytes), max(nbytes, 65536)
    small = collective_seconds_measured(group, kind, small_bytes, dtype, iters, statistic)
    large = collective_seconds_measured(group, kind, large_bytes, dtype, iters, statistic)
    n = group.size()
    # a message timed hardly slower than the small one (noise): a tenth of its time as transfer
    transfer = max(large - small, large / 10)
    return large_bytes * bus_bandwidth_factor(kind, n) / transfer / 1e9, small * 1e6


def straggler_share(group, segment_s: float, repeats: int = 24) -> float:
    """What a rank of ``group`` waits, at a collective closing a stretch of ``segment_s`` seconds of its own
    work, for the group's last rank to arrive, as a share of that work (``Hardware.straggler_share``; every
    rank calls this at once). Each repeat lines the ranks up (a barrier), runs the same work on every rank
    (bf16 256^3 products, as many as the slowest rank ran in ``segment_s`` on a first try) and compares the
    ranks' durations: the share is the sum over repeats and ranks of (the slowest's duration - the rank's
    own) over the sum of their own. It holds both the jitter of a rank's speed from stretch to stretch and
    the ranks' steady differences (a core shared with more of the machine's other threads); no collective's
    own time is in it."""
    import torch.distributed as dist

    a = torch.randn(256, 256, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.mm(a, a, out=out)
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < min(segment_s, 0.05):
        torch.mm(a, a, out=out)
        count += 1
    per_call = torch.tensor([(time.perf_counter() - start) / count], dtype=torch.float64)
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX, group=group)
    calls = max(1, round(segment_s / float(per_call)))
    n = dist.get_world_size(group)
    waited = own = 0.0
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, a, out=out)
        durations = [torch.zeros(1, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(durations, torch.tensor([time.perf_counter() - start], dtype=torch.float64), group=group)
        times = [float(d) for d in durations]
        waited += sum(max(times) - t for t in times)
        own += sum(times)
    return waited / own

