"""The engine against a plain PyTorch loop on a CPU half taken by another process, and what moves the
engine's speed there.

    python bench/contention.py --model moe --repeats 3 --steps 3
    python bench/contention.py --settings plain,default,1t,passive,spin0,loop,no-prefetch --repeats 2
    python bench/contention.py --busy 0 --settings default,passive      # the same on an idle machine
    python bench/contention.py --model dense --busy 2     # the machine fully taken besides

``--busy`` busy-loop processes (``while True: pass``) run for the whole bench, each pinned to one core with
``--pin-busy`` (else the scheduler places them). The settings alternate, ``--repeats`` times each, in fresh
processes, and the medians of their median step times give the ratios:

- ``plain``: the plain loop (``hf-fp32`` of bench/train_cpu.py: the same tiny Qwen3 / Qwen3-MoE built with
  transformers, AdamW, 2 threads), as train_cpu.py runs it;
- ``default``: the engine's 1-process run as its entry point and trainer set it up (bench/train_cpu.py's
  ``fp32`` or ``bf16`` config, ``--dtype``: 2 intra-op threads, fixed at start-up, MKL dynamic off, the entry
  point's environment defaults; OpenMP's own waiting: idle workers poll up to ``GOMP_SPINCOUNT`` times,
  300,000 by default, before they sleep);
- ``1t``: the same with 1 intra-op thread (``OMP_NUM_THREADS=1``);
- ``passive`` / ``spin0``: OpenMP's idle threads sleep at once instead of spinning first
  (``OMP_WAIT_POLICY=PASSIVE``; ``GOMP_SPINCOUNT=0``: torch's OpenMP here is GNU libgomp, see
  ``torch.__config__.parallel_info()``; ``KMP_BLOCKTIME`` is Intel's runtime's and libgomp ignores it);
- ``spin30k`` / ``spin3k``: a shorter poll before sleeping (``GOMP_SPINCOUNT`` 30,000 / 3,000);
- ``loop`` / ``grouped``: the fp32 experts as one matmul per expert / one ``torch._grouped_mm`` per projection,
  whatever the CPU rule chooses (models/ops/moe.py ``cpu_grouped_fp32``; MoE only);
- ``no-prefetch``: the batches read in the training thread instead of the prefetch thread.

The models, the data and the step timing are bench/train_cpu.py's, imported. The issue's bar: engine >= 1.0x
the plain loop in tokens/s with one core of two taken.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_cpu  # noqa: E402  (the bench's models, data and timing)

from qwen3_pretrain.cli import PROCESS_ENV_DEFAULTS  # noqa: E402

# name -> (intra-op threads, environment, what the worker changes in the engine)
SETTINGS = {
    "default": (2, {}, None),
    "spin30k": (2, {"GOMP_SPINCOUNT": "30000"}, None),
    "spin3k": (2, {"GOMP_SPINCOUNT": "3000"}, None),
    "1t": (1, {}, None),
    "passive": (2, {"OMP_WAIT_POLICY": "PASSIVE"}, None),
    "spin0": (2, {"GOMP_SPINCOUNT": "0"}, None),
    "loop": (2, {}, "loop"),
    "grouped": (2, {}, "grouped"),
    "no-prefetch": (2, {}, "no-prefetch"),
}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


class InlineBatches:
    """The trainer's loader without its prefetch thread: each step's batches read when asked for."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.loader)

    def __getattr__(self, name):  # consumed_samples, bad_token, state_dict
        return getattr(self.loader, name)

    def close(self) -> None:
        pass


def worker(args: argparse.Namespace) -> None:
    """One engine run of ``args.worker``'s setting; its result as json in ``args.out``."""
    _, _, change = SETTINGS[args.worker]
    chosen = []
    if change in ("loop", "grouped"):
        from qwen3_pretrain.models.ops import moe

        def rule(flags=None) -> bool:
            chosen.append(change)
            return change == "grouped"

        moe.cpu_grouped_fp32 = rule
    from qwen3_pretrain.train.trainer import Trainer

    trainer = Trainer(train_cpu.engine_config(args.dtype, args.data, str(Path(args.out) / "run"), args.model))
    if change in ("loop", "grouped") and not chosen:
        raise SystemExit("the expert kernel rule was not consulted: the setting would measure nothing")
    if change == "no-prefetch":
        trainer.loader.close()
        trainer.loader = InlineBatches(trainer.loader.loader)
    result = train_cpu.timed_steps(lambda: trainer.train_step()["loss"], args.warmup, args.steps)
    trainer.close()
    Path(args.out, "result.json").write_text(json.dumps(result))


