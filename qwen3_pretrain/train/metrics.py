"""Step metrics: throughput, MFU and HFU, memory; one record per logged step, written as JSON and shown as a line.

The record is the data (``metrics.jsonl``); the human log line is a view of it.
MFU = model FLOP/s achieved / the peak of the precision the matmuls run in
(bf16, TF32 where ``allow_tf32`` enables it, fp32); HFU adds what recompute runs
again; ``mfu_full_square`` counts attention over the whole square, as PaLM and
torchtitan do (the FLOP counts: ``plan/flops.py``, docs/monitoring.md). The peak
comes from the planner's device table, ``peak_tflops`` in the config, or, on a
CPU, a matmul measured at start-up (bf16, or fp32 where the engine computes its
bf16 matmuls in fp32: ``models/ops/precision.py``).
"""
from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

from qwen3_pretrain.hardware import Hardware, device_by_reported_name
from qwen3_pretrain.plan.flops import TokenFlops

log = logging.getLogger("qwen3_pretrain.train")
_warned_unknown: set[str] = set()


def device_peak_tflops(device: torch.device, configured: float | None,
                       cpu_dtype: torch.dtype | None = None, precision: str = "bf16") -> tuple[float, str]:
    """(peak TFLOP/s per device, where the figure comes from). An accelerator is looked up by the exact
    name it reports (a near name could be another SKU with another peak) and gives the peak of
    ``precision`` (``hardware.matmul_precision``); an unknown one gives nan and a warning, once per name,
    that names the ``peak_tflops`` key. On a CPU: a matmul in ``cpu_dtype`` (default bf16; fp32 where the
    engine computes its bf16 matmuls in fp32) measured now."""
    if configured:
        return configured, "config"
    if device.type in ("cuda", "npu"):
        name = getattr(torch, device.type).get_device_name(device)
        hw = device_by_reported_name(name)
        if hw is not None:
            return hw.peak_tflops_of(precision), f"device table: {hw.name} ({name}), {precision}"
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            log.warning("MFU is not computed: the device table (qwen3_pretrain/hardware.py) does not know %r; set "
                        "peak_tflops in the training config to its dense %s peak in TFLOP/s", name, precision)
        return float("nan"), f"unknown device {name!r}: set peak_tflops"
    dtype = cpu_dtype or torch.bfloat16
    return measure_cpu_tflops(dtype=dtype), f"measured {str(dtype).removeprefix('torch.')} matmul"


def cpu_peak_per_process(per_core_tflops: float, cores: int, processes_on_node: int) -> float:
    """A CPU "device" is one process: its share of the node's cores at the measured per-core peak. The same
    whatever the launcher and its thread settings, so the same tokens/s give the same MFU."""
    return per_core_tflops * cores / max(processes_on_node, 1)


