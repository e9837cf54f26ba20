"""Devices the planner knows: memory, dense bf16, TF32, fp32 and FP8 peaks, link speeds, latencies, and the
achievable shares of the peaks and per-op launch costs the roofline (simulate/roofline) prices op traces with.

Bandwidths are *bus* bandwidths in the sense of nccl-tests (what one device's
links carry in a ring collective), per device, in GB/s (1e9 bytes); they are
typical published figures, not measured here. Replace them with measured ones
with ``qwen3-pretrain commbench --json FILE`` and ``plan --commbench FILE``.

``compute_efficiency`` is the share of the dense peak at which a training step
executes its FLOPs (plan/flops.py: attention's causal half, recompute included)
end to end in eager PyTorch (matmuls at their shapes, plus norms, RoPE,
elementwise work and kernel launches). 0.35 on accelerators is calibrated on
torchtitan's published Llama-3.1-8B run (8x H100, FSDP, seq 8192, selective
recompute, eager: 5,762 tokens/s/GPU, 34% MFU in torchtitan's whole-square
count; predicted there for Qwen3-8B with MLP recompute); see docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass

from qwen3_pretrain.config.loader import lookup
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.qwen3.attention_calls import AttentionCall

GB = 1e9


def optimizer_impl(device_type: str) -> str:
    """How the engine's AdamW runs on ``device_type``, and the planner's ``Layout.optimizer_impl``.

    The fused kernel makes one pass per tensor without temporaries (much faster than the per-tensor
    loop torch otherwise picks on a CPU). torch's ``AdamW(fused=True)`` accepts an NPU (torch's
    out-of-tree device); it runs where torch_npu registers the kernel (``aten::_fused_adamw_``, served by
    CANN's ApplyAdamWV2 in recent torch_npu), else the foreach path, as on any other device. Asked of
    torch's dispatcher once torch_npu is loaded (on the NPU's machine); elsewhere (the planner on another
    machine) the foreach path is assumed, whose temporaries make the larger prediction.
    """
    if device_type in ("cpu", "cuda"):
        return "fused"
    return "fused" if device_type == "npu" and _npu_has_fused_adamw() else "foreach"


def _npu_has_fused_adamw() -> bool:
    if "torch_npu" not in sys.modules:
        return False
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_adamw_", "PrivateUse1")


# --- attention kernel rules -------------------------------------------------------------------------------
#
# Which kernel torch 2.13 runs for an attention call (models/qwen3/attention_calls.py) on each device type:
# "flash", "efficient" or "math" (SDPA's backends), "flex" (compiled FlexAttention; uncompiled it
# materializes the scores: "flex_unfused"), "npu_fusion" (torch_npu's fused kernel). On CUDA, SDPA tries
# flash, then efficient, then math (cuDNN only where the environment puts it first):
# - flash takes fp16/bf16, no mask but its own causal one (is_causal with q_len == kv_len, or the
#   lower-right CausalBias, which hands flash its bottom-right causal mode), head_dim <= 256, and GQA;
# - efficient takes fp16, bf16 or fp32 and any mask, but not GQA (equal head counts only), with
#   head_dim a multiple of 8 (4 in fp32);
# - math takes anything and keeps fp32 probabilities [batch, heads, q_len, kv_len] for backward.
# On a CPU, SDPA's flash kernel takes masks and GQA (query heads a multiple of the KV heads); math otherwise.
# tests/test_attention_rules.py checks these against torch's own choice on the CPU and, on a GPU, against
# torch.backends.cuda.can_use_flash_attention / can_use_efficient_attention.
FUSED_SDPA_DTYPES = ("bfloat16", "float16")


def attention_backend(device_type: str, call: AttentionCall) -> str:
    """The kernel ``device_type`` runs for ``call``."""
    if call.api == "npu_fusion" or device_type == "npu":  # torch_npu serves SDPA with the same fused kernel
        return "npu_fusion"
    if call.api == "flex":
        return "flex" if device_type == "cuda" else "flex_unfused"
    if call.q_heads % call.kv_heads:
        return "math"
    if device_type != "cuda":
        return "flash"
    half = call.dtype in FUSED_SDPA_DTYPES
    if half and call.mask in ("causal", "lower_right") and call.head_dim <= 256:
        return "flash"
    if call.q_heads == call.kv_heads and call.head_dim % (8 if half else 4) == 0:
        return "efficient"
    return "math"


# When ``loss_chunk_tokens`` is empty: the speed-best chunk, halved while its fp32 logits (4 bytes per token
# and vocab entry of the whole vocab, whatever tp divides it by, so one model gets one chunk in every
# layout the planner compares) exceed the budget, down to the floor. The fused loss keeps nothing else of
# that size (models/ops/loss.py). CPU: 1024 tokens, 640 MiB, floor 256: a 151,936 vocab keeps 1024 tokens
# (594 MiB), the fastest on a 2-core AMX Xeon (bench/loss.py, hidden 256: CPU seconds per step 512 tokens
# 1.15x, 256 1.4x, 2048 1.0x those of 1024); a 248,320 vocab (Qwen3.5) gets 512 (485 MiB instead of 970).
# Accelerators: 4096 tokens, 4 GiB, floor 1024: every Qwen3 and Qwen3.5 vocab keeps 4096 (3.8 GiB at most).
CHUNK_TOKENS_RULE = {"cpu": (1024, 640 * 2**20, 256), "accelerator": (4096, 4 * 2**30, 1024)}


def default_chunk_tokens(device: str, vocab_size: int | None = None) -> int:
    """Tokens per loss chunk when the config leaves it empty (``CHUNK_TOKENS_RULE``): at most 4096 on
    accelerators, whose matmuls want large operands, and 1024 on a CPU (``device`` "cpu"), where larger
    chunks are no faster; fewer where a chunk's fp32 logits over ``vocab_size`` would exceed the budget
    (without ``vocab_size``, the most)."""
    tokens, budget, floor = CHUNK_TOKENS_RULE["cpu" if device == "cpu" else "accelerator"]
    while vocab_size is not None and tokens > floor and tokens * vocab_size * 4 > budget:
        tokens //= 2
    return tokens


@dataclass(frozen=True)
class Hardware:
    """One kind of device, and the links between devices of a cluster made of it."""

    name: str
    memory_gib: float  # usable device memory as the device reports it
    peak_tflops: float  # dense bf16 peak, TFLOP/s
    fp32_peak_tflops: float  # dense fp32 peak (without TF32), TFLOP/s: mixed_precision fp32 computes at this
    intra_node_gbps: float  # bus bandwidth between devices of one node, GB/s
    inter_node_gbps: float  # bus bandwidth per device across nodes, GB/s
    memory_bandwidth_gbps: float = 2000.0  # device memory bandwidth, GB/s (the optimizer step is bound by it)
    intra_node_latency_us: float = 10.0
    inter_node_latency_us: float = 25.0
    compute_efficiency: float = 0.35
    runtime_reserved_gib: float = 1.0  # device runtime context + communicator buffers, outside the allocator
    device_type: str = "cuda"  # torch's device type: "cuda", "npu" or "cpu"
    reported_names: tuple[str, ...] = ()  # exactly as torch.<device_type>.get_device_name reports it
    source: str = ""
    # how much slower than the measured host (HOST_MS_PER_LAYER) this device's host issues the same operators:
    # 1.0 (unmeasured) for all; an NPU's eager dispatch through torch_npu may cost more
    host_slowdown: float = 1.0
    # dense TF32 tensor-core peak, TFLOP/s, where the device has one (None: fp32 matmuls run at the fp32 peak)
    tf32_peak_tflops: float | None = None
    # dense FP8 (e4m3/e5m2) tensor-core peak, TFLOP/s; None where the device has no FP8 matmuls (A100, Ascend
    # 910B/C, CPUs): the planner and the roofline refuse an FP8 recipe there
    fp8_tflops: float | None = None
    # dense MXFP8 (block-scaled FP8, Blackwell's tensor cores) peak, TFLOP/s; None before Blackwell
    mxfp8_tflops: float | None = None
    # --- what the roofline (simulate/roofline) prices an op trace with ---
    # share of a dtype's dense peak that a large, well-shaped matmul reaches (cuBLAS/CANN GEMMs at training
    # shapes); smaller and skinny shapes get less (simulate/roofline/pricing.py's shape classes)
    matmul_efficiency: float = 0.75
    # share of ``memory_bandwidth_gbps`` a streaming elementwise kernel, copy or reduction reaches
    bandwidth_efficiency: float = 0.85
    # host time to issue one op in eager PyTorch (the dispatcher, the Python around it, the driver's launch),
    # microseconds; a compiled graph launches its fused kernels at ``compiled_launch_us`` each
    launch_latency_us: float = 3.2
    compiled_launch_us: float = 4.0
    # share of the dtype's dense peak a fused attention kernel (SDPA's flash/efficient/cuDNN, the NPU's fused
    # attention) reaches on its executed FLOPs, forward and backward together (ATTENTION_EFFICIENCY's source)
    attention_efficiency: float = 0.5
    # (smallest matmul side, share of ``matmul_efficiency``) by ascending side, the first class whose side the
    # matmul's smallest side is under wins, else share 1; a grouped matmul's side is one group's
    matmul_shape_classes: tuple[tuple[int, float], ...] = ()
    fp32_shape_classes: tuple[tuple[int, float], ...] = ()  # fp32 matmuls' where they differ (a CPU's do)
    # a grouped matmul's (torch._grouped_mm) share of what a plain matmul of one group's shape reaches
    grouped_matmul_share: float = 1.0
    # (bytes one kernel moves, GB/s it reaches) by ascending size: a memory-bound kernel is priced at the rate
    # of its own size, interpolated in log size between two points and held beyond the ends (a CPU streams a
    # working set its caches hold 1.5-3x faster than one from memory). The rates are achieved ones
    # (``bandwidth_efficiency`` does not apply). Empty: every kernel at ``memory_bandwidth_gbps`` x
    # ``bandwidth_efficiency``, what the accelerators in the table use (one HBM figure: no L2 figure is
    # sourced for them)
    bandwidth_curve: tuple[tuple[float, float], ...] = ()
    # bytes of traffic within which a tensor touched by one kernel is still in the caches for the next: a read
    # of it is priced on ``bandwidth_curve`` at the kernel's size, an older one at the curve's streaming end
    # (0: every read on the curve). A CPU's from its curve (``simulate.probe.curve_points``)
    cache_bytes: float = 0.0
    # ((op class, curve), ...): the bandwidth curves of memory-bound ops that stream slower or faster per byte
    # than ``bandwidth_curve``'s (a CPU's bf16 arithmetic converts through fp32, its index, gather and scatter
    # ops move rows one at a time; ``simulate.roofline.trace.op_class`` names the classes); an op of a class
    # with no curve here is priced on ``bandwidth_curve``. Empty on the accelerators (no sourced figure)
    class_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    # TFLOP/s of a batched triangular solve (``linalg_solve_triangular``, the Gated DeltaNet's chunk inverse: a
    # batch of 64 x 64 unit-lower systems against the identity) on its n^2 k FLOPs a system. A CPU's measured
    # (``simulate.probe``: LAPACK solves each small system on its own, at an eighth of the fp32 GEMM's rate on
    # the 2-core EPYC); None: priced as a matmul of those FLOPs in the smallest shape class (the
    # accelerators': no sourced figure)
    solve_tflops: float | None = None
    # whether FSDP's all-gathers and reduce-scatters run beside the compute (on the device's side streams) or
    # block the thread that issues them. A CPU has no streams: FSDP2 calls gloo without ``async_op`` and
    # waits in ``Work.wait`` before the next op, the engine's CPU reduce-scatter is a plain all-reduce, so
    # every dp collective adds to the step (the roofline's dp overlap does not apply)
    overlaps_collectives: bool = True
    # stragglers: the time a rank waits at its collectives for the group's last rank to arrive, as a share of
    # its own time between them (the ranks' speeds jitter and differ). Measured on a CPU by the roofline's
    # probe (``simulate.probe.straggler_share``: the same work on every rank at once, segment by segment); 0 on
    # the accelerators: not modelled (no sourced figure)
    straggler_share: float = 0.0
    # ((collective kind, bus GB/s, latency us), ...): a kind whose on-node link differs from
    # ``intra_node_gbps`` / ``intra_node_latency_us``. A CPU's, measured per kind on the run's own group
    # (gloo reduces on the CPU: its reduce-scatter and all-reduce of a 1 MiB bf16 buffer took 1.7 and 1.4x
    # the all-gather's ring price on 2 processes); empty on the accelerators (NCCL's and HCCL's ring
    # collectives share one bus bandwidth)
    collective_links: tuple[tuple[str, float, float], ...] = ()
    # microseconds one fresh 4 KiB page of host memory costs at its first touch (the OS mapping and zeroing
    # it: a minor page fault) beyond a second touch, and handing one back (``madvise``/``munmap``): what a CPU
    # step pays for the pages its allocator takes from the OS and returns (glibc maps every buffer over 32 MiB
    # afresh; the engine's per-step ``malloc_trim`` hands the heap's free pages back, the next step faults
    # them in again). Measured on a CPU by ``simulate.probe.page_costs``; 0 on the accelerators (their
    # tensors come from a caching allocator's device memory)
    page_fault_us: float = 0.0
    page_release_us: float = 0.0
    # a transparent huge page's fault (2 MiB), where the allocator's large buffers get them (torch's CPU
    # allocator asks for them under ``THP_MEM_ALLOC_ENABLE``, which the CLI sets): one fault of a 4 KiB page's
    # count, about 100 times its cost (``simulate.probe.page_costs``)
    huge_page_fault_us: float = 0.0

    def link(self, kind: str, on_node: bool = True) -> tuple[float, float]:
        """(bus bytes/s, latency s) of one ``kind`` of collective on a node's link (``on_node``) or across
        nodes: ``collective_links``'s figures for the kind where it has them, else the device's."""
        if not on_node:
            return self.inter_node_gbps * GB, self.inter_node_latency_us * 1e-6
        gbps, latency = next(((g, lat) for k, g, lat in self.collective_links if k == kind),
                             (self.intra_node_gbps, self.intra_node_latency_us))
        return gbps * GB, latency * 1e-6

    def matmul_tflops(self, dtype: str) -> float | None:
        """The dense peak, TFLOP/s, of a matmul whose operands are ``dtype`` ("bf16"/"float16", "tf32",
        "fp32"/"float32", "fp8"/"float8_*", "mxfp8"): None where the device has no such matmul (FP8
        before Hopper)."""
        d = dtype.replace("torch.", "")
        if d.startswith("float8") or d == "fp8":
            return self.fp8_tflops
        if d == "mxfp8":
            return self.mxfp8_tflops
        if d in ("bf16", "bfloat16", "float16", "fp16", "half"):
            return self.peak_tflops
        if d == "tf32":
            return self.tf32_peak_tflops or self.fp32_peak_tflops
        return self.fp32_peak_tflops

    def bandwidth_at(self, nbytes: float, op_class: str | None = None) -> float:
        """Bytes per second a memory-bound kernel that moves ``nbytes`` reaches (``bandwidth_curve``, or the
        curve of its ``op_class`` in ``class_curves`` where it has one)."""
        curve = next((c for name, c in self.class_curves if name == op_class), self.bandwidth_curve) \
            if op_class is not None else self.bandwidth_curve
        if not curve:
            return self.streaming_bandwidth
        if nbytes <= curve[0][0]:
            return curve[0][1] * GB
        for (s0, r0), (s1, r1) in zip(curve, curve[1:]):
            if nbytes <= s1:
                f = math.log(nbytes / s0) / math.log(s1 / s0)
                return (r0 + f * (r1 - r0)) * GB
        return curve[-1][1] * GB

    @property
    def streaming_bandwidth(self) -> float:
        """Bytes per second a streaming kernel reaches on a device without a ``bandwidth_curve``:
        ``memory_bandwidth_gbps`` x ``bandwidth_efficiency``."""
        return self.memory_bandwidth_gbps * GB * self.bandwidth_efficiency

    def class_peak(self, op_class: str) -> float | None:
        """Bytes per second at the fastest point of ``op_class``'s curve (``class_curves``; ``bandwidth_curve``'s
        for a class without one): an op of that class whose data the caches hold, where its arithmetic, not
        the memory, sets the pace. None on a device without class curves."""
        if not self.class_curves:
            return None
        curve = next((c for name, c in self.class_curves if name == op_class), self.bandwidth_curve)
        return max(rate for _, rate in curve) * GB if curve else None

    def shape_classes(self, dtype: str = "bfloat16") -> tuple[tuple[int, float], ...]:
        """The roofline's matmul shape classes on this device for ``dtype`` matmuls (``MATMUL_SHAPE_CLASSES``
        unless it has its own)."""
        if dtype in ("float32", "fp32") and self.fp32_shape_classes:
            return self.fp32_shape_classes
        return self.matmul_shape_classes or MATMUL_SHAPE_CLASSES

    def host_seconds_per_layer(self, tensor_parallel: bool, compiled: bool) -> float:
        """Host time to issue one decoder layer's forward and backward for one micro-batch."""
        return HOST_MS_PER_LAYER[(tensor_parallel, compiled)] * self.host_slowdown / 1e3

    @property
    def optimizer_impl(self) -> str:
        """The engine's AdamW kernel on this device: the planner prices its temporaries."""
        return optimizer_impl(self.device_type)

    def compute_flops(self, precision: str) -> float:
        """The dense peak, FLOP/s, of ``precision``, what the matmuls run in (``matmul_precision``)."""
        return self.peak_tflops_of(precision) * 1e12

    def peak_tflops_of(self, precision: str) -> float:
        """The dense peak, TFLOP/s, of "bf16", "tf32" (the fp32 peak where the device has no TF32) or "fp32"."""
        if precision == "bf16":
            return self.peak_tflops
        if precision == "tf32" and self.tf32_peak_tflops:
            return self.tf32_peak_tflops
        return self.fp32_peak_tflops


