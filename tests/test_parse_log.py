"""parse-log: training log / metrics.jsonl -> CSV, summary and plot.

The logs are generated here from a table of per-step values, so every expected
number below comes from that table (a hand computation), not from the parser.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_pretrain.analysis.parse_log import main, parse_metrics
from qwen3_pretrain.analysis.report import KNOWN_COLUMNS, format_summary, summarize
from qwen3_pretrain.train.metrics import format_line
from qwen3_pretrain.train.observe import format_observed

LOG_STEPS = 10
TOTAL = 100000


def _values(step: int, segment: int) -> dict:
    """The metrics the fake engine logs at ``step`` in run segment 0 or 1 (resumed)."""
    first = step in (10, 210)  # first record of each segment: start-up makes it slow
    return {
        "loss": (8.0 - step / 100) if segment == 0 else (6.0 - step / 1000),
        "lr": 1e-5 * step / 400,
        "grad_norm": 0.5 + segment,
        "tps": 50.0 if first else (700.0 + step % 7 if segment == 0 else 800.0 + step % 5),
        "mfu_pct": 40.0 + (step % 3) / 10 if segment == 0 else 45.0,
        "mem": 43.25 if step == 370 else 41.0 + segment,
    }


def _line(step: int, v: dict, tail: str = "") -> str:
    return (
        f"2026-12-02 14:05:31 INFO step {step}/{TOTAL} | loss {v['loss']:.4f} | lr {v['lr']:.2e} | "
        f"grad_norm {v['grad_norm']:.2f} | tokens/s {v['tps']:.0f} ({v['tps'] / 8:.2f}/device) | step 0.80 s | "
        f"mfu {v['mfu_pct']:.1f}% | hfu {v['mfu_pct'] + 10:.1f}% | mem {v['mem']:.2f} GiB | eta 22h13m{tail}"
    )


def _resumed_log(path: Path) -> Path:
    """nohup log of a run logging every 10 steps: 10..300, crash, resume from 200, 210..400 (with noise)."""
    out = ["nohup: ignoring input", "[W init.cpp:767] Warning: rank 3 says hello (function operator())"]
    out.append("2026-12-02 14:00:00 INFO run start: world 8 | tp 4 pp 2 dp 1 | global_batch 4")
    for step in range(10, 301, LOG_STEPS):
        out.append(_line(step, _values(step, 0)))
        out.append(f"Loading shards: {step % 100}%|###     | {step}/400 [00:01<00:02]\r  99%|#########|")
    out += ["Traceback (most recent call last):", '  File "train.py", line 1', "RuntimeError: NCCL timeout"]
    out.append("2026-12-02 15:00:00 INFO run start: world 8 | tp 4 pp 2 dp 1 | global_batch 4")
    out.append("2026-12-02 15:00:01 INFO resumed from /ckpt/step_200 at step 200")
    for step in range(210, 401, LOG_STEPS):
        out.append(_line(step, _values(step, 1)))
    path.write_text("\n".join(out) + "\n")
    return path


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_resumed_nohup_log_to_csv(tmp_path: Path) -> None:
    log = _resumed_log(tmp_path / "pretrain.log")
    assert main(["--log_path", str(log), "--output_path", str(tmp_path / "m.csv")]) == 0
    rows = _read_csv(tmp_path / "m.csv")
    assert [int(r["step"]) for r in rows] == list(range(10, 401, LOG_STEPS))  # 400 / log_steps unique steps
    by_step = {int(r["step"]): r for r in rows}
    for step in range(210, 301, LOG_STEPS):  # re-done after the resume: the later segment wins
        assert float(by_step[step]["loss"]) == pytest.approx(_values(step, 1)["loss"], abs=5e-5)
        assert float(by_step[step]["grad_norm"]) == 1.5
    assert float(by_step[200]["loss"]) == pytest.approx(_values(200, 0)["loss"], abs=5e-5)
    assert float(by_step[200]["mfu"]) == pytest.approx((40.0 + 200 % 3 / 10) / 100)  # percent -> fraction
    assert float(by_step[200]["hfu"]) == pytest.approx((50.0 + 200 % 3 / 10) / 100)
    assert by_step[100]["total_steps"] == str(TOTAL) and by_step[100]["eta_s"] == str(22 * 3600 + 13 * 60)
    assert float(by_step[100]["tokens_per_sec_per_device"]) == pytest.approx(_values(100, 0)["tps"] / 8, abs=5e-3)
    # mfu_full_square is in metrics.jsonl only, not on the line
    assert list(rows[0]) == [c for c in KNOWN_COLUMNS if c not in ("mfu_full_square", "tokens_seen", "eval_loss",
                                                                    "eval_ppl")]


def test_summary_matches_hand_computation(tmp_path: Path) -> None:
    parsed = parse_metrics(_resumed_log(tmp_path / "pretrain.log"))
    s = summarize(parsed)
    final = {step: _values(step, 0) for step in range(10, 201, LOG_STEPS)}
    final.update({step: _values(step, 1) for step in range(210, 401, LOG_STEPS)})
    steady = [v for step, v in final.items() if step not in (10, 210)]  # warm-up: first record per segment
    assert (s.num_steps, s.first_step, s.last_step, s.num_restarts) == (40, 10, 400, 1)
    assert s.final_loss == pytest.approx(6.0 - 0.4, abs=5e-5)
    assert s.min_loss_step == 400  # segment 1 only goes down; segment 0's rows after 200 were replaced
    assert s.mean_tokens_per_sec == pytest.approx(sum(round(v["tps"]) for v in steady) / len(steady))
    assert s.mean_tokens_per_sec_per_device == pytest.approx(sum(v["tps"] / 8 for v in steady) / 38, abs=1e-2)
    assert s.mean_mfu == pytest.approx(sum(round(v["mfu_pct"], 1) for v in steady) / 38 / 100)
    assert s.peak_memory_gib == 43.25
    assert (s.skipped_steps, s.nonfinite_steps, s.num_warmup_excluded) == ([], [], 2)
    assert parsed.restart_steps == [200]


def test_nan_loss_skipped_units_and_extra_fields(tmp_path: Path) -> None:
    lines = [
        "2026-12-02 14:00:00 INFO step 1/5 | loss nan | lr 0.00e+00 | grad_norm inf | tokens/s 10 (5.0/device)"
        " | step 120 ms | mfu 0.5% | mem 512 MiB | eta 3m05s | skipped",
        "2026-12-02 14:00:01 INFO step 2/5 | loss 2.5 | lr 1.00e-05 | grad_norm 1.0 | tokens/s 20 | step 0.1 s"
        " | mfu 1.0% | mem 1.5 GiB | eta 1d02h | data wait 0.25 | phase warmup",
        "2026-12-02 14:00:02 INFO step 3/5 | loss 2.25 | lr 1.00e-05 | eta 45s",
        "2026-12-02 14:00:03 INFO step 4/5 | loss 2.5 | lr 1.00e-05 | eta ? | skipped",
    ]
    (tmp_path / "a.log").write_text("\n".join(lines) + "\n")
    parsed = parse_metrics(tmp_path / "a.log")
    r1, r2, r3, r4 = parsed.rows
    assert math.isnan(r1["loss"]) and r1["grad_norm"] == math.inf and r1["skipped"] is True
    assert (r1["step_time_s"], r1["mfu"], r1["memory_gib"], r1["eta_s"]) == (0.12, 0.005, 0.5, 185)
    assert (r2["eta_s"], r3["eta_s"], r2["data_wait"], r2["phase"]) == (26 * 3600, 45, 0.25, "warmup")
    assert "tokens_per_sec_per_device" not in r2 and r2["skipped"] is False
    s = summarize(parsed)
    assert r4["eta_s"] is None and r4["skipped"] is True  # an unknown eta does not hide the flag after it
    assert (s.skipped_steps, s.nonfinite_steps, s.min_loss, s.min_loss_step) == ([1, 4], [1], 2.25, 3)
    main(["--log-path", str(tmp_path / "a.log"), "--output-path", str(tmp_path / "a.csv")])
    rows = _read_csv(tmp_path / "a.csv")
    assert list(rows[0])[-2:] == ["data_wait", "phase"]  # extras after the known columns
    assert (rows[0]["loss"], rows[0]["skipped"], rows[1]["skipped"], rows[2]["data_wait"]) == ("nan", "1", "0", "")


def test_mangled_lines(tmp_path: Path) -> None:
    v = {"loss": 3.0, "lr": 1e-5, "grad_norm": 1.0, "tps": 80.0, "mfu_pct": 10.0, "mem": 1.0}
    lines = [
        # two lines joined (a missing newline), then one after another rank's prefix: all are read
        _line(10, v) + _line(20, {**v, "loss": 2.0}),
        "[rank3]: warn " + _line(25, {**v, "loss": 2.5}) + " [rank3]: more",
        # another process's output spliced into the record: fields before the damage are kept
        _line(30, {**v, "loss": 1.5})[:95] + "[W socket.cpp:464] connect timed out | foo",
        "2026-12-02 14:05:31 INFO step 40/100000 | lo",  # cut before the loss: ignored
    ]
    (tmp_path / "a.log").write_text("\n".join(lines) + "\n")
    parsed = parse_metrics(tmp_path / "a.log")
    rows = {r["step"]: r for r in parsed.rows}
    assert sorted(rows) == [10, 20, 25, 30] and parsed.num_ignored == 1
    assert (rows[10]["loss"], rows[10]["eta_s"], rows[20]["loss"], rows[30]["loss"]) == (3.0, 79980, 2.0, 1.5)
    assert rows[25]["loss"] == 2.5 and "eta_s" not in rows[25]  # "22h13m [rank3]: more" is not an eta
    assert "mfu" not in rows[30] and not any("socket" in key or "rank" in key for r in parsed.rows for key in r)


def test_restarts_without_start_markers_count_backward_steps(tmp_path: Path) -> None:
    v = _values(50, 0)
    steps = [10, 20, 30, 20, 30, 40, 10, 20]  # two restarts: at 20 and at 10
    (tmp_path / "a.log").write_text("\n".join(_line(s, {**v, "loss": float(i)}) for i, s in enumerate(steps)))
    parsed = parse_metrics(tmp_path / "a.log")
    assert parsed.num_restarts == 2 and parsed.restart_steps == [20, 10]
    assert {r["step"]: r["loss"] for r in parsed.rows} == {10: 6.0, 20: 7.0, 30: 4.0, 40: 5.0}
    assert parsed.warmup_steps == {10}  # 20 (first of segment 1) was replaced by segment 2


# the engine's start event names the step it resumes from; a separate resume event does too
@pytest.mark.parametrize("restart", [[{"event": "start", "step": 2}], [{"event": "start"}, {"event": "resume", "step": 2}]])
def test_metrics_jsonl(tmp_path: Path, restart: list[dict]) -> None:
    loss = 2.718281828459045
    records = [{"event": "start", "step": 0, "world": 8}]
    records += [{"step": s, "loss": loss + s, "lr": 1e-5, "tokens_per_sec": 700.0, "mfu": 0.4, "tokens_seen": s * 64}
                for s in (1, 2, 3)]  # fmt: skip
    records += restart
    records += [{"step": 3, "loss": 1.0, "mfu": 0.5, "skipped": True, "comm": {"ms": 1.5}}, {"step": 4, "loss": 0.5}]
    text = "\n".join(json.dumps(r) for r in records) + '\n{"step": 5, "lo'  # killed mid-write
    (tmp_path / "metrics.jsonl").write_text(text)
    parsed = parse_metrics(tmp_path)  # a run directory holding metrics.jsonl
    (tmp_path / "copy.txt").write_text(text)  # detected by content as well
    assert parse_metrics(tmp_path / "copy.txt").rows == parsed.rows
    assert parsed.source == "jsonl" and parsed.num_restarts == 1 and parsed.restart_steps == [2]
    assert [r["step"] for r in parsed.rows] == [1, 2, 3, 4] and parsed.num_ignored == 1
    main(["--log_path", str(tmp_path / "metrics.jsonl"), "--output_path", str(tmp_path / "m.csv")])
    rows = _read_csv(tmp_path / "m.csv")
    assert float(rows[0]["loss"]) == loss + 1  # full precision survives the CSV
    assert (rows[2]["loss"], rows[2]["mfu"], rows[2]["skipped"], rows[2]["tokens_seen"]) == ("1.0", "0.5", "1", "")
    assert (rows[2]["comm"], rows[1]["tokens_seen"]) == ('{"ms": 1.5}', "128")
    s = summarize(parsed)
    assert (s.mean_mfu, s.num_warmup_excluded, s.skipped_steps) == (pytest.approx(0.4), 2, [3])


def test_reads_the_engines_own_log_lines(tmp_path: Path) -> None:
    """The contract with the training engine: the line it prints parses back to the record it wrote."""
    base = {"total_steps": 1000, "lr": 1.234e-5, "tokens_per_sec": 732.4, "tokens_per_sec_per_device": 91.55,
            "step_time_s": 0.804, "mfu": 0.41234, "hfu": 0.54949, "mfu_full_square": 0.47,
            "memory_gib": 41.96}  # fmt: skip
    cases = [  # (loss, grad_norm, eta_s, skipped) -> eta in whole units as the engine shows it
        (2.34119, 0.9134, 93784.7, False, 26 * 3600),  # 1d02h
        (2.2, 1234.5, 3725.0, False, 3720),  # 1h02m
        (math.nan, math.inf, 185.2, True, 185),  # 3m05s
        (2.1, 0.5, math.inf, True, None),  # ?
    ]
    lines = [f"2026-12-02 14:05:{i:02d} INFO " + format_line({**base, "step": i + 1, "loss": c[0], "grad_norm": c[1],
             "eta_s": c[2], "skipped": c[3]}) for i, c in enumerate(cases)]  # fmt: skip
    (tmp_path / "a.log").write_text("\n".join(lines) + "\n")
    rows = parse_metrics(tmp_path / "a.log").rows
    assert len(rows) == len(cases)
    for row, (loss, grad_norm, _, skipped, eta) in zip(rows, cases, strict=True):
        assert row["loss"] == pytest.approx(loss, abs=5e-5, nan_ok=True)
        assert row["grad_norm"] == pytest.approx(grad_norm, rel=5e-3)
        assert (row["eta_s"], row["skipped"], row["total_steps"]) == (eta, skipped, 1000)
        assert row["lr"] == pytest.approx(1.23e-5) and row["tokens_per_sec"] == 732
        assert (row["tokens_per_sec_per_device"], row["step_time_s"], row["mfu"], row["hfu"], row["memory_gib"]) == (
            pytest.approx(91.5), 0.80, 0.412, 0.549, 42.0)  # fmt: skip


def test_pipeline_busy_and_idle_read_back_beside_the_phases(tmp_path: Path) -> None:
    """Under pp the observer's time group carries each rank's busy and idle time after ``fb``."""
    record = {"time_data_s": 0.001, "time_forward_backward_s": 0.7, "time_pp_busy_s": 0.52, "time_pp_idle_s": 0.18,
              "time_reduce_s": 0.05, "time_optimizer_s": 0.04}  # fmt: skip
    line = "step 3/10 | loss 2.5 | lr 1.00e-05" + format_observed(record)
    assert "| time data 0.001 fb 0.7 busy 0.52 idle 0.18 reduce 0.05 opt 0.04 s" in line
    (tmp_path / "a.log").write_text(f"2026-12-02 14:05:00 INFO {line}\n")
    (row,) = parse_metrics(tmp_path / "a.log").rows
    assert {k: row[k] for k in record} == record


def test_reserved_memory_beside_allocated_reads_back_and_the_old_form_still_does(tmp_path: Path, monkeypatch) -> None:
    """On an accelerator the record holds the allocator's peak reserved bytes beside the peak allocated and the
    line shows both (``mem 42.0/44.0 GiB``); a CPU run's line and older logs keep ``mem 0.8 GiB``."""
    import types

    import torch

    from qwen3_pretrain.train import metrics

    gib = 2**30
    fake = types.SimpleNamespace(max_memory_allocated=lambda device=None: 41.96 * gib,
                                 max_memory_reserved=lambda device=None: 44.04 * gib)
    monkeypatch.setattr(torch, "cuda", fake)
    assert metrics.step_memory(torch.device("cuda", 0)) == {"memory_gib": 41.96, "memory_reserved_gib": 44.04}
    monkeypatch.undo()
    assert set(metrics.step_memory(torch.device("cpu"))) == {"memory_gib"}
    base = {"total_steps": 9, "loss": 2.5, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_sec": 10.0,
            "tokens_per_sec_per_device": 5.0, "step_time_s": 0.5, "mfu": 0.1, "eta_s": 5.0}  # fmt: skip
    device_line = format_line({**base, "step": 1, "memory_gib": 41.96, "memory_reserved_gib": 44.04})
    cpu_line = format_line({**base, "step": 2, "memory_gib": 0.77})
    assert "| mem 42.0/44.0 GiB |" in device_line and "| mem 0.8 GiB |" in cpu_line
    mib_line = device_line.replace("step 1/9", "step 3/9").replace("42.0/44.0 GiB", "512 / 1024 MiB")
    (tmp_path / "a.log").write_text("\n".join([device_line, cpu_line, mib_line]) + "\n")
    r1, r2, r3 = parse_metrics(tmp_path / "a.log").rows
    assert (r1["memory_gib"], r1["memory_reserved_gib"]) == (42.0, 44.0)
    assert r2["memory_gib"] == 0.8 and "memory_reserved_gib" not in r2
    assert (r3["memory_gib"], r3["memory_reserved_gib"], r3["eta_s"]) == (0.5, 1.0, 5)
    main(["--log_path", str(tmp_path / "a.log"), "--output_path", str(tmp_path / "a.csv")])
    with open(tmp_path / "a.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["memory_gib"], r["memory_reserved_gib"]) for r in rows] == [("42.0", "44.0"), ("0.8", ""),
                                                                           ("0.5", "1.0")]