def run_setting(name: str, args: argparse.Namespace, data: str, tmp: Path) -> list[float]:
    """The timed steps' seconds of one run of setting ``name`` (``plain``: train_cpu's plain loop, its
    median only)."""
    if name == "plain":
        run_args = argparse.Namespace(steps=args.steps, warmup=args.warmup, model=args.model, profile=None)
        return [train_cpu.run_variant(f"hf-{args.dtype}", run_args, data, tmp)["wall_s"]]
    threads, extra, _ = SETTINGS[name]
    out = Path(tempfile.mkdtemp(prefix=f"{name}_", dir=tmp))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **extra)
    for key, value in PROCESS_ENV_DEFAULTS.items():  # as the engine's entry point sets them
        env.setdefault(key, value)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--data", data, "--out", str(out),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model, "--dtype", args.dtype]
    proc = subprocess.run(cmd, cwd=train_cpu.REPO, env=env, text=True, capture_output=True)
    if proc.returncode:
        raise RuntimeError(f"setting {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())["wall_s"]


def start_busy(count: int, pin: bool) -> list[subprocess.Popen]:
    cores = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(count):
        core = {cores[-1 - i % len(cores)]} if pin else None
        procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                      preexec_fn=(lambda c=core: os.sched_setaffinity(0, c)) if pin else None))
    return procs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dense", "moe"), default="moe")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the engine's mixed_precision (the plain loop: hf-fp32 or its autocast hf-bf16)")
    parser.add_argument("--settings", default="plain,default",
                        help=f"comma-separated, of: plain, {', '.join(SETTINGS)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting, interleaved")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the bench")
    parser.add_argument("--pin-busy", action="store_true", help="each busy process on one core (the last ones)")
    parser.add_argument("--data", default=str(train_cpu.REPO / "runs/data/d_convert"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = args.settings.split(",")
    times: dict[str, list[float]] = {s: [] for s in names}  # per run, its median step
    steps: dict[str, list[float]] = {s: [] for s in names}  # every timed step of every run
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        data = train_cpu.ensure_data(args.data, Path(tmp))
        busy = start_busy(args.busy, args.pin_busy)
        try:
            for i in range(args.repeats):
                for name in names if i % 2 == 0 else list(reversed(names)):
                    run_dir = Path(tmp) / f"r{i}"
                    run_dir.mkdir(exist_ok=True)
                    run = run_setting(name, args, data, run_dir)
                    steps[name] += run
                    times[name].append(statistics.median(run))
                    loads.append(os.getloadavg()[0])
                    print(f"repeat {i} {name}: {times[name][-1]:.3f} s/step (median of {args.steps})", flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    pinned = ", pinned" if args.pin_busy and args.busy else ""
    print(f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores, {args.busy} busy process(es){pinned}, "
          f"model {args.model} {args.dtype}, load {min(loads):.1f}-{max(loads):.1f}")
    medians = {name: statistics.median(times[name]) for name in names}
    print("| setting | s/step (runs) | p90/p50 of all steps | tokens/s vs plain loop | vs default |")
    print("|---|---|---|---|---|")
    for name in names:
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        plain = f"x{medians['plain'] / medians[name]:.2f}" if "plain" in medians else "-"
        default = f"x{medians['default'] / medians[name]:.2f}" if "default" in medians else "-"
        spread = f"{train_cpu.spread(steps[name]):.2f}" if name != "plain" else "-"  # the plain loop: medians only
        print(f"| {name} | {medians[name]:.3f} ({runs}) | {spread} | {plain} | {default} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
