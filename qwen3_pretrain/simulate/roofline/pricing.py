"""Price an op trace (``trace.OpTrace``) on a device (``hardware.Hardware``): a roofline per op class.

* **matmuls**: ``2 m n k`` FLOPs at the dtype's dense peak (``Hardware.matmul_tflops``) x
  ``matmul_efficiency`` x the shape class's share (``Hardware.shape_classes``: on an accelerator a GEMM
  whose smallest side is under 1024 fills the device's tiles and waves less, a simple documented model,
  not a measurement; a CPU's classes are measured by ``simulate.probe``), or its operands' bytes at memory
  bandwidth where that is longer (a skinny matmul is memory-bound). A grouped matmul is priced per group
  (the trace keeps one group's sizes): its class is one group's smallest side, times the device's
  ``grouped_matmul_share`` (a CPU runs it as a loop of small products). Triangular solves count here too:
  ``n^2 k`` FLOPs a system at ``Hardware.solve_tflops`` (a CPU's measured), else as a matmul of the smallest
  shape class, or their operands' bytes at memory bandwidth where longer.
* **attention** (SDPA's fused kernels): forward ``4 b h sq skv d`` FLOPs, half of it under a causal
  mask; backward 2.5 times the forward (it recomputes the scores: five products against two), at the
  device's ``attention_efficiency`` of the dtype's peak (0.5 on accelerators, FlashAttention's; a CPU's
  measured), or its q, k, v, output bytes at memory bandwidth where longer.
  FlexAttention and the document mask are played as causal (density 1/2). SDPA's math fallback arrives
  as ``bmm`` and softmax ops: its whole square and its probabilities' traffic.
* **memory-bound ops**: bytes at ``memory_bandwidth_gbps`` x ``bandwidth_efficiency``; eager one op at a
  time; compiled, the fused regions inside the compiled scope (the decoder layers ``compile: true``
  compiles, ``trace.py``) and the ops outside it (embedding, loss, optimizer, FSDP's copies) one at a time.
  A fused region saves the traffic between its ops, not their arithmetic: on a device with class curves (a
  CPU's) a phase's regions take at least each of their ops' bytes at its class's fastest rate
  (``fused_compute_seconds``: with its data in the caches an op's pace is its arithmetic's).
  Where the device has a ``bandwidth_curve`` (a CPU's, measured by ``simulate.probe``: its caches stream a
  few MiB 1.5-3x faster than memory, when they are in its caches), each op's or fused region's bytes at
  the rate of its own size where its caches hold them: its writes, and its reads of tensors some kernel
  touched within the device's ``cache_bytes`` of traffic before (the trace's reuse distances); its other
  reads at the streaming rate (``memory_seconds``). Each eager op also carries its class (``trace.op_class``:
  index, conv, strided, cast, copy, bf16 math, bf16, in-place, fp32), priced on that class's own curve
  where the device has one (``Hardware.class_curves``, a CPU's from its probe: per byte a bf16 SiLU streams
  3-4x slower than an fp32 multiply, a SiLU backward on a transposed view 20x); a fused region stays on the
  one curve. The accelerators keep one HBM figure and no class curves.
* **collectives**: the planner's link model (``plan.formulas.collective_seconds``, the device's intra-
  or inter-node bus bandwidth and latency per axis; on a node, a kind's own where the device has one,
  ``Hardware.collective_links``: a CPU's gloo reduces on the CPU, its reduce-scatter and all-reduce slower
  per byte than its all-gather). Overlap, as the engine runs them: FSDP's (dp)
  all-gathers and reduce-scatters run on side streams behind compute, except the first all-gather and
  the last reduce-scatter of a step (one call of each kind, the average size), and whatever of the rest
  outlasts the step's compute; tp, cp, ep and pp
  collectives are waited on by the compute that follows and count whole. On a device without side streams
  (``Hardware.overlaps_collectives`` false: a CPU, where FSDP2 waits for each gloo call on the thread that
  computes) the dp collectives count whole too: measured on 2 gloo processes, 10 all-reduces of 4 MB took
  0.058 s of the caller's wall time, 0.008 of it inside the collective's op and the rest in its wait.
* **host**: eager issues every op at ``launch_latency_us``; compiled, each matmul, attention call,
  collective and fused region of the compiled scope at ``compiled_launch_us``, and every op outside it at
  ``launch_latency_us``. An accelerator computes asynchronously, so only
  host time beyond the device's is exposed; a CPU computes on its host, so there it adds.
* **waiting** (stragglers): on a multi-rank layout, a rank's own time between its collectives (compute, and a
  CPU's host) x ``Hardware.straggler_share``, what it waits at them for the group's last rank. A CPU's
  share is measured (``simulate.probe.straggler_share``); the accelerators' is 0, not modelled.
* **page faults** (a CPU's): the step's counted minor page faults and released pages (``OpTrace.page_faults``,
  ``pages_released``, where a real step was counted) at ``Hardware.page_fault_us`` and ``page_release_us``
  (a fresh 4 KiB page's first touch and its release, a CPU's measured; 0 on the accelerators). On a 2-core
  EPYC a dense bf16 step at the CPU bench's shapes took about 20,000 faults with the engine's per-step
  ``malloc_trim`` and 1,100 without, and ran 3.5-5% slower with it. The transparent huge pages among the
  faults (``OpTrace.huge_page_faults``: torch's large CPU buffers, 2 MiB a page) at
  ``Hardware.huge_page_fault_us`` (a 4 KiB page's where unmeasured): a step there took 0-91 of them at
  110-200 us each, one fault of the count at a hundred small pages' cost. The released pages all at the
  4 KiB page's cost: the trim hands back ranges of the heap, not whole huge pages, and the kernel splits a
  huge page a range cuts (the bench's "outside every op" cells agreed in 14 of 18 medians of three rounds
  priced so, 9 of 18 with the trim's drop of ``AnonHugePages`` priced as whole huge pages, 6-9 us each).
* **pipeline bubble**: the busy time x Megatron's bubble ratio ``(p - 1) / (v m)``
  (``plan.formulas.megatron_bubble_ratio``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from qwen3_pretrain.hardware import MATMUL_SHAPE_CLASSES, Hardware
from qwen3_pretrain.plan.formulas import collective_seconds, megatron_bubble_ratio
from qwen3_pretrain.simulate.roofline.trace import FUSED, OpTrace, bucket_bytes

# smallest matmul side -> share of the large-GEMM efficiency on an accelerator (hardware.py has the figures)
SHAPE_CLASSES = MATMUL_SHAPE_CLASSES
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
_P2P = ("send", "recv", "broadcast")


def matmul_shape_share(m: int, n: int, k: int, classes: tuple[tuple[int, float], ...] = SHAPE_CLASSES) -> float:
    """The share of ``matmul_efficiency`` a matmul (or one group of a grouped one) of these sizes reaches:
    the first of ``classes`` (smallest side below which, share) its smallest side is under, else 1."""
    side = min(m, n, k)
    for bound, share in classes:
        if side < bound:
            return share
    return 1.0


@dataclass
class Breakdown:
    """Seconds per step by category; ``step`` is their sum."""

    matmul: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    communication: float = 0.0  # exposed
    host: float = 0.0  # exposed
    bubble: float = 0.0
    communication_total: float = 0.0  # every collective's time, hidden or not
    waiting: float = 0.0  # at the collectives, for the group's last rank (``Hardware.straggler_share``)
    page_faults: float = 0.0  # the OS mapping fresh host pages at their first touch and taking them back (a CPU's)

    @property
    def compute(self) -> float:
        return self.matmul + self.attention + self.elementwise

    @property
    def step(self) -> float:
        return self.compute + self.communication + self.host + self.bubble + self.waiting + self.page_faults

    def to_json(self) -> dict:
        return {**{k: round(v, 6) for k, v in asdict(self).items()}, "step": round(self.step, 6)}


def _matmul_seconds(trace: OpTrace, hw: Hardware) -> float:
    bandwidth = hw.streaming_bandwidth
    total = 0.0
    for (_, dtype, m, n, k, groups), calls in trace.matmuls.items():
        classes = hw.shape_classes(dtype)
        peak = hw.matmul_tflops(dtype)
        if peak is None:
            raise ValueError(f"the {hw.name} has no {dtype} matmuls")
        # one group's product (a plain matmul is one group), ``groups`` of them per call
        flops = 2.0 * m * n * k * groups
        moved = _BYTES.get(dtype, 1) * (m * k + k * n + m * n) * groups
        rate = peak * 1e12 * hw.matmul_efficiency * matmul_shape_share(m, n, k, classes)
        if groups > 1:
            rate *= hw.grouped_matmul_share
        total += calls * max(flops / rate, moved / bandwidth)
    return total


def _solve_seconds(trace: OpTrace, hw: Hardware) -> float:
    """Triangular solves: ``n^2 k`` FLOPs a system at ``Hardware.solve_tflops``, else as a matmul of those FLOPs
    in the device's smallest shape class; or their operands' bytes at memory bandwidth where longer."""
    bandwidth = hw.streaming_bandwidth
    total = 0.0
    for (_, dtype, batch, n, k), calls in trace.solves.items():
        flops = float(batch) * n * n * k
        moved = _BYTES.get(dtype, 4) * batch * (n * n + 2 * n * k)  # the systems, the right-hand sides, the result
        if hw.solve_tflops:
            rate = hw.solve_tflops * 1e12
        else:
            peak = hw.matmul_tflops(dtype) or hw.peak_tflops
            rate = peak * 1e12 * hw.matmul_efficiency * matmul_shape_share(1, 1, 1, hw.shape_classes(dtype))
        total += calls * max(flops / rate, moved / bandwidth)
    return total


def attention_flops(b: int, h: int, sq: int, skv: int, d: int, causal: bool, backward: bool) -> float:
    """Executed FLOPs of one fused attention call (module docstring)."""
    forward = 4.0 * b * h * sq * skv * d * (0.5 if causal else 1.0)
    return forward * (2.5 if backward else 1.0)


def _attention_seconds(trace: OpTrace, hw: Hardware) -> float:
    bandwidth = hw.streaming_bandwidth
    total = 0.0
    for (_, kernel, dtype, b, h, sq, skv, d, causal), calls in trace.attention.items():
        backward = kernel.endswith("_backward")
        flops = attention_flops(b, h, sq, skv, d, causal, backward)
        moved = _BYTES.get(dtype, 2) * b * h * d * (2 * sq + 2 * skv) * (2 if backward else 1)
        total += calls * max(flops / ((hw.matmul_tflops(dtype) or hw.peak_tflops) * 1e12 * hw.attention_efficiency),
                             moved / bandwidth)
    return total


def memory_seconds(trace: OpTrace, hw: Hardware, compiled: bool = False) -> float:
    """Seconds of the memory-bound ops: eager each op's bytes, compiled the fused regions' and the ops'
    outside the compiled scope. On a device with a ``bandwidth_curve``, the bytes the trace has sizes for
    at ``sizes_seconds``; bytes a trace has no sizes for, and every byte on a device without a curve, at
    ``memory_bandwidth_gbps`` x ``bandwidth_efficiency``. Compiled, on a device with class curves, a phase's
    fused regions take at least their ops' arithmetic (``fused_compute_seconds``)."""
    flat = hw.streaming_bandwidth
    kinds = ("fused", "outside") if compiled else ("eager",)
    seconds = 0.0
    for m in trace.memory.values():
        moved = m.fused_bytes + m.outside_bytes if compiled else m.eager_bytes
        if hw.bandwidth_curve:
            priced, nbytes = sizes_seconds(m.sizes, hw, kinds)
            seconds += priced
            moved -= nbytes
            if compiled:
                # max(regions' traffic, their arithmetic): the traffic is in ``priced`` already
                regions = {k: v for k, v in m.sizes.items() if k[0] == "fused" and k[3] == FUSED}
                seconds += max(0.0, fused_compute_seconds(m.fused_ops, hw) - sizes_seconds(regions, hw, ("fused",))[0])
        seconds += max(0.0, moved) / flat
    return seconds


