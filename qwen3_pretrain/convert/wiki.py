"""Wikipedia -> parquet: the ``wiki2parquet`` stage.

Two inputs give the same table (``id``, ``title``, ``url``, ``text``, all strings):

* MediaWiki XML dumps (``.xml`` or ``.xml.bz2``, one file, several, the
  dump's ``pages-articlesN.xml-p...`` parts or a glob of them, multistream or
  not), read as a stream, decompressed and cleaned in parallel
  (``wiki_dump``); redirects and pages outside the article namespace (ns 0)
  are skipped;
* a ``wikiextractor`` output folder (``AA/wiki_00`` ..., optionally ``.bz2``),
  in its ``<doc ...>`` text format or its ``--json`` format.

``text`` is the article body without the title line that wikiextractor's text
format repeats, and without wikiextractor's HTML escaping, so both routes
agree. Articles whose text is empty are dropped and counted. Rows are written
in row groups as they come (memory stays bounded whatever the input size) to
a temporary file that is renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.convert.wiki_dump import Article, DumpProgress, compression, iter_dump_articles, open_binary
from qwen3_pretrain.data.pool import available_cores
from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.fsutil import make_dirs

SCHEMA = pa.schema([("id", pa.string()), ("title", pa.string()), ("url", pa.string()), ("text", pa.string())])
# A row group is flushed at whichever limit comes first.
ROW_GROUP_ROWS = 20_000
ROW_GROUP_BYTES = 64 << 20


@dataclasses.dataclass
class WikiStats:
    """What one conversion did; ``summary()`` is the line printed at the end."""

    articles: int = 0
    empty: int = 0
    skipped: int = 0
    text_bytes: int = 0
    xml_bytes: int = 0
    seconds: float = 0.0

    def summary(self, output: Path) -> str:
        """One line: counts, MB of text (and of dump XML, with its rate), seconds, output file."""
        xml = (f" from {self.xml_bytes / 1e6:.1f} MB of XML ({self.xml_bytes / 1e6 / max(self.seconds, 1e-3):.1f} "
               "MB/s)" if self.xml_bytes else "")
        return (f"wiki2parquet: {self.articles} articles, {self.empty} empty dropped, "
                f"{self.skipped} redirects/non-article pages skipped, "
                f"{self.text_bytes / 1e6:.1f} MB of text{xml}, {self.seconds:.1f} s -> {output}")


# ---------------------------------------------------------------- inputs

def _natural_key(path: Path) -> list:
    # A dump's parts sort by number: pages-articles2 before pages-articles10.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def resolve_inputs(inputs: list[str | os.PathLike]) -> list[Path]:
    """The inputs in the order given, each glob expanded to its matches in natural order (part 2 before 10)."""
    paths: list[Path] = []
    for item in inputs:
        text = str(item)
        if any(ch in text for ch in "*?["):
            matches = sorted((Path(p) for p in glob.glob(text, recursive=True)), key=_natural_key)
            if not matches:
                raise MissingFileError(f"input {text!r} matches no file; check the pattern")
            paths += matches
        else:
            paths.append(Path(text))
    return paths


def _read_head(path: Path, size: int = 4096) -> bytes:
    try:
        with open_binary(path) as f:
            return f.read(size)
    except (OSError, EOFError, RuntimeError) as exc:  # indexed_bzip2 raises RuntimeError
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
    with open_binary(path) as f:
        try:
            data = f.read()
        except (OSError, EOFError, RuntimeError) as exc:  # indexed_bzip2 raises RuntimeError
            raise UserError(f"{path}: cannot be decompressed ({exc}); extract it again") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = " of the decompressed data" if compression(path) else ""
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

def _flush(writer: pq.ParquetWriter, rows: list[tuple[str, str, str]], texts: list[bytes], stats: WikiStats) -> None:
    # The texts arrive already encoded (their size was counted): arrow takes bytes as they are, while
    # from str it would encode every text again.
    columns = [pa.array(col, pa.string()) for col in zip(*rows)]
    columns.append(pa.array(texts, pa.binary()).cast(pa.string()))
    writer.write_table(pa.table(columns, schema=SCHEMA), row_group_size=len(rows))
    stats.articles += len(rows)
    stats.text_bytes += sum(map(len, texts))


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
        with _writing(output):
            writer = pq.ParquetWriter(tmp, SCHEMA, compression="zstd")
        with writer:
            rows: list[tuple[str, str, str]] = []  # (id, title, url)
            texts: list[bytes] = []
            size = 0
            for article in _non_empty(articles, stats):
                rows.append(article[:3])
                texts.append(article[3].encode("utf-8"))
                size += len(texts[-1])
                if len(rows) >= ROW_GROUP_ROWS or size >= ROW_GROUP_BYTES:
                    with _writing(output):
                        _flush(writer, rows, texts, stats)
                    rows, texts, size = [], [], 0
            if rows:
                with _writing(output):
                    _flush(writer, rows, texts, stats)
        with _writing(output):
            os.replace(tmp, output)
    finally:
        with contextlib.suppress(OSError):  # nothing was written there, or the folder refuses it too
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _writing(output: Path):
    """An operating-system error while writing ``output`` is the user's to fix: one line naming it."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"--output {output}: cannot write there ({exc.strerror or exc}); choose a writable "
                        "location") from None


