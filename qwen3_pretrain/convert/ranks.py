"""``convert`` on several ranks (torchrun or mpirun): the same corpus, tokenized in parallel across nodes.

The sorted input files are cut into one contiguous run per rank, balanced by
bytes (whole files: a rank without a file idles). Every rank tokenizes its run
into a staging dataset in input order. The one-process rule puts each
document on the shard with the fewest tokens so far; that choice depends only
on the token counts before it, so the ranks pass the shard loads along in rank
order (a few integers each) and every rank then knows where each of its
documents would have gone. Rank ``r`` writes those documents to its pieces
``shard_SSSSS-RRRRR`` (shard ``S``, rank ``R``; a piece without documents is
not written), and rank 0 lists the pieces shard by shard, rank by rank, in one
``manifest.json``. Read in manifest order, the pieces are exactly the
one-process shards' sequences, document boundaries included, so the reader
yields the same samples; only the files are cut finer.

Every step ends with the ranks agreeing: a failure on any rank stops all of
them, rank 0 names it, each rank deletes what it wrote and no manifest is
written. Nodes must share ``output_path`` (and see the same input files).

A rank done with a step early may wait hours for the slowest share, so the
waits are not bounded in time but in silence: every rank publishes how far its
work has got (a counter in the rendezvous store, bumped as units are written),
and a waiting rank stops everything, naming the rank, when one that has not
finished the step shows no progress for ``rank_timeout_s`` (killed, stuck, or
its node gone).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from qwen3_pretrain.convert.config import DataConvertConfig
from qwen3_pretrain.convert.inputs import check_inputs
from qwen3_pretrain.convert.shards import (Progress, ShardWriter, backend_line, conversion_manifest, prepare_output,
                                           summary, tokenize_into, warn_fewer_shards)
from qwen3_pretrain.convert.tokenizer import load_tokenizer
from qwen3_pretrain.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab
from qwen3_pretrain.data.manifest import ShardCounts, write_manifest
from qwen3_pretrain.data.pool import available_cores
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.parallel.env import destroy, init_process_group
from qwen3_pretrain.parallel.launch import LaunchInfo

T = TypeVar("T")
_INIT_TIMEOUT_S = 300
_MARKER = ".convert-ranks"


class _Stop(Exception):
    """Another rank failed (rank 0 prints why); this rank stops without a message of its own."""


def split_files(sizes: list[int], world: int) -> list[range]:
    """Contiguous runs of file indices, one per rank, each ending where the running byte count is
    nearest to the rank's share of the total; in file order, so rank order is input order."""
    cumulative = np.concatenate([[0], np.cumsum(sizes, dtype=np.float64)])
    ends, previous = [], 0
    for rank in range(1, world):
        target = cumulative[-1] * rank / world
        end = int(np.argmin(np.abs(cumulative - target)))  # first of equally near: earlier boundary
        previous = max(previous, end)
        ends.append(previous)
    bounds = [0, *ends, len(sizes)]
    return [range(bounds[r], bounds[r + 1]) for r in range(world)]