def matmul_precision(mixed_precision: str, allow_tf32: bool = False, device_type: str = "cuda") -> str:
    """What the matmuls run in, the peak MFU divides by: bf16 under ``mixed_precision: bf16``; under fp32,
    TF32 where ``allow_tf32`` lets CUDA's fp32 matmuls use it (the engine enables it only there), else fp32."""
    if mixed_precision == "bf16":
        return "bf16"
    return "tf32" if allow_tf32 and device_type == "cuda" else "fp32"


# Host milliseconds per decoder layer per micro-batch (forward and backward, the engine's FSDP and, under tp,
# DTensor sequence parallelism), by (tp > 1, compiled): bench/host_overhead.py at tiny shapes, where compute
# is negligible, on a 2-core AMD EPYC host (torch 2.13, tp 2 played on the fake process group so that no
# collective waits are counted). A device computes asynchronously, so this bounds a micro-batch's time
# from below rather than adding to it.
HOST_MS_PER_LAYER = {(False, False): 2.4, (True, False): 9.6, (False, True): 1.4, (True, True): 3.3}
# The roofline's matmul shape classes on an accelerator: (smallest side below which, share of the large-GEMM
# efficiency), smallest first (the device table's comment says where the figures come from)
MATMUL_SHAPE_CLASSES = ((128, 0.35), (512, 0.6), (1024, 0.85))