def fused_compute_seconds(fused_ops: dict, hw: Hardware) -> float:
    """The arithmetic of a phase's fused regions (``MemoryOps.fused_ops``: their ops' bytes one at a time, by
    op class) on a device with class curves: each op's bytes at its class's fastest rate (``Hardware.class_peak``,
    the op with its data in the caches, where its arithmetic sets the pace). A fused kernel saves the traffic
    between its ops, not their arithmetic: on the 2-core EPYC the compiled layers' kernels of the CPU bench's
    dense, MoE and hybrid steps took 0.04, 0.08 and 0.08-0.12 s, their fused bytes priced 0.006, 0.015 and
    0.018, their ops at their classes' fastest rates 0.052, 0.084 and 0.10. 0 on a device without class
    curves (an accelerator's vector units outrun its memory on these ops)."""
    seconds = 0.0
    for op_class, nbytes in fused_ops.items():
        rate = hw.class_peak(op_class)
        if rate:
            seconds += nbytes / rate
    return seconds


def sizes_seconds(sizes: dict, hw: Hardware, kinds: tuple[str, ...] = ("eager",)) -> tuple[float, float]:
    """(seconds, bytes) of the entries of a ``MemoryOps.sizes`` whose ``how`` is one of ``kinds``, on a device
    with a ``bandwidth_curve``: each kernel's bytes that its caches hold at the rate of its size (the size
    bucket) on the curve of its op class (``Hardware.bandwidth_at``): its writes, and the reads of tensors
    touched within ``cache_bytes`` of traffic (the reuse bucket; every read where ``cache_bytes`` is 0);
    its other reads stream from memory, at the class's curve's largest size."""
    seconds = moved = 0.0
    for key, nbytes in sizes.items():
        how, bucket, reuse = key[:3]
        if how not in kinds:
            continue
        op_class = key[3] if len(key) > 3 else None
        cached = not hw.cache_bytes or bucket_bytes(reuse) <= hw.cache_bytes
        rate = hw.bandwidth_at(bucket_bytes(bucket) if cached else math.inf, op_class)
        seconds += nbytes / rate
        moved += nbytes
    return seconds, moved


