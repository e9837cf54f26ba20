"""The inputs of ``convert``: which files, checked up front, cut into units of parallel work.

Two kinds of file, told apart by name:

* parquet (``*.parquet``): the text is one string column;
* JSON lines (``*.jsonl``, ``*.json``, ``*.ndjson``, each also as ``.gz`` or
  ``.zst``): one JSON object per line, the text under one key.

``input_path`` is a file, a folder (searched recursively: every parquet file,
or, when there is none, every JSON-lines file, as a HuggingFace dataset folder
holds them) or a glob; files are read in sorted path order.

A unit of work ends once it holds ``chunk_size`` documents or ``chunk_bytes``
bytes of text, whichever comes first, so a few large documents spread over all
workers just as many small ones do. Units are cut from the documents' order
alone; where they fall never changes what is written.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
from pathlib import Path
from typing import IO, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from qwen3_pretrain.errors import MissingFileError, UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED_SUFFIXES = ("", ".gz", ".zst")
# Rows per parquet read: a unit gathers reads until full, so this bounds only the memory of one
# read, not the size of a unit.
_READ_ROWS = 256


@dataclasses.dataclass
class Unit:
    """One unit of work: either an Arrow string array (parquet) or raw JSON lines with where they start."""

    num_bytes: int
    texts: pa.Array | None = None
    lines: list[bytes] | None = None
    path: str = ""
    first_line: int = 0

    def documents(self, key: str) -> list[str | None]:
        """The texts (None where a row has none); JSON is parsed here, in the worker."""
        if self.texts is not None:
            return self.texts.to_pylist()
        return [_json_text(line, key, self.path, self.first_line + i)
                for i, line in enumerate(self.lines or []) if line.strip()]


def _json_text(line: bytes, key: str, path: str, lineno: int) -> str | None:
    try:
        record = json.loads(line)
    except ValueError as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise UserError(f"{path}:{lineno}: not a JSON object ({msg}); fix or remove that line") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}:{lineno}: a {type(record).__name__}, not a JSON object; give one object per line")
    if key not in record:
        keys = ", ".join(list(record)[:10])
        raise UserError(f"{path}:{lineno}: no key {key!r} (keys: {keys}); set text_column to the key holding the text")
    text = record[key]
    if text is not None and not isinstance(text, str):
        raise UserError(f"{path}:{lineno}: {key!r} holds a {type(text).__name__}, not text; "
                        "set text_column to a key holding strings")
    return text


# ---------------------------------------------------------------- which files

def file_kind(path: Path) -> str | None:
    """``"parquet"``, ``"jsonl"`` or None, from the file name."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if any(name.endswith(s + c) for s in JSONL_SUFFIXES for c in COMPRESSED_SUFFIXES):
        return "jsonl"
    return None


def _folder_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and file_kind(p))
    parquet = [p for p in files if file_kind(p) == "parquet"]
    return parquet or files


