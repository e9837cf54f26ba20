"""The observer's parts on their own: phase clock, device health readers (CUDA and NPU through stand-ins),
straggler bookkeeping, profiler windows, memory snapshots (a stand-in allocator), the hang watchdog in one
process, NCCL's flight recorder variables, experiment trackers (stand-in wandb and swanlab modules),
TensorBoard's per-rank scalars, the log line's new fields through parse-log, and the config's checks."""

from __future__ import annotations

import json
import logging
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from qwen3_pretrain.analysis.parse_log import parse_metrics
from qwen3_pretrain.errors import ConfigError
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.metrics import MetricsWriter
from qwen3_pretrain.train.observe import format_observed
from qwen3_pretrain.train.observe import health as health_mod
from qwen3_pretrain.train.observe.phases import PHASES, PhaseClock
from qwen3_pretrain.train.observe.profiling import MemorySnapshots, window_of
from qwen3_pretrain.train.observe.stragglers import Stragglers
from qwen3_pretrain.train.observe.trackers import open_trackers
from qwen3_pretrain.train.observe.watchdog import HANG_EXIT_CODE, Watchdog, behind, flight_recorder_env


def _config(tmp_path, **overrides) -> TrainConfig:
    return TrainConfig(data_path=str(tmp_path), output_path=str(tmp_path / "out"), **overrides)


# --- phases -----------------------------------------------------------------------------------

def test_cpu_phases_are_the_spans_between_marks():
    clock = PhaseClock(torch.device("cpu"))
    clock.mark("data")  # outside a step (the simulation runs the engine so): nothing is timed
    clock.begin(1)
    start = time.perf_counter()
    for seconds, phase in zip((0.02, 0.04, 0.0, 0.01), PHASES):
        time.sleep(seconds)
        clock.mark(phase)
    span = time.perf_counter() - start
    clock.end()
    with clock.between_steps("checkpoint"):
        time.sleep(0.01)
    got = clock.read()
    assert got["time_data_s"] >= 0.02 and got["time_forward_backward_s"] >= 0.04
    assert sum(got[f"time_{p}_s"] for p in PHASES) == pytest.approx(span, abs=2e-3)
    assert got["time_checkpoint_s"] >= 0.01
    assert "time_checkpoint_s" not in clock.read()  # reported once, with the next logged step


def test_an_unfinished_step_reports_no_phases():
    clock = PhaseClock(torch.device("cpu"))
    clock.begin(1)
    clock.mark("data")
    clock.end()
    assert clock.read() == {}


class _FakeEvent:
    """A device event whose time is the host's when recorded; counts the waits."""
    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        _FakeEvent.waits += 1

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return (other.at - self.at) * 1e3  # milliseconds, as torch's


def test_device_phases_use_events_and_wait_once_per_read(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    clock = PhaseClock(torch.device("cuda", 0))
    _FakeEvent.waits = 0
    for step in (1, 2):  # two steps, the second one read
        clock.begin(step)
        for phase in PHASES:
            time.sleep(0.005)
            clock.mark(phase)
        clock.end()
    assert _FakeEvent.waits == 0  # marks never wait
    got = clock.read()
    assert _FakeEvent.waits == 1
    assert all(0.004 < got[f"time_{p}_s"] < 0.5 for p in PHASES), got


# --- device health ----------------------------------------------------------------------------

def _fake_nvml(power_fails: bool = False):
    calls = {}

    def power(handle):
        if power_fails:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 412_000  # milliwatts

    def handle_by_uuid(uuid):
        calls["uuid"] = uuid
        return "handle"

    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=handle_by_uuid,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=60 * 2**30, total=80 * 2**30),
        nvmlDeviceGetPowerUsage=power, nvmlDeviceGetTemperature=lambda h, sensor: 71,
        nvmlDeviceGetClockInfo=lambda h, clock: 1755, NVML_TEMPERATURE_GPU=0, NVML_CLOCK_SM=1), calls


def test_nvml_health_reads_what_the_device_reports_and_omits_the_rest(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="1234-abcd"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 62 * 2**30)
    nvml, calls = _fake_nvml()
    got = health_mod.NvmlHealth(torch.device("cuda", 0), nvml).read()
    assert calls["uuid"] == "GPU-1234-abcd"
    assert got == {"util_pct": 87.0, "mem_used_gib": 60.0, "mem_total_gib": 80.0, "power_w": 412.0,
                   "temp_c": 71.0, "sm_clock_mhz": 1755.0, "mem_reserved_gib": 62.0}
    nvml, _ = _fake_nvml(power_fails=True)
    assert "power_w" not in health_mod.NvmlHealth(torch.device("cuda", 0), nvml).read()