def comm_seconds(comm: dict, hw: Hardware, intra: dict[str, bool] | None = None) -> dict[str, tuple[float, float]]:
    """Seconds per axis of ``comm`` ({(axis, kind, n): (whole-buffer bytes, calls)}): (total, first + last
    call of the kind, for dp's overlap). ``intra``: axis -> whether its groups stay inside a node (default
    yes)."""
    out: dict[str, tuple[float, float]] = {}
    for (axis, kind, n), (nbytes, calls) in comm.items():
        if calls == 0:
            continue
        bw, latency = hw.link(kind, (intra or {}).get(axis, True))
        per_call = collective_seconds("p2p" if kind in _P2P else kind, nbytes / calls, n, bw, latency)
        total, edge = out.get(axis, (0.0, 0.0))
        edge += per_call if kind in ("all_gather", "reduce_scatter") else 0.0
        out[axis] = (total + per_call * calls, edge)
    return out


def price(trace: OpTrace, hardware: Hardware, compiled: bool = False, comm: dict | None = None,
          intra: dict[str, bool] | None = None, pp: int = 1, microbatches: int = 1, virtual: int = 1) -> Breakdown:
    """The step time of ``trace`` on ``hardware`` by category (module docstring). ``comm``:
    {(axis, kind, group size): (whole-buffer bytes, calls)} per step (``track.CommCounter.calls_by_size``);
    ``intra``: which axes stay inside a node; ``pp``, ``microbatches``, ``virtual``: the pipeline."""
    out = Breakdown(matmul=_matmul_seconds(trace, hardware) + _solve_seconds(trace, hardware),
                    attention=_attention_seconds(trace, hardware))
    out.elementwise = memory_seconds(trace, hardware, compiled)
    compute = out.compute
    exposed = 0.0
    for axis, (total, edge) in comm_seconds(comm or {}, hardware, intra).items():
        out.communication_total += total
        hidden = axis == "dp" and hardware.overlaps_collectives
        exposed += min(total, edge + max(0.0, total - edge - compute)) if hidden else total
    out.communication = exposed
    if compiled:
        # the compiled scope's kernels at the compiled launch cost; every op outside the scope at the eager one
        outside = sum(trace.outside_ops.values())
        host = (compiled_kernels(trace, comm) * hardware.compiled_launch_us
                + outside * hardware.launch_latency_us) * 1e-6
    else:
        host = sum(trace.host_ops.values()) * hardware.launch_latency_us * 1e-6
    out.host = host if hardware.device_type == "cpu" else max(0.0, host - compute - exposed)
    if hardware.straggler_share and any(n > 1 and calls for (_, _, n), (_, calls) in (comm or {}).items()):
        # a rank's own time between its collectives (compute and, on a CPU, its host's) stretched by what it
        # waits there for the last rank of its group
        out.waiting = hardware.straggler_share * (compute + (out.host if hardware.device_type == "cpu" else 0.0))
    out.page_faults = sum(page_seconds(trace, hardware))
    if pp > 1:
        out.bubble = (compute + out.communication + out.host) * megatron_bubble_ratio(pp, microbatches, virtual)
    return out


