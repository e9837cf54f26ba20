"""parquet -> tokenized Megatron indexed-dataset shards: the ``convert`` stage.

``qwen3-pretrain convert --config pretain_data_config.yaml [key=value ...]``
writes ``shard_00000.bin/.idx`` ... and, last, ``manifest.json`` into
``output_path``. The input (parquet or JSON lines, see ``convert_input``) is
cut into units of at most ``chunk_size`` documents and ``chunk_bytes`` bytes,
tokenized by ``workers`` processes (ordered, at most two units per worker in
flight, so memory stays bounded), and each document (its tokens, then
``<|endoftext|>``) goes to the shard holding the fewest tokens so far (the
lowest shard index on ties). The rule depends only on the documents and their
order, so the shards are byte-identical whatever the number of workers or how
the input is cut into units.

``manifest.json`` is the commit marker: it is removed before anything else is
touched and written only once every shard is complete, so a run that dies
leaves no manifest (and only ``*.tmp`` files, cleaned by the next run).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import re
import sys
import time
from contextlib import closing
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
from tqdm import tqdm

from qwen3_pretrain.config.loader import field_help, load_config, to_dict
from qwen3_pretrain.data.convert_input import Unit, check_inputs, input_files, units
from qwen3_pretrain.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab
from qwen3_pretrain.data.pool import available_cores, ordered_map
from qwen3_pretrain.data.tokenizer import load_tokenizer
from qwen3_pretrain.errors import ConfigError, UserError
from qwen3_pretrain.parallel.launch import LaunchInfo, detect_launch
from qwen3_pretrain.fsutil import make_dirs, write_json_atomic

MANIFEST = "manifest.json"
FORMAT = "megatron-indexed-dataset"
FORMAT_VERSION = 1
# shard_NNNNN (one process), shard_NNNNN-RRRRR and staging-RRRRR (several ranks, see convert_ranks).
# What torchrun, mpirun and srun export as the number of processes (see parallel.launch.detect_launch).
_WORLD_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
_SHARD_FILE = re.compile(r"^(?:shard_\d{5}(?:-\d{5})?|staging-\d{5})\.(?:bin|idx)(?:\.tmp)?$")


@dataclasses.dataclass
class DataConvertConfig:
    """The data conversion config (``pretain_data_config.yaml``)."""

    input_path: str = field_help(help="parquet or JSON-lines file (.jsonl, also .gz/.zst), a folder of them "
                                      "(searched recursively) or a glob")
    tokenizer_path: str = field_help(help="folder holding tokenizer.json (a HuggingFace model folder) or the file")
    output_path: str = field_help(help="folder for shard_NNNNN.bin/.idx and manifest.json (created if missing)")
    seq_length: int = field_help(8192, help="training sequence length the data is meant for (recorded in "
                                            "the manifest; training checks it)")
    shards: int = field_help(16, help="number of output shards; documents are spread so tokens balance "
                                         "(on several ranks each shard is written as one piece per rank)")
    do_lower_case: bool = field_help(False, help="lower-case the text before tokenizing")
    max_doc_length: int = field_help(100000, help="longest sequence, in tokens (end-of-document token not "
                                                  "counted); a longer document is split into consecutive "
                                                  "sequences of at most this many tokens, none dropped")
    chunk_size: int = field_help(5000, help="most documents per unit of parallel work")
    chunk_bytes: int = field_help(1 << 20, help="most bytes of text per unit of parallel work: a unit ends at "
                                                "chunk_size documents or chunk_bytes bytes, whichever comes "
                                                "first, so every worker gets a share of any input")
    workers: int = field_help(0, help="tokenizing processes; 0 = all available cores")
    text_column: str = field_help("text", help="parquet column (or JSON-lines key) holding the document text")
    append_eod: bool = field_help(True, help="end every document with the end-of-document token "
                                             "(<|endoftext|>, id 151643 for Qwen3)")
    master_addr: str = field_help("127.0.0.1", help="under mpirun with several ranks: host name or address of the "
                                                    "node running rank 0 (torchrun exports its own)")
    master_port: int = field_help(29500, help="under mpirun with several ranks: TCP port rank 0 listens on")
    rank_timeout_s: int = field_help(600, help="with several ranks: a rank that shows no progress for this "
                                               "many seconds while others wait for it stops the run, named in "
                                               "the error (a rank done early waits as long as the others keep "
                                               "making progress)")
    tokenizer_backend: Literal["auto", "fast", "reference"] = field_help(
        "auto", help="fast (tiktoken, exact), reference (the tokenizers library) or auto (fast when it "
                     "can be exact for this tokenizer, else reference)")

    def validate(self) -> None:
        """Raise ConfigError naming the first key whose value cannot work."""
        minimums = {"seq_length": (2, "a training sample needs at least 2 tokens"),
                    "shards": (1, "at least one shard is needed"),
                    "chunk_size": (1, "a unit holds at least one document"),
                    "chunk_bytes": (1, "a unit holds at least one byte"),
                    "max_doc_length": (1, "a sequence holds at least one token"),
                    "workers": (0, "0 means all cores"),
                    "rank_timeout_s": (1, "a wait needs a limit")}
        for key, (minimum, why) in minimums.items():
            value = getattr(self, key)
            if value < minimum:
                raise ConfigError(f"{key}: {value} is too small; give at least {minimum} ({why})")
        for key in ("input_path", "tokenizer_path", "output_path", "text_column"):
            if not str(getattr(self, key)).strip():
                raise ConfigError(f"{key}: is empty; give a value")


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

@dataclasses.dataclass
class _ShardCounts:
    num_documents: int = 0
    num_sequences: int = 0
    num_tokens: int = 0


class _Shards:
    """The open shard writers and the least-loaded (by tokens) document assignment."""

    def __init__(self, prefixes: list[Path], dtype: type, max_doc_length: int, eod: bool) -> None:
        self.writers: list[IndexedDatasetWriter] = []
        try:
            for prefix in prefixes:
                self.writers.append(IndexedDatasetWriter(prefix, dtype))
        except BaseException:
            self.abort()
            raise
        self.counts = [_ShardCounts() for _ in prefixes]
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


def _prepare_output(output: Path, sha256: str) -> None:
    """Check ``output`` may be (re)written with this tokenizer, then clear our previous files from it."""
    if output.exists() and not output.is_dir():
        raise UserError(f"output_path {str(output)!r} is a file; give a folder")
    manifest = output / MANIFEST
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


# ---------------------------------------------------------------- the run

@dataclasses.dataclass
class _Progress:
    empty: int = 0
    text_bytes: int = 0
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def rate(self) -> float:
        return self.text_bytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)


def _tokenize_into(shards: _Shards, cfg: DataConvertConfig, files: list[Path], tokenizer: Any,
                   workers: int, total_docs: int | None, desc: str = "convert", show: bool = True,
                   tick: Callable[[], None] = lambda: None) -> _Progress:
    """Tokenize ``files`` into ``shards`` in input order; ``tick`` is called after each unit of work."""
    progress = _Progress()
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


def _manifest(cfg: DataConvertConfig, tokenizer: Any, dtype: type, shards: list[tuple[str, _ShardCounts]],
              files: list[Path], workers: int, elapsed: float) -> dict[str, Any]:
    totals = {key: sum(getattr(c, key) for _, c in shards)
              for key in ("num_documents", "num_sequences", "num_tokens")}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": np.dtype(dtype).name,
        "tokenizer": {"path": str(Path(cfg.tokenizer_path).resolve()), "sha256": tokenizer.sha256,
                      "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id, "backend": tokenizer.backend},
        "seq_length": cfg.seq_length, **totals,
        "shards": [{"prefix": prefix, **dataclasses.asdict(c)} for prefix, c in shards],
        "source": {"path": str(Path(cfg.input_path).resolve()), "size_bytes": sum(f.stat().st_size for f in files)},
        "config": {**to_dict(cfg), "workers": workers},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed, 3),
    }


def convert(cfg: DataConvertConfig) -> dict[str, Any]:
    """Run the conversion described by ``cfg``; returns the manifest it wrote (on several ranks: rank 0
    returns it, the others an empty dict)."""
    start = time.perf_counter()
    cfg.validate()
    files = input_files(cfg.input_path)
    launch = _launch(cfg)
    if launch is not None:
        # Imported here: the several-rank driver builds on this module's pieces.
        from qwen3_pretrain.data.convert_ranks import convert_on_ranks

        return convert_on_ranks(cfg, files, launch, start)
    total_docs = check_inputs(files, cfg.text_column)
    tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.tokenizer_backend)
    print(_backend_line(tokenizer), file=sys.stderr)
    output, workers = Path(cfg.output_path), cfg.workers or available_cores()
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    _prepare_output(output, tokenizer.sha256)
    shards = _Shards([output / f"shard_{i:05d}" for i in range(cfg.shards)], dtype, cfg.max_doc_length,
                     cfg.append_eod)
    try:
        progress = _tokenize_into(shards, cfg, files, tokenizer, workers, total_docs)
        if not any(c.num_documents for c in shards.counts):
            raise UserError(f"input_path {cfg.input_path!r}: no document has any text; nothing to write")
        kept = shards.finalize()
    except BaseException:
        shards.abort()
        raise
    named = [(f"shard_{i:05d}", shards.counts[i]) for i in kept]
    manifest = _manifest(cfg, tokenizer, dtype, named, files, workers, time.perf_counter() - start)
    write_json_atomic(output / MANIFEST, manifest)
    warn_fewer_shards(manifest)
    print(_summary(manifest, progress, output))
    return manifest


def _launch(cfg: DataConvertConfig) -> LaunchInfo | None:
    """The launch, when a launcher started several processes. Without a launcher's variables the
    environment is left as it is: a conversion called from a program must not make it look launched."""
    if not any(int(os.environ.get(name, "1") or 1) > 1 for name in _WORLD_VARIABLES):
        return None
    launch = detect_launch(cfg.master_addr, cfg.master_port)
    return launch if launch.world_size > 1 else None


def _backend_line(tokenizer: Any) -> str:
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


def _summary(manifest: dict[str, Any], progress: _Progress, output: Path, where: str = "") -> str:
    written, asked = _shards_written(manifest), manifest["config"]["shards"]
    warning = f" (shards: {asked} asked, fewer documents than that)" if written < asked else ""
    return (f"convert: {manifest['num_documents']} documents ({progress.empty} empty skipped), "
            f"{manifest['num_sequences']} sequences, {manifest['num_tokens']} tokens in "
            f"{written} shards{warning}{where}; {progress.text_bytes / 1e6:.1f} MB of text in "
            f"{manifest['elapsed_s']:.1f} s ({progress.text_bytes / 1e6 / max(manifest['elapsed_s'], 1e-3):.1f} MB/s) "
            f"-> {output}")


def _config_help() -> str:
    lines = ["config keys (YAML or key=value):"]
    lines += [f"  {f.name}: {f.metadata['help']}" for f in dataclasses.fields(DataConvertConfig)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``convert --config FILE.yaml [key=value ...]``."""
    parser = argparse.ArgumentParser(prog="convert", description=__doc__.split("\n\n")[0],
                                     epilog=_config_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (e.g. examples/pretain_data_config.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override a config key")
    args = parser.parse_args(argv)
    convert(load_config(DataConvertConfig, args.config, args.overrides))
    return 0
