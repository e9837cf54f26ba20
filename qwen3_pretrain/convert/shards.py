"""The shards of a conversion, for one process and several ranks alike: tokenizing workers, the shard
writers with their least-loaded assignment, the output folder's preparation, and the run's summary.

Each document (its tokens, then ``<|endoftext|>``) goes to the shard holding the fewest tokens so far (the
lowest shard index on ties). The rule depends only on the documents and their order, so the shards are
byte-identical whatever the number of workers or how the input is cut into units.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import re
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from qwen3_pretrain.config.loader import to_dict
from qwen3_pretrain.convert.config import DataConvertConfig
from qwen3_pretrain.convert.inputs import Unit, units
from qwen3_pretrain.data.indexed_dataset import IndexedDatasetWriter
from qwen3_pretrain.data.manifest import MANIFEST_NAME, ShardCounts, build_manifest
from qwen3_pretrain.data.pool import ordered_map
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.fsutil import make_dirs

# shard_NNNNN (one process), shard_NNNNN-RRRRR and staging-RRRRR (several ranks, see ranks.py).
_SHARD_FILE = re.compile(r"^(?:shard_\d{5}(?:-\d{5})?|staging-\d{5})\.(?:bin|idx)(?:\.tmp)?$")


# ---------------------------------------------------------------- tokenizing workers

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, lower: bool, eod_id: int | None, column: str, in_pool: bool) -> None:
    if in_pool:  # one process per core already: keep the reference tokenizer from adding threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=tokenizer, lower=lower, eod_id=eod_id, column=column)


def _encode_chunk(unit: Unit) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(tokens of all non-empty documents back to back, their lengths, empty count, text bytes)."""
    # The unit's texts cross the process boundary as Arrow buffers or raw lines: the workers, not the
    # main process, pay for turning them into Python strings.
    texts = unit.documents(_WORKER["column"])
    num_bytes = unit.num_bytes
    docs = [text for text in texts if text]
    if _WORKER["lower"]:
        docs = [text.lower() for text in docs]
    eod_id = _WORKER["eod_id"]
    encoded = _WORKER["tokenizer"].encode_arrays(docs)
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    if eod_id is not None:
        eod = np.array([eod_id], dtype=np.int32)
        encoded = [part for ids in encoded for part in (ids, eod)]
        lengths += 1
    tokens = np.concatenate(encoded, dtype=np.int32, casting="unsafe") if encoded else np.empty(0, np.int32)
    return tokens, lengths, len(texts) - len(docs), num_bytes


# ---------------------------------------------------------------- output

class ShardWriter:
    """The open shard writers and the least-loaded (by tokens) document assignment."""

    def __init__(self, prefixes: list[Path], dtype: type, max_doc_length: int, eod: bool) -> None:
        self.writers: list[IndexedDatasetWriter] = []
        try:
            for prefix in prefixes:
                self.writers.append(IndexedDatasetWriter(prefix, dtype))
        except BaseException:
            self.abort()
            raise
        self.counts = [ShardCounts() for _ in prefixes]
        self._load = [(0, index) for index in range(len(prefixes))]  # heap of (tokens, shard index)
        self._max, self._eod = max_doc_length, int(eod)

    def add(self, doc: np.ndarray) -> bool:
        """Write one document (EOD included when enabled) to the shard with the fewest tokens; False
        (nothing written) for a document without a single token (text a tokenizer normalizes away)."""
        if len(doc) == 0:
            return False
        tokens, index = self._load[0]
        body = len(doc) - self._eod
        for start in range(0, max(body, 1), self._max):  # a lone EOD is a sequence of its own
            end = start + self._max if start + self._max < body else len(doc)  # EOD rides on the last piece
            self.writers[index].add_sequence(doc[start:end])
            self.counts[index].num_sequences += 1
        self.writers[index].end_document()
        self.counts[index].num_documents += 1
        self.counts[index].num_tokens += len(doc)
        heapq.heapreplace(self._load, (tokens + len(doc), index))
        return True

    def finalize(self, drop_empty: bool = True) -> list[int]:
        """Rename the shards into place (all complete by now); the indices of the shards kept. With
        ``drop_empty`` a shard without documents is dropped instead (fewer documents than shards: an empty
        shard is a file Megatron's reader cannot open)."""
        kept = []
        for index, (writer, counts) in enumerate(zip(self.writers, self.counts)):
            if counts.num_documents or not drop_empty:
                writer.finalize()
                kept.append(index)
            else:
                writer.abort()
        return kept

    def abort(self) -> None:
        """Delete every shard's temporary files."""
        for writer in self.writers:
            writer.abort()