def input_files(input_path: str) -> list[Path]:
    """The files ``input_path`` names: a file, a folder (recursive) or a glob; sorted."""
    path = Path(input_path).expanduser()
    if any(ch in input_path for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    elif path.is_dir():
        files = _folder_files(path)
    elif path.is_file():
        files = [path]
    else:
        raise MissingFileError(f"input_path {input_path!r} does not exist; give a parquet file "
                               "(e.g. from 'qwen3-pretrain wiki2parquet'), a JSON-lines file, a folder of them "
                               "or a glob")
    if not files:
        raise MissingFileError(f"input_path {input_path!r}: no parquet or JSON-lines files there")
    for file in files:
        if file_kind(file) is None:
            raise UserError(f"input_path {input_path!r}: {file} is neither parquet (.parquet) nor JSON lines "
                            "(.jsonl/.json/.ndjson, optionally .gz or .zst); narrow the glob or rename the file")
    return files


def open_parquet(path: Path, column: str) -> pq.ParquetFile:
    """``path`` opened, with ``column`` checked to exist and hold strings."""
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: not a readable parquet file ({exc}); check the file or re-create it") from None
    schema = parquet.schema_arrow
    problem = None
    if column not in schema.names:
        problem = (f"no column {column!r} (columns: {', '.join(schema.names)}); "
                   "set text_column to the one holding the text")
    elif not (pa.types.is_string(schema.field(column).type) or pa.types.is_large_string(schema.field(column).type)):
        problem = f"column {column!r} holds {schema.field(column).type}, not text; set text_column to a string column"
    if problem:
        parquet.close()
        raise UserError(f"{path}: {problem}")
    return parquet


def open_jsonl(path: Path) -> IO[bytes]:
    """``path`` opened for reading lines, decompressed by its suffix (.gz, .zst)."""
    name = path.name.lower()
    try:
        if name.endswith(".gz"):
            return gzip.open(path, "rb")
        if name.endswith(".zst"):
            import zstandard

            raw = open(path, "rb")
            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
        return open(path, "rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot be opened ({exc})") from None


def check_inputs(files: list[Path], column: str) -> int | None:
    """Check every file before any output is touched; the number of documents when known (parquet only)."""
    total: int | None = 0
    for path in files:
        if file_kind(path) == "parquet":
            parquet = open_parquet(path, column)
            total = None if total is None else total + parquet.metadata.num_rows
            parquet.close()
        else:
            _check_jsonl_start(path)
            total = None
    return total


def _check_jsonl_start(path: Path) -> None:
    try:
        with open_jsonl(path) as stream:
            stream.read(1 << 16)
    except (OSError, EOFError) as exc:
        raise UserError(f"{path}: cannot be read or decompressed ({exc}); check that the file is complete") from None
    except Exception as exc:  # zstandard raises its own ZstdError
        raise UserError(f"{path}: cannot be decompressed ({exc}); check that the file is complete") from None


# ---------------------------------------------------------------- cutting into units

class _Cutter:
    """Gathers documents into units: a unit ends at ``max_docs`` documents or ``max_bytes`` bytes."""

    def __init__(self, max_docs: int, max_bytes: int) -> None:
        self.max_docs, self.max_bytes = max_docs, max_bytes
        self.docs, self.bytes = 0, 0

    def take(self, lengths: np.ndarray) -> int:
        """How many of the next documents (byte ``lengths``) the current unit takes; counts them in."""
        room = self.max_docs - self.docs
        cumulative = np.cumsum(lengths[:room])
        # The document that reaches the budget still joins: a unit holds at least one document.
        count = min(int(np.searchsorted(cumulative, self.max_bytes - self.bytes, side="left")) + 1, len(cumulative))
        self.docs += count
        self.bytes += int(cumulative[count - 1]) if count else 0
        return count

    def add(self, num_bytes: int) -> None:
        """Count one more document of ``num_bytes`` bytes into the current unit."""
        self.docs += 1
        self.bytes += num_bytes

    def full(self) -> bool:
        return self.docs >= self.max_docs or self.bytes >= self.max_bytes

    def reset(self) -> int:
        num_bytes, self.docs, self.bytes = self.bytes, 0, 0
        return num_bytes


def _parquet_units(path: Path, column: str, cutter: _Cutter) -> Iterator[Unit]:
    parquet = open_parquet(path, column)
    pending: list[pa.Array] = []
    try:
        # One thread: decoding is a small share of the work, and the cores belong to the tokenizers.
        for batch in parquet.iter_batches(batch_size=min(cutter.max_docs, _READ_ROWS), columns=[column],
                                          use_threads=False):
            texts = batch.column(0)
            lengths = pc.binary_length(texts).fill_null(0).to_numpy(zero_copy_only=False)
            start = 0
            while start < len(texts):
                count = cutter.take(lengths[start:])
                pending.append(texts.slice(start, count))
                start += count
                if cutter.full():
                    yield Unit(cutter.reset(), texts=pa.concat_arrays(pending))
                    pending = []
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: cannot be read past a corrupt part ({exc}); re-create the file") from None
    finally:
        parquet.close()
    if pending:
        yield Unit(cutter.reset(), texts=pa.concat_arrays(pending))


def _jsonl_units(path: Path, cutter: _Cutter) -> Iterator[Unit]:
    lines: list[bytes] = []
    first = 0
    with open_jsonl(path) as stream:
        for lineno, line in enumerate(_read_lines(stream, path), 1):
            if not lines:
                first = lineno
            lines.append(line)  # a blank line stays, so line numbers hold, and is skipped when parsed
            if line.strip():
                cutter.add(len(line))
            if cutter.full():
                yield Unit(cutter.reset(), lines=lines, path=str(path), first_line=first)
                lines = []
    if lines:
        yield Unit(cutter.reset(), lines=lines, path=str(path), first_line=first)


def _read_lines(stream: IO[bytes], path: Path) -> Iterator[bytes]:
    try:
        yield from stream
    except (OSError, EOFError) as exc:
        raise UserError(f"{path}: cannot be read or decompressed ({exc}); check that the file is complete") from None
    except Exception as exc:  # zstandard raises its own ZstdError
        raise UserError(f"{path}: cannot be decompressed ({exc}); check that the file is complete") from None


def units(files: list[Path], column: str, chunk_size: int, chunk_bytes: int) -> Iterator[Unit]:
    """Units of work over ``files``, in order; a unit never spans two files."""
    for path in files:
        cutter = _Cutter(chunk_size, chunk_bytes)
        if file_kind(path) == "parquet":
            yield from _parquet_units(path, column, cutter)
        else:
            yield from _jsonl_units(path, cutter)