def utilization(flops: TokenFlops, tokens_per_sec_per_device: float, peak_tflops: float) -> dict[str, float]:
    """The record's ``mfu``, ``hfu`` and ``mfu_full_square`` (fractions of the peak) at this throughput."""
    per_token = {"mfu": flops.model, "hfu": flops.hardware, "mfu_full_square": flops.full_square}
    return {key: value * tokens_per_sec_per_device / (peak_tflops * 1e12) for key, value in per_token.items()}


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on an accelerator (CUDA or NPU); nothing to wait for on a CPU."""
    if device.type in ("cuda", "npu"):
        getattr(torch, device.type).synchronize(device)


def measure_cpu_tflops(n: int = 1024, reps: int = 8, dtype: torch.dtype = torch.bfloat16,
                       max_seconds: float = 0.5, threads: int | None = None) -> float:
    """Matmul throughput of this CPU in ``dtype`` on ``threads`` threads (default: the process's setting):
    up to ``reps`` timed products, fewer once ``max_seconds`` have passed (a CPU that emulates bf16 takes
    about a second per product).

    ``threads`` goes through ``torch.set_num_threads``, which is process-wide (MKL's count and the thread
    count new threads start with), so the probe must run where no other thread runs torch work: the
    trainer calls it on the training thread before the first step, before the batch prefetch thread
    starts, and the count set at start-up (parallel/env.py ``set_cpu_threads``) is restored before any
    step runs. Run beside a step, it would change that step's thread count, and so its kernels' split and
    last bits, mid-run."""
    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return measure_cpu_tflops(n, reps, dtype, max_seconds)
        finally:
            torch.set_num_threads(before)
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    start = time.perf_counter()
    done, elapsed = 0, 0.0
    while done < reps and (done == 0 or elapsed < max_seconds):
        a @ b
        done += 1
        elapsed = time.perf_counter() - start
    return 2 * n**3 * done / elapsed / 1e12


def memory_gib(device: torch.device) -> float:
    """Peak memory: the device allocator's on accelerators, the process's peak RSS on a CPU."""
    if device.type in ("cuda", "npu"):
        return getattr(torch, device.type).max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20


def step_memory(device: torch.device) -> dict[str, float]:
    """The memory fields of a step record: ``memory_gib`` (``memory_gib`` above) and, on accelerators,
    ``memory_reserved_gib``, the caching allocator's peak reserved bytes. Reserved is what the device
    cannot give to anything else (fragmentation included), so it is the figure that approaches
    out-of-memory while allocated still looks comfortable."""
    record = {"memory_gib": memory_gib(device)}
    if device.type in ("cuda", "npu"):
        record["memory_reserved_gib"] = getattr(torch, device.type).max_memory_reserved(device) / 2**30
    return record


def format_memory(r: dict) -> str:
    """``mem 41.2/44.0 GiB`` (peak allocated/reserved) on accelerators, ``mem 0.8 GiB`` (peak RSS) on a CPU."""
    if r.get("memory_reserved_gib") is None:
        return f"mem {r['memory_gib']:.1f} GiB"
    return f"mem {r['memory_gib']:.1f}/{r['memory_reserved_gib']:.1f} GiB"


def device_capacity(device: torch.device) -> float | None:
    """The device's memory in bytes (None on a CPU)."""
    if device.type not in ("cuda", "npu"):
        return None
    return float(getattr(torch, device.type).get_device_properties(device).total_memory)


def runtime_reserved_gib(device: torch.device) -> float:
    """The device runtime's own memory (context, communicator buffers) as the planner counts it: the
    device table's figure for this device, else the table's default; nothing on a CPU."""
    if device.type not in ("cuda", "npu"):
        return 0.0
    hw = device_by_reported_name(getattr(torch, device.type).get_device_name(device))
    return hw.runtime_reserved_gib if hw is not None else Hardware.runtime_reserved_gib


def memory_warning(predicted_total: float, capacity: float | None) -> str | None:
    """The start-up warning when the predicted peak (tensors, fragmentation and the runtime's own memory)
    exceeds the device's memory."""
    if capacity is None or predicted_total <= capacity:
        return None
    return (f"the predicted {predicted_total / 2**30:.1f} GiB (tensors, allocator overhead and the device "
            f"runtime's reserve) exceed this device's {capacity / 2**30:.1f} GiB: expect out-of-memory; see "
            "'qwen3-pretrain plan' for layouts that fit")


def device_memory(device: torch.device) -> dict[str, float]:
    """Where the device's memory went, in GiB, for calibrating the planner's overhead terms (docs/planner.md):
    the allocator's peak allocated and reserved bytes, what the device holds outside the allocator (runtime
    context, communicator buffers: total - free - reserved now) and what is free; a CPU's peak RSS."""
    if device.type not in ("cuda", "npu"):
        return {"rss_gib": memory_gib(device)}
    module = getattr(torch, device.type)
    free, total = module.mem_get_info(device)
    reserved_now = module.memory_reserved(device)
    return {"allocated_gib": module.max_memory_allocated(device) / 2**30,
            "reserved_gib": module.max_memory_reserved(device) / 2**30,
            "outside_allocator_gib": (total - free - reserved_now) / 2**30,
            "free_gib": free / 2**30, "total_gib": total / 2**30}


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def format_line(r: dict) -> str:
    line = (f"step {r['step']}/{r['total_steps']} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad_norm {r['grad_norm']:.3g} | tokens/s {r['tokens_per_sec']:.0f} "
            f"({r['tokens_per_sec_per_device']:.1f}/device) | step {r['step_time_s']:.2f} s | "
            f"mfu {100 * r['mfu']:.1f}%{format_hfu(r)} | {format_memory(r)} | eta {format_eta(r['eta_s'])}")
    if "mtp_loss" in r:  # a hybrid's multi-token-prediction loss, beside the LM loss
        line = line.replace(" | lr ", f" | mtp_loss {r['mtp_loss']:.4f} | lr ", 1)
    mix = r.get("samples_by_dataset", {})
    if len(mix) > 1:
        line += " | mix " + format_mix(mix)
    if "moe_load_max" in r:  # a MoE model: its balancing losses and the worst layer's expert load
        if "moe_aux_loss" in r:
            line += f" | aux {r['moe_aux_loss']:.4f}"
        if "moe_z_loss" in r:
            line += f" | z {r['moe_z_loss']:.4g}"
        line += f" | load {r['moe_load_max']:.2f} max/mean, {100 * r['moe_idle_experts']:.0f}% idle"
        if "moe_dropped" in r:  # pairs dropped at the experts' capacity (moe_capacity_factor)
            line += f" | dropped {100 * r['moe_dropped']:.2f}%"
        if r.get("moe_force_balance"):
            line += " | routing forced (benchmark)"
    return line + (" | skipped" if r.get("skipped") else "")


def format_hfu(r: dict) -> str:
    """`` | hfu 41.0%`` beside MFU (a record written before HFU existed has none)."""
    if "hfu" not in r:
        return ""
    return f" | hfu {100 * r['hfu']:.1f}%"


def format_mix(samples_by_dataset: dict[str, int]) -> str:
    """``wiki=70.0% books=30.0%``: each dataset's share of the samples so far, named by its directory's
    name (the whole path where two names are the same)."""
    total = sum(samples_by_dataset.values()) or 1
    names = [os.path.basename(os.path.normpath(path)) for path in samples_by_dataset]
    if len(set(names)) < len(names):
        names = list(samples_by_dataset)
    return " ".join(f"{name.replace('|', '/')}={100 * count / total:.1f}%"
                    for name, count in zip(names, samples_by_dataset.values()))


class MetricsWriter:
    """Appends one JSON object per record to ``metrics.jsonl`` (and optionally TensorBoard). ``sinks``: more
    receivers of every record (``write``/``close``: the experiment trackers, ``train/observe/trackers.py``)."""

    def __init__(self, output_path: str | os.PathLike, tensorboard: bool = False, sinks: list | None = None) -> None:
        self.sinks = list(sinks or [])
        self.file = open(Path(output_path) / "metrics.jsonl", "a", encoding="utf-8")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("warning: tensorboard is not installed; pip install tensorboard", file=sys.stderr)
            else:
                self.tb = SummaryWriter(str(Path(output_path) / "tensorboard"))

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None and "step" in record and "event" not in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"train/{key}", value, record["step"])
            for row in record.get("ranks", ()):  # every rank's step time, phases and device health
                for key, value in row.items():
                    if key != "rank":
                        self.tb.add_scalar(f"ranks/{key}/rank{row['rank']}", value, record["step"])
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        self.file.close()
        for sink in self.sinks:
            sink.close()
        if self.tb is not None:
            self.tb.close()