def test_npu_health_from_torch_npu(monkeypatch):
    npu = types.SimpleNamespace(memory_reserved=lambda d: 3 * 2**30, mem_get_info=lambda d: (20 * 2**30, 64 * 2**30),
                                utilization=lambda d: 55)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    device = types.SimpleNamespace(type="npu", index=0)  # this torch has no npu device type
    got = health_mod.health_reader(device).read()
    assert got["mem_reserved_gib"] == 3 and got["mem_used_gib"] == 44 and got["mem_total_gib"] == 64
    assert got["util_pct"] == 55 and "rss_gib" in got and "power_w" not in got  # never invented
    del npu.utilization  # an older torch_npu: no utilization figure
    assert "util_pct" not in health_mod.health_reader(device).read()


def test_cpu_health_measures_this_process(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    reader = health_mod.CpuHealth()
    wall, cpu = time.monotonic(), time.process_time()
    end = cpu + 0.3
    while time.process_time() < end:  # one busy thread (on a loaded machine it gets less than a core)
        pass
    want = 100 * (time.process_time() - cpu) / (time.monotonic() - wall)
    got = reader.read()
    assert got["cpu_util_pct"] == pytest.approx(want, abs=10) and want > 10
    assert 0.01 < got["rss_gib"] < 64


def test_worst_rank_per_figure():
    rows = [{"rank": 0, "util_pct": 90, "temp_c": 60, "rss_gib": 1.0},
            {"rank": 1, "util_pct": 40, "temp_c": 80}, {"rank": 2, "util_pct": 95, "temp_c": 70, "rss_gib": 2.0}]
    got = health_mod.worst(rows)
    assert got == {"util_pct": (40, 1), "temp_c": (80, 1), "rss_gib": (2.0, 2)}


# --- stragglers -------------------------------------------------------------------------------

def _rows(local_times, step=1.0):
    return [{"rank": r, "step_time_s": step, "time_data_s": t, "time_optimizer_s": 0.0}
            for r, t in enumerate(local_times)]


def test_slowest_rank_and_the_warning_after_repeats(caplog):
    s = Stragglers()
    assert s.observe(_rows([0.1, 0.1, 0.1, 0.1])) == {}  # nobody stands out
    caplog.set_level(logging.WARNING, logger="qwen3_pretrain.train")
    got = [s.observe(_rows([0.1, 0.1, 0.6, 0.2])) for _ in range(4)]
    assert [g["slowest_rank"] for g in got] == [2, 2, 2, 2]
    assert got[0]["slowest_excess_s"] == pytest.approx(0.5)  # over the others' median
    assert [g["slowest_in_a_row"] for g in got] == [1, 2, 3, 4]
    assert sum("rank 2 has been the slowest" in r.message for r in caplog.records) == 1
    assert s.observe(_rows([0.5, 0.1, 0.1]))["slowest_in_a_row"] == 1  # another rank: counted anew
    assert s.observe(_rows([0.1])) == {}


# --- profiler windows, config ------------------------------------------------------------------

def test_profile_windows():
    assert [s for s in range(1, 15) if window_of(s, (3, 4), 0, 2)] == [3, 4]
    assert [s for s in range(1, 15) if window_of(s, None, 5, 2)] == [4, 5, 9, 10, 14]
    assert window_of(9, None, 5, 2) == (9, 10)
    assert window_of(1, None, 5, 5) == (1, 5)


@pytest.mark.parametrize("overrides, message", [
    ({"profile_steps": "12-10"}, "profile_steps"), ({"profile_steps": "x"}, "profile_steps"),
    ({"profile_every": 3, "profile_window": 4}, "profile_window 4"), ({"hang_factor": -1}, "hang_factor"),
    ({"trackers": ["mlflow"]}, "mlflow"), ({"profile_window": 0}, "profile_window"),
])
def test_config_errors_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **overrides)