class Liveness:
    """Each rank's progress, published in the rendezvous store, and waits on the other ranks that give up
    only on one that has gone silent.

    Each rank keeps one status key: its progress count (``tick()``, cheap: an integer increment, bumped as
    work is done and while it waits on another rank, alive) and the steps it has answered (``post``). A
    thread publishes the status every ``beat_s`` seconds while it changes. A waiting rank reads every
    rank's status in one store call per poll, returns the answers once the ranks it waits for have
    posted them, and raises a UserError naming the ranks whose count has not moved for ``timeout_s``
    while they had not posted.
    """

    def __init__(self, store: dist.Store, info: LaunchInfo, timeout_s: float, beat_s: float = 2.0) -> None:
        self.store, self.info, self.timeout_s, self.beat_s = store, info, timeout_s, beat_s
        self.count = 0
        self.posted: list[str] = []
        self._lock = threading.Lock()  # the status key is written by the thread and by post()
        self._publish_status()  # exists before any rank reads it (the first collective comes after)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publish, name="convert-progress", daemon=True)
        self._thread.start()

    def tick(self) -> None:
        self.count += 1

    def _key(self, rank: int) -> str:
        return f"status/{rank}"

    def _publish_status(self) -> None:
        with self._lock:
            self.store.set(self._key(self.info.rank), json.dumps([self.count, self.posted]))

    def _publish(self) -> None:
        published = self.count
        while not self._stop.wait(self.beat_s):
            if self.count != published:
                published = self.count
                try:
                    self._publish_status()
                except Exception:  # the store is gone: the main thread finds out itself
                    return

    def close(self, linger_s: float = 60.0) -> None:
        """Stop publishing; then rank 0, whose process holds the store under mpirun, waits (at most
        ``linger_s``) until every rank is done reading from it before it may exit."""
        self._stop.set()
        self._thread.join(timeout=2 * self.beat_s)
        try:
            self.store.add("closed", 1)
            deadline = time.monotonic() + linger_s
            while self.info.rank == 0 and self.store.add("closed", 0) < self.info.world_size \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # the store is gone: nobody is left to read from it
            pass

    def post(self, step: str, answer: Any) -> None:
        """This rank's answer to ``step`` (any JSON value), for the others to read."""
        self.tick()
        self.store.set(f"{step}/{self.info.rank}", json.dumps(answer))
        self.posted.append(step)
        self._publish_status()

    def wait_for_all(self, step: str, poll_s: float = 0.5) -> list[Any]:
        """Every rank's answer to ``step``, in rank order."""
        return self._wait(step, list(range(self.info.world_size)), poll_s)

    def wait_for(self, rank: int, step: str, poll_s: float = 0.5) -> Any:
        """Rank ``rank``'s answer to ``step``."""
        return self._wait(step, [rank], poll_s)[0]

    def _wait(self, step: str, ranks: list[int], poll_s: float) -> list[Any]:
        last_seen: dict[int, tuple[int, float]] = {}
        while True:
            statuses = [json.loads(v) for v in self._read([self._key(r) for r in ranks])]
            waiting = [(r, count) for r, (count, posted) in zip(ranks, statuses) if step not in posted]
            if not waiting:
                return [json.loads(v) for v in self._read([f"{step}/{r}" for r in ranks])]
            now = time.monotonic()
            silent = []
            for r, count in waiting:
                if r not in last_seen or last_seen[r][0] != count:
                    last_seen[r] = (count, now)
                elif now - last_seen[r][1] >= self.timeout_s:
                    silent.append(r)
            if silent:
                names = ", ".join(f"rank {r} of {self.info.world_size}" for r in silent)
                raise UserError(f"{names} made no progress for {self.timeout_s:g} s (rank_timeout_s) before "
                                f"finishing the step '{step}' that rank {self.info.rank} waits for: its process is "
                                "stuck or gone (killed, out of memory, its node down; see that rank's output). "
                                "Every rank stops; raise rank_timeout_s if that rank's work was just slow")
            self.tick()  # waiting on a live rank is progress: the ranks waiting on this one keep waiting
            time.sleep(poll_s)

    def _read(self, keys: list[str]) -> list[bytes]:
        try:
            return self.store.multi_get(keys)
        except Exception as exc:  # the process holding the store has ended
            raise UserError(f"lost the rendezvous store ({exc}): the process holding it (rank 0 under mpirun, "
                            "torchrun's agent under torchrun) has stopped; see its output") from None


def _agree(step: Callable[[], T], info: LaunchInfo, live: Liveness, name: str) -> T:
    """Run ``step`` here, then learn whether it worked on every rank; on a failure anywhere every rank
    raises: rank 0 a UserError naming the rank(s) and their message, the others ``_Stop``."""
    result, problem = None, None
    try:
        result = step()
    except _Stop:  # stopped by another rank's failure within the step: that rank names it
        problem = ""
    except UserError as exc:
        problem = str(exc)
    except Exception as exc:  # a bug: its traceback stays on the rank that hit it
        traceback.print_exc()
        problem = f"{type(exc).__name__}: {exc}"
    live.post(name, problem)
    problems = live.wait_for_all(name)
    if all(p is None for p in problems):
        return result  # type: ignore[return-value]
    if info.rank == 0:
        raise UserError("; ".join(f"rank {rank} of {info.world_size} stopped the conversion: {p}"
                                  for rank, p in enumerate(problems) if p))
    raise _Stop


@dataclasses.dataclass
class _Rank:
    """What one rank has: its files, the tokenizer, its staging and piece writers."""

    cfg: DataConvertConfig
    info: LaunchInfo
    files: list[Path]
    all_files: list[Path]
    tokenizer: Any = None
    total_docs: int | None = None
    staging: ShardWriter | None = None
    pieces: list[IndexedDatasetWriter] = dataclasses.field(default_factory=list)
    written: list[Path] = dataclasses.field(default_factory=list)
    tick: Callable[[], None] = lambda: None  # marks progress (``Liveness.tick``)

    @property
    def output(self) -> Path:
        return Path(self.cfg.output_path)

    def staging_prefix(self) -> Path:
        return self.output / f"staging-{self.info.rank:05d}"

    def cleanup(self) -> None:
        for writer in ([*self.staging.writers] if self.staging else []) + self.pieces:
            writer.abort()
        for prefix in [self.staging_prefix(), *self.written]:
            for suffix in (".bin", ".idx"):
                Path(f"{prefix}{suffix}").unlink(missing_ok=True)


