"""Wikipedia -> parquet: the wikitext cleaner, both input routes, and bad input."""

from __future__ import annotations

import bz2
import html
import json
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from qwen3_pretrain.convert import wiki, wiki_dump, wikitext
from qwen3_pretrain.data import pool
from qwen3_pretrain.convert.wikitext import is_redirect_text, remove_nested, wikitext_to_text
from qwen3_pretrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]
DUMP = REPO / "assets" / "enwiki-sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


# ---------------------------------------------------------------- cleaner

@pytest.mark.parametrize("wikitext, expected", [
    ("a {{x|{{y|z}}|w}} b", "a b"),
    ("keep {{ unclosed", "keep {{ unclosed"),
    ("x\n{| class=wikitable\n|-\n| a || {{b}}\n{|\n|inner\n|}\n|}\ny", "x\n\ny"),
    ('A<ref name="a">cite {{c}} [[d]]</ref> B<ref name="a"/>.', "A B."),
    ("a<!-- hidden [[x]] -->b", "ab"),
    ("[[a|b]] [[c]]s [[File:x.jpg|thumb|cap [[d]]]] [[:Category:Y|cat]] end", "b cs cat end"),
    ("text [[Category:Z]] [[de:Anarchismus]]", "text"),
    ("a [[File:x.png|thumb|Bicyclo[1.1.0]butane [above] [[d|e]]]] b", "a b"),
    ("[http://x.org some text] and [https://y.org]", "some text and"),
    ("'''bold''' and ''italic'' and '''''both'''''", "bold and italic and both"),
    ("== Head ==\nbody\n=== Sub ===", "Head\nbody\nSub"),
    ("a<br/>b <span style='x'>c</span> <math>x^2</math>d", "a\nb c d"),
    ("&amp; &lt;b&gt; caf&eacute;", "& <b> café"),
    ("* one\n# two\n: three", "one\ntwo\nthree"),
    ("Name ({{IPA|x}}) is", "Name is"),
    ("p1\n\n\n\np2 __NOTOC__\n----", "p1\n\np2"),
])
def test_wikitext_to_text(wikitext: str, expected: str) -> None:
    assert wikitext_to_text(wikitext) == expected


def test_remove_nested_keeps_text_around_spans() -> None:
    assert remove_nested("a{{b{{c}}d}}e{{f}}g", "{{", "}}") == "aeg"


def _plain_remove_nested(text: str, opener: str, closer: str) -> str:
    depth, kept, opened, out = 0, 0, 0, []
    for match in re.finditer(f"{re.escape(opener)}|{re.escape(closer)}", text):
        if match.group() == opener:
            if depth == 0:
                out.append(text[kept:match.start()])
                opened = match.start()
            depth += 1
        elif depth:
            depth -= 1
            kept = match.end() if depth == 0 else kept
    return "".join(out) + text[opened if depth else kept:]


def _plain_link_text(match: re.Match[str]) -> str:
    target, pipe, label = match.group(1).partition("|")
    target = target.strip()
    if target.startswith(":"):
        return label.strip() if pipe else target[1:]
    if ":" in target and target.split(":", 1)[0].strip().lower() in {"file", "image", "category", "media"}:
        return ""
    if not pipe and re.match(r"[a-z]{2,3}(?:-[a-z0-9]+)*:", target):
        return ""
    return label.strip() if pipe and label.strip() else target


def _plain_resolve_links(text: str) -> str:
    text = re.sub(r"\[(?:https?:|ftp:|mailto:|//)[^\s\[\]]*(?:\s+([^\[\]]*))?\]", lambda m: m.group(1) or "",
                  text, flags=re.I)
    while True:
        resolved = re.sub(r"\[\[((?:(?!\[\[|\]\]).)*)\]\]", _plain_link_text, text, flags=re.S)
        if resolved == text:
            return resolved
        text = resolved


def _plain_line_markup(text: str) -> str:
    text = re.sub(r"^(={1,6})[ \t]*(.+?)[ \t]*\1[ \t]*$", r"\2", text, flags=re.M)
    return re.sub(r"^[*#:;]+[ \t]*", "", text, flags=re.M)


