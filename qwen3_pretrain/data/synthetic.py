"""A converted data directory written from token arrays: for tests, benchmarks and experiments that need
the reader without a tokenizer or a corpus.

Real data comes from ``qwen3-pretrain convert``; this writes the same layout
(``shard_NNNNN.bin/.idx`` + ``manifest.json``, through the manifest's one
writer) from token arrays given directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from qwen3_pretrain.data.indexed_dataset import IndexedDatasetWriter
from qwen3_pretrain.data.manifest import ShardCounts, build_manifest, write_manifest


def write_synthetic_dataset(path: str | os.PathLike, docs: Sequence[np.ndarray], eod_id: int, *,
                            docs_per_shard: int | None = None, max_piece_length: int | None = None,
                            vocab_size: int | None = None, tokenizer_sha256: str = "0" * 64,
                            seq_length: int = 8192) -> dict[str, Any]:
    """Write ``docs`` (token arrays without EOD) as a converted data directory; return the manifest.

    Each document gets ``eod_id`` appended, then is cut into pieces of at most
    ``max_piece_length`` tokens (only the last piece ends with EOD), one
    sequence per piece, as the converter does for long documents. Documents go
    ``docs_per_shard`` to a shard (all in one shard by default).
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    per_shard = docs_per_shard or max(1, len(docs))
    shards = [_write_shard(root / f"shard_{i:05d}", docs[start:start + per_shard], eod_id, max_piece_length)
              for i, start in enumerate(range(0, max(1, len(docs)), per_shard))]
    max_id = max([eod_id] + [int(np.max(d)) for d in docs if len(d)])
    tokenizer = {"path": "synthetic", "sha256": tokenizer_sha256, "vocab_size": vocab_size or max_id + 1,
                 "eod_id": eod_id, "backend": "synthetic"}
    manifest = build_manifest(dtype=np.int32, tokenizer=tokenizer, seq_length=seq_length, shards=shards,
                              source={"path": "synthetic", "size_bytes": 0}, config={}, elapsed_s=0.0)
    write_manifest(root, manifest)
    return manifest


def _write_shard(prefix: Path, docs: Sequence[np.ndarray], eod_id: int,
                 max_piece_length: int | None) -> tuple[str, ShardCounts]:
    writer = IndexedDatasetWriter(prefix, dtype=np.int32)
    counts = ShardCounts(num_documents=len(docs))
    for doc in docs:
        tokens = np.append(np.asarray(doc, dtype=np.int32), np.int32(eod_id))
        step = max_piece_length or len(tokens)
        for start in range(0, len(tokens), step):
            writer.add_document(tokens[start:start + step])
            counts.num_sequences += 1
        counts.num_tokens += len(tokens)
    writer.finalize()
    return prefix.name, counts
