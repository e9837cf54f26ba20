"""Time the training thread waits for a step's batches: the plain loader vs the prefetching one.

    python bench/prefetch.py [--seq-length 4096] [--global-batch 32] [--step-ms 50]

Writes a synthetic data directory to a temporary directory, then takes
``--steps`` global batches from each loader, sleeping ``--step-ms`` between
them as a training step would compute, and prints the median time ``next``
took in the training thread.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qwen3_pretrain.data.prefetch import Prefetcher
from qwen3_pretrain.data.reader import GlobalBatchLoader, PackedDataset
from qwen3_pretrain.data.synthetic import write_synthetic_dataset


def median_wait_ms(loader, steps: int, step_s: float) -> float:
    waits = []
    for _ in range(steps):
        start = time.perf_counter()
        next(loader)
        waits.append(time.perf_counter() - start)
        time.sleep(step_s)
    return 1000 * float(np.median(waits[2:]))  # the first steps also start the thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=50.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lengths = np.random.default_rng(0).integers(100, 3000, 4000)
        write_synthetic_dataset(Path(tmp) / "data", [1 + np.arange(n) for n in lengths], 0, docs_per_shard=500,
                                max_piece_length=2048)
        dataset = PackedDataset(Path(tmp) / "data", args.seq_length, seed=1)
        plain = GlobalBatchLoader(dataset, args.global_batch, 0, 1, 4)
        print(f"plain loader: {median_wait_ms(plain, args.steps, args.step_ms / 1000):.2f} ms per step")
        ahead = Prefetcher(GlobalBatchLoader(dataset, args.global_batch, 0, 1, 4), torch.device("cpu"))
        try:
            print(f"prefetcher:   {median_wait_ms(ahead, args.steps, args.step_ms / 1000):.2f} ms per step")
        finally:
            ahead.close()


if __name__ == "__main__":
    main()