_ELEMENTS = "|".join(wikitext._DISCARDED_ELEMENTS)
# (plain definition, the cleaner's faster form, pieces the random texts are made of)
_FAST_FORMS = {
    "empty parens": (lambda s: re.sub(r"[ \t]?\(\s*(?:[,;]\s*)*\)", "", s), wikitext._drop_empty_parens,
                     " \t(),;\na"),
    "emphasis": (lambda s: re.sub(r"'{2,5}", "", s), lambda s: wikitext._EMPHASIS.sub("", s), "'''a"),
    "blank lines": (lambda s: re.sub(r"\n{3,}", "", s), lambda s: wikitext._BLANK_LINES.sub("", s), "\n\n\na"),
    "spaces": (lambda s: re.sub(r"[ \t\u00a0]{2,}", "_", s), lambda s: wikitext._SPACES.sub("_", s),
               " \t\u00a0a\n"),
    "paired elements": (lambda s: re.sub(rf"<({_ELEMENTS})\b[^>]*>.*?</\1\s*>", "", s, flags=re.I | re.S),
                        lambda s: wikitext._PAIRED.sub("", s),
                        ["<ref>", "<Ref a>", "</ref>", "</REF >", "<math>", "</math>", "<", "/", ">", "a", "\n"]),
    "templates": (lambda s: _plain_remove_nested(s, "{{", "}}"), lambda s: remove_nested(s, "{{", "}}"), "{}|a"),
    "tables": (lambda s: _plain_remove_nested(s, "{|", "|}"), lambda s: remove_nested(s, "{|", "|}"), "{}|a"),
    "links": (_plain_resolve_links, wikitext._resolve_links,
              ["[[", "]]", "[", "]", "|", ":", " ", "a", "File:", "fr:", "Category:", "http://x", "\n"]),
    "line markup": (_plain_line_markup, wikitext._drop_line_markup,
                    ["=", "==", "*", "#", ":", ";", " ", "\t", "\n", "a"]),
}


@pytest.mark.parametrize("name", _FAST_FORMS)
def test_fast_forms_match_their_plain_definitions(name: str) -> None:
    """The rewritten patterns and scans (a literal first, repeats written out, str.find) give exactly what
    the plain definitions do, on random texts made of the pieces they care about."""
    plain, fast, pieces = _FAST_FORMS[name]
    rng = random.Random(0)
    for _ in range(10_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))
        assert fast(text) == plain(text), text


def test_redirect_text() -> None:
    assert is_redirect_text("  #REDIRECT [[Foo]]") and is_redirect_text("#redirect[[Foo]]")
    assert not is_redirect_text("A #REDIRECT in prose")


# ---------------------------------------------------------------- the bundled dump

@pytest.fixture(scope="module")
def dump_parquet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, wiki.WikiStats]:
    out = tmp_path_factory.mktemp("dump") / "wiki.parquet"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wiki, "ROW_GROUP_ROWS", 10)  # several row groups even from a small dump
        patch.setattr(wiki_dump, "CLEAN_BATCH_BYTES", 256 << 10)  # several batches for the two workers
        stats = wiki.wiki_to_parquet(DUMP, out, workers=2)
    return out, stats


def test_dump_route_counts_and_schema(dump_parquet: tuple[Path, wiki.WikiStats]) -> None:
    path, stats = dump_parquet
    # 206 pages: 100 redirects (one outside the article namespace), 106 articles, none empty once cleaned.
    assert (stats.articles, stats.empty, stats.skipped) == (106, 0, 100)
    parquet = pq.ParquetFile(path)
    assert parquet.schema_arrow.names == ["id", "title", "url", "text"]
    assert all(str(t) == "string" for t in parquet.schema_arrow.types)
    assert parquet.metadata.num_row_groups == 11
    rows = parquet.read().to_pylist()
    assert rows[0]["id"] == "12" and rows[0]["title"] == "Anarchism"
    assert rows[0]["url"] == "https://en.wikipedia.org/wiki?curid=12"
    assert rows[0]["text"].startswith("Anarchism is a political philosophy")
    assert stats.text_bytes == sum(len(r["text"].encode()) for r in rows)
    for marker in ("{{", "[[", "<ref", "'''", "&amp;", "&nbsp;"):
        assert not any(marker in r["text"] for r in rows), marker


@pytest.mark.parametrize("workers, decode_threads", [(1, 0), (1, 3)])
def test_dump_route_is_worker_and_thread_count_independent(dump_parquet: tuple[Path, wiki.WikiStats], tmp_path: Path,
                                                           workers: int, decode_threads: int) -> None:
    """bzip2 decoded by the standard library (one thread) or by indexed_bzip2 (several): the same output."""
    single = tmp_path / "one.parquet"
    wiki.wiki_to_parquet(DUMP, single, workers=workers, decode_threads=decode_threads)
    assert pq.read_table(single).equals(pq.read_table(dump_parquet[0]))


