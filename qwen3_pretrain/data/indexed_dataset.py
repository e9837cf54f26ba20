"""The Megatron-LM indexed dataset format (``.bin`` + ``.idx``): the one module that owns its bytes.

``.bin`` holds every token id back to back, little-endian, in the recorded
dtype. ``.idx`` (little-endian) holds:

    magic       b"MMIDIDX\\x00\\x00"      9 bytes
    version     <Q = 1
    dtype code  <B                        (int32 = 4 for Qwen's 151,936 vocab)
    num_seqs    <Q
    num_docs    <Q                        (= number of documents + 1)
    seq_lengths int32[num_seqs]
    seq_ptrs    int64[num_seqs]           byte offsets into .bin
    doc_idx     int64[num_docs]           0, then one entry per finished document

This is what ``megatron.core.datasets.indexed_dataset.IndexedDataset`` reads.
A document is one sequence, or several when a long one is split; ``doc_idx``
holds the number of sequences before each document boundary, as Megatron's
builder writes it (``add_item`` per sequence, ``end_document`` per document).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from qwen3_pretrain.errors import MissingFileError, UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8


def dtype_for_vocab(vocab_size: int) -> type:
    """Megatron's rule: uint16 below 65,500 ids, int32 otherwise."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Appends documents to ``prefix.bin`` and writes ``prefix.idx`` on ``finalize``.

    Both files are written under temporary names and renamed into place only
    when complete, so a killed run never leaves a pair that looks finished.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type = np.int32) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self._bin_tmp = self.prefix.with_name(self.prefix.name + ".bin.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_sequence(self, tokens: np.ndarray) -> None:
        """Append one sequence to the current document."""
        if self.dtype.itemsize < 4 and len(tokens) and int(np.max(tokens)) > np.iinfo(self.dtype).max:
            raise UserError(f"{self.prefix}: token id {int(np.max(tokens))} does not fit the shard's "
                            f"{self.dtype.name}; the tokenizer's ids exceed its vocabulary size")
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document (its sequences so far); no-op when it has none."""
        if self._doc_idx[-1] != len(self._lengths):
            self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens: np.ndarray) -> None:
        """Append a document of one sequence."""
        self.add_sequence(tokens)
        self.end_document()

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        self.end_document()
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        idx_tmp = self.prefix.with_name(self.prefix.name + ".idx.tmp")
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())
            f.flush()
            os.fsync(f.fileno())
        # .bin first: an .idx only ever exists beside its complete .bin.
        os.replace(self._bin_tmp, Path(f"{self.prefix}.bin"))
        os.replace(idx_tmp, Path(f"{self.prefix}.idx"))

    def abort(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        for tmp in (self._bin_tmp, self.prefix.with_name(self.prefix.name + ".idx.tmp")):
            tmp.unlink(missing_ok=True)


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin``/``prefix.idx``."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = str(prefix)
        idx_path, bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise MissingFileError(f"{path}: missing; an indexed dataset needs both .bin and .idx")
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or header[: len(MAGIC)] != MAGIC:
            raise UserError(f"{idx_path}: not a Megatron indexed-dataset index (bad magic); re-run the conversion")
        version, code, num_seqs, num_docs = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION or code not in DTYPE_CODES:
            raise UserError(f"{idx_path}: unsupported version {version} or dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + num_seqs * (4 + 8) + num_docs * 8
        if idx_path.stat().st_size != expected:
            raise UserError(f"{idx_path}: truncated or corrupt ({idx_path.stat().st_size} bytes, expected {expected})")
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=num_seqs, offset=off)
        off += num_seqs * 4
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=num_seqs, offset=off)
        off += num_seqs * 8
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=num_docs, offset=off)
        total = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if bin_path.stat().st_size != total:
            raise UserError(f"{bin_path}: {bin_path.stat().st_size} bytes but its .idx describes {total}; "
                            "the shard is truncated or does not belong to this index: re-run the conversion")
        # A plain ndarray view of the map: slicing an np.memmap object costs microseconds per call.
        self.tokens = np.asarray(np.memmap(bin_path, mode="r", dtype=self.dtype)) if total else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence ``index`` from ``offset`` (``length`` of them, or to the end)."""
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        end = start - offset + int(self.sequence_lengths[index]) if length is None else start + length
        return np.asarray(self.tokens[start:end])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)
