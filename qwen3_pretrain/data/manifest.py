"""A converted data directory's ``manifest.json``: the one module that writes it and reads it.

The converter writes ``shard_NNNNN.bin/.idx`` plus ``manifest.json`` (last: it
is the commit marker); training trusts nothing it has not checked here,
because a wrong tokenizer or a shard cut short by a failed copy otherwise shows
up hours later as a bad loss curve or an index error deep inside a training
step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from qwen3_pretrain.data.indexed_dataset import IndexedDataset
from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.fsutil import write_json_atomic

MANIFEST_NAME = "manifest.json"
FORMAT = "megatron-indexed-dataset"
FORMAT_VERSION = 1
_REQUIRED_KEYS = ("format", "format_version", "dtype", "tokenizer", "num_documents", "num_sequences",
                  "num_tokens", "shards")
_REQUIRED_TOKENIZER_KEYS = ("vocab_size", "eod_id", "sha256")
_REQUIRED_SHARD_KEYS = ("prefix", "num_documents", "num_sequences", "num_tokens")
_CONVERT_HINT = "run 'qwen3-pretrain convert' to produce shards and manifest.json"


@dataclasses.dataclass
class ShardCounts:
    """What one shard (or one rank's piece of it) holds."""

    num_documents: int = 0
    num_sequences: int = 0
    num_tokens: int = 0


def build_manifest(*, dtype: type, tokenizer: dict[str, Any], seq_length: int, shards: list[tuple[str, ShardCounts]],
                   source: dict[str, Any], config: dict[str, Any], elapsed_s: float) -> dict[str, Any]:
    """The manifest of ``shards`` (prefix, counts) in reading order; ``tokenizer`` holds path, sha256,
    vocab_size, eod_id and backend, ``source`` the input's path and size."""
    totals = {key: sum(getattr(c, key) for _, c in shards) for key in ("num_documents", "num_sequences", "num_tokens")}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": np.dtype(dtype).name, "tokenizer": tokenizer,
        "seq_length": seq_length, **totals,
        "shards": [{"prefix": prefix, **dataclasses.asdict(c)} for prefix, c in shards],
        "source": source, "config": config,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "elapsed_s": round(elapsed_s, 3),
    }


