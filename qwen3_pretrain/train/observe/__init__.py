"""The run's observer: the one object the trainer calls at phase boundaries (docs/monitoring.md).

It owns the step's phase clock (``phases``), the scheduled profiler and the
memory snapshots (``profiling``), the hang watchdog (``watchdog``), device
health (``health``) and the per-rank gather with the straggler report
(``stragglers``); experiment trackers (``trackers``) are sinks of the
metrics writer. The engine and the model do not time themselves: the engine
takes a ``mark`` callback and calls it where a phase ends.

Costs in the steady state: five host clock reads (or device event records) per
step, under pp two more per stage compute chunk (``phases.StageBusy``); on a
logged step one wait for the step's last event and one ``all_gather`` of a
few dozen floats per rank.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

from qwen3_pretrain.train.observe.health import format_health, health_reader, worst
from qwen3_pretrain.train.observe.phases import PhaseClock, format_phases
from qwen3_pretrain.train.config import parse_step_range
from qwen3_pretrain.train.observe.profiling import MemorySnapshots, Profiler
from qwen3_pretrain.train.observe.stragglers import Stragglers, format_slowest, gather_rows
from qwen3_pretrain.train.observe.trackers import Tracker, open_trackers
from qwen3_pretrain.train.observe.watchdog import Watchdog, flight_recorder_env, test_sleep

__all__ = ["Observer", "flight_recorder_env", "format_observed", "tracker_sinks"]


class Observer:
    def __init__(self, cfg, device: torch.device, rank: int, world: int, parts: list[nn.Module],
                 stage_indices: list[int]) -> None:
        self.device, self.rank, self.world = device, rank, world
        self.clock = PhaseClock(device)
        self.health = health_reader(device)
        self.stragglers = Stragglers()
        self.profiler = Profiler(cfg.output_path, rank, device, parts, stage_indices,
                                 parse_step_range(cfg.profile_steps), cfg.profile_every, cfg.profile_window)
        if self.profiler.enabled:
            self.clock.ranges = self.profiler.phase_range
        self.snapshots = MemorySnapshots(cfg.output_path, rank, device, cfg.memory_snapshot_steps)
        self.watchdog = (Watchdog(self.clock, cfg.output_path, rank, world, cfg.hang_factor, cfg.hang_min_s,
                                  nccl=device.type == "cuda" and cfg.nccl_trace_buffer_size > 0)
                         if cfg.hang_factor > 0 else None)
        self.sleep = test_sleep(rank)

    @contextmanager
    def step(self, step: int):
        """Around one training step (``step`` counts from 1)."""
        self.profiler.begin(step)
        self.clock.begin(step)
        if self.watchdog is not None:
            self.watchdog.begin()
        start, finished = time.perf_counter(), False
        try:
            with self.snapshots.on_oom(step):
                yield
            finished = True
        finally:  # a step that raised is not timed, and no longer watched
            self.clock.end()
            if self.watchdog is not None:
                self.watchdog.end(time.perf_counter() - start if finished else None)
        self.profiler.end(step)
        self.snapshots.end(step)

    def mark(self, phase: str) -> None:
        """``phase`` of the running step ended (``phases.PHASES``)."""
        if self.sleep is not None and phase == "data" and self.sleep[0] <= self.clock.step <= self.sleep[1]:
            time.sleep(self.sleep[2])
        self.clock.mark(phase)

    def between_steps(self, phase: str):
        """Time a checkpoint save's blocking part or an evaluation (``phases.BETWEEN_STEPS``)."""
        return self.clock.between_steps(phase)

    def collect(self, step_time_s: float, warn: bool) -> dict:
        """On every rank at a logged step (a collective): the record's phase times (this rank's), ``ranks``
        (every rank's step time, phases and device health), ``health_worst`` and the slowest rank; ``warn``:
        this rank warns of a rank that stays the slowest (the logging rank)."""
        mine = {"step_time_s": step_time_s, **self.clock.read(), **self.health.read()}
        rows = gather_rows(mine, self.device)
        record = {k: v for k, v in mine.items() if k.startswith("time_")}
        record["ranks"] = rows
        health = worst(rows)
        if health:
            record["health_worst"] = {k: list(v) for k, v in health.items()}
        record.update(self.stragglers.observe(rows, warn))
        return record

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()


def format_observed(r: dict) -> str:
    """The log line's observer fields: phases, the slowest rank, the worst rank's health."""
    return format_phases(r) + format_slowest(r) + format_health(r)


def tracker_sinks(cfg, config: dict) -> list[Tracker]:
    """The experiment trackers of ``cfg.trackers`` that could start (on the logging rank)."""
    if not cfg.trackers:
        return []
    return open_trackers(cfg.trackers, cfg.output_path, config, cfg.tracker_project, cfg.tracker_run_name,
                         cfg.tracker_tags, cfg.tracker_mode)