def _niceness(_: int) -> int:
    return os.nice(0)


def test_dump_workers_yield_a_core_to_decompression(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cleaning workers run below the main process's priority (the reader thread decompresses for all
    of them); with one worker the cleaning runs in this process, whose priority stays."""
    initializers = []
    real = wiki_dump.ordered_map

    def spy(func, items, workers, **kwargs):
        initializers.append((workers, kwargs.get("initializer")))
        return real(func, items, workers, **kwargs)

    monkeypatch.setattr(wiki_dump, "ordered_map", spy)
    before = os.nice(0)
    for workers in (1, 2):
        wiki.wiki_to_parquet(DUMP, tmp_path / f"{workers}.parquet", workers=workers)
    assert os.nice(0) == before
    assert initializers == [(1, None), (2, wiki_dump.lower_priority)]
    niceness = list(pool.ordered_map(_niceness, range(2), 2, initializer=wiki_dump.lower_priority))
    assert niceness == [min(before + wiki_dump.WORKER_NICENESS, 19)] * 2


def _split_dump(xml: bytes, parts: int) -> list[bytes]:
    """The dump cut into ``parts`` complete dumps (each with the header and the closing tag), as the
    Wikimedia dump's pages-articlesN.xml-p...-p... parts are."""
    head_end, tail_start = xml.index(b"<page>"), xml.rindex(b"</mediawiki>")
    pages = [p + b"</page>" for p in xml[head_end:tail_start].split(b"</page>")[:-1]]
    bounds = [len(pages) * i // parts for i in range(parts + 1)]
    return [xml[:head_end] + b"".join(pages[a:b]) + b"\n" + xml[tail_start:] for a, b in zip(bounds, bounds[1:])]


def _multistream(xml: bytes, pages_per_stream: int = 7) -> bytes:
    """bzip2 streams of a few pages each, concatenated, as the dump's multistream files are."""
    pieces = re.split(rb"(?<=</page>)", xml)
    return b"".join(bz2.compress(b"".join(pieces[i:i + pages_per_stream]))
                    for i in range(0, len(pieces), pages_per_stream))


def test_dump_parts_multistream_and_globs_give_the_single_file_output(tmp_path: Path) -> None:
    xml = bz2.decompress(DUMP.read_bytes())
    (tmp_path / "whole.xml").write_bytes(xml)  # plain XML: no decompressor involved in the reference
    reference = wiki.wiki_to_parquet(tmp_path / "whole.xml", tmp_path / "reference.parquet", workers=1)
    parts = _split_dump(xml, 3)
    # Numbered as the dump's parts are; part 2 must come before part 10.
    for number, part in zip((2, 10, 11), parts):
        (tmp_path / f"enwiki-pages-articles{number}.xml-p{number}p{number + 1}.bz2").write_bytes(_multistream(part))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wiki_dump, "CLEAN_BATCH_BYTES", 100 << 10)
        patch.setattr(wiki_dump, "READ_BYTES", 64 << 10)
        one = wiki.wiki_to_parquet([tmp_path / "enwiki-pages-articles*.xml-p*.bz2"], tmp_path / "one.parquet",
                                   workers=1)
        two = wiki.wiki_to_parquet([str(tmp_path / "enwiki-pages-articles2.xml-p2p3.bz2"),
                                    tmp_path / "enwiki-pages-articles1?.xml-p*.bz2"], tmp_path / "two.parquet",
                                   workers=2, decode_threads=2)
    expected = pq.read_table(tmp_path / "reference.parquet")
    assert pq.read_table(tmp_path / "one.parquet").equals(expected)
    assert pq.read_table(tmp_path / "two.parquet").equals(expected)
    counts = [(s.articles, s.empty, s.skipped) for s in (reference, one, two)]
    assert counts == [(106, 0, 100)] * 3 and one.xml_bytes == two.xml_bytes > 0


def test_glob_matching_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"input '.*pages-\*\.bz2' matches no file"):
        wiki.wiki_to_parquet([tmp_path / "pages-*.bz2"], tmp_path / "out.parquet")


def _page(page_id: int, title: str, text: str, ns: int = 0, redirect: bool = False) -> str:
    redirect_tag = f'<redirect title="{title}x" />' if redirect else ""
    return (f"<page><title>{html.escape(title)}</title><ns>{ns}</ns><id>{page_id}</id>{redirect_tag}"
            f"<revision><id>1</id><text xml:space=\"preserve\">{html.escape(text)}</text></revision></page>")


