"""Wikipedia -> parquet: the ``wiki2parquet`` stage.

Two inputs give the same table (``id``, ``title``, ``url``, ``text``, all strings):

* a MediaWiki XML dump (``.xml`` or ``.xml.bz2``), read as a stream; article
  wikitext is cleaned to plain text in parallel worker processes; redirects
  and pages outside the article namespace (ns 0) are skipped;
* a ``wikiextractor`` output folder (``AA/wiki_00`` ..., optionally ``.bz2``),
  in its ``<doc ...>`` text format or its ``--json`` format.

``text`` is the article body without the title line that wikiextractor's text
format repeats, and without wikiextractor's HTML escaping, so both routes
agree. Articles whose text is empty are dropped and counted. Rows are written
in row groups as they come (memory stays bounded whatever the input size) to
a temporary file that is renamed into place only when complete.
"""

from __future__ import annotations

import argparse
import bz2
import dataclasses
import gzip
import json
import os
import re
import time
import xml.etree.ElementTree as ET
from contextlib import closing
from pathlib import Path
from typing import IO, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from qwen3_pretrain.data.pool import available_cores, ordered_map
from qwen3_pretrain.data.wikitext import is_redirect_text, wikitext_to_text
from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.fsutil import make_dirs

# (id, title, url, text)
Article = tuple[str, str, str, str]
SCHEMA = pa.schema([("id", pa.string()), ("title", pa.string()), ("url", pa.string()), ("text", pa.string())])
DEFAULT_URL_BASE = "https://en.wikipedia.org/wiki"
# A row group is flushed at whichever limit comes first.
ROW_GROUP_ROWS = 20_000
ROW_GROUP_BYTES = 64 << 20
# Pages handed to a cleaning worker at a time: big enough to amortize the
# inter-process transfer, small enough to keep every core busy.
CLEAN_BATCH_BYTES = 1 << 20


@dataclasses.dataclass
class WikiStats:
    """What one conversion did; ``summary()`` is the line printed at the end."""

    articles: int = 0
    empty: int = 0
    skipped: int = 0
    text_bytes: int = 0
    seconds: float = 0.0

    def summary(self, output: Path) -> str:
        """One line: counts, MB of text, seconds, output file."""
        return (f"wiki2parquet: {self.articles} articles, {self.empty} empty dropped, "
                f"{self.skipped} redirects/non-article pages skipped, "
                f"{self.text_bytes / 1e6:.1f} MB of text, {self.seconds:.1f} s -> {output}")


# ---------------------------------------------------------------- opening files

def _compression(path: Path) -> str | None:
    """``"bz2"``, ``"gzip"`` or None, from the file's first bytes (not its name)."""
    with open(path, "rb") as f:
        magic = f.read(3)
    return "bz2" if magic == b"BZh" else "gzip" if magic[:2] == b"\x1f\x8b" else None


def _open_binary(path: Path) -> IO[bytes]:
    """``path`` opened for reading, decompressed when it is bzip2 or gzip."""
    kind = _compression(path)
    if kind == "bz2":
        return bz2.open(path, "rb")
    return gzip.open(path, "rb") if kind == "gzip" else open(path, "rb")


def _read_head(path: Path, size: int = 4096) -> bytes:
    try:
        with _open_binary(path) as f:
            return f.read(size)
    except (OSError, EOFError) as exc:
        raise UserError(f"{path}: cannot be read or decompressed ({exc}); check that the file is complete") from None


def detect_source(path: Path) -> str:
    """``"dump"`` for a MediaWiki XML dump, ``"extracted"`` for wikiextractor output."""
    if not path.exists():
        raise MissingFileError(f"input {str(path)!r} does not exist; give a Wikipedia dump "
                               "(.xml or .xml.bz2) or a wikiextractor output folder")
    if path.is_dir():
        return "extracted"
    head = _read_head(path).lstrip(b"\xef\xbb\xbf \t\r\n")
    if b"<mediawiki" in head:
        return "dump"
    if head.startswith(b"<doc") or head.startswith(b"{"):
        return "extracted"
    raise UserError(f"{path}: neither a MediaWiki XML dump (no <mediawiki> element at the start) "
                    "nor wikiextractor output (<doc ...> or JSON lines)")


# ---------------------------------------------------------------- XML dump route