def test_flight_recorder_env_on_cuda_only(tmp_path):
    environ = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}  # the environment's own setting wins
    got = flight_recorder_env("cuda", 4000, str(tmp_path), environ)
    assert environ == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "4000",
                       "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "hang" / "nccl_trace_rank_")}
    assert set(got) == {"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    assert (tmp_path / "hang").is_dir()
    assert flight_recorder_env("cpu", 4000, str(tmp_path), {}) == {}
    assert flight_recorder_env("cuda", 0, str(tmp_path), {}) == {}


# --- memory snapshots -------------------------------------------------------------------------

class _FakeMemory:
    def __init__(self) -> None:
        self.calls = []

    def _record_memory_history(self, enabled="all", max_entries=0):
        self.calls.append(("history", enabled))

    def _dump_snapshot(self, path):
        self.calls.append(("dump", path))
        Path(path).write_bytes(b"snapshot")


def test_memory_history_for_the_first_steps(tmp_path):
    memory = _FakeMemory()
    snaps = MemorySnapshots(str(tmp_path), 3, torch.device("cuda", 0), steps=2, memory=memory)
    assert memory.calls == [("history", "all")]
    assert snaps.end(1) is None
    path = snaps.end(2)
    assert path == tmp_path / "memory" / "rank3_steps1-2.pickle" and path.read_bytes() == b"snapshot"
    assert memory.calls[-1] == ("history", None) and snaps.end(3) is None
    assert MemorySnapshots(str(tmp_path), 0, torch.device("cpu"), steps=2).memory is None  # CPU: nothing


def test_out_of_memory_names_its_snapshot(tmp_path):
    snaps = MemorySnapshots(str(tmp_path), 1, torch.device("cuda", 0), steps=0, memory=_FakeMemory())
    with pytest.raises(torch.OutOfMemoryError, match=r"memory snapshot at the error: .*rank1_oom_step7\.pickle"):
        with snaps.on_oom(7):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert (tmp_path / "memory" / "rank1_oom_step7.pickle").exists()
    cpu = MemorySnapshots(str(tmp_path), 0, torch.device("cpu"), steps=0)
    with pytest.raises(torch.OutOfMemoryError, match="^plain$"):
        with cpu.on_oom(1):
            raise torch.OutOfMemoryError("plain")


# --- hang watchdog in one process ---------------------------------------------------------------

def test_behind_names_the_earliest_or_silent_ranks():
    posts = {0: {"step": 6, "phase": "forward_backward"}, 1: {"step": 6, "phase": "data"},
             2: {"step": 6, "phase": "reduce"}}
    assert behind(posts, 3) == [1]
    assert behind(posts, 4) == [3]
    assert behind({0: {"step": 5, "phase": "reduce"}, 1: {"step": 6, "phase": "data"}}, 2) == [0]


def test_watchdog_fires_over_the_limit_and_writes_stacks(tmp_path):
    clock = PhaseClock(torch.device("cpu"))
    exits = []
    dog = Watchdog(clock, str(tmp_path), rank=0, world=1, factor=3, min_s=0.2, exit=exits.append, poll_s=0.05)
    try:
        for _ in range(3):
            dog.begin()
            dog.end(0.01)
        assert dog.limit() == 0.2  # the floor: 3 x 0.01 s is below it
        clock.begin(4)
        dog.begin()
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.close()
    assert exits == [HANG_EXIT_CODE]
    text = (tmp_path / "hang" / "rank0.txt").read_text()
    assert json.loads(text.splitlines()[0])["step"] == 4 and "most recent call first" in text
    assert "test_watchdog_fires_over_the_limit" in text  # the main thread's stack, where it waited


def test_watchdog_is_not_armed_before_enough_steps(tmp_path):
    dog = Watchdog(PhaseClock(torch.device("cpu")), str(tmp_path), 0, 1, 3, 0.0, exit=lambda c: None)
    dog.end(1.0)
    assert dog.limit() is None
    dog.close()


# --- trackers, TensorBoard, the log line -------------------------------------------------------

def _fake_tracker(name: str, fail: bool = False):
    module = types.ModuleType(name)
    module.inits, module.logs, module.finished = [], [], []

    def init(**kwargs):
        if fail:
            raise ConnectionError("no network")
        module.inits.append(kwargs)
        return object()

    module.init = init
    module.log = lambda values, step=None: module.logs.append((step, values))
    module.finish = lambda: module.finished.append(True)
    return module


RECORD = {"step": 5, "loss": 2.5, "lr": 1e-4, "time_data_s": 0.01, "skipped": False,
          "ranks": [{"rank": 0, "rss_gib": 1.5}, {"rank": 1, "rss_gib": 1.7}], "health_worst": {"rss_gib": [1.7, 1]}}


def test_trackers_get_tensorboards_scalars_and_the_config(tmp_path, monkeypatch, caplog):
    wandb, swanlab = _fake_tracker("wandb"), _fake_tracker("swanlab")
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "swanlab", swanlab)
    trackers = open_trackers(["wandb", "swanlab"], str(tmp_path), {"seq_length": 64}, "proj", "run-1", ["a"],
                             "offline")
    writer = MetricsWriter(tmp_path, sinks=trackers)
    writer.write(RECORD)
    writer.write({"event": "eval", "step": 5, "eval_loss": 2.4})
    writer.write({"event": "checkpoint", "step": 5, "save_s": 1.0})  # not a scalar stream
    writer.close()
    want = [(5, {"train/loss": 2.5, "train/lr": 1e-4, "train/time_data_s": 0.01}), (5, {"eval/eval_loss": 2.4})]
    assert wandb.logs == want and swanlab.logs == want
    assert wandb.inits[0]["mode"] == "offline" and wandb.inits[0]["config"] == {"seq_length": 64}
    assert wandb.inits[0]["project"] == "proj" and wandb.inits[0]["name"] == "run-1" and wandb.inits[0]["tags"] == ["a"]
    assert swanlab.inits[0]["mode"] == "offline" and swanlab.inits[0]["experiment_name"] == "run-1"
    assert wandb.finished and swanlab.finished


