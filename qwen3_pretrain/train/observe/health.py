"""Device health at a logged step: what the device (or, on a CPU, the process) reports, nothing guessed.

One flat dict of floats per rank, keys from ``FIELDS``; a figure the device
does not report, or whose reader is not installed, is absent:

- CUDA: NVML through ``nvidia-ml-py`` (the ``observe`` extra; absent: only the
  allocator's figures): utilization, memory used and total as the driver sees
  it, power, temperature, SM clock; the allocator's reserved bytes from torch.
- NPU: what ``torch_npu`` reports (its allocator's reserved bytes, the
  device's free and total memory, and ``torch.npu.utilization`` where the
  installed version has it). ``npu-smi info`` stays the way to see power and
  temperature beside the log: it is a process to start, too slow for each step.
- CPU: the process's utilization (CPU seconds over wall seconds since the
  last reading, over the threads torch computes on) and its resident memory
  now.
"""

from __future__ import annotations

import os
import time

import torch

from qwen3_pretrain.train.host_memory import resident_bytes

# key -> (log-line label, unit, which rank is the worst: "max" or "min")
FIELDS = {
    "util_pct": ("util", "%", "min"),
    "mem_used_gib": ("mem", "GiB", "max"),
    "mem_reserved_gib": ("reserved", "GiB", "max"),
    "mem_total_gib": ("total", "GiB", "min"),
    "power_w": ("power", "W", "max"),
    "temp_c": ("temp", "C", "max"),
    "sm_clock_mhz": ("clock", "MHz", "min"),
    "cpu_util_pct": ("cpu", "%", "min"),
    "rss_gib": ("rss", "GiB", "max"),
}


class CpuHealth:
    """The process's CPU utilization since the previous reading and its resident memory."""

    def __init__(self) -> None:
        # the threads torch computes on, at most the cores the process may run on: 100% is all of them busy
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.cores = max(1, min(cores, torch.get_num_threads()))
        self.last = self._clocks()

    @staticmethod
    def _clocks() -> tuple[float, float]:
        t = os.times()
        return time.monotonic(), t.user + t.system

    def read(self) -> dict[str, float]:
        now = self._clocks()
        wall, cpu = now[0] - self.last[0], now[1] - self.last[1]
        self.last = now
        record = {}
        if wall > 0:
            record["cpu_util_pct"] = 100.0 * cpu / wall / self.cores
        rss = resident_bytes()  # now (ru_maxrss is the peak, already in the record as memory_gib)
        if rss is not None:
            record["rss_gib"] = rss / 2**30
        return record


class NvmlHealth:
    """A CUDA device through NVML, found by the UUID torch reports (CUDA_VISIBLE_DEVICES renumbers devices;
    NVML does not). ``nvml``: the ``pynvml`` module (a stand-in in tests)."""

    def __init__(self, device: torch.device, nvml) -> None:
        self.device, self.nvml = device, nvml
        nvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        self.handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")

    def read(self) -> dict[str, float]:
        n, h, record = self.nvml, self.handle, {}
        readers = {
            "util_pct": lambda: n.nvmlDeviceGetUtilizationRates(h).gpu,
            "mem_used_gib": lambda: n.nvmlDeviceGetMemoryInfo(h).used / 2**30,
            "mem_total_gib": lambda: n.nvmlDeviceGetMemoryInfo(h).total / 2**30,
            "power_w": lambda: n.nvmlDeviceGetPowerUsage(h) / 1e3,  # milliwatts
            "temp_c": lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
            "sm_clock_mhz": lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
        }
        for key, reader in readers.items():
            try:
                record[key] = float(reader())
            except Exception:  # noqa: BLE001 - a figure this device or driver does not report: omitted
                pass
        record["mem_reserved_gib"] = torch.cuda.memory_reserved(self.device) / 2**30
        return record


class AllocatorHealth:
    """An accelerator without a health library: its allocator's and runtime's own figures."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.module = device, getattr(torch, device.type)

    def read(self) -> dict[str, float]:
        record = {"mem_reserved_gib": self.module.memory_reserved(self.device) / 2**30}
        try:
            free, total = self.module.mem_get_info(self.device)
            record.update(mem_used_gib=(total - free) / 2**30, mem_total_gib=total / 2**30)
        except Exception:  # noqa: BLE001 - not reported by this runtime
            pass
        utilization = getattr(self.module, "utilization", None)
        if utilization is not None:
            try:
                record["util_pct"] = float(utilization(self.device))
            except Exception:  # noqa: BLE001
                pass
        return record


def health_reader(device: torch.device):
    """The reader of this device: ``.read()`` gives the figures it reports (a CPU's process figures always
    come along: a host process starved of CPU starves its device)."""
    cpu = CpuHealth()
    device_reader = None
    if device.type == "cuda":
        try:
            import pynvml
            device_reader = NvmlHealth(device, pynvml)
        except Exception:  # noqa: BLE001 - not installed or no driver access: the allocator's figures only
            device_reader = AllocatorHealth(device)
    elif device.type == "npu":
        device_reader = AllocatorHealth(device)
    return _Both(device_reader, cpu)


class _Both:
    def __init__(self, device_reader, cpu: CpuHealth) -> None:
        self.device_reader, self.cpu = device_reader, cpu

    def read(self) -> dict[str, float]:
        record = self.device_reader.read() if self.device_reader is not None else {}
        return {**record, **self.cpu.read()}


def worst(ranks: list[dict]) -> dict[str, tuple[float, int]]:
    """Per figure, the worst rank's value and the rank (``FIELDS``' direction), over the ranks reporting it."""
    result = {}
    for key, (_, _, direction) in FIELDS.items():
        values = [(r[key], r["rank"]) for r in ranks if key in r]
        if values:
            pick = max if direction == "max" else min
            result[key] = pick(values, key=lambda v: v[0])
    return result


def format_health(r: dict) -> str:
    """`` | health util 45%@r3 temp 81C@r1 ...``: each figure's worst rank (the record's ``health_worst``)."""
    items = r.get("health_worst")
    if not items:
        return ""
    parts = []
    for key, (value, rank) in items.items():
        if key == "mem_total_gib":
            continue  # capacity, not health: in metrics.jsonl
        label, unit, _ = FIELDS[key]
        parts.append(f"{label} {value:.3g}{unit}@r{rank}")
    return " | health " + " ".join(parts)
