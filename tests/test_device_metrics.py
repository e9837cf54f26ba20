"""MFU's peak comes from the exact name a device reports; an unknown one warns once; NPUs are synchronized."""

from __future__ import annotations

import logging
import math
import types

import pytest
import torch

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.hardware import DEVICES, get_device
from qwen3_pretrain.train import metrics

REQUIRED = ["h100", "h100-pcie", "h100-nvl", "h800", "h20", "h200", "a100", "a100-40gb", "a100-pcie",
            "a100-pcie-40gb", "a800", "b200", "l40s", "910b1", "910b2", "910b3", "910b4", "910c"]


@pytest.fixture
def warnings_seen(monkeypatch):
    """Warnings of the training logger, and a fresh memory of which devices were warned about."""
    monkeypatch.setattr(metrics, "_warned_unknown", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("qwen3_pretrain.train")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def reporting(monkeypatch, device_type: str, name: str) -> types.SimpleNamespace:
    """A device of ``device_type`` whose runtime reports ``name`` (torch.npu exists only with torch_npu)."""
    runtime = types.SimpleNamespace(get_device_name=lambda device=None: name, synchronize=lambda device=None: None)
    monkeypatch.setattr(torch, device_type, runtime, raising=False)
    return types.SimpleNamespace(type=device_type)


def test_every_listed_device_reports_its_own_peak(monkeypatch, warnings_seen):
    for key in REQUIRED:
        hw = DEVICES[key]
        assert hw.reported_names, key
        for name in hw.reported_names:
            peak, where = metrics.device_peak_tflops(reporting(monkeypatch, hw.device_type, name), None)
            assert peak == hw.peak_tflops and key in where
    assert not warnings_seen


def test_names_are_matched_exactly_not_by_substring(monkeypatch, warnings_seen):
    # Each of these contains a known key: a substring match gave the H100 SXM's or H200's peak.
    assert metrics.device_peak_tflops(reporting(monkeypatch, "cuda", "NVIDIA H100 PCIe"), None)[0] == 756.0
    assert metrics.device_peak_tflops(reporting(monkeypatch, "cuda", "NVIDIA H100 NVL"), None)[0] == 835.0
    for name in ("NVIDIA H200 NVL", "NVIDIA H100"):
        assert math.isnan(metrics.device_peak_tflops(reporting(monkeypatch, "cuda", name), None)[0])
    reported = [n for hw in DEVICES.values() for n in hw.reported_names]
    assert len(reported) == len(set(reported))


def test_an_unknown_device_warns_once_naming_peak_tflops(monkeypatch, warnings_seen):
    device = reporting(monkeypatch, "cuda", "NVIDIA GeForce RTX 4090")
    for _ in range(3):
        peak, where = metrics.device_peak_tflops(device, None)
        assert math.isnan(peak) and "peak_tflops" in where
    assert len(warnings_seen) == 1
    message = warnings_seen[0].getMessage()
    assert "peak_tflops" in message and "NVIDIA GeForce RTX 4090" in message
    assert metrics.device_peak_tflops(device, 165.0) == (165.0, "config")  # the configured figure wins
    assert len(warnings_seen) == 1


def test_step_timing_waits_for_npus_and_cuda_devices(monkeypatch):
    calls = []
    for device_type in ("npu", "cuda"):
        device = reporting(monkeypatch, device_type, "x")
        monkeypatch.setattr(getattr(torch, device_type), "synchronize", lambda d=None, t=device_type: calls.append(t))
        metrics.synchronize(device)
    metrics.synchronize(torch.device("cpu"))
    assert calls == ["npu", "cuda"]


def test_the_planner_takes_the_short_names(monkeypatch):
    for key in REQUIRED + ["910b", "cpu"]:
        assert get_device(key.upper()).name == key
    with pytest.raises(UserError, match="did you mean 'h100-pcie'"):
        get_device("h100-pci")


def test_a_cpu_peak_is_measured_in_the_dtype_the_matmuls_run_in(monkeypatch):
    """fp32 training (and bf16 computed on fp32 copies) must not be rated against a bf16 matmul: on a CPU
    without native bf16 that figure is tens of times lower, and measuring it took half a minute per run."""
    from qwen3_pretrain.models.ops.precision import matmul_dtype

    assert matmul_dtype("fp32", False) == torch.float32
    assert matmul_dtype("bf16", True) == torch.float32
    assert matmul_dtype("bf16", False) == torch.bfloat16
    seen = []
    monkeypatch.setattr(metrics, "measure_cpu_tflops", lambda dtype: seen.append(dtype) or 1.0)
    assert metrics.device_peak_tflops(torch.device("cpu"), None, torch.float32) == (1.0, "measured float32 matmul")
    assert seen == [torch.float32]


def test_the_cpu_measurement_stops_at_its_time_limit(monkeypatch):
    """However slow the matmul, the measurement takes the warm-up and one timed product past the limit."""
    clock = iter(range(0, 1000, 10))  # every reading 10 s after the previous one
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    tflops = metrics.measure_cpu_tflops(n=64, reps=8, dtype=torch.float32, max_seconds=0.5)
    assert tflops == pytest.approx(2 * 64**3 / 10 / 1e12)  # one product, 10 s


GIB = 2**30


def _fake_cuda(monkeypatch, name: str = "NVIDIA H100 80GB HBM3"):
    fake = types.SimpleNamespace(
        get_device_name=lambda device=None: name,
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=80 * GIB),
        mem_get_info=lambda device=None: (10 * GIB, 80 * GIB),
        memory_reserved=lambda device=None: 66 * GIB,
        max_memory_reserved=lambda device=None: 68 * GIB,
        max_memory_allocated=lambda device=None: 60 * GIB)
    monkeypatch.setattr(torch, "cuda", fake)
    return torch.device("cuda", 0)


def test_the_memory_record_says_where_the_device_memory_went(monkeypatch):
    """allocated and reserved peaks from the allocator; what the device holds outside it (runtime context,
    communicator buffers) is total - free - reserved now: the planner's runtime reserve, measured."""
    record = metrics.device_memory(_fake_cuda(monkeypatch))
    assert record == {"allocated_gib": 60.0, "reserved_gib": 68.0, "outside_allocator_gib": 4.0,
                      "free_gib": 10.0, "total_gib": 80.0}
    assert set(metrics.device_memory(torch.device("cpu"))) == {"rss_gib"}


def test_the_out_of_memory_warning_counts_the_runtime_reserve(monkeypatch):
    """A prediction whose tensors fit but whose tensors plus the runtime's own memory do not is warned of:
    the trainer predicts with the device's runtime reserve from the device table."""
    device = _fake_cuda(monkeypatch)
    assert metrics.runtime_reserved_gib(device) == DEVICES["h100"].runtime_reserved_gib > 0
    assert metrics.runtime_reserved_gib(torch.device("cpu")) == 0.0
    capacity = metrics.device_capacity(device)
    tensors = capacity - 0.5 * GIB
    assert metrics.memory_warning(tensors, capacity) is None
    warning = metrics.memory_warning(tensors + metrics.runtime_reserved_gib(device) * GIB, capacity)
    assert "exceed this device's 80.0 GiB" in warning and "runtime's reserve" in warning