def test_a_tracker_that_cannot_start_is_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", _fake_tracker("wandb", fail=True))
    monkeypatch.setitem(sys.modules, "swanlab", None)  # not installed: import fails
    caplog.set_level(logging.WARNING, logger="qwen3_pretrain.train")
    assert open_trackers(["wandb", "swanlab"], str(tmp_path), {}, "p", None, [], "online") == []
    text = caplog.text
    assert "tracker wandb could not start (no network)" in text and "tracker swanlab is not installed" in text


def test_tensorboard_gets_every_ranks_figures(tmp_path, monkeypatch):
    scalars = []

    class SummaryWriter:
        def __init__(self, path):
            pass

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    writer = MetricsWriter(tmp_path, tensorboard=True)
    writer.write(RECORD)
    writer.close()
    assert ("train/time_data_s", 0.01, 5) in scalars
    assert ("ranks/rss_gib/rank1", 1.7, 5) in scalars


def test_log_line_fields_parse_back(tmp_path):
    record = {"time_data_s": 0.0123, "time_forward_backward_s": 0.71, "time_reduce_s": 0.05,
              "time_optimizer_s": 0.04, "time_eval_s": 3.2, "slowest_rank": 3, "slowest_excess_s": 0.25,
              "health_worst": {"util_pct": [45.0, 3], "temp_c": [81.0, 1], "power_w": [650.0, 0],
                               "mem_used_gib": [70.1, 2], "mem_total_gib": [80.0, 0], "sm_clock_mhz": [1410.0, 3],
                               "cpu_util_pct": [97.5, 2], "rss_gib": [12.3, 0]}}
    line = ("2026-12-02 14:05:31 INFO step 100/1000 | loss 2.3412 | lr 1.00e-05 | grad_norm 0.91 | tokens/s 732 "
            "(91.5/device) | step 0.80 s | mfu 41.2% | mem 42.0 GiB | eta 22h13m" + format_observed(record))
    (tmp_path / "train.log").write_text(line + "\n")
    row = parse_metrics(tmp_path / "train.log").rows[0]
    for key in ("time_data_s", "time_forward_backward_s", "time_reduce_s", "time_optimizer_s", "time_eval_s",
                "slowest_excess_s"):
        assert row[key] == pytest.approx(record[key], rel=5e-3), key
    assert row["slowest_rank"] == 3 and row["eta_s"] == 22 * 3600 + 13 * 60
    assert (row["health_util_pct"], row["health_util_pct_rank"]) == (45, 3)
    assert (row["health_temp_c"], row["health_temp_c_rank"]) == (81, 1)
    assert (row["health_sm_clock_mhz"], row["health_rss_gib"], row["health_rss_gib_rank"]) == (1410, 12.3, 0)
    assert "health_mem_total_gib" not in row  # capacity stays in metrics.jsonl


def test_a_step_that_raises_is_neither_timed_nor_watched(tmp_path):
    from qwen3_pretrain.train.observe import Observer
    observer = Observer(_config(tmp_path), torch.device("cpu"), 0, 1, [], [])
    try:
        with pytest.raises(ValueError):
            with observer.step(1):
                observer.mark("data")
                raise ValueError("bad batch")
        assert not observer.watchdog.in_step and len(observer.watchdog.recent) == 0
        with observer.step(2):
            for phase in PHASES:
                observer.mark(phase)
        assert len(observer.watchdog.recent) == 1
        assert set(observer.collect(0.1, warn=True)) >= {"time_data_s", "ranks", "health_worst"}
    finally:
        observer.close()
