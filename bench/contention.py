"""The engine against a plain PyTorch loop on a CPU half taken by another process.

    python bench/contention.py --model moe --repeats 3 --steps 3
    python bench/contention.py --model dense --busy 2     # the machine fully taken besides

One busy-loop process (``--busy``) runs for the whole bench; the engine's fp32 1-process run (``fp32``
of bench/train_cpu.py: its defaults, threads set at start-up as the trainer sets them) and the plain
loop (``hf-fp32``: the same tiny Qwen3 / Qwen3-MoE built with transformers, AdamW) alternate,
``--repeats`` times each, and the medians of their median step times give the ratio. The models, the
data and the timing are bench/train_cpu.py's, imported. The issue's bar: engine >= 1.0x the plain loop
in tokens/s with one core of two taken.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_cpu  # noqa: E402  (the bench's models, data and timing)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dense", "moe"), default="moe")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the bench")
    parser.add_argument("--data", default=str(train_cpu.REPO / "runs/data/d_convert"))
    args = parser.parse_args(argv)
    run_args = argparse.Namespace(steps=args.steps, warmup=args.warmup, model=args.model, profile=None)
    sides = ("hf-fp32", "fp32")
    times: dict[str, list[float]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        data = train_cpu.ensure_data(args.data, Path(tmp))
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            for i in range(args.repeats):
                for side in sides if i % 2 == 0 else reversed(sides):
                    run_dir = Path(tmp) / f"r{i}"
                    run_dir.mkdir(exist_ok=True)
                    r = train_cpu.run_variant(side, run_args, data, run_dir)
                    times[side].append(r["wall_s"])
                    print(f"repeat {i} {side}: {r['wall_s']:.3f} s/step (median of {args.steps})", flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    hf, ours = (statistics.median(times[s]) for s in sides)
    print(f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores, {args.busy} busy process(es), "
          f"model {args.model} fp32, load {os.getloadavg()[0]:.1f}")
    print(f"plain loop (hf-fp32): {hf:.3f} s/step; engine (fp32): {ours:.3f} s/step; "
          f"engine/plain tokens/s x{hf / ours:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
