"""MediaWiki XML dump -> articles: the dump route of ``wiki2parquet``.

The main process only decompresses and cuts. A reader thread decompresses
(see ``decode_threads``: bzip2 on one thread by the standard library, or on
several by ``indexed_bzip2``; one ordinary stream and the concatenated streams
of a multistream dump alike), beside the main thread, which cuts the XML into
batches of whole pages at ``</page>`` (which cannot occur inside XML text,
where ``<`` is always escaped). Worker processes parse the pages and clean
their wikitext; batches come back in input order, so the output does not
depend on the number of workers or threads. Memory stays bounded: two read
blocks queued, one read buffer and at most two batches per worker in flight.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import itertools
import os
import queue
import re
import sys
import threading
import time
import xml.etree.ElementTree as ET
from contextlib import closing
from html import unescape
from pathlib import Path
from typing import IO, Iterator

import indexed_bzip2
from tqdm import tqdm

from qwen3_pretrain.data.pool import ordered_map, put_unless_stopped
from qwen3_pretrain.convert.wikitext import is_redirect_text, wikitext_to_text
from qwen3_pretrain.errors import UserError

# (id, title, url, text)
Article = tuple[str, str, str, str]
DEFAULT_URL_BASE = "https://en.wikipedia.org/wiki"
# Pages handed to a cleaning worker at a time: big enough to amortize the
# inter-process transfer, small enough to keep every core busy.
CLEAN_BATCH_BYTES = 1 << 20
READ_BYTES = 4 << 20
READ_AHEAD_BLOCKS = 2
_PAGE_END = b"</page>"
_BASE = re.compile(rb"<base>([^<]*)</base>")


@dataclasses.dataclass
class _Batch:
    path: str
    url_base: str
    xml: bytes


@dataclasses.dataclass
class _Cleaned:
    articles: list[Article]
    skipped: int
    pages: int
    xml_bytes: int


def compression(path: Path) -> str | None:
    """``"bz2"``, ``"gzip"`` or None, from the file's first bytes (not its name)."""
    with open(path, "rb") as f:
        magic = f.read(3)
    return "bz2" if magic == b"BZh" else "gzip" if magic[:2] == b"\x1f\x8b" else None


def decode_threads(workers: int) -> int:
    """Threads decompressing bzip2 for ``workers`` cleaning processes.

    One thread decodes on one core more cheaply than two share the work (parallel decoding first
    searches the stream for block starts), and one keeps up with two workers; past that, parallel
    decoding costs about as much CPU per MB as the cleaning, so it gets as many threads as there are
    workers (threads with nothing to decode cost nothing).
    """
    return 1 if workers <= 2 else workers


def open_binary(path: Path, threads: int = 1) -> IO[bytes]:
    """``path`` opened for reading, decompressed when it is bzip2 (on ``threads`` threads) or gzip.

    One bzip2 thread is the standard library's: ``indexed_bzip2`` on one thread keeps the interpreter
    lock while it decodes, which would stall the main thread and the worker pool's own threads.
    """
    kind = compression(path)
    if kind == "bz2":
        return indexed_bzip2.open(str(path), parallelization=threads) if threads > 1 else bz2.open(path, "rb")
    return gzip.open(path, "rb") if kind == "gzip" else open(path, "rb")


# ---------------------------------------------------------------- main process: read and cut

def _read(stream: IO[bytes], path: Path) -> bytes:
    try:
        return stream.read(READ_BYTES)
    except EOFError as exc:
        raise UserError(f"{path}: compressed data ends too early ({exc}); "
                        "the download is incomplete: download it again") from None
    except (OSError, RuntimeError) as exc:  # indexed_bzip2 reports a cut or corrupt stream as RuntimeError
        raise UserError(f"{path}: compressed data ends too early or is corrupt ({exc}); "
                        "download it again") from None


def _read_into(queued: queue.Queue, stop: threading.Event, path: Path, threads: int) -> None:
    """Reader thread: the decompressed blocks of ``path``, then b"" (or the exception that ended it)."""
    def put(item: bytes | BaseException) -> bool:
        return put_unless_stopped(queued, item, stop)

    try:
        with open_binary(path, threads) as stream:
            while put(block := _read(stream, path)) and block:
                pass
    except BaseException as exc:  # raised again in the consuming thread
        put(exc)


def _read_ahead(path: Path, threads: int) -> Iterator[bytes]:
    """The decompressed bytes of ``path`` in blocks, read on a thread of their own so that decompression
    runs beside the cutting (both decompressors let go of the interpreter lock while they decode)."""
    queued: queue.Queue = queue.Queue(maxsize=READ_AHEAD_BLOCKS)
    stop = threading.Event()
    reader = threading.Thread(target=_read_into, args=(queued, stop, path, threads), daemon=True,
                              name="wiki2parquet-read")
    reader.start()
    try:
        while block := queued.get():
            if isinstance(block, BaseException):
                raise block
            yield block
    finally:
        stop.set()
        reader.join()


