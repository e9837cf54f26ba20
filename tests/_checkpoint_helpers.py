"""Helpers of the checkpoint tests: a checkpoint to resume from, a checkpoint's tensors, per-step metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


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
