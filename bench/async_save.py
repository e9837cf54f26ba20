"""How long an asynchronous checkpoint save holds training up: the copy of the state into host memory.

Saves a model's weights and AdamW state several times with ``Checkpointer(async_save=True)`` (host memory
kept across saves; page-locked on CUDA) and with DCP's default stager (fresh memory at every save), in one
process, and prints the time each save blocked. On a CPU both copy CPU to CPU; the difference is the fresh
allocation (page faults) at every save.

    python bench/async_save.py [--params-m 100] [--saves 4] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from qwen3_pretrain.checkpoint.manager import Checkpointer


def _model(params_m: int, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 4096
    rows = params_m * 1_000_000 // width // 4
    model = nn.Sequential(*(nn.Linear(width, rows, bias=False) for _ in range(4))).to(device)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the optimizer state exists: weights + two moments, 12 bytes per parameter
    return model, opt


def _ours(root: Path, model: nn.Module, opt: torch.optim.Optimizer, saves: int) -> list[float]:
    checkpointer = Checkpointer(root, [model], [opt], keep_last_n=1, async_save=True)
    blocked = []
    for step in range(1, saves + 1):
        start = time.perf_counter()
        checkpointer.save(step, {})
        blocked.append(time.perf_counter() - start)
        checkpointer.wait()
    checkpointer.close()
    return blocked


def _default(root: Path, model: nn.Module, opt: torch.optim.Optimizer, saves: int) -> list[float]:
    group = dist.new_group(backend="gloo")
    blocked = []
    for step in range(1, saves + 1):
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(root / f"default_{step}"), process_group=group)
        blocked.append(time.perf_counter() - start)
        future.result()
    return blocked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=int, default=100, help="parameters, in millions")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, opt = _model(args.params_m, args.device)
        with tempfile.TemporaryDirectory() as tmp:
            for name, run in (("dcp default stager", _default), ("kept host memory", _ours)):
                blocked = run(Path(tmp), model, opt, args.saves)
                print(f"{name:20s} blocked per save (s): " + ", ".join(f"{b:.3f}" for b in blocked))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
