"""Denormal floats on CPU: the gated delta rule and the Qwen3.5 hybrid's training step with denormals flushed
to zero (``cpu_flush_denormal``) or computed, and the delta rule with its decays floored or as it is.

    python bench/denormal_cpu.py kernel --repeats 5     # the delta rule alone, forward + backward
    python bench/denormal_cpu.py train --modes eager,compiled --repeats 2

``kernel``: the project's chunked delta rule on the tiny hybrid's shapes (batch 4, seq 512, 2 key and 4 value
heads of 64) with gates drawn as the model's start (``g = -A softplus(a + 1)``, ``A`` in [1, 16], ``a`` ~
N(0, 0.3)), which send in-chunk decay sums to -1000 and put some pairwise decays in fp32's denormal range.
Four variants: flush off / on x the kernel as it is / with a decay floor (``--floor``, log: the kernel's
masked exponentials patched here to write 0 below it, so that its own decays are never denormal; the
alternative to the flag, measured and not adopted, bench/README.md). Each runs in a fresh process (the flag
must be set before the intra-op threads start: they copy it), alternated ``--repeats`` times, one forward +
backward timed ``--reps`` times per run (median). Accuracy: the output and the five input gradients against a
token-by-token recurrence in fp64 written here, as the largest error over the largest reference value.

``train``: bench/train_cpu.py's tiny Qwen3.5 hybrid (3 Gated DeltaNet layers, 1 full-attention layer; bf16
mixed precision, seq 512 x batch 4), eager and compiled, ``cpu_flush_denormal`` true vs false, alternated:
the median step time and every step's loss (the two settings' losses side by side). By default as
bench/roofline_cpu.py's 1-process rows run it: 1 thread, the vocabulary cut to 16,384 (random tokens) so
that the decoder layers, not the head, hold most of the step; ``--vocab 151936 --threads 2`` is
train_cpu.py's own setting (its Wikipedia sample).

The CPU's name and the load average are printed beside each table: on a shared machine times move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_cpu  # noqa: E402  (the tiny models and the data)

from qwen3_pretrain.cli import PROCESS_ENV_DEFAULTS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQ, K_HEADS, V_HEADS, DIM = 4, 512, 2, 4, 64
FLOOR = -60.0  # e^-60 = 8.8e-27: 19 orders of magnitude under fp32's resolution beside the token's own term


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def header() -> str:
    return (f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, "
            f"load {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")


# --- the delta rule alone ----------------------------------------------------------------------------------

def kernel_inputs(seed: int = 0) -> list[torch.Tensor]:
    """q, k (normalized), v, g, beta as the hybrid's Gated DeltaNet layers feed them at the start of training."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(BATCH, SEQ, K_HEADS, DIM, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(BATCH, SEQ, V_HEADS, DIM, generator=gen)
    a_scale = 1.0 + 15.0 * torch.rand(V_HEADS, generator=gen)
    g = -a_scale * torch.nn.functional.softplus(0.3 * torch.randn(BATCH, SEQ, V_HEADS, generator=gen) + 1.0)
    beta = torch.randn(BATCH, SEQ, V_HEADS, generator=gen).sigmoid()
    return [q, k, v, g, beta]


def recurrence_fp64(q, k, v, g, beta) -> torch.Tensor:
    """The rule token by token in fp64 over all rows and heads at once: ``S *= exp(g)``,
    ``S += beta k (v - S^T k)^T``, ``o = S^T q`` with q scaled by dk ** -0.5 (the kernel's default)."""
    group = V_HEADS // K_HEADS
    q, k = (x.double().repeat_interleave(group, dim=2) for x in (q, k))
    q = q * DIM ** -0.5
    v, g, beta = v.double(), g.double(), beta.double()
    state = torch.zeros(BATCH, V_HEADS, DIM, DIM, dtype=torch.float64)
    out = []
    for t in range(SEQ):
        kt = k[:, t]  # [batch, heads, dk]
        state = state * g[:, t].exp()[..., None, None]
        error = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, kt)
        state = state + beta[:, t][..., None, None] * kt[..., :, None] * error[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1)


def reference(path: Path) -> None:
    """The fp64 output and gradients (for a fixed upstream gradient) of ``kernel_inputs``, saved to ``path``."""
    leaves = [x.double().requires_grad_() for x in kernel_inputs()]
    out = recurrence_fp64(*leaves)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(upstream)
    torch.save({"out": out.detach(), "grads": [x.grad for x in leaves], "upstream": upstream}, path)


