"""Small synthetic data directories in the converter's output layout, for tests and benchmarks (test code, so
it lives beside the tests, outside the package).

Real data comes from ``qwen3-pretrain convert``; this writes the same layout
(``shard_NNNNN.bin/.idx`` + ``manifest.json``) from token arrays given
directly, so the reader can be exercised without a tokenizer or a corpus.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from qwen3_pretrain.data.indexed_dataset import IndexedDatasetWriter
from qwen3_pretrain.data.reader_manifest import FORMAT, FORMAT_VERSION, MANIFEST_NAME


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
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": "int32",
        "tokenizer": {"path": "synthetic", "sha256": tokenizer_sha256,
                      "vocab_size": vocab_size or max_id + 1, "eod_id": eod_id, "backend": "synthetic"},
        "seq_length": seq_length,
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_sequences": sum(s["num_sequences"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
        "source": {"path": "synthetic", "size_bytes": 0}, "config": {}, "created": "", "elapsed_s": 0.0,
    }
    tmp = root / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(tmp, root / MANIFEST_NAME)
    return manifest


def _write_shard(prefix: Path, docs: Sequence[np.ndarray], eod_id: int,
                 max_piece_length: int | None) -> dict[str, Any]:
    writer = IndexedDatasetWriter(prefix, dtype=np.int32)
    num_sequences = num_tokens = 0
    for doc in docs:
        tokens = np.append(np.asarray(doc, dtype=np.int32), np.int32(eod_id))
        step = max_piece_length or len(tokens)
        for start in range(0, len(tokens), step):
            writer.add_document(tokens[start:start + step])
            num_sequences += 1
        num_tokens += len(tokens)
    writer.finalize()
    return {"prefix": prefix.name, "num_documents": len(docs), "num_sequences": num_sequences,
            "num_tokens": num_tokens}
