"""Simulated vs predicted peak memory per pipeline stage, and simulated vs predicted bytes per axis, for
Qwen3-8B/32B layouts from 8 to 512 ranks (``qwen3-pretrain simulate`` underneath).

    PYTHONPATH=. python bench/simulate_scale.py [--jobs 2] [--only NAME]
"""

from __future__ import annotations

import argparse
import time

from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.hardware import get_device
from qwen3_pretrain.plan.step import predict_step
from qwen3_pretrain.simulate.run import make_world, simulate_ranks
from qwen3_pretrain.train.config import TrainConfig

BASE = "examples/pretrain_config.yaml"
CASES = {  # name -> (world size, overrides of the seed config)
    "8b-tp4-pp2": (8, []),
    "8b-tp8": (8, ["tp=8", "pp=1"]),
    "8b-tp4-pp2-dp4": (32, []),
    "32b-tp8-pp4-dp2": (64, ["model_name=qwen3-32b", "tp=8", "pp=4"]),
    "32b-tp8-pp4-dp16": (512, ["model_name=qwen3-32b", "tp=8", "pp=4"]),
}
GiB = 2**30


def run(name: str, jobs: int) -> None:
    world_size, overrides = CASES[name]
    cfg = load_config(TrainConfig, BASE, ["model_path=", f"rank_size={world_size}", *overrides])
    world = make_world(cfg, world_size)
    start = time.perf_counter()
    results = simulate_ranks(world, world.dims.first_rank_of_stages(), jobs=jobs)
    seconds = time.perf_counter() - start
    step = predict_step(world.source.config, world.layout, get_device("h100"))
    for r in results:
        sim, pred = r.peak["total"] / GiB, r.predicted.allocated / GiB
        comm = {a: sum(k.values()) / GiB for a, k in r.comm.items() if a in ("tp", "pp", "dp")}
        print(f"{name:>16} stage {r.coords['pp']}: simulated {sim:6.2f} GiB, planner {pred:6.2f} GiB "
              f"({(pred - sim) / sim:+.1%}); sent GiB/step simulated "
              + ", ".join(f"{a} {v:.2f}" for a, v in sorted(comm.items()))
              + " | planner " + ", ".join(f"{a} {v / GiB:.2f}" for a, v in
                                          sorted(step.comm_bytes_per_stage[r.coords["pp"]].items())))
        planned = {k: v for k, v in r.predicted.gib().items() if k not in ("total", "overhead")}
        print(f"{'':>16} GiB by category at the peak, simulated " + ", ".join(
            f"{k} {v / GiB:.2f}" for k, v in r.peak.items() if k != "total")
            + f" | planner ({r.predicted.moment}) " + ", ".join(f"{k} {v:.2f}" for k, v in planned.items()))
    print(f"{name:>16}: {len(results)} stage(s) simulated in {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", choices=sorted(CASES))
    args = parser.parse_args()
    for name in [args.only] if args.only else CASES:
        run(name, args.jobs)


if __name__ == "__main__":
    main()