def page_seconds(trace: OpTrace, hardware: Hardware) -> tuple[float, float]:
    """Seconds of the step's counted page faults (``fault_seconds``), and of its released pages (4 KiB each)."""
    return (fault_seconds(trace.page_faults, trace.huge_page_faults, hardware.page_fault_us,
                          hardware.huge_page_fault_us),
            trace.pages_released * hardware.page_release_us * 1e-6)


def fault_seconds(faults: float, huge: float, fault_us: float, huge_fault_us: float) -> float:
    """Seconds of ``faults`` minor page faults of which ``huge`` (at most all) were transparent huge pages:
    each at its own cost, a huge page's at a 4 KiB page's where unmeasured (``huge_fault_us`` 0)."""
    huge = min(huge, faults)
    return ((faults - huge) * fault_us + huge * (huge_fault_us or fault_us)) * 1e-6


def compiled_kernels(trace: OpTrace, comm: dict | None = None) -> int:
    """The kernels a compiled step launches from its compiled scope, each at ``compiled_launch_us``: its
    matmuls, solves and attention calls, its fused regions (and convolutions), and the step's collectives."""
    return (sum(trace.matmuls.values()) + sum(trace.solves.values()) + sum(trace.attention.values())
            - trace.outside_kernels + sum(m.regions for m in trace.memory.values())
            + sum(calls for _, calls in (comm or {}).values()))


def throughput(breakdown: Breakdown, tokens_per_device: float, model_flops_per_token: float,
               hardware_flops_per_token: float, peak_flops: float) -> dict:
    """Tokens/s/device, MFU and HFU of a priced step (the FLOP counts per token of plan/flops.py)."""
    step = breakdown.step
    rate = tokens_per_device / step if step > 0 else 0.0
    return {"step_s": round(step, 4), "tokens_per_s_per_device": round(rate, 1),
            "mfu": round(rate * model_flops_per_token / peak_flops, 4),
            "hfu": round(rate * hardware_flops_per_token / peak_flops, 4)}
