"""MediaWiki XML dump -> articles: the dump route of ``wiki2parquet``.

The main process only decompresses and cuts: bzip2 is decoded by
``indexed_bzip2`` on ``workers`` threads (one ordinary stream and the
concatenated streams of a multistream dump alike), and the XML is cut into
batches of whole pages at ``</page>`` (which cannot occur inside XML text,
where ``<`` is always escaped). Worker processes parse the pages and clean
their wikitext; batches come back in input order, so the output does not
depend on the number of workers. Memory stays bounded: one read buffer and at
most two batches per worker in flight.
"""

from __future__ import annotations

import dataclasses
import gzip
import re
import sys
import time
import xml.etree.ElementTree as ET
from contextlib import closing
from html import unescape
from pathlib import Path
from typing import IO, Iterator

import indexed_bzip2
from tqdm import tqdm

from qwen3_pretrain.data.pool import ordered_map
from qwen3_pretrain.data.wikitext import is_redirect_text, wikitext_to_text
from qwen3_pretrain.errors import UserError

# (id, title, url, text)
Article = tuple[str, str, str, str]
DEFAULT_URL_BASE = "https://en.wikipedia.org/wiki"
# Pages handed to a cleaning worker at a time: big enough to amortize the
# inter-process transfer, small enough to keep every core busy.
CLEAN_BATCH_BYTES = 1 << 20
READ_BYTES = 4 << 20
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


def open_binary(path: Path, threads: int = 1) -> IO[bytes]:
    """``path`` opened for reading, decompressed when it is bzip2 (on ``threads`` threads) or gzip."""
    kind = compression(path)
    if kind == "bz2":
        return indexed_bzip2.open(str(path), parallelization=max(threads, 1))
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


def _header(stream: IO[bytes], path: Path) -> tuple[bytes, str]:
    """(the bytes read past the ``<siteinfo>`` header, the wiki's URL base)."""
    buffer = b""
    while b"<page" not in buffer and b"</mediawiki>" not in buffer:
        block = _read(stream, path)
        if not block:
            break
        buffer += block
    start = min(i for i in (buffer.find(b"<page"), buffer.find(b"</mediawiki>"), len(buffer)) if i >= 0)
    head = buffer[:start]
    if b"<mediawiki" not in head:
        raise UserError(f"{path}: not a valid MediaWiki XML dump (no <mediawiki> element before the first page)")
    base = _BASE.search(head)
    url_base = unescape(base[1].decode("utf-8")).strip().rsplit("/", 1)[0] if base else DEFAULT_URL_BASE
    return buffer[start:], url_base


def _page_batches(path: Path, threads: int) -> Iterator[_Batch]:
    """Batches of whole ``<page>`` elements; a batch ends at the first ``</page>`` past CLEAN_BATCH_BYTES,
    so where batches fall depends on the bytes alone."""
    with open_binary(path, threads) as stream:
        buffer, url_base = _header(stream, path)
        pos, eof = 0, False
        while not eof:
            block = _read(stream, path)
            eof = not block
            buffer = buffer[pos:] + block
            pos = 0
            while True:
                end = buffer.find(_PAGE_END, pos + CLEAN_BATCH_BYTES)
                if end < 0 and eof:
                    end = buffer.rfind(_PAGE_END, pos)
                if end < 0:
                    break
                yield _Batch(str(path), url_base, buffer[pos:end + len(_PAGE_END)])
                pos = end + len(_PAGE_END)
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


def iter_dump_articles(paths: list[Path], workers: int, progress: DumpProgress | None = None) -> Iterator[Article]:
    """Articles of the MediaWiki XML dumps ``paths``, one after the other, cleaned by ``workers`` processes."""
    progress = progress or DumpProgress()
    with tqdm(unit="page", file=sys.stderr, desc="wiki2parquet", mininterval=1.0,
              dynamic_ncols=True) as bar:
        for path in paths:
            batches = ordered_map(_clean_batch, _page_batches(path, workers), workers)
            with closing(batches):
                for cleaned in batches:
                    progress.pages += cleaned.pages
                    progress.skipped += cleaned.skipped
                    progress.xml_bytes += cleaned.xml_bytes
                    bar.update(cleaned.pages)
                    bar.set_postfix_str(f"{progress.rate():.1f} MB/s of XML", refresh=False)
                    yield from cleaned.articles