def _start(rank: _Rank, nonce: str) -> tuple[str, list[tuple[str, int]]]:
    """Check this rank's inputs and load the tokenizer; rank 0 prepares the output. What every rank
    must agree on comes back: the tokenizer's hash and the input files with their sizes."""
    rank.total_docs = check_inputs(rank.files, rank.cfg.text_column)
    rank.tokenizer = load_tokenizer(rank.cfg.tokenizer_path, rank.cfg.tokenizer_backend)
    if rank.info.rank == 0:
        print(backend_line(rank.tokenizer), file=sys.stderr)
        prepare_output(rank.output, rank.tokenizer.sha256)
        (rank.output / _MARKER).write_text(nonce)
    return rank.tokenizer.sha256, [(str(f), f.stat().st_size) for f in rank.all_files]


def _check_shared(rank: _Rank, nonce: str, views: list[tuple[str, list[tuple[str, int]]]]) -> None:
    """Every rank sees the tokenizer, the input files and the output folder rank 0 sees."""
    mine, first = views[rank.info.rank], views[0]
    if mine[0] != first[0]:
        raise UserError(f"tokenizer_path {rank.cfg.tokenizer_path!r}: this rank's tokenizer.json differs from rank "
                        "0's; every node must see the same files at the same paths (a shared filesystem)")
    if mine[1] != first[1]:
        raise UserError(f"input_path {rank.cfg.input_path!r}: this rank sees other files (or sizes) than rank 0; "
                        "every node must see the same files at the same paths (a shared filesystem)")
    marker = rank.output / _MARKER
    if not marker.is_file() or marker.read_text() != nonce:
        raise UserError(f"output_path {str(rank.output)!r} is not the folder rank 0 prepared (no {_MARKER} "
                        "from rank 0 there): every node must see output_path on a shared filesystem")


def _tokenize(rank: _Rank) -> Progress:
    """This rank's files, tokenized into its staging dataset in input order."""
    dtype = dtype_for_vocab(rank.tokenizer.vocab_size)
    rank.staging = ShardWriter([rank.staging_prefix()], dtype, rank.cfg.max_doc_length, rank.cfg.append_eod)
    workers = rank.cfg.workers or available_cores()
    desc = f"convert (rank 0's share of {rank.info.world_size})"
    progress = tokenize_into(rank.staging, rank.cfg, rank.files, rank.tokenizer, workers, rank.total_docs, desc,
                              show=rank.info.rank == 0, tick=rank.tick)
    rank.staging.finalize(drop_empty=False)  # a rank without documents stages an empty dataset
    return progress


def _assign(rank: _Rank, live: Liveness) -> np.ndarray:
    """Each staged document's shard under the one-process rule, continuing from the loads the ranks
    before this one left (through the store, waited for like a step); the loads after this rank's
    documents go on to the next rank. A rank that fails here, or gets no loads because one before it
    failed, passes None on, so that every rank reaches the step's agreement."""
    loads: list[int] | None = [0] * rank.cfg.shards
    try:
        staged = IndexedDataset(rank.staging_prefix())
        doc_tokens = _staged_documents(staged)[1]
        if rank.info.rank > 0:
            loads = live.wait_for(rank.info.rank - 1, "loads")
            if loads is None:
                raise _Stop
        heap = [(int(tokens), index) for index, tokens in enumerate(loads)]
        heapq.heapify(heap)  # the minimum of distinct (tokens, index) pairs is the same however they are held
        shards = np.empty(len(doc_tokens), dtype=np.int64)
        for doc, tokens in _numbered(doc_tokens, tick=rank.tick):
            load, index = heap[0]
            shards[doc] = index
            heapq.heapreplace(heap, (load + tokens, index))
        loads = [load for load, _ in sorted(heap, key=lambda pair: pair[1])]
    except BaseException:
        loads = None
        raise
    finally:
        if rank.info.rank + 1 < rank.info.world_size:
            live.post("loads", loads)
    return shards


def _numbered(values: np.ndarray, block: int = 1 << 16,
              tick: Callable[[], None] = lambda: None) -> Iterator[tuple[int, int]]:
    """(position, value) as Python ints, a block at a time (``tick`` after each): a list of every value
    of a large share would hold tens of bytes per document."""
    for start in range(0, len(values), block):
        yield from enumerate(values[start:start + block].tolist(), start)
        tick()


def _staged_documents(staged: IndexedDataset) -> tuple[np.ndarray, np.ndarray]:
    """(first sequence, tokens) of every staged document."""
    first = np.asarray(staged.document_indices[:-1], dtype=np.int64)
    lengths = staged.sequence_lengths.astype(np.int64)
    tokens = np.add.reduceat(lengths, first) if len(first) else np.zeros(0, np.int64)
    return first, tokens