def test_plot_png(tmp_path: Path) -> None:
    log = _resumed_log(tmp_path / "pretrain.log")
    assert main(["--log_path", str(log), "--plot", str(tmp_path / "m.png")]) == 0
    data = (tmp_path / "m.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.png", "pretrain.log"]  # no temporary left behind


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "qwen3_pretrain", "parse-log", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_bad_inputs_exit_2_with_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "empty.log").write_text("nohup: ignoring input\nTraceback (most recent call last):\n")
    good = _resumed_log(tmp_path / "pretrain.log")
    cases = [
        (["--log_path", str(tmp_path / "missing.log")], "missing.log"),
        (["--log_path", str(tmp_path / "empty.log")], "step N/M | loss"),
        (["--log_path", str(good), "--output_path", str(tmp_path / "no_dir" / "m.csv")], "m.csv"),
    ]
    for args, expected in cases:
        proc = _cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert expected in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "no_dir").exists()


def test_held_out_evaluations_reach_the_csv_and_summary(tmp_path: Path) -> None:
    """Eval records as the engine writes them (log line and metrics.jsonl event): on the row of their step,
    a row of their own when that step was not logged, and the resumed run's wins."""
    first = {100: (7.5, 1808.04), 200: (7.1, 1211.97), 205: (6.95, 1043.15), 300: (6.8, 897.85)}
    redone = {205: (6.9, 992.27), 300: (6.7, 812.41)}  # the run resumed from step 200 evaluates these again
    log, jsonl = [], []

    def evaluation(step: int, loss_ppl: tuple[float, float]) -> None:
        log.append(f"2026-12-02 14:30:00 INFO eval at step {step} | loss {loss_ppl[0]:.4f} | ppl {loss_ppl[1]:.2f}")
        jsonl.append({"event": "eval", "step": step, "eval_loss": loss_ppl[0], "eval_ppl": loss_ppl[1]})

    for segment, steps, evals in ((0, range(10, 301, LOG_STEPS), first), (1, range(210, 401, LOG_STEPS), redone)):
        if segment:
            log += ["2026-12-02 15:00:00 INFO run start: world 8", "2026-12-02 15:00:01 INFO resumed from x at step 200"]
            jsonl.append({"event": "start", "step": 200})
        for step in steps:
            if step - 5 in evals:  # step 205 is evaluated but not logged (log_steps 10)
                evaluation(step - 5, evals[step - 5])
            v = _values(step, segment)
            log.append(_line(step, v))
            jsonl.append({"step": step, "loss": v["loss"], "lr": v["lr"]})
            if step in evals:
                evaluation(step, evals[step])
    (tmp_path / "run.log").write_text("\n".join(log) + "\n")
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in jsonl) + "\n")
    want = {100: first[100], 200: first[200], 205: redone[205], 300: redone[300]}
    for name in ("run.log", "metrics.jsonl"):
        assert main(["--log_path", str(tmp_path / name), "--output_path", str(tmp_path / f"{name}.csv")]) == 0
        rows = _read_csv(tmp_path / f"{name}.csv")
        got = {int(r["step"]): (float(r["eval_loss"]), float(r["eval_ppl"])) for r in rows if r["eval_loss"]}
        assert sorted(got) == sorted(want), name
        for step, (loss, ppl) in want.items():
            assert got[step] == (pytest.approx(loss), pytest.approx(ppl)), (name, step)
        own = [r for r in rows if r["step"] == "205"]
        assert len(own) == 1 and own[0]["loss"] == ""  # step 205 was evaluated but not logged
        assert len(rows) == 40 + 1  # 10..400 every 10 steps, plus the evaluation-only row
        parsed = parse_metrics(tmp_path / name)
        assert [e["step"] for e in parsed.evals] == [100, 200, 205, 300]
        assert summarize(parsed).num_steps == 40  # evaluations are not steps
        assert "held-out eval: 4 evaluation(s); last 6.7000 at step 300; best 6.7000 at step 300" in \
            format_summary(summarize(parsed))