def write_manifest(root: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` into ``root`` atomically (a reader sees the whole file or none)."""
    write_json_atomic(Path(root) / MANIFEST_NAME, manifest)


def read_manifest(data_path: str | os.PathLike) -> dict[str, Any]:
    """Load ``data_path/manifest.json`` and check its structure and that every listed shard exists.

    Cheap (reads no shard): this is what every rank does at start-up.
    """
    root = Path(data_path)
    if root.is_file():
        raise UserError(f"data_path {root} is a file; give the folder 'qwen3-pretrain convert' wrote (shard_*.bin/"
                        ".idx and manifest.json)")
    if not root.is_dir():
        words = str(data_path).split()
        blend = ("; a blend of several datasets is written weight first: \"0.7 /data/wiki 0.3 /data/books\""
                 if len(words) > 1 and any(_is_number(w) for w in words) else "")
        raise MissingFileError(f"data_path {root}: no such directory; {_CONVERT_HINT}{blend}")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise MissingFileError(f"{path}: missing, so {root} is not a converted dataset; {_CONVERT_HINT}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc}); re-run the conversion") from None
    _check_structure(manifest, path)
    for shard in manifest["shards"]:
        for suffix in (".idx", ".bin"):
            file = root / (shard["prefix"] + suffix)
            if not file.is_file():
                raise MissingFileError(f"{file}: listed in {path} but missing; copy the whole data "
                                       "directory or re-run the conversion")
    return manifest


def _check_structure(manifest: Any, path: Path) -> None:
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: expected a JSON object; re-run the conversion")
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: unknown format {manifest.get('format')!r} version "
                        f"{manifest.get('format_version')!r}; this reader understands {FORMAT!r} version "
                        f"{FORMAT_VERSION}: re-run the conversion with this version of qwen3-pretrain")
    _require(manifest, _REQUIRED_KEYS, f"{path}")
    if not isinstance(manifest["tokenizer"], dict) or not isinstance(manifest["shards"], list):
        raise UserError(f"{path}: 'tokenizer' must be an object and 'shards' a list; re-run the conversion")
    _require(manifest["tokenizer"], _REQUIRED_TOKENIZER_KEYS, f"{path}: tokenizer")
    for i, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict):
            raise UserError(f"{path}: shards[{i}] must be an object; re-run the conversion")
        _require(shard, _REQUIRED_SHARD_KEYS, f"{path}: shards[{i}]")


def _require(obj: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise UserError(f"{where}: missing key(s) {', '.join(missing)}; re-run the conversion")


def validate_manifest(data_path: str | os.PathLike, model_vocab_size: int,
                      tokenizer_path: str | os.PathLike | None = None,
                      seq_length: int | None = None) -> dict[str, Any]:
    """Check that ``data_path`` is complete and fits the model; return the manifest.

    Checks: manifest present and of a known format; every shard present, its
    ``.bin`` as long as its ``.idx`` says and its counts equal the manifest's;
    the data's tokenizer no larger than ``model_vocab_size``; when
    ``tokenizer_path`` (a tokenizer directory or its ``tokenizer.json``) is
    given, the same tokenizer.json (sha256) the data was converted with; at
    least one token, and at least one sample of ``seq_length + 1`` tokens when
    ``seq_length`` is given. Opens every shard's index, reads no token.
    """
    manifest = read_manifest(data_path)
    manifest_path = Path(data_path) / MANIFEST_NAME
    _check_shards(Path(data_path), manifest)
    _check_vocab(manifest, model_vocab_size)
    if tokenizer_path is not None:
        _check_tokenizer_file(manifest, manifest_path, Path(tokenizer_path))
    _check_token_count(manifest, Path(data_path), seq_length)
    return manifest


def _check_shards(root: Path, manifest: dict[str, Any]) -> None:
    total_sequences = total_tokens = 0
    for shard in manifest["shards"]:
        data = IndexedDataset(root / shard["prefix"])  # raises, naming the .bin, when it is truncated
        if str(data.dtype) != manifest["dtype"]:
            raise UserError(f"{root / shard['prefix']}.idx: dtype {data.dtype} but {MANIFEST_NAME} says "
                            f"{manifest['dtype']}; re-run the conversion")
        found = {"num_sequences": len(data), "num_tokens": data.num_tokens}
        for key, value in found.items():
            if shard[key] != value:
                raise UserError(f"{root / shard['prefix']}.idx: {value} {key[4:]} but {MANIFEST_NAME} says "
                                f"{shard[key]}; the shard does not belong to this manifest: re-run the conversion")
        total_sequences += found["num_sequences"]
        total_tokens += found["num_tokens"]
    for key, value in (("num_sequences", total_sequences), ("num_tokens", total_tokens)):
        if manifest[key] != value:
            raise UserError(f"{root / MANIFEST_NAME}: {key} is {manifest[key]} but its shards hold {value}; "
                            "re-run the conversion")


def _check_vocab(manifest: dict[str, Any], model_vocab_size: int) -> None:
    data_vocab = int(manifest["tokenizer"]["vocab_size"])
    if data_vocab > model_vocab_size:
        raise UserError(f"data was tokenized with a tokenizer of {data_vocab} ids but the model has "
                        f"{model_vocab_size} (vocab_size); use a model whose vocab_size is at least {data_vocab} "
                        "or re-convert the data with the model's tokenizer")


def _check_tokenizer_file(manifest: dict[str, Any], manifest_path: Path, tokenizer_path: Path) -> None:
    file = tokenizer_path / "tokenizer.json" if tokenizer_path.is_dir() else tokenizer_path
    if not file.is_file():
        raise MissingFileError(f"{file}: no such tokenizer file; give a tokenizer directory or its tokenizer.json")
    digest = sha256_file(file)
    expected = str(manifest["tokenizer"]["sha256"])
    if digest != expected:
        data_tokenizer = manifest["tokenizer"].get("path", "?")
        raise UserError(f"tokenizer mismatch: {file} (sha256 {digest[:16]}...) is not the tokenizer the data in "
                        f"{manifest_path} was converted with ({data_tokenizer}, sha256 {expected[:16]}...); "
                        "train with that tokenizer or re-convert the data")


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_token_count(manifest: dict[str, Any], root: Path, seq_length: int | None) -> None:
    num_tokens = int(manifest["num_tokens"])
    if num_tokens == 0:
        raise UserError(f"{root / MANIFEST_NAME}: the dataset holds no tokens; convert a non-empty corpus")
    if seq_length is not None and num_tokens < seq_length + 1:
        raise UserError(f"{root}: {num_tokens} tokens, fewer than one sample of seq_length + 1 = "
                        f"{seq_length + 1}; lower seq_length or convert more text")


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
