"""Helpers of the training tests: a tiny synthetic corpus, a tiny model config, launching the trainer,
reading and comparing what runs logged."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from qwen3_pretrain.data.synthetic import write_synthetic_dataset

TINY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": True}


def make_corpus(path: Path, num_docs: int = 300, vocab: int = 500, eod: int = 511, seed: int = 0) -> Path:
    """Documents of random length whose tokens follow a simple learnable pattern (so the loss falls)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        start, step = rng.integers(0, vocab), rng.integers(1, 4)
        docs.append((start + step * np.arange(rng.integers(20, 300))) % vocab)
    write_synthetic_dataset(path, docs, eod_id=eod, docs_per_shard=100, vocab_size=512)
    return path


# MFU's peak of the test runs: given, so that a run skips the CPU's matmul probe (about 0.5 s of one core
# per launch, while the other ranks wait; hundreds of launches in the suite). The probe runs where a test
# passes peak_tflops=None (test_first_hour.py's torchrun runs) or uses a shipped config (the quickstart, the
# examples, the device check), and tests/test_device_metrics.py times it alone.
TEST_PEAK_TFLOPS = 1.0


def write_config(path: Path, data_path: Path, output_path: Path, **overrides) -> Path:
    cfg = {"model_name": "qwen3-0.6b", "data_path": str(data_path), "output_path": str(output_path),
           "seq_length": 64, "batch_size": 2, "total_steps": 5, "log_steps": 1, "learning_rate": 3e-3,
           "warmup_steps": 1, "mixed_precision": "fp32", "seed": 7, "model_overrides": dict(TINY_MODEL),
           "save_steps": 0, "peak_tflops": TEST_PEAK_TFLOPS}
    cfg.update(overrides)
    path.write_text(yaml.safe_dump(cfg))
    return path


# Sockets of the ports handed out by free_port, kept bound until this test process exits.
_HELD_PORTS: list[socket.socket] = []


def free_port() -> int:
    """A TCP port that no other process can take before the launch this test is about to make uses it.

    Closing a probe socket and passing its port on would leave a window in which any other process
    (a parallel test, an outgoing connection) may take it. Instead the socket stays bound, not
    listening, with SO_REUSEADDR, until the test session ends: the kernel hands the port to no other
    bind or connect, while the rendezvous store (torch's TCPStore, which binds with SO_REUSEADDR too)
    can still listen on it.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    _HELD_PORTS.append(sock)
    return sock.getsockname()[1]


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    return env


def train_command(config: Path, nproc: int = 1, *overrides: str, torchrun: bool = False) -> list[str]:
    """``qwen3-pretrain train`` as one process, or ``nproc`` ranks started by tests/_ranks.py with torchrun's
    environment (``torchrun``: under torchrun itself, for the tests of what torchrun does)."""
    train = ["-m", "qwen3_pretrain", "train", "--config", str(config), *overrides]
    if nproc == 1:
        return [sys.executable, *train]
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), *train]
    return ranks_launch(nproc) + [sys.executable, *train]


def ranks_launch(nproc: int) -> list[str]:
    """The start of a command that runs what follows it as ``nproc`` ranks with torchrun's environment
    (tests/_ranks.py: no agent process importing torch)."""
    return [sys.executable, str(Path(__file__).with_name("_ranks.py")), str(nproc), str(free_port())]


def run_train(config: Path, nproc: int = 1, *overrides: str, timeout: int = 300,
              torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run ``qwen3-pretrain train`` as one process or on ``nproc`` ranks (``train_command``)."""
    return subprocess.run(train_command(config, nproc, *overrides, torchrun=torchrun), capture_output=True,
                          text=True, timeout=timeout, env=child_env())


def step_records(output_path: Path) -> list[dict]:
    """Per-step metrics records (loss, grad_norm, lr, ...) of the last run in ``output_path``, by step
    (later records of a step win)."""
    by_step = {}
    for line in (Path(output_path) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            by_step[rec["step"]] = rec
    return [by_step[k] for k in sorted(by_step)]


def losses(output_path: Path) -> list[float]:
    """Per-step losses of the last run in ``output_path`` (later records of a step win)."""
    return [rec["loss"] for rec in step_records(output_path)]


def worst_relative_diff(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), f"{len(got)} values vs {len(want)}: {got} vs {want}"
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


# fp32 runs that differ only in the order of sums (reductions over ranks and micro-batches, recompute,
# another implementation) agree to ~1e-7 in the loss and ~3e-6 in the gradient norm over 5 steps.
FP32_LOSS_RTOL = 1e-5
FP32_GRAD_RTOL = 3e-5


def assert_same_training(got: list[dict], want: list[dict], rtol: float = FP32_LOSS_RTOL,
                         grad_rtol: float = FP32_GRAD_RTOL, label: str = "") -> None:
    """Loss (within ``rtol``) and gradient norm (within ``grad_rtol``) agree step by step, relative.

    The gradient norm is what shows a gradient scaled by a constant (a missing or doubled
    reduction): AdamW's update is nearly scale-free and clipping caps the rest, so the losses
    alone move only slightly under such a bug.
    """
    assert len(got) == len(want) and got, f"{label}: {len(got)} logged steps vs {len(want)}"
    assert [r["step"] for r in got] == [r["step"] for r in want], (label, got, want)
    for key, tol in (("loss", rtol), ("grad_norm", grad_rtol)):
        worst = worst_relative_diff([r[key] for r in got], [r[key] for r in want])
        print(f"{label}: max relative {key} diff {worst:.2e} (tolerance {tol:.0e})")
        assert worst <= tol, f"{label}: {key} differs by {worst:.2e} > {tol:.0e}: " \
                             f"{[r[key] for r in got]} vs {[r[key] for r in want]}"


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