def prepare_output(output: Path, sha256: str) -> None:
    """Check ``output`` may be (re)written with this tokenizer, then clear our previous files from it."""
    if output.exists() and not output.is_dir():
        raise UserError(f"output_path {str(output)!r} is a file; give a folder")
    manifest = output / MANIFEST_NAME
    if manifest.is_file():
        try:
            previous = json.loads(manifest.read_text(encoding="utf-8"))["tokenizer"]["sha256"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{manifest}: unreadable; delete output_path {str(output)!r} "
                            "or choose another one") from None
        if previous != sha256:
            raise UserError(f"output_path {str(output)!r} holds shards made with another tokenizer "
                            f"(tokenizer.json sha256 {previous[:12]}..., this one {sha256[:12]}...); "
                            "choose another output_path or delete that folder")
    make_dirs(output, "output_path")
    manifest.unlink(missing_ok=True)  # first: from here on the folder is incomplete
    for path in output.iterdir():
        if _SHARD_FILE.match(path.name):
            path.unlink()


@dataclasses.dataclass
class Progress:
    empty: int = 0
    text_bytes: int = 0
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def rate(self) -> float:
        return self.text_bytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)


def tokenize_into(shards: ShardWriter, cfg: DataConvertConfig, files: list[Path], tokenizer: Any,
                   workers: int, total_docs: int | None, desc: str = "convert", show: bool = True,
                   tick: Callable[[], None] = lambda: None) -> Progress:
    """Tokenize ``files`` into ``shards`` in input order; ``tick`` is called after each unit of work."""
    progress = Progress()
    eod_id = tokenizer.eod_id if cfg.append_eod else None
    encoded = ordered_map(_encode_chunk, units(files, cfg.text_column, cfg.chunk_size, cfg.chunk_bytes), workers,
                          _init_worker, (tokenizer, cfg.do_lower_case, eod_id, cfg.text_column, workers > 1))
    # closing(): on an error the workers stop now, not when the traceback is garbage collected.
    with closing(encoded), tqdm(total=total_docs, unit="doc", unit_scale=True, file=sys.stderr,
                                desc=desc, mininterval=1.0, dynamic_ncols=True, disable=not show) as bar:
        for tokens, lengths, empty, num_bytes in encoded:
            ends = np.cumsum(lengths)
            for start, end in zip(ends - lengths, ends):
                if not shards.add(tokens[start:end]):
                    empty += 1
            progress.empty += empty
            progress.text_bytes += num_bytes
            bar.update(len(lengths) + empty)
            tick()
            bar.set_postfix_str(f"{progress.rate():.1f} MB/s", refresh=False)
    return progress


def backend_line(tokenizer: Any) -> str:
    if tokenizer.backend == "fast":
        return f"tokenizer: fast (tiktoken, same ids as the tokenizers library) from {tokenizer.path}"
    why = f"; the fast path would not be exact: {tokenizer.fallback_reason}" if tokenizer.fallback_reason else ""
    return f"tokenizer: reference (the tokenizers library) from {tokenizer.path}{why}"


def _shards_written(manifest: dict[str, Any]) -> int:
    return len({s["prefix"].split("-")[0] for s in manifest["shards"]})  # a shard of several ranks has pieces


def warn_fewer_shards(manifest: dict[str, Any]) -> None:
    """A warning on stderr when fewer shards than ``shards`` were written (only non-empty shards are)."""
    written, asked = _shards_written(manifest), manifest["config"]["shards"]
    if written < asked:
        print(f"warning: shards: {asked} asked, but the input has only {manifest['num_documents']} documents: "
              f"wrote {written} shards (a shard without documents would be a file Megatron's reader cannot "
              "open); lower shards to silence this", file=sys.stderr)


def summary(manifest: dict[str, Any], progress: Progress, output: Path, where: str = "") -> str:
    written, asked = _shards_written(manifest), manifest["config"]["shards"]
    warning = f" (shards: {asked} asked, fewer documents than that)" if written < asked else ""
    return (f"convert: {manifest['num_documents']} documents ({progress.empty} empty skipped), "
            f"{manifest['num_sequences']} sequences, {manifest['num_tokens']} tokens in "
            f"{written} shards{warning}{where}; {progress.text_bytes / 1e6:.1f} MB of text in "
            f"{manifest['elapsed_s']:.1f} s ({progress.text_bytes / 1e6 / max(manifest['elapsed_s'], 1e-3):.1f} MB/s) "
            f"-> {output}")


def conversion_manifest(cfg: DataConvertConfig, tokenizer: Any, dtype: type, shards: list[tuple[str, ShardCounts]],
                        files: list[Path], workers: int, elapsed: float) -> dict[str, Any]:
    """The manifest of a conversion of ``files`` into ``shards`` (data/manifest.py writes and reads it)."""
    tokenizer_info = {"path": str(Path(cfg.tokenizer_path).resolve()), "sha256": tokenizer.sha256,
                      "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id, "backend": tokenizer.backend}
    source = {"path": str(Path(cfg.input_path).resolve()), "size_bytes": sum(f.stat().st_size for f in files)}
    return build_manifest(dtype=dtype, tokenizer=tokenizer_info, seq_length=cfg.seq_length, shards=shards,
                          source=source, config={**to_dict(cfg), "workers": workers}, elapsed_s=elapsed)
