"""Helpers of the training tests: a tiny synthetic corpus, a tiny model config, launching the trainer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from qwen3_pretrain.data.reader_synthetic import write_synthetic_dataset

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


def write_config(path: Path, data_path: Path, output_path: Path, **overrides) -> Path:
    cfg = {"model_name": "qwen3-0.6b", "data_path": str(data_path), "output_path": str(output_path),
           "seq_length": 64, "batch_size": 2, "total_steps": 5, "log_steps": 1, "learning_rate": 3e-3,
           "warmup_steps": 1, "mixed_precision": "fp32", "seed": 7, "model_overrides": dict(TINY_MODEL),
           "save_steps": 0}
    cfg.update(overrides)
    path.write_text(yaml.safe_dump(cfg))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    return env


def run_train(config: Path, nproc: int = 1, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``qwen3-pretrain train`` as one process, or under torchrun with ``nproc`` processes."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "qwen3_pretrain", "train", "--config", str(config), *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), "-m", "qwen3_pretrain", "train", "--config", str(config),
               *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())


def losses(output_path: Path) -> list[float]:
    """Per-step losses of the last run in ``output_path`` (later records of a step win)."""
    by_step = {}
    for line in (Path(output_path) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            by_step[rec["step"]] = rec["loss"]
    return [by_step[k] for k in sorted(by_step)]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