def _write_pieces(rank: _Rank, staged: IndexedDataset, shards: np.ndarray) -> list[tuple[str, ShardCounts]]:
    """Copy the staged documents into this rank's pieces; the pieces that got documents, by shard."""
    prefixes = [rank.output / f"shard_{s:05d}-{rank.info.rank:05d}" for s in range(rank.cfg.shards)]
    rank.pieces = [IndexedDatasetWriter(p, staged.dtype) for p in prefixes]
    counts = [ShardCounts() for _ in prefixes]
    bounds = np.asarray(staged.document_indices, dtype=np.int64)
    for doc, shard in _numbered(shards, block=1 << 12, tick=rank.tick):
        for seq in range(int(bounds[doc]), int(bounds[doc + 1])):
            piece = staged.get(seq)
            rank.pieces[shard].add_sequence(piece)
            counts[shard].num_sequences += 1
            counts[shard].num_tokens += len(piece)
        rank.pieces[shard].end_document()
        counts[shard].num_documents += 1
    named = []
    for prefix, writer, count in zip(prefixes, rank.pieces, counts):
        if count.num_documents:
            writer.finalize()
            rank.written.append(prefix)
            named.append((prefix.name, count))
        else:
            writer.abort()
    return named


def _place(rank: _Rank, live: Liveness) -> list[tuple[str, ShardCounts]]:
    shards = _assign(rank, live)
    staged = IndexedDataset(rank.staging_prefix())
    named = _write_pieces(rank, staged, shards)
    del staged  # its memory maps, before the files go
    for suffix in (".bin", ".idx"):
        Path(f"{rank.staging_prefix()}{suffix}").unlink()
    return named


def _finish(rank: _Rank, gathered: list[tuple[list[tuple[str, ShardCounts]], Progress]],
            start: float) -> dict[str, Any] | None:
    """Rank 0: check it sees every piece, then write the one manifest over all of them."""
    if rank.info.rank != 0:
        return None
    pieces = sorted((name, count) for named, _ in gathered for name, count in named)  # shard, then rank
    for name, _ in pieces:
        for suffix in (".bin", ".idx"):
            if not (rank.output / f"{name}{suffix}").is_file():
                raise UserError(f"{rank.output / (name + suffix)}: written by another rank but not visible from "
                                "rank 0; every node must see output_path on a shared filesystem")
    if not pieces:
        raise UserError(f"input_path {rank.cfg.input_path!r}: no document has any text; nothing to write")
    cfg, workers = rank.cfg, rank.cfg.workers or available_cores()
    manifest = conversion_manifest(cfg, rank.tokenizer, dtype_for_vocab(rank.tokenizer.vocab_size), pieces,
                                   rank.all_files, workers, time.perf_counter() - start)
    manifest["ranks"] = rank.info.world_size
    (rank.output / _MARKER).unlink(missing_ok=True)
    write_manifest(rank.output, manifest)
    warn_fewer_shards(manifest)
    progress = Progress(sum(p.empty for _, p in gathered), sum(p.text_bytes for _, p in gathered))
    print(summary(manifest, progress, rank.output, f" from {rank.info.world_size} ranks"))
    return manifest


def convert_on_ranks(cfg: DataConvertConfig, files: list[Path], info: LaunchInfo,
                     start: float) -> dict[str, Any]:
    """Convert ``files`` as rank ``info.rank`` of ``info.world_size``; rank 0 returns the manifest."""
    runs = split_files([f.stat().st_size for f in files], info.world_size)
    rank = _Rank(cfg, info, [files[i] for i in runs[info.rank]], files)
    # Collectives run only once every rank has reached them (the long waits are Liveness's), so the
    # silence limit bounds them as well.
    store = init_process_group(info, torch.device("cpu"), cfg.rank_timeout_s, _INIT_TIMEOUT_S)
    live = Liveness(store or dist.distributed_c10d._get_default_store(), info, cfg.rank_timeout_s)
    rank.tick = live.tick
    try:
        nonce = [uuid.uuid4().hex]
        dist.broadcast_object_list(nonce, src=0)
        view = _agree(lambda: _start(rank, nonce[0]), info, live, "start")
        views: list[Any] = [None] * info.world_size
        dist.all_gather_object(views, view)
        _agree(lambda: _check_shared(rank, nonce[0], views), info, live, "check")
        progress = _agree(lambda: _tokenize(rank), info, live, "tokenize")
        named = _agree(lambda: _place(rank, live), info, live, "place")
        gathered: list[Any] = [None] * info.world_size
        dist.all_gather_object(gathered, (named, progress))
        manifest = _agree(lambda: _finish(rank, gathered, start), info, live, "finish")
    except BaseException as exc:
        rank.cleanup()
        if info.rank == 0:
            (rank.output / _MARKER).unlink(missing_ok=True)
        live.close()
        destroy()
        if isinstance(exc, _Stop):
            raise SystemExit(2) from None
        raise
    live.close()
    destroy()
    return manifest or {}