def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _page_record(page: ET.Element, ns: str) -> tuple[str, str, str, bool]:
    """(id, title, wikitext, is_article) of a ``<page>``; last revision wins (history dumps)."""
    revisions = page.findall(f"{ns}revision")
    wikitext = (revisions[-1].findtext(f"{ns}text") if revisions else None) or ""
    is_article = (page.findtext(f"{ns}ns", "0").strip() == "0" and page.find(f"{ns}redirect") is None
                  and not is_redirect_text(wikitext))
    return page.findtext(f"{ns}id", "").strip(), page.findtext(f"{ns}title", ""), wikitext, is_article


def _iter_pages(path: Path, stats: WikiStats) -> Iterator[tuple[str, str, str, str]]:
    """(id, title, url, wikitext) of each article page, streamed; skipped pages counted."""
    url_base, ns, root = DEFAULT_URL_BASE, "", None
    with _open_binary(path) as stream:
        for event, elem in ET.iterparse(stream, events=("start", "end")):
            if root is None:
                root, ns = elem, elem.tag[: elem.tag.index("}") + 1] if elem.tag.startswith("{") else ""
            if event != "end":
                continue
            tag = _local(elem.tag)
            if tag == "base" and elem.text and "/" in elem.text:
                url_base = elem.text.strip().rsplit("/", 1)[0]
            elif tag == "page":
                page_id, title, wikitext, is_article = _page_record(elem, ns)
                if is_article:
                    yield page_id, title, f"{url_base}?curid={page_id}", wikitext
                else:
                    stats.skipped += 1
                root.clear()  # drop finished pages: memory stays flat over a 90 GB dump


def _batches(pages: Iterable[tuple[str, str, str, str]]) -> Iterator[list[tuple[str, str, str, str]]]:
    batch: list[tuple[str, str, str, str]] = []
    size = 0
    for page in pages:
        batch.append(page)
        size += len(page[3])
        if size >= CLEAN_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _clean_batch(batch: list[tuple[str, str, str, str]]) -> list[Article]:
    return [(pid, title, url, wikitext_to_text(wikitext)) for pid, title, url, wikitext in batch]


def iter_dump_articles(path: Path, stats: WikiStats, workers: int) -> Iterator[Article]:
    """Articles of a MediaWiki XML dump, cleaned to plain text by ``workers`` processes."""
    try:
        with closing(ordered_map(_clean_batch, _batches(_iter_pages(path, stats)), workers)) as cleaned:
            for batch in cleaned:
                yield from batch
    except ET.ParseError as exc:
        raise UserError(f"{path}: not a valid MediaWiki XML dump ({exc}); "
                        "the file is corrupt or truncated: download it again") from None
    except EOFError as exc:
        raise UserError(f"{path}: compressed data ends too early ({exc}); "
                        "the download is incomplete: download it again") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read or decompressed ({exc})") from None


# ---------------------------------------------------------------- wikiextractor route

_DOC = re.compile(r'^<doc id="(?P<id>[^"]*)"(?: revid="[^"]*")? url="(?P<url>[^"]*)" title="(?P<title>[^\n]*)">\n'
                  r"(?P<body>.*?)\n?</doc>$", re.M | re.S)
# wikiextractor escapes exactly these three by default (``--html-safe``).
_ESCAPES = (("&lt;", "<"), ("&gt;", ">"), ("&amp;", "&"))


def _unescape(text: str) -> str:
    for entity, char in _ESCAPES:
        text = text.replace(entity, char)
    return text


def extracted_files(folder: Path) -> list[Path]:
    """wikiextractor's ``wiki_NN`` files (plain or compressed) under ``folder``, in order."""
    if folder.is_file():
        return [folder]
    files = sorted(p for p in folder.rglob("wiki_*") if p.is_file())
    if not files:
        raise UserError(f"{folder}: no wikiextractor files (AA/wiki_00, ...) found; "
                        "give the folder wikiextractor wrote, or the .xml.bz2 dump itself")
    return files


def _read_text(path: Path) -> str:
    with _open_binary(path) as f:
        try:
            data = f.read()
        except (OSError, EOFError) as exc:
            raise UserError(f"{path}: cannot be decompressed ({exc}); extract it again") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = " of the decompressed data" if _compression(path) else ""
        raise UserError(f"{path}: not UTF-8 text: invalid byte 0x{data[exc.start]:02x} at byte offset "
                        f"{exc.start}{where}; fix or re-extract this file") from None


