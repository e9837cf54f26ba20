"""Helpers of the checkpoint tests: a checkpoint to resume from, a checkpoint's tensors, per-step metrics, a run
killed with SIGKILL and resumed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests._train_helpers import check_ok, child_env, losses, run_train, train_command


def step_dir(output_path: Path, step: int) -> Path:
    return output_path / f"step_{step:07d}"


def resume_from(src: Path, step: int, dst: Path) -> None:
    """Make ``dst`` an output_path whose only (and latest) checkpoint is ``src``'s step ``step``."""
    dst.mkdir(parents=True)
    shutil.copytree(step_dir(src, step), step_dir(dst, step))
    (dst / "latest").write_text(f"step_{step:07d}\n")


def checkpoint_state(path: Path, tmp: Path) -> dict[str, dict[str, Any]]:
    """{"model": {name: tensor}, "optim": {flattened key: value}} of checkpoint directory ``path``, read
    without any of the project's code."""
    flat = tmp / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, flat)
    state = torch.load(flat, weights_only=False)
    flat.unlink()
    return {"model": state["model"], "optim": state["optim"]}


def records(output_path: Path) -> list[tuple[int, float, float]]:
    """(step, loss, grad_norm) of each step the last run in ``output_path`` logged (later records win)."""
    by_step = {}
    for line in (Path(output_path) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            by_step[rec["step"]] = (rec["step"], rec["loss"], rec["grad_norm"])
    return [by_step[k] for k in sorted(by_step)]


def assert_identical_states(want: dict[str, dict[str, Any]], got: dict[str, dict[str, Any]]) -> None:
    """Same keys in "model" and "optim", every tensor bit-identical, every other value equal."""
    for part in ("model", "optim"):
        assert sorted(got[part]) == sorted(want[part]), (part, set(got[part]) ^ set(want[part]))
        for key, value in want[part].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[part][key], value), f"{part}.{key} differs"
            else:
                assert got[part][key] == value, (part, key, got[part][key], value)


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Return once ``step`` is logged; the timeout is generous, as start-up is slow on a busy machine."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.is_file() and any(json.loads(l).get("step", 0) >= step and "loss" in json.loads(l)
                                     for l in metrics.read_text().splitlines() if l.strip()):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.kill()
    raise TimeoutError(f"step {step} never logged in {timeout} s")


def kill_then_resume(cfg, out, kill_after: int, total: int, nproc: int = 1, *overrides: str
                     ) -> subprocess.CompletedProcess:
    """Start ``cfg`` (on ``nproc`` processes), SIGKILL it after step ``kill_after`` of ``total`` (every
    process of the launch at once, as a machine that dies), run it again to the end; the resumed run's
    completed process."""
    proc = subprocess.Popen(train_command(cfg, nproc, *overrides), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=child_env(), start_new_session=True)
    wait_for_step(out / "metrics.jsonl", kill_after, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # Popen does not signal a process that already exited: then the exit code would be 0 and every
    # step logged, and the rest of the test would prove nothing.
    assert proc.returncode == -signal.SIGKILL, f"the run ended (exit {proc.returncode}) before it could be killed"
    assert len(losses(out)) < total, "the run finished before it was killed"
    proc = run_train(cfg, nproc, *overrides, timeout=900)
    check_ok(proc)
    return proc