def _dump_xml(pages: list[str]) -> str:
    return ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">'
            "<siteinfo><base>https://de.wikipedia.org/wiki/Hauptseite</base></siteinfo>"
            + "".join(pages) + "</mediawiki>")


@pytest.mark.parametrize("compress", [False, True])
def test_dump_route_skips_redirects_namespaces_and_empty(tmp_path: Path, compress: bool) -> None:
    xml = _dump_xml([
        _page(1, "Kept", "'''Kept''' is [[kept|an article]]."),
        _page(2, "Wikipedia:About", "project page", ns=4),
        _page(3, "Moved", "#REDIRECT [[Kept]]", redirect=True),
        _page(4, "Old", "#REDIRECT [[Kept]]"),  # a redirect written only in the text
        _page(5, "Stub", "{{stub}}\n[[Category:Empty]]"),
    ]).encode()
    source = tmp_path / ("dump.xml.bz2" if compress else "dump.xml")
    source.write_bytes(bz2.compress(xml) if compress else xml)
    stats = wiki.wiki_to_parquet(source, tmp_path / "out.parquet", workers=1)
    assert (stats.articles, stats.empty, stats.skipped) == (1, 1, 3)
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == [
        {"id": "1", "title": "Kept", "url": "https://de.wikipedia.org/wiki?curid=1", "text": "Kept is an article."}]


# ---------------------------------------------------------------- wikiextractor route

def write_extracted(folder: Path, rows: list[dict[str, str]], fmt: str, per_file: int = 40) -> None:
    """Write ``rows`` the way wikiextractor 3 does: AA/wiki_00 ..., HTML-escaped text, last file bz2."""
    files = [rows[i:i + per_file] for i in range(0, len(rows), per_file)]
    for number, chunk in enumerate(files):
        if fmt == "json":
            content = "".join(json.dumps({"id": r["id"], "revid": "1", "url": r["url"], "title": r["title"],
                                          "text": html.escape(r["text"], quote=False)}) + "\n" for r in chunk)
        else:
            content = "".join(f'<doc id="{r["id"]}" url="{r["url"]}" title="{r["title"]}">\n{r["title"]}\n\n'
                              f'{html.escape(r["text"], quote=False)}\n</doc>\n' for r in chunk)
        path = folder / f"A{'AB'[number // 2]}" / f"wiki_{number % 2:02d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if number == len(files) - 1:
            path.with_name(path.name + ".bz2").write_bytes(bz2.compress(content.encode()))
        else:
            path.write_text(content, encoding="utf-8")


@pytest.mark.parametrize("fmt", ["doc", "json"])
def test_extracted_route_reads_what_the_dump_route_wrote(dump_parquet: tuple[Path, wiki.WikiStats],
                                                         tmp_path: Path, fmt: str) -> None:
    rows = pq.read_table(dump_parquet[0]).to_pylist()
    rows.append({"id": "999", "title": 'Empty "quoted" & odd', "url": "u", "text": ""})
    write_extracted(tmp_path / "wiki_text", rows, fmt)
    stats = wiki.wiki_to_parquet(tmp_path / "wiki_text", tmp_path / "out.parquet")
    assert (stats.articles, stats.empty, stats.skipped) == (106, 1, 0)
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == rows[:-1]


def test_extracted_text_is_unescaped_and_title_line_dropped(tmp_path: Path) -> None:
    row = {"id": "7", "url": "https://en.wikipedia.org/wiki?curid=7", "title": "AT&T <x>",
           "text": "AT&T said 1 < 2 &amp; 3 > 2.\nSecond line."}
    write_extracted(tmp_path / "a", [row], "doc")
    write_extracted(tmp_path / "b", [row], "json")
    for folder in ("a", "b"):
        wiki.wiki_to_parquet(tmp_path / folder, tmp_path / f"{folder}.parquet")
        assert pq.read_table(tmp_path / f"{folder}.parquet").to_pylist() == [row]


# ---------------------------------------------------------------- bad input

def _no_leftovers(folder: Path) -> None:
    assert [p.name for p in folder.iterdir() if p.suffix in (".parquet", ".tmp")] == []


def test_non_utf8_extracted_file_names_file_and_offset(tmp_path: Path) -> None:
    bad = tmp_path / "wiki_text" / "AA" / "wiki_00"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b'<doc id="1" url="u" title="T">\nT\n\nok \xff bad\n</doc>\n')
    with pytest.raises(UserError, match=r"wiki_00: not UTF-8 text: invalid byte 0xff at byte offset 37"):
        wiki.wiki_to_parquet(tmp_path / "wiki_text", tmp_path / "out.parquet")
    _no_leftovers(tmp_path)


