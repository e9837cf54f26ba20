"""Benchmark of the training data reader: index build time and samples/s.

    python bench/reader.py [--tokens 50e6] [--seq-length 8192] [--samples 3000]

Writes a synthetic data directory of ``--tokens`` tokens (Wikipedia-like
document lengths, long documents cut into pieces as the converter does) to a
temporary directory, then prints: dataset open time (manifest, memory maps,
grouping pieces into documents), one epoch's index build time,
``__getitem__`` samples/s, one global-batch step, and the epoch index build
time at full scale (6M documents, 4B tokens) on in-memory arrays.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from qwen3_pretrain.data.reader import Corpus, GlobalBatchLoader, PackedDataset, build_epoch_index
from qwen3_pretrain.data.synthetic import write_synthetic_dataset

EOD = 151643


def document_lengths(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    """Log-normal lengths with a mean near 650 tokens, roughly English Wikipedia articles."""
    lengths = np.maximum(1, rng.lognormal(mean=5.8, sigma=1.1, size=num_tokens // 300)).astype(np.int64)
    return lengths[: np.searchsorted(np.cumsum(lengths), num_tokens)]


def write_data(path: Path, num_tokens: int, seq_length: int) -> None:
    rng = np.random.default_rng(0)
    lengths = document_lengths(rng, num_tokens)
    flat = rng.integers(0, EOD, int(lengths.sum()), dtype=np.int32)
    docs = np.split(flat, np.cumsum(lengths)[:-1])
    write_synthetic_dataset(path, docs, EOD, docs_per_shard=len(docs) // 4 + 1, max_piece_length=seq_length,
                            vocab_size=151669, seq_length=seq_length)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def bench_files(path: Path, seq_length: int, num_samples: int) -> None:
    ds, t_open = timed(lambda: PackedDataset(path, seq_length))
    print(f"documents {ds.corpus.num_documents:,}  sequences {len(ds.corpus.seq_len):,}  tokens {ds.num_tokens:,}  "
          f"samples/epoch {len(ds):,}")
    print(f"open (manifest, memmaps, pieces -> documents): {t_open * 1e3:.1f} ms")
    _, t_index = timed(lambda: ds.epoch_index(0))
    print(f"epoch index build: {t_index * 1e3:.1f} ms")
    # Consecutive indices, as the loader reads them (each one a shuffled window). CPU time is
    # printed too: on a shared machine it is the steadier figure.
    for label, first in (("first pass", 0), ("second pass", num_samples)):
        cpu = time.process_time()
        _, t = timed(lambda: [ds[i] for i in range(first, first + num_samples)])
        cpu = time.process_time() - cpu
        print(f"__getitem__ ({label}, seq {seq_length}): {num_samples / t:,.0f} samples/s wall "
              f"({num_samples * seq_length / t / 1e6:.1f} M tokens/s), {num_samples / cpu:,.0f} per CPU second")
    loader = GlobalBatchLoader(ds, global_batch_size=64, dp_rank=0, dp_size=8, micro_batch_size=2)
    _, t_step = timed(lambda: next(loader))
    print(f"one step, global batch 64 on dp 8 (8 samples for this rank): {t_step * 1e3:.1f} ms")


def bench_full_scale(seq_length: int, num_docs: int = 6_000_000, num_tokens: int = 4_000_000_000) -> None:
    rng = np.random.default_rng(0)
    doc_len = rng.multinomial(num_tokens - num_docs, np.full(num_docs, 1 / num_docs)) + 1
    ids = np.arange(num_docs, dtype=np.int64)
    corpus = Corpus([], np.zeros(num_docs, np.int32), np.cumsum(doc_len) - doc_len, doc_len, ids,
                    np.ones(num_docs, np.int64), doc_len)
    index, t = timed(lambda: build_epoch_index(corpus, ids, seq_length, np.random.default_rng(1)))
    print(f"epoch index build at {num_docs / 1e6:.0f}M documents, {num_tokens / 1e9:.0f}B tokens, "
          f"{index.num_samples:,} samples of {seq_length}: {t:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=50e6)
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _, t_write = timed(lambda: write_data(Path(tmp), int(args.tokens), args.seq_length))
        print(f"wrote {args.tokens / 1e6:.0f}M synthetic tokens in {t_write:.1f} s")
        bench_files(Path(tmp), args.seq_length, args.samples)
    bench_full_scale(args.seq_length)


if __name__ == "__main__":
    main()
