"""Where a step's time goes: marks at the phase boundaries, read once per logged step.

A step is cut into ``PHASES`` by marks, each saying "this phase ended here":
the trainer marks ``data`` (the next global batch handed over), the engine
``forward_backward`` (every micro-batch's backward queued), ``reduce`` (the
gradient norm's and the loss's all-reduces, and what is left of the gradient
reduction, read on the host) and ``optimizer`` (the update queued). The
phases are the differences of consecutive marks, so they add up to the step's
span by construction; ``step_time_s`` (the trainer's host clock) and that span
differ by the marks' own placement only.

On an accelerator a mark records a device event on the current stream (no
wait): the phases are device time, the idle gap while the host waits for data
included in ``data``. The events are read once, when a step is logged (one
wait for the step's last event, at the log interval); a step that is not
logged re-records the same events. On a CPU a mark is the host clock.

Under pipeline parallelism ``forward_backward`` is cut once more, per rank:
``time_pp_busy_s``, its local stages' compute (each forward, backward and
weight-gradient chunk the schedule runs, and the last stage's loss), and
``time_pp_idle_s``, the rest of the phase (waits on the pipeline's sends and
receives: the bubble); a rank holding several stages (interleaved) adds
``time_pp_busy_stage<i>_s`` per stage. Each compute span is a pair of marks
of the same kind as the phases' (device events recorded without a wait, or
host times), read with them.

Outside the steps: the blocking part of a checkpoint save and an evaluation
are timed on the host (``time_checkpoint_s``, ``time_eval_s``) and reported
with the next logged step; they are not part of any step's time.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

# In step order; the log line's short names beside them.
PHASES = ("data", "forward_backward", "reduce", "optimizer")
SHORT = {"data": "data", "forward_backward": "fb", "reduce": "reduce", "optimizer": "opt",
         "checkpoint": "ckpt", "eval": "eval", "pp_busy": "busy", "pp_idle": "idle"}
BETWEEN_STEPS = ("checkpoint", "eval")
# forward_backward under pp, split into the local stages' compute and the rest (shown after "fb" in the log line)
PIPELINE = ("pp_busy", "pp_idle")


def field(phase: str) -> str:
    """The record's key of a phase: ``time_<phase>_s``."""
    return f"time_{phase}_s"


class PhaseClock:
    """Marks of the running step (device events or host times) and the time spent between steps.

    ``ranges``: called with a phase's name when it starts and with None when the step ends (the profiler's
    named ranges, ``profiling.py``); None when nothing listens.
    """

    def __init__(self, device: torch.device) -> None:
        self.device_module = getattr(torch, device.type) if device.type in ("cuda", "npu") else None
        self.events = ([self.device_module.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
                       if self.device_module is not None else None)
        self.times = [0.0] * (len(PHASES) + 1)
        self.next = 0  # index of the next mark; 0 between steps
        self.between = dict.fromkeys(BETWEEN_STEPS, 0.0)
        self.ranges = None
        self.stages: StageBusy | None = None  # under pp: the local stages' compute spans (``watch_stages``)
        # what the hang watchdog reads (plain attributes: no lock, a torn read only shifts a name)
        self.step, self.phase, self.started = 0, "between steps", time.monotonic()

    def watch_stages(self, stage_indices: list[int]) -> "StageBusy":
        """Time the compute of these local pipeline stages inside ``forward_backward``; the returned object's
        ``span`` is what the schedule's stage wrappers call (``parallel/pipeline.StageCompute``)."""
        self.stages = StageBusy(stage_indices, self.device_module)
        return self.stages

    def begin(self, step: int) -> None:
        self.step, self.started = step, time.monotonic()
        self.next = 0
        if self.stages is not None:
            self.stages.reset()
        self._mark()
        self.phase = PHASES[0]
        if self.ranges is not None:
            self.ranges(PHASES[0])

    def mark(self, phase: str) -> None:
        """``phase`` ended (phases marked out of order or twice are a bug of the caller)."""
        if not self.next:  # engine used outside a timed step (simulation, tests): nothing to time
            return
        assert PHASES[self.next - 1] == phase, (phase, self.next)
        self._mark()
        following = PHASES[self.next - 1] if self.next <= len(PHASES) else None
        self.phase = following or "between steps"
        if self.stages is not None:  # spans count inside forward_backward only (not in an evaluation's schedule)
            self.stages.active = following == "forward_backward"
        if self.ranges is not None:
            self.ranges(following)

    def _mark(self) -> None:
        if self.events is not None:
            self.events[self.next].record()
        else:
            self.times[self.next] = time.perf_counter()
        self.next += 1

    def end(self) -> None:
        if self.next != len(PHASES) + 1 and self.next:  # a step that did not mark every phase times nothing
            self.next = -1
        self.phase = "between steps"
        if self.stages is not None:
            self.stages.active = False

    @contextmanager
    def between_steps(self, phase: str):
        """Time a blocking phase outside the steps (a checkpoint save, an evaluation) on the host."""
        start = time.perf_counter()
        self.phase = phase
        try:
            yield
        finally:
            self.between[phase] += time.perf_counter() - start
            self.phase = "between steps"

    def read(self) -> dict[str, float]:
        """The last step's phases (``time_<phase>_s``) and the time spent between steps since the last read.
        On an accelerator this waits for the step's last event: call it on logged steps only."""
        record: dict[str, float] = {}
        if self.next == len(PHASES) + 1:
            if self.events is not None:
                self.events[-1].synchronize()
                spans = [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])]
            else:
                spans = [b - a for a, b in zip(self.times, self.times[1:])]
            record.update({field(p): s for p, s in zip(PHASES, spans)})
            if self.stages is not None:
                busy = self.stages.read()
                record[field("pp_busy")] = sum(busy.values())
                record[field("pp_idle")] = record[field("forward_backward")] - record[field("pp_busy")]
                if len(busy) > 1:
                    record.update({field(f"pp_busy_stage{i}"): s for i, s in busy.items()})
        for phase, seconds in self.between.items():
            if seconds:
                record[field(phase)] = seconds
        self.between = dict.fromkeys(BETWEEN_STEPS, 0.0)
        return record