def _articles(sources: list[Path], workers: int, progress: DumpProgress, threads: int = 0) -> Iterator[Article]:
    """The articles of every source in order; consecutive dumps go to one `iter_dump_articles` (one progress
    bar), which cleans each file with a pool of its own."""
    kinds = [(path, detect_source(path)) for path in sources]  # every input checked before any is read
    for kind, group in itertools.groupby(kinds, key=lambda item: item[1]):
        paths = [path for path, _ in group]
        if kind == "dump":
            yield from iter_dump_articles(paths, workers, progress, threads)
        else:
            for path in paths:
                yield from iter_extracted_articles(path)


def wiki_to_parquet(source: str | os.PathLike | list[str | os.PathLike], output: str | os.PathLike,
                    workers: int = 0, decode_threads: int = 0) -> WikiStats:
    """Convert dumps and/or wikiextractor folders (one, a list, globs) to the parquet file ``output``;
    ``workers`` processes clean (0: all cores), ``decode_threads`` threads decompress bzip2 (0: chosen
    from ``workers``)."""
    sources = resolve_inputs(source if isinstance(source, list) else [source])
    output = Path(output)
    if output.suffix != ".parquet":
        raise UserError(f"--output {str(output)!r}: give a file name ending in .parquet")
    stats, progress = WikiStats(), DumpProgress()
    write_parquet(_articles(sources, workers or available_cores(), progress, decode_threads), output, stats)
    stats.seconds = time.perf_counter() - progress.start
    stats.skipped, stats.xml_bytes = progress.skipped, progress.xml_bytes
    return stats


def main(argv: list[str]) -> int:
    """``wiki2parquet --input PATH [PATH ...] --output FILE.parquet``."""
    parser = CommandParser("wiki2parquet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, nargs="+",
                        help="Wikipedia dumps (.xml or .xml.bz2; several files, the dump's parts or a quoted "
                             "glob such as 'enwiki-*-pages-articles*.xml-p*.bz2') or wikiextractor output folders")
    parser.add_argument("--output", required=True, help="parquet file to write")
    parser.add_argument("--workers", type=int, default=0,
                        help="processes cleaning dump wikitext (default: all cores)")
    parser.add_argument("--decode-threads", type=int, default=0,
                        help="threads decompressing a bzip2 dump (default: 1 for up to 2 workers, else one per "
                             "worker)")
    args = parser.parse_args(argv)
    for option, value in (("--workers", args.workers), ("--decode-threads", args.decode_threads)):
        if value < 0:
            raise UserError(f"{option} {value}: give 0 (the default) or a positive number")
    stats = wiki_to_parquet(args.input, args.output, args.workers, args.decode_threads)
    print(stats.summary(Path(args.output)))
    return 0
