"""``bench/device_check.sh``: the script that spends a device slot runs every stage on a CPU (``--cpu``),
records each stage in summary.json as it ends, and keeps going past a stage that fails or hangs.

The resume and the merge are checked here from the runs' own files (metrics.jsonl, the merged
safetensors), not only from the figures the script reports about them.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[1]
CLI_STAGES = ["env", "tests", "convert", "train_resume", "merge", "parse_log", "bench_data"]


def command(out: Path, *args: str) -> list[str]:
    return ["bash", str(REPO / "bench" / "device_check.sh"), "--work", str(out / "work"), *args, str(out)]


def script_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "QWEN3_PRETRAIN_DEBUG")}
    return {**env, "PYTHON": sys.executable}


def run_check(out: Path, *args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(command(out, *args), capture_output=True, text=True, timeout=timeout, env=script_env())
    return proc, json.loads((out / "summary.json").read_text())


def by_name(summary: dict) -> dict[str, dict]:
    return {s["name"]: s for s in summary["stages"]}


def losses(metrics: Path) -> dict[int, float]:
    """Loss per step, a later record of a step (re-done after a resume) replacing the earlier one."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}


@pytest.fixture(autouse=True)
def _bench_on_path(monkeypatch):
    """bench/'s scripts import each other by name: bench/ is on sys.path during each test here and taken off
    after it (left there, every later test of the session would see it)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """The whole check on the CPU, once; the budget is generous because a shared test machine may be slow."""
    out = tmp_path_factory.mktemp("device_check")
    proc, summary = run_check(out, "--cpu", "--budget", "1500", timeout=1800)
    return proc, summary, out


@pytest.mark.slow
def test_every_stage_passes_on_the_cpu(cpu_run):
    proc, summary, out = cpu_run
    failed = {s["name"]: (s.get("error"), s.get("tail", "")[-1500:]) for s in summary["stages"] if not s["ok"]}
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = [s["name"] for s in summary["stages"]]
    assert names[:len(CLI_STAGES)] == CLI_STAGES
    multi = [n for n in names if n.startswith("multi/")]
    assert names[len(CLI_STAGES):len(CLI_STAGES) + len(multi)] == multi and "multi/ep2-moe-bf16" in multi
    variants = names[len(CLI_STAGES) + len(multi):-2]
    assert variants and [n.startswith("throughput/") for n in variants] == [True] * len(variants), variants
    for name in variants:  # the roofline's predicted step beside the measured one (probed CPU figures)
        roofline = by_name(summary)[name]["roofline"]
        assert roofline["predicted_step_s"] > 0 and roofline["measured_step_s"] > 0 and roofline["ratio"] > 0, roofline
        assert roofline["breakdown_s"]["matmul"] > 0 and roofline["breakdown_s"]["elementwise"] > 0, roofline
    assert names[-2:] == ["fp8/dense", "fp8/moe"]  # emulated FP8 runs, the last stages
    assert summary["finished"] and summary["all_ok"] and summary["not_run"] == [] and summary["mode"] == "cpu"
    assert summary["skipped"] == []
    for stage in summary["stages"]:
        assert stage["seconds"] >= 0 and stage["timeout_s"] > 0, stage
    assert by_name(summary)["tests"]["passed"] > 0 and by_name(summary)["tests"]["failed"] == 0
    # on the CPU fsdp2's run carries the asynchronous save, which fsdp2-async_save resumes from (no second run)
    async_save = by_name(summary)["multi/fsdp2-async_save"]
    assert async_save["resumed_from"] == 2 and async_save["steps"] == [1, 2, 3, 4], async_save
    assert "in the background" in (out / "multi" / "fsdp2.log").read_text()
    assert not (out / "multi" / "fsdp2-async_save.log").exists()


@pytest.mark.slow
def test_the_run_stopped_by_sigterm_then_killed_resumes_to_identical_losses_and_weights(cpu_run):
    _, summary, out = cpu_run
    stage = by_name(summary)["train_resume"]
    assert stage["ok"] and stage["exact"], stage
    total = stage["total_steps"]
    work = Path(summary["work"])
    # the bulky files (checkpoints) are in the work folder, not beside the summary and logs
    assert work == out / "work" and list((work / "cli").rglob("*.distcp")) and not list((out / "cli").rglob("*.distcp"))
    want, got = losses(work / "cli" / "ref" / "metrics.jsonl"), losses(work / "cli" / "run" / "metrics.jsonl")
    assert sorted(want) == list(range(1, total + 1)) and got == want  # exact float equality
    events = [json.loads(line) for line in (work / "cli" / "run" / "metrics.jsonl").read_text().splitlines()]
    resumes = [r["step"] for r in events if r.get("event") == "resume"]
    assert len(resumes) == 2 and 0 < resumes[0] < resumes[1] < total, resumes
    log = (out / "cli" / "train.log").read_text()
    assert "stopped on request" in log and log.count("resumed from") == 2
    # the killed run logged a step after its last checkpoint, which the resumed run re-did
    assert stage["sigkill_after"] > stage["checkpoint_at_kill"] == resumes[1]
    merged = [{k: v for f in sorted((work / "cli" / name).glob("*.safetensors")) for k, v in load_file(f).items()}
              for name in ("ref_merged", "run_merged")]
    assert merged[0] and merged[0].keys() == merged[1].keys()
    assert all(np.array_equal(merged[0][k], merged[1][k]) for k in merged[0])
    assert by_name(summary)["merge"]["weights_equal"]


@pytest.mark.slow
def test_parse_log_and_throughput_report_figures(cpu_run):
    _, summary, out = cpu_run
    stages = by_name(summary)
    assert stages["parse_log"]["rows"] == stages["train_resume"]["total_steps"]
    assert (out / "cli" / "train_metrics.png").stat().st_size > 0
    for name, stage in stages.items():
        if name.startswith("throughput/"):
            assert stage["tokens_per_sec_per_device"] > 0 and stage["steps"] > 0, stage
            assert math.isfinite(stage["mfu"]) and math.isfinite(stage["last_loss"]), stage
            assert (out / "bench" / name.split("/")[1] / "metrics.jsonl").is_file()


def test_a_failed_stage_is_recorded_and_the_next_stage_still_runs(tmp_path):
    proc, summary = run_check(tmp_path, "--cpu", "--only", "tests,bench_data", "--inject", "tests=fail")
    stages = by_name(summary)
    assert list(stages) == ["env", "tests", "bench_data"]
    assert not stages["tests"]["ok"] and "exit 3" in stages["tests"]["error"]
    assert "injected failure" in stages["tests"]["tail"]
    assert stages["bench_data"]["ok"] and stages["env"]["ok"]
    assert proc.returncode == 1 and summary["finished"] and not summary["all_ok"]


def test_a_stage_past_its_timeout_is_stopped_and_the_next_stage_still_runs(tmp_path):
    proc, summary = run_check(tmp_path, "--cpu", "--only", "tests,bench_data", "--inject", "tests=hang",
                              "--timeout", "tests=3")
    stages = by_name(summary)
    assert not stages["tests"]["ok"] and stages["tests"]["error"].startswith("timed out after 3 s")
    assert stages["tests"]["seconds"] < 30 and stages["bench_data"]["ok"]
    assert proc.returncode == 1


def test_summary_is_written_as_each_stage_ends(tmp_path):
    """Killed in the middle of its second stage, the check has already recorded the first."""
    proc = subprocess.Popen(command(tmp_path, "--cpu", "--only", "bench_data", "--inject", "bench_data=hang"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=script_env(),
                            start_new_session=True)
    summary_path, deadline = tmp_path / "summary.json", time.time() + 300
    try:
        while not (summary_path.is_file() and json.loads(summary_path.read_text())["stages"]):
            assert proc.poll() is None and time.time() < deadline, "no stage was recorded"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    summary = json.loads(summary_path.read_text())
    assert [s["name"] for s in summary["stages"]] == ["env"] and summary["stages"][0]["ok"]
    assert summary["finished"] is False


def test_stages_the_budget_cannot_cover_are_listed_as_not_run(tmp_path):
    proc, summary = run_check(tmp_path, "--cpu", "--budget", "2")
    assert summary["stages"] == [] and proc.returncode == 1
    reasons = {r["name"]: r["reason"] for r in summary["not_run"]}
    assert "budget" in reasons["env"] and "needs env" in reasons["convert"]
    assert any(name.startswith("throughput/") for name in reasons)


def test_without_an_accelerator_the_device_check_says_so_and_stops(tmp_path):
    proc, summary = run_check(tmp_path, "--only", "convert")
    env = by_name(summary)["env"]
    assert not env["ok"] and "sees no CUDA or NPU device" in env["error"] and "--cpu" in env["error"]
    assert [r["name"] for r in summary["not_run"]] == ["convert"] and proc.returncode == 1


def write_metrics(run: Path, sequence: list, loss_of) -> None:
    """metrics.jsonl of a run that logged ``sequence``: step numbers, and ("resume", step) events."""
    run.mkdir(parents=True)
    lines = [{"event": "resume", "step": item[1]} if isinstance(item, tuple) else
             {"step": item, "loss": loss_of(item), "tokens_per_sec_per_device": 10.0, "mfu": 0.1, "memory_gib": 1.0}
             for item in sequence]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_the_resume_comparison_catches_one_ulp_and_a_missing_resume(tmp_path):
    from device_check_stages import StageFailed, compare_runs

    loss = {k: 3.0 - 0.1 * k for k in range(1, 7)}
    write_metrics(tmp_path / "ref", list(range(1, 7)), loss.get)
    # stopped after 2, resumed; killed after 4 with a checkpoint at 3, resumed: step 4 is logged twice
    interrupted = [1, 2, ("resume", 2), 3, 4, ("resume", 3), 4, 5, 6]
    write_metrics(tmp_path / "same", interrupted, loss.get)
    figures = compare_runs(tmp_path / "ref", tmp_path / "same", 6)
    assert figures["exact"] and figures["first_run_equal"] and figures["resumed_at"] == [2, 3]
    off = {**loss, 5: float(np.nextafter(loss[5], 10.0))}
    write_metrics(tmp_path / "off", interrupted, off.get)
    with pytest.raises(StageFailed, match="at 1 of 6 steps, first at step 5"):
        compare_runs(tmp_path / "ref", tmp_path / "off", 6)
    write_metrics(tmp_path / "once", [1, 2, ("resume", 2), 3, 4, 5, 6], loss.get)
    with pytest.raises(StageFailed, match="expected two resumes"):
        compare_runs(tmp_path / "ref", tmp_path / "once", 6)


def test_runs_that_differ_before_any_resume_are_compared_within_the_stated_tolerance(tmp_path):
    """Kernels that are not deterministic make the runs differ before any resume; then the resume passes
    within NONDETERMINISTIC_REL_TOL and both figures are reported. A run whose losses are equal before any
    resume leaves no excuse for a difference after it."""
    from device_check_stages import NONDETERMINISTIC_REL_TOL, StageFailed, compare_runs

    loss = {k: 3.0 - 0.1 * k for k in range(1, 7)}
    write_metrics(tmp_path / "ref", list(range(1, 7)), loss.get)
    interrupted = [1, 2, ("resume", 2), 3, 4, ("resume", 3), 4, 5, 6]
    noisy = {k: v * (1 + 1e-4 * k) for k, v in loss.items()}
    write_metrics(tmp_path / "noisy", interrupted, noisy.get)
    figures = compare_runs(tmp_path / "ref", tmp_path / "noisy", 6)
    assert not figures["exact"] and not figures["first_run_equal"]
    assert 0 < figures["first_run_max_rel_diff"] < figures["max_rel_diff"] < NONDETERMINISTIC_REL_TOL
    assert figures["within_tolerance"] == NONDETERMINISTIC_REL_TOL
    lost = {**noisy, 5: noisy[5] * 1.05}  # a resume that lost state: far outside the kernels' noise
    write_metrics(tmp_path / "lost", interrupted, lost.get)
    with pytest.raises(StageFailed, match=r"max relative difference 5\.\d+e-02; before any resume 2\.\d+e-04"):
        compare_runs(tmp_path / "ref", tmp_path / "lost", 6)
    exact_before = {**loss, 5: loss[5] * (1 + 1e-6)}
    write_metrics(tmp_path / "late", interrupted, exact_before.get)
    with pytest.raises(StageFailed, match="first at step 5"):
        compare_runs(tmp_path / "ref", tmp_path / "late", 6)


def test_train_gpu_counts_the_devices_torch_sees_not_nvidia_smi_lines(tmp_path):
    """``nvidia-smi -L`` lists every GPU of the node (and a line per MIG slice) whatever CUDA_VISIBLE_DEVICES
    says; bench/train_gpu.sh asks torch instead. A fake nvidia-smi listing 8 GPUs must not be believed."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA H100 (UUID: GPU-$i)\"; done\n")
    fake.chmod(0o755)
    env = {**script_env(), "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    script = [str(REPO / "bench" / "train_gpu.sh"), "--out", str(tmp_path / "out")]
    dry = subprocess.run(["bash", *script, "--dry-run"], capture_output=True, text=True, timeout=300, env=env)
    assert dry.returncode == 0 and "devices: 0 (none)" in dry.stdout, dry.stdout + dry.stderr
    assert "fsdp8" not in dry.stdout  # the whole-model case is planned from the devices torch counts
    real = subprocess.run(["bash", *script], capture_output=True, text=True, timeout=300, env=env)
    assert real.returncode == 2 and "torch sees no GPU or NPU" in real.stderr, real.stdout + real.stderr


def multi_module():
    import device_check_multi

    return device_check_multi


@pytest.mark.slow
def test_two_gloo_processes_train_like_one_under_tp_2(cpu_run):
    """The multi-device stage's CPU variant: data, the one-device run and tp 2 over two gloo processes, each
    recorded in summary.json with its difference from one device (the other layouts run the same code path
    with other overrides; the whole stage: docs/devices.md). Read from the whole check's run (``cpu_run``),
    which runs these stages as ``--only multi/data,multi/one_device,multi/tp2`` would (--only: the tests above)."""
    _, summary, out = cpu_run
    stages = {name: s for name, s in by_name(summary).items()
              if name in ("env", "multi/data", "multi/one_device", "multi/tp2")}
    assert list(stages) == ["env", "multi/data", "multi/one_device", "multi/tp2"], summary
    assert all(s["ok"] for s in stages.values()), {k: (s.get("error"), s.get("tail", "")[-1500:])
                                                   for k, s in stages.items() if not s["ok"]}
    tp2 = stages["multi/tp2"]
    assert tp2["nproc"] == 2 and tp2["steps"] == [1, 2, 3, 4]
    tol = tp2["tolerance"]
    assert tp2["max_rel_loss_diff"] <= tol["loss"] and tp2["max_rel_grad_norm_diff"] <= tol["grad_norm"]
    # the figures are the runs' own: recomputed from their metrics.jsonl
    got, want = (losses(out / "multi" / f"{n}_metrics.jsonl") for n in ("tp2", "one_device"))
    assert sorted(got) == [1, 2, 3, 4] and got.keys() == want.keys()
    assert tp2["max_rel_loss_diff"] == max(abs(got[k] - want[k]) / abs(want[k]) for k in got)
    log = (out / "multi" / "tp2.log").read_text()
    assert "run start: world 2 | tp 2 pp 1" in log, "the tp2 run's log does not show its layout"


def test_the_comparison_with_one_device_catches_a_loss_or_gradient_off_by_more_than_its_tolerance():
    multi = multi_module()
    from device_check_stages import StageFailed

    want = [{"step": k, "loss": 3.0 - 0.1 * k, "grad_norm": 1.0 + k} for k in range(1, 5)]
    same = [dict(r, loss=r["loss"] * (1 + 1e-6)) for r in want]
    figures = multi.compare(same, want, multi.FP32_TOL, "tp2")
    assert figures["max_rel_loss_diff"] == pytest.approx(1e-6) and figures["max_rel_grad_norm_diff"] == 0
    off = [dict(r, loss=r["loss"] * (1 + 1e-4) if r["step"] == 3 else r["loss"]) for r in want]
    with pytest.raises(StageFailed, match="differs from one device by 1.00e-04 in the loss"):
        multi.compare(off, want, multi.FP32_TOL, "tp2")
    # bf16: a later step may drift by rounding; the first, from the same weights, may not
    assert multi.compare(off, want, multi.BF16_TOL, "ep2")["max_rel_loss_diff"] == pytest.approx(1e-4)
    first_off = [dict(r, grad_norm=r["grad_norm"] * (1 + 3e-3) if r["step"] == 1 else r["grad_norm"]) for r in want]
    with pytest.raises(StageFailed, match=r"3.00e-03 in the gradient norm at the first step \(allowed 1e-03\)"):
        multi.compare(first_off, want, multi.BF16_TOL, "ep2")
    assert multi.compare(first_off[1:], want[1:], multi.BF16_TOL, "ep2")["first_rel_grad_norm_diff"] == 0
    halved = [dict(r, grad_norm=r["grad_norm"] / 2) for r in want]  # a gradient reduced over half the ranks
    with pytest.raises(StageFailed, match="in the gradient norm"):
        multi.compare(halved, want, multi.BF16_TOL, "ep2")
    with pytest.raises(StageFailed, match=r"logged steps \[1, 2, 3\]"):
        multi.compare(want[:3], want, multi.FP32_TOL, "pp2")


def test_with_one_device_the_multi_device_stages_are_skipped_not_failed(tmp_path, monkeypatch):
    """A machine with one GPU runs the single-device stages and lists the multi-device ones as skipped: the
    check passes. Two devices run them; a CPU (--cpu) runs them as gloo processes."""
    multi = multi_module()
    import device_check
    from device_check_stages import CPU_SIZES, Context, Stage

    ctx = Context(mode="device", out=tmp_path, work=tmp_path, sizes=CPU_SIZES, python=sys.executable, injected={},
                  caps={})

    def env(c, deadline):
        c.device, c.device_count = "cuda", 1
        return {}

    staged = [Stage("env", env, 10), *multi.multi_stages(ctx)]
    monkeypatch.setattr(device_check, "stages", lambda c: staged)
    summary = device_check.Summary(tmp_path / "summary.json", {})
    device_check.run_all(ctx, device_check.Budget(time.monotonic() + 60), summary, None)
    assert [s["name"] for s in summary.data["stages"]] == ["env"] and summary.finish()
    assert summary.data["all_ok"] and summary.data["not_run"] == []
    skipped = {r["name"]: r["reason"] for r in summary.data["skipped"]}
    assert set(skipped) == {s.name for s in staged[1:]} and "multi/ep2-moe-bf16" in skipped
    assert skipped["multi/tp2"] == "torch sees 1 cuda device(s); the multi-device runs need 2"
    ctx.device_count = 2
    assert multi.too_few_devices(ctx) is None and "multi/tp2-compile" in {s.name for s in multi.multi_stages(ctx)}
    # two devices: the default budget grows once env has counted them
    staged = [Stage("env", lambda c, deadline: setattr(c, "device_count", 2) or {}, 10)]
    budget = device_check.Budget(time.monotonic() + 60, multi_device_s=100)
    before = budget.end
    device_check.run_all(ctx, budget, device_check.Summary(tmp_path / "two.json", {"budget_s": 60}), None)
    assert budget.end == before + 100 and json.loads((tmp_path / "two.json").read_text())["budget_s"] == 160
    cpu = Context(mode="cpu", out=tmp_path, work=tmp_path, sizes=CPU_SIZES, python=sys.executable, injected={},
                  caps={})
    assert multi.too_few_devices(cpu) is None
    assert not [s.name for s in multi.multi_stages(cpu) if "compile" in s.name]  # inductor's C++ build: device only