def _cpu_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError, AttributeError):
        return 16.0


_HOPPER_NET = "one 400 Gb/s NDR NIC per GPU"
_910B_NET = dict(memory_bandwidth_gbps=1600.0, intra_node_latency_us=20.0, inter_node_latency_us=50.0,
                 device_type="npu", matmul_efficiency=0.70, bandwidth_efficiency=0.80)
_ASCEND_PEAK = ("no Huawei datasheet gives per-SKU dense bf16 figures; this is the commonly reported figure, "
                "unverified: set peak_tflops (train) or --peak-tflops (plan) for yours")

# Keys are the planner's short names (--device); ``reported_names`` are the exact names the device
# reports (torch.cuda/torch.npu.get_device_name), which metrics match for MFU. Peaks are dense (no
# sparsity). TF32: the datasheet's dense TF32 tensor-core figure, or its figure "with sparsity" halved
# (H100, H200, L40S: 366 sparse; B200: the HGX B200's 18 PFLOP/s / 8 / 2); the H20's brief quotes it dense
# (74). Never the fp32 (non-tensor-core) figure, which is the fallback only where a device has no TF32:
# Ascend NPUs and CPUs, where mixed_precision fp32 runs at the fp32 peak. FP8 (``fp8_tflops``): the dense
# FP8 tensor-core figure, or the datasheet's "with sparsity" one halved (H100/H200/H800 SXM 3,958 -> 1,979;
# H100 PCIe 3,026 -> 1,513; H100 NVL 3,341 -> 1,670.5; L40S 1,466 -> 733; B200: the HGX B200's 72 PFLOP/s
# FP8 / 8 / 2 = 4,500, MXFP8 the same; the H20's brief quotes 296 dense); None before Hopper/Ada and on
# Ascend 910B/C (no FP8 matmul units) and CPUs.
# Roofline figures (simulate/roofline): ``matmul_efficiency`` 0.75 on Hopper and Blackwell (cuBLAS bf16
# GEMMs at training shapes commonly reach 700-780 of 989 TFLOP/s on an H100 SXM; not measured here), 0.80 on
# Ampere (~250 of 312), 0.70 on Ascend (unverified); ``bandwidth_efficiency`` 0.85 (a streaming copy reaches
# ~2.9 of 3.35 TB/s on an H100 SXM), 0.80 on Ascend (unverified); ``launch_latency_us`` 3.2 per eager op:
# bench/host_overhead.py's HOST_MS_PER_LAYER (2.4 ms per eager layer at tp 1) over the ~760 operators a
# decoder layer's forward and backward dispatch there (simulate's op trace of a tiny Qwen3 at tp 1, FSDP's
# copies included: 3,530 ops for 4 layers, 2,012 for 2): the engine's whole host cost per op at tiny shapes
# (its Python, autograd and FSDP's hooks with the dispatch and the launch), what bench/roofline_cpu.py
# calibrates the same way on a CPU; and 4 per compiled kernel launch (inductor's launcher, no CUDA graphs;
# not measured here). An NPU's eager dispatch through torch_npu's task queue is
# reportedly slower: unmeasured, the same figure is used.
# ``attention_efficiency`` 0.5 of the dtype's peak for fused attention (FlashAttention-2 on Hopper, forward and
# backward together: ~50% of the H100's bf16 peak in its paper's training benchmarks; not measured here),
# kept for every accelerator; a CPU's is measured (simulate/probe.py: torch's flash kernel for CPU reached
# 0.02-0.03 TFLOP/s, a tenth of its matmuls, on the 2-core AMX Xeon). ``matmul_shape_classes``: a GEMM whose
# smallest side is under 128 / 512 / 1024 reaches 0.35 / 0.6 / 0.85 of ``matmul_efficiency`` on an
# accelerator (it fills fewer tiles and waves; a simple documented model, not a measurement); a CPU's
# classes come from the probe. ``grouped_matmul_share`` 1: a grouped GEMM (CUTLASS / cuBLAS grouped, the
# NPU's GroupedMatmul) taken as fast as one GEMM of a group's shape (unmeasured); on a CPU torch runs it as
# a loop of small products, measured by the probe.
# Sources and what was verified on hardware: docs/planner.md, "Devices".
DEVICES: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", 79.6, 989.0, 67.0, 360.0, 45.0, memory_bandwidth_gbps=3350.0,
        tf32_peak_tflops=494.7, fp8_tflops=1979.0, reported_names=("NVIDIA H100 80GB HBM3",),
        source="H100 SXM5 80GB: 989 TFLOP/s dense bf16, 67 fp32, 3.35 TB/s HBM3 (NVIDIA H100 datasheet); "
               "81,559 MiB as nvidia-smi reports; NVLink 4 at ~360 GB/s ring bus bandwidth; " + _HOPPER_NET),
    "h100-pcie": Hardware(
        "h100-pcie", 79.6, 756.0, 51.0, 50.0, 45.0, memory_bandwidth_gbps=2000.0,
        tf32_peak_tflops=378.0, fp8_tflops=1513.0, reported_names=("NVIDIA H100 PCIe",),
        source="H100 PCIe 80GB: 756 TFLOP/s dense bf16, 51 fp32, 2.0 TB/s HBM2e (NVIDIA H100 datasheet); "
               "PCIe Gen5 between GPUs (no NVLink bridge assumed)"),
    "h100-nvl": Hardware(
        "h100-nvl", 93.6, 835.0, 60.0, 50.0, 45.0, memory_bandwidth_gbps=3900.0,
        tf32_peak_tflops=417.5, fp8_tflops=1670.5, reported_names=("NVIDIA H100 NVL",),
        source="H100 NVL 94GB: 835 TFLOP/s dense bf16, 60 fp32, 3.9 TB/s HBM3 (NVIDIA H100 datasheet); "
               "95,830 MiB as nvidia-smi reports; PCIe Gen5 between bridge pairs"),
    "h800": Hardware(
        "h800", 79.6, 989.0, 67.0, 160.0, 45.0, memory_bandwidth_gbps=3350.0,
        tf32_peak_tflops=494.7, fp8_tflops=1979.0, reported_names=("NVIDIA H800", "NVIDIA H800 80GB HBM3"),
        source="H800 SXM5 80GB: the H100 SXM's compute and memory (989 dense bf16, 3.35 TB/s; NVIDIA H800 "
               "product brief) with NVLink cut to 400 GB/s, ~160 GB/s ring bus bandwidth"),
    "h20": Hardware(
        "h20", 95.0, 148.0, 44.0, 360.0, 45.0, memory_bandwidth_gbps=4000.0,
        tf32_peak_tflops=74.0, fp8_tflops=296.0, reported_names=("NVIDIA H20",),
        source="H20 96GB: 148 TFLOP/s dense bf16, 44 fp32, 4.0 TB/s HBM3, NVLink 900 GB/s (NVIDIA H20 "
               "product brief as published by OEMs; not on nvidia.com)"),
    "h200": Hardware(
        "h200", 140.4, 989.0, 67.0, 360.0, 45.0, memory_bandwidth_gbps=4800.0,
        tf32_peak_tflops=494.7, fp8_tflops=1979.0, reported_names=("NVIDIA H200",),
        source="H200 SXM 141GB: 989 TFLOP/s dense bf16, 67 fp32, 4.8 TB/s HBM3e (NVIDIA H200 datasheet); "
               "143,771 MiB as nvidia-smi reports; NVLink 4 and NDR networking as H100"),
    "a100": Hardware(
        "a100", 80.0, 312.0, 19.5, 230.0, 22.0, memory_bandwidth_gbps=2039.0,
        tf32_peak_tflops=156.0, matmul_efficiency=0.80, reported_names=("NVIDIA A100-SXM4-80GB",),
        source="A100 SXM4 80GB: 312 TFLOP/s dense bf16, 19.5 fp32, 2.04 TB/s HBM2e (NVIDIA A100 datasheet); "
               "NVLink 3 at ~230 GB/s ring bus bandwidth; one 200 Gb/s HDR NIC per GPU"),
    "a100-40gb": Hardware(
        "a100-40gb", 40.0, 312.0, 19.5, 230.0, 22.0, memory_bandwidth_gbps=1555.0,
        tf32_peak_tflops=156.0, matmul_efficiency=0.80, reported_names=("NVIDIA A100-SXM4-40GB",),
        source="A100 SXM4 40GB: 312 TFLOP/s dense bf16, 19.5 fp32, 1.56 TB/s HBM2 (NVIDIA A100 datasheet)"),
    "a100-pcie": Hardware(
        "a100-pcie", 80.0, 312.0, 19.5, 25.0, 22.0, memory_bandwidth_gbps=1935.0,
        tf32_peak_tflops=156.0, matmul_efficiency=0.80, reported_names=("NVIDIA A100 80GB PCIe",),
        source="A100 PCIe 80GB: 312 TFLOP/s dense bf16, 19.5 fp32, 1.94 TB/s HBM2e (NVIDIA A100 datasheet); "
               "PCIe Gen4 between GPUs"),
    "a100-pcie-40gb": Hardware(
        "a100-pcie-40gb", 40.0, 312.0, 19.5, 25.0, 22.0, memory_bandwidth_gbps=1555.0,
        tf32_peak_tflops=156.0, matmul_efficiency=0.80, reported_names=("NVIDIA A100-PCIE-40GB",),
        source="A100 PCIe 40GB: 312 TFLOP/s dense bf16, 19.5 fp32, 1.56 TB/s HBM2 (NVIDIA A100 datasheet)"),
    "a800": Hardware(
        "a800", 80.0, 312.0, 19.5, 160.0, 22.0, memory_bandwidth_gbps=2039.0,
        tf32_peak_tflops=156.0, matmul_efficiency=0.80, reported_names=("NVIDIA A800-SXM4-80GB",),
        source="A800 SXM4 80GB: the A100 SXM4's compute and memory (312 dense bf16; NVIDIA A800 product "
               "brief) with NVLink cut to 400 GB/s, ~160 GB/s ring bus bandwidth"),
    "b200": Hardware(
        "b200", 179.1, 2250.0, 75.0, 720.0, 45.0, memory_bandwidth_gbps=8000.0,
        tf32_peak_tflops=1125.0, fp8_tflops=4500.0, mxfp8_tflops=4500.0, reported_names=("NVIDIA B200",),
        source="B200 (HGX B200): 2,250 TFLOP/s dense bf16 and 75 fp32 per GPU (NVIDIA HGX B200 datasheet, "
               "8-GPU figures / 8, sparsity halved), 8 TB/s HBM3e; 183,359 MiB as nvidia-smi reports; "
               "NVLink 5 at ~720 GB/s ring bus bandwidth"),
    "l40s": Hardware(
        "l40s", 45.0, 362.0, 91.6, 25.0, 22.0, memory_bandwidth_gbps=864.0,
        tf32_peak_tflops=183.0, fp8_tflops=733.0, reported_names=("NVIDIA L40S",),
        source="L40S 48GB: 362 TFLOP/s dense bf16, 183 TF32 (366 with sparsity), 91.6 fp32, 864 GB/s GDDR6 "
               "(NVIDIA L40S datasheet); "
               "46,068 MiB as nvidia-smi reports; PCIe Gen4 between GPUs"),
    "910b": Hardware(
        "910b", 64.0, 313.0, 78.0, 100.0, 22.0, **_910B_NET,
        source="Ascend 910B, SKU unknown (Atlas 800T A2 class): 64 GB HBM (~1.6 TB/s); 313 TFLOP/s bf16 "
               "(the 910B3 figure; " + _ASCEND_PEAK + "), fp32 assumed a quarter of it; HCCS ring "
               "~100 GB/s; one 200 Gb/s RoCE port per NPU"),
    "910b1": Hardware(
        "910b1", 64.0, 414.0, 103.0, 100.0, 22.0, **_910B_NET, reported_names=("Ascend910B1",),
        source="Ascend 910B1: 414 TFLOP/s bf16 (" + _ASCEND_PEAK + "); links as 910b"),
    "910b2": Hardware(
        "910b2", 64.0, 376.0, 94.0, 100.0, 22.0, **_910B_NET, reported_names=("Ascend910B2", "Ascend910B2C"),
        source="Ascend 910B2: 376 TFLOP/s bf16 (" + _ASCEND_PEAK + "); links as 910b"),
    "910b3": Hardware(
        "910b3", 64.0, 313.0, 78.0, 100.0, 22.0, **_910B_NET, reported_names=("Ascend910B3",),
        source="Ascend 910B3: 313 TFLOP/s bf16 (" + _ASCEND_PEAK + "); links as 910b"),
    "910b4": Hardware(
        "910b4", 32.0, 280.0, 70.0, 100.0, 22.0, **_910B_NET, reported_names=("Ascend910B4",),
        source="Ascend 910B4: 280 TFLOP/s bf16, 32 GB HBM (" + _ASCEND_PEAK + "); links as 910b"),
    "910c": Hardware(
        "910c", 64.0, 376.0, 94.0, 100.0, 22.0, **_910B_NET,
        reported_names=("Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382"),
        source="Ascend 910C (Atlas A3), per device: each of its two dies is one device with 64 GB; 376 "
               "TFLOP/s bf16 per die, half the ~752 reported per package (" + _ASCEND_PEAK + "); links as 910b"),
    "cpu": Hardware(
        "cpu", _cpu_memory_gib(), 2.4, 2.4, 5.0, 1.0, memory_bandwidth_gbps=10.0, intra_node_latency_us=50.0,
        inter_node_latency_us=100.0, compute_efficiency=0.07, runtime_reserved_gib=0.0, device_type="cpu",
        matmul_efficiency=1.0, bandwidth_efficiency=1.0, compiled_launch_us=3.2, overlaps_collectives=False,
        source="this project's 2-core test machine: bf16 matmul 2.4 TFLOP/s (AMX, measured); fp32 steps measured "
               "no slower than bf16 ones, so fp32 uses the same peak; efficiency 0.07 from measured small-model "
               "training (vocabulary-sized elementwise work dominates, which a roofline does not see); memory is "
               "this machine's RAM; memory bandwidth and gloo links are placeholders: measure with commbench; the "
               "roofline's efficiencies are 1 (the peaks are the measured throughputs): a CPU's computes "
               "synchronously with its host, so its host term adds to the compute"),
}