def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "AA" / "wiki_00"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"id": "1", "url": "u", "title": "T", "text": "x"}\n{"id": "2", "title": "T"}\n')
    with pytest.raises(UserError, match=r"wiki_00:2: .*keys id, url, title and text"):
        wiki.wiki_to_parquet(tmp_path, tmp_path / "out.parquet")
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("decode_threads", [1, 2])
def test_truncated_dump_is_reported_and_nothing_written(tmp_path: Path, decode_threads: int) -> None:
    cut = tmp_path / "cut.xml.bz2"
    cut.write_bytes(DUMP.read_bytes()[: len(DUMP.read_bytes()) // 2])
    with pytest.raises(UserError, match="cut.xml.bz2: compressed data ends too early"):
        wiki.wiki_to_parquet(cut, tmp_path / "out.parquet", workers=1, decode_threads=decode_threads)
    _no_leftovers(tmp_path)
    assert not [t for t in threading.enumerate() if t.name == "wiki2parquet-read"]


def test_bad_page_mid_dump_stops_the_reader(tmp_path: Path) -> None:
    """An error found while the reader thread is still decompressing ends the run: the thread is stopped
    and joined (no hang, nothing left running), and the error names the file."""
    xml = bz2.decompress(DUMP.read_bytes())
    middle = xml.index(b"</page>", len(xml) // 4)
    broken = tmp_path / "broken.xml.bz2"
    broken.write_bytes(bz2.compress(xml[:middle] + b"<oops>" + xml[middle:]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wiki_dump, "CLEAN_BATCH_BYTES", 64 << 10)
        patch.setattr(wiki_dump, "READ_BYTES", 16 << 10)
        with pytest.raises(UserError, match="broken.xml.bz2: not a valid MediaWiki XML dump"):
            wiki.wiki_to_parquet(broken, tmp_path / "out.parquet", workers=1)
    _no_leftovers(tmp_path)
    assert not [t for t in threading.enumerate() if t.name == "wiki2parquet-read"]


def test_malformed_xml_is_reported(tmp_path: Path) -> None:
    source = tmp_path / "dump.xml"
    source.write_text(_dump_xml([_page(1, "A", "text")])[:-40])
    with pytest.raises(UserError, match="dump.xml: not a valid MediaWiki XML dump"):
        wiki.wiki_to_parquet(source, tmp_path / "out.parquet", workers=1)
    _no_leftovers(tmp_path)


def test_unknown_inputs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        wiki.wiki_to_parquet(tmp_path / "missing", tmp_path / "out.parquet")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="neither a MediaWiki XML dump"):
        wiki.wiki_to_parquet(tmp_path / "notes.txt", tmp_path / "out.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no wikiextractor files"):
        wiki.wiki_to_parquet(tmp_path / "empty", tmp_path / "out.parquet")
    with pytest.raises(UserError, match="ending in .parquet"):
        wiki.wiki_to_parquet(DUMP, tmp_path / "out.csv")


def test_cli_script_summary_and_error(tmp_path: Path) -> None:
    source = tmp_path / "dump.xml"
    source.write_text(_dump_xml([_page(1, "A", "Some text."), _page(2, "B", "#REDIRECT [[A]]")]))
    script = REPO / "tools" / "convert_wiki_to_parquet.py"
    ok = subprocess.run([sys.executable, script, "--input", source, "--output", tmp_path / "w.parquet"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "1 articles, 0 empty dropped, 1 redirects/non-article pages skipped" in ok.stdout
    assert re.search(r"MB of XML \([\d.]+ MB/s\)", ok.stdout) and re.search(r"2page .*MB/s of XML", ok.stderr), ok.stderr
    bad = subprocess.run([sys.executable, script, "--input", tmp_path / "nope", "--output", tmp_path / "x.parquet"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: input") and "Traceback" not in bad.stderr
    negative = subprocess.run([sys.executable, script, "--input", source, "--output", tmp_path / "x.parquet",
                               "--decode-threads", "-1"], capture_output=True, text=True, timeout=120)
    assert negative.returncode == 2 and "--decode-threads -1: give 0" in negative.stderr, negative.stderr
    assert "Traceback" not in negative.stderr and not (tmp_path / "x.parquet").exists()
