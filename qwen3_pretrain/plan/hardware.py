"""Devices the planner knows: memory, dense bf16 peak, link speeds, latencies.

Bandwidths are *bus* bandwidths in the sense of nccl-tests (what one device's
links carry in a ring collective), per device, in GB/s (1e9 bytes); they are
typical published figures, not measured here. Replace them with measured ones
with ``qwen3-pretrain commbench --json FILE`` and ``plan --commbench FILE``.

``compute_efficiency`` is the share of the dense peak that a training step's
compute reaches end to end in eager PyTorch (matmuls at their shapes, plus
norms, RoPE, elementwise work and kernel launches). 0.40 on accelerators is
calibrated on torchtitan's published Llama-3.1-8B run (8x H100, FSDP, seq 8192,
selective recompute, eager: 34% MFU); see docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from qwen3_pretrain.config.loader import nearest
from qwen3_pretrain.errors import UserError

GB = 1e9


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
    compute_efficiency: float = 0.40
    runtime_reserved_gib: float = 1.0  # device runtime context + communicator buffers, outside the allocator
    optimizer_impl: str = "fused"  # the engine's AdamW kernel there: fused on CPU and CUDA, torch's foreach elsewhere
    source: str = ""

    def compute_flops(self, mixed_precision: str) -> float:
        """The dense peak, FLOP/s, of the precision the matmuls run in."""
        return (self.peak_tflops if mixed_precision == "bf16" else self.fp32_peak_tflops) * 1e12


def _cpu_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError, AttributeError):
        return 16.0


DEVICES: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", 79.6, 989.0, 67.0, 360.0, 45.0, memory_bandwidth_gbps=3350.0,
        source="H100 SXM5 80GB: 989 TFLOP/s dense bf16, 67 fp32, 3.35 TB/s HBM3 (NVIDIA datasheet); "
               "81,559 MiB as nvidia-smi reports; NVLink 4 at ~360 GB/s ring bus bandwidth; "
               "one 400 Gb/s NDR NIC per GPU"),
    "h200": Hardware(
        "h200", 140.4, 989.0, 67.0, 360.0, 45.0, memory_bandwidth_gbps=4800.0,
        source="H200 SXM 141GB: 989 TFLOP/s dense bf16, 67 fp32, 4.8 TB/s HBM3e (NVIDIA datasheet); "
               "143,771 MiB as nvidia-smi reports; NVLink 4 and NDR networking as H100"),
    "a100": Hardware(
        "a100", 80.0, 312.0, 19.5, 230.0, 22.0, memory_bandwidth_gbps=2039.0,
        source="A100 SXM4 80GB: 312 TFLOP/s dense bf16, 19.5 fp32, 2.04 TB/s HBM2e (NVIDIA datasheet); "
               "NVLink 3 at ~230 GB/s ring bus bandwidth; one 200 Gb/s HDR NIC per GPU"),
    "910b": Hardware(
        "910b", 64.0, 313.0, 78.0, 100.0, 22.0, memory_bandwidth_gbps=1600.0, intra_node_latency_us=20.0,
        inter_node_latency_us=50.0, optimizer_impl="foreach",
        source="Ascend 910B (Atlas 800T A2 class): 64 GB HBM (~1.6 TB/s); 313 TFLOP/s fp16/bf16 used here "
               "(published figures differ by SKU, about 280-376: set --peak-tflops for yours), fp32 assumed a "
               "quarter of it; HCCS ring ~100 GB/s; one 200 Gb/s RoCE port per NPU"),
    "cpu": Hardware(
        "cpu", _cpu_memory_gib(), 2.4, 2.4, 5.0, 1.0, memory_bandwidth_gbps=10.0, intra_node_latency_us=50.0,
        inter_node_latency_us=100.0, compute_efficiency=0.07, runtime_reserved_gib=0.0,
        source="this project's 2-core test machine: bf16 matmul 2.4 TFLOP/s (AMX, measured); fp32 steps measured "
               "no slower than bf16 ones, so fp32 uses the same peak; efficiency 0.07 from measured small-model "
               "training (vocabulary-sized elementwise work dominates, which a roofline does not see); memory is "
               "this machine's RAM; memory bandwidth and gloo links are placeholders: measure with commbench"),
}


def get_device(name: str) -> Hardware:
    """The named device (case-insensitive); an unknown name suggests the nearest one."""
    key = name.strip().lower()
    if key not in DEVICES:
        hint = nearest(key, DEVICES)
        raise UserError(f"unknown device {name!r}" + (f"; did you mean {hint!r}?" if hint else "")
                        + f" (known: {', '.join(DEVICES)}; or give --device-memory-gib and --peak-tflops)")
    return DEVICES[key]


def with_overrides(hw: Hardware, **values: float | None) -> Hardware:
    """``hw`` with the given fields replaced (``None`` values are ignored); each must be positive."""
    changes = {k: v for k, v in values.items() if v is not None}
    for key, value in changes.items():
        if not value > 0:
            raise UserError(f"--{key.replace('_', '-')} must be positive, got {value}")
    if changes and "source" not in changes:
        changes["source"] = hw.source + f"; overridden: {', '.join(sorted(changes))}"
    return dataclasses.replace(hw, **changes)