def _header(blocks: Iterator[bytes], path: Path) -> tuple[bytes, str]:
    """(the bytes read past the ``<siteinfo>`` header, the wiki's URL base)."""
    buffer = b""
    for block in blocks:
        buffer += block
        if b"<page" in buffer or b"</mediawiki>" in buffer:
            break
    start = min(i for i in (buffer.find(b"<page"), buffer.find(b"</mediawiki>"), len(buffer)) if i >= 0)
    head = buffer[:start]
    if b"<mediawiki" not in head:
        raise UserError(f"{path}: not a valid MediaWiki XML dump (no <mediawiki> element before the first page)")
    base = _BASE.search(head)
    url_base = unescape(base[1].decode("utf-8")).strip().rsplit("/", 1)[0] if base else DEFAULT_URL_BASE
    return buffer[start:], url_base


def _batch_end(buffer: bytes, pos: int, eof: bool) -> int:
    """Where the batch that starts at ``pos`` ends (past its last ``</page>``), or -1: more bytes needed."""
    end = buffer.find(_PAGE_END, pos + CLEAN_BATCH_BYTES)
    if end < 0 and eof:
        end = buffer.rfind(_PAGE_END, pos)
    return end + len(_PAGE_END) if end >= 0 else -1


def _page_batches(path: Path, threads: int) -> Iterator[_Batch]:
    """Batches of whole ``<page>`` elements; a batch ends at the first ``</page>`` past CLEAN_BATCH_BYTES,
    so where batches fall depends on the bytes alone."""
    blocks = _read_ahead(path, threads)
    with closing(blocks):
        buffer, url_base = _header(blocks, path)
        pos = 0
        for block in itertools.chain(blocks, [b""]):
            buffer, pos = buffer[pos:] + block, 0
            while (end := _batch_end(buffer, pos, eof=not block)) >= 0:
                yield _Batch(str(path), url_base, buffer[pos:end])
                pos = end
        _check_tail(buffer[pos:], path)


def _check_tail(tail: bytes, path: Path) -> None:
    if b"<page" in tail or b"</mediawiki>" not in tail:
        raise UserError(f"{path}: not a valid MediaWiki XML dump (it ends inside a page or before "
                        "</mediawiki>); the file is corrupt or truncated: download it again")


# ---------------------------------------------------------------- workers: parse and clean

def _page_record(page: ET.Element) -> tuple[str, str, str, bool]:
    """(id, title, wikitext, is_article) of a ``<page>``; last revision wins (history dumps)."""
    revisions = page.findall("revision")
    wikitext = (revisions[-1].findtext("text") if revisions else None) or ""
    is_article = (page.findtext("ns", "0").strip() == "0" and page.find("redirect") is None
                  and not is_redirect_text(wikitext))
    return page.findtext("id", "").strip(), page.findtext("title", ""), wikitext, is_article


def _clean_batch(batch: _Batch) -> _Cleaned:
    # The pages are parsed without the dump's root element, so their tags carry no namespace.
    try:
        root = ET.fromstring(b"<pages>" + batch.xml + b"</pages>")
    except ET.ParseError as exc:
        raise UserError(f"{batch.path}: not a valid MediaWiki XML dump ({exc} in a batch of pages); "
                        "the file is corrupt: download it again") from None
    articles, skipped = [], 0
    for page in root.iterfind("page"):
        page_id, title, wikitext, is_article = _page_record(page)
        if is_article:
            articles.append((page_id, title, f"{batch.url_base}?curid={page_id}", wikitext_to_text(wikitext)))
        else:
            skipped += 1
    return _Cleaned(articles, skipped, len(articles) + skipped, len(batch.xml))


# ---------------------------------------------------------------- the route

@dataclasses.dataclass
class DumpProgress:
    """Pages and MB of XML done; shown as a progress line on stderr."""

    pages: int = 0
    skipped: int = 0
    xml_bytes: int = 0
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def rate(self) -> float:
        return self.xml_bytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)


# The cleaning workers run slightly below this process's priority: when no core is spare, the reader
# thread's decompression, which everything else waits for, then gets a core before they do.
WORKER_NICENESS = 5


def lower_priority() -> None:
    """Pool initializer of the cleaning workers (where the platform has ``nice``)."""
    if hasattr(os, "nice"):
        os.nice(WORKER_NICENESS)


def iter_dump_articles(paths: list[Path], workers: int, progress: DumpProgress | None = None,
                       threads: int = 0) -> Iterator[Article]:
    """Articles of the MediaWiki XML dumps ``paths``, one after the other, cleaned by ``workers`` processes
    and decompressed on ``threads`` threads (0: ``decode_threads(workers)``)."""
    progress = progress or DumpProgress()
    threads = threads or decode_threads(workers)
    with tqdm(unit="page", file=sys.stderr, desc="wiki2parquet", mininterval=1.0,
              dynamic_ncols=True) as bar:
        for path in paths:
            # with one worker the cleaning runs in this process, which keeps its priority
            batches = ordered_map(_clean_batch, _page_batches(path, threads), workers,
                                  initializer=lower_priority if workers > 1 else None)
            with closing(batches):
                for cleaned in batches:
                    progress.pages += cleaned.pages
                    progress.skipped += cleaned.skipped
                    progress.xml_bytes += cleaned.xml_bytes
                    bar.update(cleaned.pages)
                    bar.set_postfix_str(f"{progress.rate():.1f} MB/s of XML", refresh=False)
                    yield from cleaned.articles