def _parse_doc_format(content: str, path: Path) -> Iterator[Article]:
    found = False
    for match in _DOC.finditer(content):
        found = True
        title, body = _unescape(match["title"]), match["body"]
        first, _, rest = body.partition("\n")
        if _unescape(first) == title:  # the text format repeats the title, then a blank line
            body = rest
        yield match["id"], title, match["url"], _unescape(body).strip()
    if not found and content.strip():
        raise UserError(f"{path}: no <doc id=... url=... title=...> ... </doc> blocks; not wikiextractor output")


def _parse_json_lines(content: str, path: Path) -> Iterator[Article]:
    for lineno, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            yield str(doc["id"]), doc["title"], doc["url"], _unescape(doc["text"]).strip()
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
        except (KeyError, TypeError) as exc:
            raise UserError(f"{path}:{lineno}: a wikiextractor --json line needs the keys "
                            f"id, url, title and text (missing {exc})") from None


def iter_extracted_articles(folder: Path) -> Iterator[Article]:
    """Articles of a wikiextractor output folder (or one of its files), in file order."""
    for path in extracted_files(folder):
        content = _read_text(path)
        parse = _parse_json_lines if content.lstrip().startswith("{") else _parse_doc_format
        yield from parse(content, path)


# ---------------------------------------------------------------- parquet

def _flush(writer: pq.ParquetWriter, rows: list[Article], size: int, stats: WikiStats) -> None:
    columns = list(zip(*rows))
    table = pa.table([pa.array(col, pa.string()) for col in columns], schema=SCHEMA)
    writer.write_table(table, row_group_size=len(rows))
    stats.articles += len(rows)
    stats.text_bytes += size


def _non_empty(articles: Iterable[Article], stats: WikiStats) -> Iterator[Article]:
    for article in articles:
        if article[3]:
            yield article
        else:
            stats.empty += 1


def write_parquet(articles: Iterable[Article], output: Path, stats: WikiStats) -> None:
    """Write non-empty ``articles`` to ``output`` in row groups; atomic (temp file + rename)."""
    make_dirs(output.parent, "the output file's folder")
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        with pq.ParquetWriter(tmp, SCHEMA, compression="zstd") as writer:
            rows: list[Article] = []
            size = 0
            for article in _non_empty(articles, stats):
                rows.append(article)
                size += len(article[3].encode("utf-8"))
                if len(rows) >= ROW_GROUP_ROWS or size >= ROW_GROUP_BYTES:
                    _flush(writer, rows, size, stats)
                    rows, size = [], 0
            if rows:
                _flush(writer, rows, size, stats)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)


def wiki_to_parquet(source: str | os.PathLike, output: str | os.PathLike, workers: int = 0) -> WikiStats:
    """Convert a dump or a wikiextractor folder at ``source`` to the parquet file ``output``."""
    source, output = Path(source), Path(output)
    if output.suffix != ".parquet":
        raise UserError(f"--output {str(output)!r}: give a file name ending in .parquet")
    stats, start = WikiStats(), time.perf_counter()
    if detect_source(source) == "dump":
        articles = iter_dump_articles(source, stats, workers or available_cores())
    else:
        articles = iter_extracted_articles(source)
    write_parquet(articles, output, stats)
    stats.seconds = time.perf_counter() - start
    return stats


def main(argv: list[str]) -> int:
    """``wiki2parquet --input PATH --output FILE.parquet``."""
    parser = argparse.ArgumentParser(prog="wiki2parquet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True,
                        help="Wikipedia dump (.xml or .xml.bz2) or wikiextractor output folder")
    parser.add_argument("--output", required=True, help="parquet file to write")
    parser.add_argument("--workers", type=int, default=0,
                        help="processes cleaning dump wikitext (default: all cores)")
    args = parser.parse_args(argv)
    if args.workers < 0:
        raise UserError(f"--workers {args.workers}: give 0 (all cores) or a positive number")
    stats = wiki_to_parquet(args.input, args.output, args.workers)
    print(stats.summary(Path(args.output)))
    return 0