def floored_exp(floor: float):
    """The kernel's masked exponential, also 0 where ``x < floor``."""
    def masked_exp(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask & (x >= floor)
        return torch.where(keep, torch.where(keep, x, 0.0).exp(), 0.0)
    return masked_exp


def kernel_worker(flush: bool, floor: float | None, reps: int, ref_path: str) -> dict:
    torch.set_flush_denormal(flush)  # before any parallel kernel: the intra-op threads copy it
    from qwen3_pretrain.models.ops import gated_delta
    from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule

    if floor is not None:
        gated_delta._masked_exp = floored_exp(floor)

    ref = torch.load(ref_path)
    leaves = [x.requires_grad_() for x in kernel_inputs()]
    upstream = ref["upstream"].float()

    def step():
        for x in leaves:
            x.grad = None
        out, _ = chunk_gated_delta_rule(*leaves)
        out.backward(upstream)
        return out

    out = step()  # first touch of the memory, not timed
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    errors = [rel(out.detach(), ref["out"])] + [rel(x.grad, r) for x, r in zip(leaves, ref["grads"])]
    return {"s": statistics.median(times), "errors": errors}


KERNEL_VARIANTS = {"flush off": (False, False), "flush off, floor": (False, True),
                   "flush on": (True, False), "flush on, floor": (True, True)}


def kernel_main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ref_path = Path(tmp) / "ref.pt"
        reference(ref_path)
        results: dict[str, list[dict]] = {name: [] for name in KERNEL_VARIANTS}
        names = list(KERNEL_VARIANTS)
        for i in range(args.repeats):
            for name in names if i % 2 == 0 else reversed(names):
                flush, floored = KERNEL_VARIANTS[name]
                cmd = [sys.executable, __file__, "kernel-worker", "--flush", str(int(flush)), "--reps",
                       str(args.reps), "--ref", str(ref_path), f"--floor={args.floor}", "--floored", str(int(floored))]
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True)
                results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(header())
    print(f"delta rule forward + backward, batch {BATCH} x seq {SEQ}, {K_HEADS}/{V_HEADS} heads of {DIM}, "
          f"{args.threads} thread(s), median of {args.repeats} runs x {args.reps}; decay floor {args.floor}")
    base = statistics.median(r["s"] for r in results[names[0]])
    print("| variant | s | vs flush off | error: out / dq / dk / dv / dg / dbeta (max over max of fp64) |")
    print("|---|---|---|---|")
    for name in names:
        s = statistics.median(r["s"] for r in results[name])
        errors = " / ".join(f"{e:.1e}" for e in results[name][0]["errors"])
        print(f"| {name} | {s:.3f} | x{base / s:.2f} | {errors} |")


# --- the hybrid's training step ----------------------------------------------------------------------------

def train_config(mode: str, flush: bool, data: str, out: str, vocab: int):
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig

    overrides = dict(train_cpu.model_keys("hybrid"), vocab_size=vocab)
    cfg = {"model_name": "qwen3.5-0.8b", "model_overrides": overrides, "data_path": data,
           "output_path": out, "seq_length": train_cpu.SEQ, "batch_size": train_cpu.BATCH, "total_steps": 1000,
           "log_steps": 1000, "save_steps": 0, "learning_rate": 3e-4, "mixed_precision": "bf16",
           "compile": mode == "compiled", "cpu_flush_denormal": flush}
    return from_dict(TrainConfig, cfg, source=f"hybrid {mode} flush={flush}")


def train_worker(mode: str, flush: bool, data: str, out: str, warmup: int, steps: int, vocab: int) -> dict:
    from qwen3_pretrain.train.trainer import Trainer

    trainer = Trainer(train_config(mode, flush, data, out, vocab))
    losses, walls = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        losses.append(trainer.train_step()["loss"])
        if i >= warmup:
            walls.append(time.perf_counter() - start)
    trainer.close()
    return {"s": statistics.median(walls), "walls": walls, "losses": losses}


def train_main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if args.vocab == train_cpu.MODEL["vocab_size"]:
            data = train_cpu.ensure_data(args.data, Path(tmp))
        else:
            from roofline_cpu import synthetic_data

            data = synthetic_data(Path(tmp) / "data", args.vocab)
        for mode in args.modes.split(","):
            sides = (True, False)
            results: dict[bool, list[dict]] = {s: [] for s in sides}
            for i in range(args.repeats):
                for flush in sides if i % 2 == 0 else reversed(sides):
                    out = tempfile.mkdtemp(dir=tmp)
                    cmd = [sys.executable, __file__, "train-worker", "--mode", mode, "--flush", str(int(flush)),
                           "--data", data, "--out", out, "--warmup", str(args.warmup), "--steps", str(args.steps),
                           "--vocab", str(args.vocab)]
                    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
                    for key, value in PROCESS_ENV_DEFAULTS.items():  # as the engine's entry point sets them
                        env.setdefault(key, value)
                    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
                    if proc.returncode:
                        raise RuntimeError(proc.stderr[-3000:])
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                    results[flush].append(r)
                    print(f"{mode} flush={flush} repeat {i}: {r['s']:.3f} s/step, steps {r['walls']}", flush=True)
            on, off = (statistics.median(r["s"] for r in results[s]) for s in sides)
            print(header())
            print(f"hybrid {mode}, bf16, vocab {args.vocab}, {args.threads} thread(s), {args.repeats} runs each, "
                  f"median of {args.steps} steps after {args.warmup}: flush on {on:.3f} s/step, off {off:.3f} "
                  f"s/step: x{off / on:.2f}")
            for s in sides:
                print(f"  losses flush={'on' if s else 'off'}: {results[s][0]['losses']}")
            print(f"  losses equal bitwise: {results[True][0]['losses'] == results[False][0]['losses']}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("kernel", "train", "kernel-worker", "train-worker"))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternated")
    parser.add_argument("--reps", type=int, default=5, help="kernel: timed forward + backward per run")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (kernel: 2, train: 1)")
    parser.add_argument("--vocab", type=int, default=16384, help="train: vocabulary size")
    parser.add_argument("--modes", default="eager,compiled", help="train: comma-separated, of: eager, compiled")
    parser.add_argument("--steps", type=int, default=4, help="train: timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="train: untimed steps first (compilation)")
    parser.add_argument("--data", default=str(REPO / "runs/data/d_convert"))
    parser.add_argument("--flush", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--floor", type=float, default=FLOOR, help="kernel: the floored variants' log decay floor")
    parser.add_argument("--ref", help=argparse.SUPPRESS)
    parser.add_argument("--floored", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = 2 if args.what.startswith("kernel") else 1
    if args.what == "kernel":
        kernel_main(args)
    elif args.what == "train":
        train_main(args)
    elif args.what == "kernel-worker":
        print(json.dumps(kernel_worker(bool(args.flush), args.floor if args.floored else None, args.reps,
                                        args.ref)))
    else:
        print(json.dumps(train_worker(args.mode, bool(args.flush), args.data, args.out, args.warmup, args.steps,
                                       args.vocab)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