def device_by_reported_name(name: str) -> Hardware | None:
    """The table's entry for a device that reports exactly ``name`` (surrounding spaces aside), or None."""
    name = name.strip()
    for hw in DEVICES.values():
        if name in hw.reported_names:
            return hw
    return None


def get_device(name: str) -> Hardware:
    """The named device (case-insensitive); an unknown name suggests the nearest one."""
    return lookup(DEVICES, name, "device", "; or give --device-memory-gib and --peak-tflops")


def with_overrides(hw: Hardware, **values: float | None) -> Hardware:
    """``hw`` with the given fields replaced (``None`` values are ignored); each must be positive."""
    changes = {k: v for k, v in values.items() if v is not None}
    for key, value in changes.items():
        if not value > 0:
            raise UserError(f"--{key.replace('_', '-')} must be positive, got {value}")
    if changes and "source" not in changes:
        changes["source"] = hw.source + f"; overridden: {', '.join(sorted(changes))}"
    return dataclasses.replace(hw, **changes)


def measured_cpu(bf16_tflops: float, fp32_tflops: float, memory_bandwidth_gbps: float, launch_latency_us: float,
                 name: str = "cpu-measured", source: str = "", *, attention_tflops: float | None = None,
                 shape_classes: tuple[tuple[int, float], ...] = (),
                 fp32_shape_classes: tuple[tuple[int, float], ...] = (), grouped_matmul_share: float = 1.0,
                 compiled_launch_us: float | None = None, intra_node_gbps: float | None = None,
                 intra_node_latency_us: float | None = None,
                 bandwidth_curve: tuple[tuple[float, float], ...] = (), cache_bytes: float = 0.0,
                 class_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = (),
                 straggler_share: float = 0.0,
                 collective_links: tuple[tuple[str, float, float], ...] = (),
                 page_fault_us: float = 0.0, page_release_us: float = 0.0,
                 huge_page_fault_us: float = 0.0, solve_tflops: float | None = None) -> Hardware:
    """The table's "cpu" entry with this machine's measured figures: the matmul throughputs (TFLOP/s, at the
    shapes the benchmark ran), the memory bandwidth (GB/s, a streaming copy's read plus write) and the host
    time of one eager op (microseconds, dispatch and the training step's Python included). The efficiencies
    stay 1: the figures are the achieved ones. What a roofline check on this CPU prices a recorded trace with
    (``simulate.probe.CpuProbe.hardware`` fills it from a probe). Optional: the fused attention kernel's
    measured rate (TFLOP/s on the roofline's FLOP count; ``attention_efficiency`` is it over the bf16 peak),
    shape classes (shares of the peaks, bf16 and fp32), a grouped matmul's share of a plain one of a group's
    shape, a compiled kernel's launch cost (default: the eager op's), the link between two processes (bus
    bandwidth and latency) and the
    bandwidth by working-set size (``Hardware.bandwidth_curve``: (bytes, GB/s) by ascending bytes) with the
    traffic its caches hold (``cache_bytes``), and per op class where its ops stream at other rates
    (``class_curves``), the stragglers' share (``Hardware.straggler_share``), per collective kind its own
    link where measured (``Hardware.collective_links``), the costs of a fresh page's fault and release
    (``Hardware.page_fault_us``, ``page_release_us``), a huge page's fault (``huge_page_fault_us``) and a
    triangular solve's rate (``Hardware.solve_tflops``)."""
    for key, value in (("bf16_tflops", bf16_tflops), ("fp32_tflops", fp32_tflops),
                       ("memory_bandwidth_gbps", memory_bandwidth_gbps), ("launch_latency_us", launch_latency_us)):
        if not value > 0:
            raise UserError(f"measured_cpu: {key} must be positive, got {value}")
    return dataclasses.replace(
        DEVICES["cpu"], name=name, peak_tflops=bf16_tflops, fp32_peak_tflops=fp32_tflops,
        memory_bandwidth_gbps=memory_bandwidth_gbps, launch_latency_us=launch_latency_us,
        compiled_launch_us=compiled_launch_us or launch_latency_us,
        attention_efficiency=(attention_tflops / bf16_tflops) if attention_tflops else 1.0,
        matmul_shape_classes=shape_classes or ((1, 1.0),), fp32_shape_classes=fp32_shape_classes,
        grouped_matmul_share=grouped_matmul_share, bandwidth_curve=tuple(bandwidth_curve), cache_bytes=cache_bytes,
        class_curves=tuple((k, tuple(c)) for k, c in class_curves), straggler_share=straggler_share,
        collective_links=tuple(tuple(link) for link in collective_links), page_fault_us=page_fault_us,
        page_release_us=page_release_us, huge_page_fault_us=huge_page_fault_us, solve_tflops=solve_tflops,
        intra_node_gbps=intra_node_gbps or DEVICES["cpu"].intra_node_gbps,
        intra_node_latency_us=DEVICES["cpu"].intra_node_latency_us if intra_node_latency_us is None
        else intra_node_latency_us,
        source=source or f"measured on this CPU: bf16 {bf16_tflops:.3g} TFLOP/s, fp32 {fp32_tflops:.3g} TFLOP/s, "
                         f"{memory_bandwidth_gbps:.3g} GB/s, {launch_latency_us:.3g} us per op")