class StageBusy:
    """Each local pipeline stage's compute spans in the running step: ``span(i, True)`` where stage ``i``'s
    compute begins, ``span(i, False)`` where it ends; ignored outside ``forward_backward`` (``active``).

    On an accelerator each span is a pair of device events recorded on the current stream (no wait), from a
    pool per stage that grows to the step's number of spans once and is re-recorded each step after; the
    events are read with the phases' on a logged step (after the wait for the step's last event, which
    follows them on the stream). On a CPU each span adds its host time to the stage's sum."""

    def __init__(self, stage_indices: list[int], device_module=None) -> None:
        self.device_module = device_module
        self.seconds = dict.fromkeys(stage_indices, 0.0)  # CPU: the sums; accelerator: unused
        self.events: dict[int, list] = {i: [] for i in stage_indices}  # per stage [start, end, start, end, ...]
        self.count = dict.fromkeys(stage_indices, 0)  # marks recorded this step, per stage
        self.opened = dict.fromkeys(stage_indices, 0.0)
        self.active = False

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.count = dict.fromkeys(self.count, 0)

    def span(self, stage: int, start: bool) -> None:
        if not self.active:
            return
        if self.device_module is None:
            now = time.perf_counter()
            if start:
                self.opened[stage] = now
            else:
                self.seconds[stage] += now - self.opened[stage]
            return
        events, n = self.events[stage], self.count[stage]
        if n == len(events):
            events.append(self.device_module.Event(enable_timing=True))
        events[n].record()
        self.count[stage] = n + 1

    def read(self) -> dict[int, float]:
        """Seconds of compute per local stage in the last step (its events already complete: ``PhaseClock.read``
        waited for the step's last one)."""
        if self.device_module is None:
            return dict(self.seconds)
        return {i: sum(ev[k].elapsed_time(ev[k + 1]) for k in range(0, self.count[i] - 1, 2)) / 1e3
                for i, ev in self.events.items()}


def format_phases(r: dict) -> str:
    """`` | time data 0.01 fb 0.70 reduce 0.05 opt 0.04 s`` (under pp ``busy``/``idle`` after ``fb``, and
    ``ckpt``/``eval`` when they ran)."""
    order = PHASES[:2] + PIPELINE + PHASES[2:] + BETWEEN_STEPS
    parts = [f"{SHORT[p]} {r[field(p)]:.3g}" for p in order if field(p) in r]
    return f" | time {' '.join(parts)} s" if parts else ""
