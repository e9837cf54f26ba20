"""The observer in real training runs (CPU, one process and two gloo processes): the phases add up to the
step time, the profiler's trace holds our ranges, a slow rank is named, a hung rank is named and the run ends.

The slow and hung ranks are made so by a test-only hook (``QWEN3_PRETRAIN_TEST_SLEEP``: a sleep in one rank's
data phase of chosen steps).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from qwen3_pretrain.analysis.parse_log import parse_metrics
from qwen3_pretrain.train.observe.phases import PHASES
from qwen3_pretrain.train.observe.watchdog import HANG_EXIT_CODE, TEST_SLEEP_ENV
from tests._train_helpers import check_ok, child_env, make_corpus, step_records, train_command, write_config

PHASE_KEYS = [f"time_{p}_s" for p in PHASES]

# A stand-in for the wandb package (not a dependency): what the run hands it, written where a real offline run
# would write its files.
STANDIN_WANDB = """
import json, os
_file = None
def init(**kwargs):
    global _file
    _file = open(os.path.join(kwargs["dir"], "standin.jsonl"), "a")
    _file.write(json.dumps({"init": {k: v for k, v in kwargs.items() if k != "config"},
                            "config": kwargs["config"]}) + "\\n")
    return object()
def log(values, step=None):
    _file.write(json.dumps({"step": step, **values}) + "\\n")
    _file.flush()
def finish():
    _file.close()
"""


def _run(tmp_path, nproc: int, env: dict | None = None, timeout: int = 240, **overrides):
    data = tmp_path / "data"
    if not data.exists():
        make_corpus(data, num_docs=120)
    config = write_config(tmp_path / "c.yaml", data, tmp_path / "out", **overrides)
    proc = subprocess.run(train_command(config, nproc), capture_output=True, text=True, timeout=timeout,
                          env={**child_env(), **(env or {})})
    return proc, tmp_path / "out"


def _assert_phases_add_up(records: list[dict]) -> None:
    for rec in records[1:]:  # the first step's time holds the allocator's and the loader's warm-up
        total = sum(rec[k] for k in PHASE_KEYS)
        # 5% of the step, or 5 ms: the marks' placement against the trainer's clock, a few ms on a loaded host
        bound = max(0.05 * rec["step_time_s"], 0.005)
        assert abs(total - rec["step_time_s"]) <= bound, (rec["step"], total, rec)


def test_one_process_phases_profile_and_parse_log(tmp_path):
    (tmp_path / "standin").mkdir()
    (tmp_path / "standin" / "wandb.py").write_text(STANDIN_WANDB)
    proc, out = _run(tmp_path, 1, env={"PYTHONPATH": str(tmp_path / "standin")}, total_steps=6, save_steps=3,
                     profile_steps="4-5", trackers=["wandb"], tracker_run_name="r1", tracker_tags=["t"])
    check_ok(proc)
    records = step_records(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    _assert_phases_add_up(records)
    assert records[3]["time_checkpoint_s"] > 0  # the save after step 3 is reported with step 4
    assert "time_checkpoint_s" not in records[2]
    row = records[-1]["ranks"][0]
    assert row["rank"] == 0 and row["rss_gib"] > 0.05 and 0 <= row["cpu_util_pct"] <= 150
    assert records[-1]["health_worst"]["rss_gib"] == [row["rss_gib"], 0]
    # the log line's phases parse back to the record's (3 significant digits in the line)
    (tmp_path / "train.log").write_text(proc.stdout)
    parsed = {r["step"]: r for r in parse_metrics(tmp_path / "train.log").rows}
    for rec in records:
        for key in PHASE_KEYS:
            assert parsed[rec["step"]][key] == pytest.approx(rec[key], rel=6e-3, abs=1e-6), key
    assert parsed[4]["time_checkpoint_s"] == pytest.approx(records[3]["time_checkpoint_s"], rel=6e-3)
    assert parsed[6]["health_rss_gib_rank"] == 0
    # the profile of steps 4-5: a Chrome trace with our phases, the stage and every layer
    trace = json.loads((out / "profile" / "step_4-5" / "rank0.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {f"phase:{p}" for p in PHASES} <= names
    assert {"stage 0 forward", "layer 0", "layer 3"} <= names
    assert not (out / "profile" / "step_1-1").exists()
    # the tracker got the config and, per step, the scalars TensorBoard gets
    tracked = [json.loads(line) for line in (out / "wandb" / "standin.jsonl").read_text().splitlines()]
    assert tracked[0]["init"]["mode"] == "offline" and tracked[0]["init"]["name"] == "r1"
    assert tracked[0]["init"]["tags"] == ["t"] and tracked[0]["config"]["seq_length"] == 64
    by_step = {t["step"]: t for t in tracked[1:]}
    for rec in records:
        assert by_step[rec["step"]]["train/loss"] == rec["loss"]
        assert by_step[rec["step"]]["train/time_reduce_s"] == rec["time_reduce_s"]


@pytest.mark.slow
def test_two_processes_slow_rank_is_named(tmp_path):
    proc, out = _run(tmp_path, 2, env={TEST_SLEEP_ENV: "1:2-7:0.3"}, total_steps=7)
    check_ok(proc)
    records = step_records(out)
    _assert_phases_add_up(records)
    for rec in records[1:]:
        assert rec["slowest_rank"] == 1, rec
        assert 0.25 < rec["slowest_excess_s"] < 0.6, rec
        assert [r["rank"] for r in rec["ranks"]] == [0, 1]
        assert rec["ranks"][1]["time_data_s"] > 0.3 > rec["ranks"][0]["time_data_s"]
    assert records[-1]["slowest_in_a_row"] >= len(records) - 1
    assert proc.stdout.count("rank 1 has been the slowest in 3 logged steps in a row") == 1  # once, not each step
    assert "| slowest r1 +0." in proc.stdout


@pytest.mark.slow
def test_two_processes_hang_names_the_rank_and_ends_the_run(tmp_path):
    # steps of ~0.2 s: after 5 of them the limit is the floor of 2 s; rank 1 then sleeps 120 s in step 6
    proc, out = _run(tmp_path, 2, env={TEST_SLEEP_ENV: "1:6:120"}, total_steps=8, hang_factor=3, hang_min_s=2)
    assert proc.returncode != 0, proc.stdout[-3000:]
    log = proc.stdout + proc.stderr
    assert "hang: rank(s) 1 behind" in log, log[-4000:]
    assert f"exit code {HANG_EXIT_CODE}" in log
    summary = json.loads((out / "hang" / "summary.json").read_text())
    assert summary["behind"] == [1]
    assert summary["ranks"]["1"]["phase"] == "data" and summary["ranks"]["0"]["phase"] == "forward_backward"
    assert summary["ranks"]["1"]["step"] == summary["ranks"]["0"]["step"] == 6
    assert all(isinstance(summary["ranks"][r]["collective_seq"], int) for r in ("0", "1"))
    for rank in (0, 1):
        stacks = (out / "hang" / f"rank{rank}.txt").read_text()
        assert "most recent call first" in stacks and "train_step" in stacks, stacks
    assert "in mark" in (out / "hang" / "rank1.txt").read_text()  # the test's sleep, in the observer's hook
