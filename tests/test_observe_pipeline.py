"""Each pipeline stage's busy and idle time (train/observe/phases ``StageBusy``, parallel/pipeline
``StageCompute``): the wrappers on one stage instance, the clock's split of ``forward_backward``, and a real
two-process gloo run with pp 2, where every rank's busy and idle time add up to its ``forward_backward`` phase
and the pipeline's bubble shows as idle time.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from qwen3_pretrain.analysis.parse_log import parse_metrics
from qwen3_pretrain.parallel.pipeline import StageCompute
from qwen3_pretrain.train.observe.phases import PHASES, PhaseClock, format_phases
from tests._train_helpers import check_ok, child_env, make_corpus, step_records, train_command, write_config


class _Stage:
    """What the wrappers touch of a ``PipelineStage``: its index and its compute methods."""

    stage_index = 3

    def __init__(self) -> None:
        self.calls: list[str] = []

    def forward_one_chunk(self, mb: int) -> int:
        time.sleep(0.02)
        self.calls.append(f"f{mb}")
        return mb

    def backward_one_chunk(self, mb: int, loss=None) -> None:
        time.sleep(0.03)
        self.calls.append(f"b{mb}")


def test_wrappers_time_one_instance_inside_forward_backward_only() -> None:
    stage, other, compute = _Stage(), _Stage(), StageCompute()
    compute.install(stage)
    assert stage.forward_one_chunk(1) == 1  # nobody listens: the call passes through
    clock = PhaseClock(torch.device("cpu"))
    compute.on = clock.watch_stages([3]).span
    stage.forward_one_chunk(0)  # between steps (an evaluation's schedule): not counted
    clock.begin(1)
    clock.mark("data")
    stage.forward_one_chunk(2)
    other.backward_one_chunk(9)  # another instance of the class is not wrapped
    stage.backward_one_chunk(2, loss=None)
    time.sleep(0.03)  # waiting on a neighbour stage
    clock.mark("forward_backward")
    stage.forward_one_chunk(4)  # after the phase: not counted
    clock.mark("reduce")
    clock.mark("optimizer")
    clock.end()
    assert stage.calls == ["f1", "f0", "f2", "b2", "f4"] and other.calls == ["b9"]
    assert "forward_one_chunk" not in vars(other) and type(stage).forward_one_chunk is _Stage.forward_one_chunk
    r = clock.read()
    assert 0.05 <= r["time_pp_busy_s"] < r["time_forward_backward_s"]
    assert r["time_pp_busy_s"] + r["time_pp_idle_s"] == pytest.approx(r["time_forward_backward_s"])
    assert r["time_pp_idle_s"] >= 0.06  # other's backward and the wait
    assert "time_pp_busy_stage3_s" not in r  # one local stage: the totals say it all
    line = format_phases(r)
    assert line.startswith(" | time data ") and " busy " in line and line.index(" fb ") < line.index(" busy ")


def test_several_local_stages_are_reported_each() -> None:
    clock = PhaseClock(torch.device("cpu"))
    busy = clock.watch_stages([0, 2])
    clock.begin(1)
    clock.mark("data")
    for stage, seconds in ((0, 0.01), (2, 0.02), (0, 0.01)):
        busy.span(stage, True)
        time.sleep(seconds)
        busy.span(stage, False)
    for phase in PHASES[1:]:
        clock.mark(phase)
    clock.end()
    r = clock.read()
    assert r["time_pp_busy_stage0_s"] >= 0.02 and r["time_pp_busy_stage2_s"] >= 0.02
    assert r["time_pp_busy_s"] == pytest.approx(r["time_pp_busy_stage0_s"] + r["time_pp_busy_stage2_s"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device events need CUDA")
def test_device_events_time_the_spans_without_a_wait_per_span() -> None:
    clock = PhaseClock(torch.device("cuda"))
    busy = clock.watch_stages([1])
    x = torch.randn(2048, 2048, device="cuda")
    for step in (1, 2):  # the second step re-records the first one's events
        clock.begin(step)
        clock.mark("data")
        for _ in range(3):
            busy.span(1, True)
            y = x @ x
            busy.span(1, False)
            y = y @ x  # between spans: idle for the count
        for phase in PHASES[1:]:
            clock.mark(phase)
        clock.end()
    assert len(busy.events[1]) == 6
    r = clock.read()
    assert 0 < r["time_pp_busy_s"] < r["time_forward_backward_s"]
    assert r["time_pp_busy_s"] + r["time_pp_idle_s"] == pytest.approx(r["time_forward_backward_s"])


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_two_processes_pp2_busy_and_idle_add_up(tmp_path, schedule) -> None:
    data = tmp_path / "data"
    make_corpus(data, num_docs=120)
    config = write_config(tmp_path / "c.yaml", data, tmp_path / "out", pp=2, total_steps=4,
                          gradient_accumulation_steps=2, pp_schedule=schedule)
    proc = subprocess.run(train_command(config, 2), capture_output=True, text=True, timeout=240, env=child_env())
    check_ok(proc)
    records = step_records(tmp_path / "out")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    idle_seen = False
    for rec in records:
        assert [row["rank"] for row in rec["ranks"]] == [0, 1]
        for row in rec["ranks"]:
            fb, busy, idle = row["time_forward_backward_s"], row["time_pp_busy_s"], row["time_pp_idle_s"]
            assert busy > 0 and abs(busy + idle - fb) <= 0.05 * fb, (rec["step"], row)
            idle_seen |= idle > 0
        assert rec["time_pp_busy_s"] == rec["ranks"][1]["time_pp_busy_s"]  # the logging rank's: the last stage's
    assert idle_seen  # the bubble: a stage waits for its neighbour
    if schedule == "interleaved":  # the logging rank holds stages 1 and 3 of 4: each has its own figure
        rec = records[-1]
        assert rec["time_pp_busy_stage1_s"] > 0 and rec["time_pp_busy_stage3_s"] > 0
        assert rec["time_pp_busy_stage1_s"] + rec["time_pp_busy_stage3_s"] == pytest.approx(rec["time_pp_busy_s"])
    # the log line's busy and idle parse back to the record's (3 significant digits in the line)
    (tmp_path / "train.log").write_text(proc.stdout)
    parsed = {r["step"]: r for r in parse_metrics(tmp_path / "train.log").rows}
    for rec in records:
        for key in ("time_pp_busy_s", "time_pp_idle_s"):
            assert parsed[rec["step"]][key] == pytest.approx(rec[key], rel=6e-3, abs=1e-6), key
    print({rec["step"]: [(round(r["time_pp_busy_s"], 3), round(r["time_pp_idle_s"], 3)) for r in rec["ranks"]]
           for rec in records})
