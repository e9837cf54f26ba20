"""What recording and pricing the op trace costs ``simulate`` at full size: one rank simulated with the
recorder on and with it off (its ``record`` a no-op), alternated, for a dense, a MoE and a hybrid model:

* ``dense``: Qwen3-8B at the reference layout (8 ranks, tp 4 pp 2, seq 8192, batch 4, full recompute;
  examples/pretrain_config.yaml), stage 0, built for the 910B;
* ``moe``: Qwen3-30B-A3B at its example layout (16 ranks, dp 16, ep 8, seq 4096, batch 2, full recompute;
  examples/qwen3_30b_a3b_16xh100.yaml), rank 0, one micro-batch per step, on the H100;
* ``hybrid``: Qwen3.5-9B at its example layout (8 ranks, tp 2 pp 2 dp 2, seq 4096, selective recompute;
  examples/qwen3.5_9b_8x910b.yaml), stage 0, 2 pipeline micro-batches, on the 910B.

Each simulation runs in a child process (``simulate_ranks``); the figures are its wall time and its CPU
time (user + system, from ``getrusage`` of the reaped children): on a shared machine the CPU time varies far
less than the wall time, which waits for the cores. Prints per case the medians and their ratio (on / off)
and the priced step.

    PYTHONPATH=. python bench/simulate_roofline_cost.py [--cases dense,moe,hybrid] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.simulate.roofline.trace import TraceRecorder
from qwen3_pretrain.simulate.run import make_world, simulate_ranks
from qwen3_pretrain.train.config import TrainConfig

CASES = {
    "dense": ("examples/pretrain_config.yaml", ["model_path="], "910b", 0),
    "moe": ("examples/qwen3_30b_a3b_16xh100.yaml", ["model_path=", "gradient_accumulation_steps=1"], "h100", 0),
    "hybrid": ("examples/qwen3.5_9b_8x910b.yaml", ["model_path=", "batch_size=2"], "910b", 0),
}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(case: str, repeats: int) -> None:
    path, overrides, device, rank = CASES[case]
    cfg = load_config(TrainConfig, path, overrides)
    world = make_world(cfg, cfg.rank_size, hardware=device)
    record = TraceRecorder.record
    wall: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    result = None
    try:
        for _ in range(repeats):
            for mode in ("on", "off"):
                TraceRecorder.record = record if mode == "on" else (lambda *a, **k: None)
                start, start_cpu = time.perf_counter(), children_cpu()
                out = simulate_ranks(world, [rank], jobs=1, extrapolate=False)[0]
                wall[mode].append(round(time.perf_counter() - start, 1))
                cpu[mode].append(round(children_cpu() - start_cpu, 1))
                result = out if mode == "on" else result
    finally:
        TraceRecorder.record = record
    ratio_wall = statistics.median(wall["on"]) / statistics.median(wall["off"])
    ratio_cpu = statistics.median(cpu["on"]) / statistics.median(cpu["off"])
    print(f"{case}: wall on {wall['on']} s, off {wall['off']} s, ratio {ratio_wall:.2f}; CPU on {cpu['on']} s, "
          f"off {cpu['off']} s, ratio {ratio_cpu:.2f} (load {os.getloadavg()[0]:.1f})", flush=True)
    for mode in ("eager", "compiled"):
        e = result.roofline[mode]
        print(f"  {device} rank {rank} {mode}: {e['step_s']} s, {e['tokens_per_s_per_device']} tokens/s/device, "
              f"MFU {e['mfu']:.1%}, HFU {e['hfu']:.1%}, {e['breakdown_s']}")
    print(f"  {result.roofline['trace']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="dense,moe,hybrid")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}", flush=True)
    for case in args.cases.split(","):
        measure(case, args.repeats)


if __name__ == "__main__":
    main()
