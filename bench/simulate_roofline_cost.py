"""What recording and pricing the op trace costs ``simulate`` at full size: one stage of Qwen3-8B at the
reference layout (8 ranks, tp 4 pp 2, seq 8192, full recompute; examples/pretrain_config.yaml), simulated
with the recorder on and with it off (its ``record`` a no-op), alternated; prints the wall-time ratio
of the medians and the priced step on the 910B.

    PYTHONPATH=. python bench/simulate_roofline_cost.py [--repeats 2] [--device 910b]
"""

from __future__ import annotations

import argparse
import statistics
import time

from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.simulate.roofline.trace import TraceRecorder
from qwen3_pretrain.simulate.run import make_world, simulate_ranks
from qwen3_pretrain.train.config import TrainConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="910b")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    cfg = load_config(TrainConfig, "examples/pretrain_config.yaml", ["model_path=", "rank_size=8"])
    world = make_world(cfg, 8, hardware=args.device)
    record = TraceRecorder.record
    times: dict[str, list[float]] = {"on": [], "off": []}
    result = None
    for _ in range(args.repeats):
        for mode in ("on", "off"):
            TraceRecorder.record = record if mode == "on" else (lambda *a, **k: None)
            start = time.perf_counter()
            out = simulate_ranks(world, [args.rank], jobs=1)[0]
            times[mode].append(time.perf_counter() - start)
            result = out if mode == "on" else result
    TraceRecorder.record = record
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"recorder on {times['on']} s, off {times['off']} s: median ratio {on / off:.2f}")
    for mode in ("eager", "compiled"):
        e = result.roofline[mode]
        print(f"{args.device} rank {args.rank} {mode}: {e['step_s']} s, {e['tokens_per_s_per_device']} tokens/s/device, "
              f"MFU {e['mfu']:.1%}, HFU {e['hfu']:.1%}, {e['breakdown_s']}")
    print(result.roofline["trace"])


if __name__ == "__main__":
    main()
