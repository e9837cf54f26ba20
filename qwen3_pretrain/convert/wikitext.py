"""Wikitext (MediaWiki markup) -> plain text, without expanding templates.

Good enough for language-model pre-training, in the spirit of
``wikiextractor --no-templates``: the prose of an article survives, the
machinery around it (templates, tables, references, files, categories,
comments) does not. The passes run in a fixed order because later ones rely on
earlier ones: comments can hide any markup, references and templates may hold
links and tables, and links must be resolved before stray tags are stripped.
"""

from __future__ import annotations

import html
import re
from typing import Iterator

# Elements whose content is not prose: dropped together with their content.
_DISCARDED_ELEMENTS = (
    "ref", "references", "gallery", "timeline", "imagemap", "math", "chem", "ce", "score", "graph",
    "mapframe", "maplink", "templatedata", "indicator", "includeonly", "table", "caption", "img",
)
_ELEMENTS = "|".join(_DISCARDED_ELEMENTS)
_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.S)
_SELF_CLOSING = re.compile(rf"<(?:{_ELEMENTS})\b[^>]*/>", re.I)
# The element's content up to the first matching end tag, written out ("no '<' | a '<' that does not
# start the end tag") instead of a lazy ".*?", which tries the end tag at every character.
_PAIRED = re.compile(rf"<({_ELEMENTS})\b[^>]*>[^<]*(?:<(?!/\1\s*>)[^<]*)*</\1\s*>", re.I)
_BREAK = re.compile(r"<br\s*/?>", re.I)
_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*(?:\s[^<>]*)?/?>")

# [url label] -> label; a bare [url] carries no text.
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:|mailto:|//)[^\s\[\]]*(?:\s+([^\[\]]*))?\]", re.I)
# Innermost [[...]] first, so a caption's links resolve before the file link around them is dropped.
# A caption may hold single brackets ("[above]", "Bicyclo[1.1.0]butane"), so only "[[" and "]]" end a link.
# Written out as runs of other characters between single brackets, so the engine does not test for
# "[[" or "]]" at every character.
_INTERNAL_LINK = re.compile(r"\[\[([^\[\]]*(?:(?:\[(?!\[)|\](?!\]))[^\[\]]*)*)\]\]")
_DROPPED_NAMESPACES = {"file", "image", "category", "media"}
_INTERLANGUAGE = re.compile(r"^[a-z]{2,3}(?:-[a-z0-9]+)*:")

# Patterns that start with a literal (or a single character class) let the regex engine skip ahead to
# it instead of trying every position: "''" and "\n\n\n" below, the empty parentheses found by their "(",
# runs of spaces by their first space, and line starts as "\n" (put in front of the text by
# _drop_line_markup).
_EMPHASIS = re.compile(r"''(?:'{0,3})")  # 2 to 5 quotes
_HEADING = re.compile(r"\n(={1,6})[ \t]*(.+?)[ \t]*\1[ \t]*$", re.M)
_LIST_MARKER = re.compile(r"\n[*#:;]+[ \t]*")
_RULE = re.compile(r"^-{4,}[ \t]*$", re.M)
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
# "( )" or "(; )" left behind where a template (pronunciation, dates) stood; one space or tab
# before it goes with it (see _drop_empty_parens).
_EMPTY_PARENS = re.compile(r"\(\s*(?:[,;]\s*)*\)")
_SPACES = re.compile(r"[ \t\u00a0][ \t\u00a0]+")
_BLANK_LINES = re.compile(r"\n\n\n+")
_REDIRECT = re.compile(r"^\s*#redirect", re.I)


def is_redirect_text(wikitext: str) -> bool:
    """True for ``#REDIRECT [[...]]`` pages (dumps without a ``<redirect>`` element)."""
    return bool(_REDIRECT.match(wikitext))


def _tokens(text: str, opener: str, closer: str) -> Iterator[tuple[int, bool]]:
    """(position, is it the opener) of every opener and closer, left to right, never overlapping.

    Found with ``str.find``: a regex alternation of the two would be tried at every character.
    """
    next_open, next_close = text.find(opener), text.find(closer)
    while next_open >= 0 or next_close >= 0:
        if next_close < 0 or 0 <= next_open < next_close:
            yield next_open, True
            pos = next_open + len(opener)
        else:
            yield next_close, False
            pos = next_close + len(closer)
        if 0 <= next_open < pos:
            next_open = text.find(opener, pos)
        if 0 <= next_close < pos:
            next_close = text.find(closer, pos)


def remove_nested(text: str, opener: str, closer: str) -> str:
    """Remove every balanced ``opener ... closer`` span, nesting included.

    An opener that is never closed is left in place with the rest of the text:
    one stray ``{{`` must not swallow the remainder of an article.
    """
    if opener not in text:  # a closer alone removes nothing
        return text
    out: list[str] = []
    depth, kept_from, opened_at = 0, 0, 0
    for at, is_opener in _tokens(text, opener, closer):
        if is_opener:
            if depth == 0:
                out.append(text[kept_from:at])
                opened_at = at
            depth += 1
        elif depth > 0:
            depth -= 1
            if depth == 0:
                kept_from = at + len(closer)
    out.append(text[opened_at if depth else kept_from:])
    return "".join(out)


def _link_text(match: re.Match[str]) -> str:
    target, pipe, label = match.group(1).partition("|")
    if ":" not in target:  # most links: no namespace, no interlanguage prefix
        return (pipe and label.strip()) or target.strip()
    target = target.strip()
    if target.startswith(":"):  # [[:Category:X]] is a visible link, not a categorization
        return label.strip() if pipe else target[1:]
    namespace = target.split(":", 1)[0].strip().lower() if ":" in target else ""
    if namespace in _DROPPED_NAMESPACES:
        return ""
    if not pipe and _INTERLANGUAGE.match(target):
        return ""
    return label.strip() if pipe and label.strip() else target


def _resolve_links(text: str) -> str:
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1) or "", text)
    while True:
        text, count = _INTERNAL_LINK.subn(_link_text, text)
        if not count or "[[" not in text:
            return text


def _drop_elements(text: str) -> str:
    text = _COMMENT.sub("", text)
    text = _SELF_CLOSING.sub("", text)
    return _PAIRED.sub("", text)


def _drop_empty_parens(text: str) -> str:
    out: list[str] = []
    kept = 0
    for match in _EMPTY_PARENS.finditer(text):
        start = match.start()
        if start > kept and text[start - 1] in " \t":
            start -= 1
        out.append(text[kept:start])
        kept = match.end()
    out.append(text[kept:])
    return "".join(out)


def _drop_line_markup(text: str) -> str:
    """Headings' ``=`` and list markers, which the wikitext puts at a line's start."""
    text = _HEADING.sub("\n\\2", "\n" + text)
    return _LIST_MARKER.sub("\n", text)[1:]


def _tidy(text: str) -> str:
    text = _EMPHASIS.sub("", text)
    text = _drop_line_markup(text)
    if "----" in text:
        text = _RULE.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    text = _drop_empty_parens(text)
    text = html.unescape(text)
    text = _SPACES.sub(" ", text)
    lines = [line.strip() for line in text.split("\n")]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def wikitext_to_text(wikitext: str) -> str:
    """Plain text of an article's wikitext: prose, link labels and headings; no markup."""
    text = _drop_elements(wikitext)
    text = remove_nested(text, "{{", "}}")
    text = remove_nested(text, "{|", "|}")
    text = _resolve_links(text)
    text = _BREAK.sub("\n", text)
    text = _TAG.sub("", text)
    return _tidy(text)
