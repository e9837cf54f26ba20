"""A ``tokenizer.json`` byte-level BPE, re-expressed as tiktoken ranks, with the proof that it is exact.

HuggingFace ``tokenizers`` applies BPE merges by their position in the
``merges`` list; tiktoken merges the adjacent pair whose concatenation has the
lowest rank (token id). The two agree when

1. merge ``i`` creates a token whose id grows with ``i`` (checked here, cheap), and
2. tiktoken, run on the bytes of any token ``t`` alone, ends with ``[t]`` and
   makes its last merge from exactly the pair that ``merges`` lists for ``t``.

Why 2 suffices: a merge only ever involves parts inside the span that becomes
``t``, so tiktoken builds ``t`` the same way in every context as it does on
``t`` alone. Every merge tiktoken makes is then one that ``merges`` lists with
the same priority, so both algorithms pick the same pair at every step; and the
shortcut tiktoken takes for a piece that is itself a token gives the same
answer because of the ``[t]`` part. Condition 2 is checked token by token
(``rank_merge_violations``, a few seconds in Python for 151k tokens).
"""

from __future__ import annotations

import functools
from typing import Any

# The pre-tokenizer regex that ByteLevel(use_regex=True) applies (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class NotConvertible(Exception):
    """The tokenizer cannot be reproduced exactly by tiktoken; the message says why."""


@functools.lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes -> printable characters table, which byte-level vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


@functools.lru_cache(maxsize=1)
def _to_latin1() -> dict[int, int]:
    # Alphabet characters -> the code point equal to their byte; any other character below 256 -> one
    # that latin-1 cannot encode, so it is refused instead of passing for itself.
    table = {code: 0xFFFF for code in range(256)}
    table.update({ord(c): b for c, b in unicode_to_byte().items()})
    return table


def token_bytes(token: str) -> bytes:
    """The bytes a byte-level vocabulary entry stands for."""
    try:
        return token.translate(_to_latin1()).encode("latin-1")
    except UnicodeEncodeError:
        raise NotConvertible(f"vocabulary entry {token!r} is not in the byte-level alphabet") from None


def _all_token_bytes(tokens: list[str]) -> list[bytes]:
    """``[token_bytes(t) for t in tokens]``, translating the whole vocabulary in one call (far fewer Python calls than one per token)."""
    sep = "\ufffe"  # a noncharacter: outside the byte-level alphabet, and left alone by the translation
    pieces = sep.join(tokens).translate(_to_latin1()).split(sep)
    if len(pieces) != len(tokens):  # some entry holds the separator: let the slow path name it
        return [token_bytes(token) for token in tokens]
    try:
        return [piece.encode("latin-1") for piece in pieces]
    except UnicodeEncodeError:
        return [token_bytes(token) for token in tokens]  # raises NotConvertible naming the entry


def split_pattern(pre_tokenizer: dict[str, Any] | None) -> str:
    """The regex the pre-tokenizer splits text with, if it is one tiktoken can reproduce."""
    if pre_tokenizer is None:
        raise NotConvertible("no pre-tokenizer (tiktoken needs a byte-level split regex)")
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"]:
        _check_byte_level(steps[0], expect_regex=True)
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"]:
        split, byte_level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
            raise NotConvertible(f"Split pre-tokenizer {split} is not an isolated, non-inverted regex split")
        _check_byte_level(byte_level, expect_regex=False)
        return regex
    raise NotConvertible(f"pre-tokenizer sequence {kinds} is not [ByteLevel] or [Split, ByteLevel]")


def _check_byte_level(step: dict[str, Any], expect_regex: bool) -> None:
    if step.get("add_prefix_space"):
        raise NotConvertible("ByteLevel add_prefix_space=true is not supported by the fast path")
    if bool(step.get("use_regex", True)) != expect_regex:
        raise NotConvertible(f"ByteLevel use_regex={step.get('use_regex')} in this position is not supported")


def check_model(model: dict[str, Any]) -> None:
    """Raise NotConvertible unless ``model`` is a plain byte-level BPE."""
    if model.get("type") != "BPE":
        raise NotConvertible(f"model type {model.get('type')!r} is not BPE")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NotConvertible(f"BPE option {key}={model[key]!r} is not supported by the fast path")
    if model.get("byte_fallback"):
        raise NotConvertible("BPE option byte_fallback=true is not supported by the fast path")


def mergeable_ranks(model: dict[str, Any]) -> dict[bytes, int]:
    """tiktoken's ``{token bytes: rank}``, the rank being the token id."""
    vocab = model["vocab"]
    ranks = dict(zip(_all_token_bytes(list(vocab)), map(int, vocab.values())))
    if len(ranks) != len(model["vocab"]) or len(set(ranks.values())) != len(ranks):
        raise NotConvertible("two vocabulary entries share the same bytes or the same id")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise NotConvertible(f"{len(missing)} single bytes (e.g. 0x{missing[0]:02x}) have no token")
    return ranks


def _pair(merge: str | list[str]) -> tuple[str, str]:
    left, right = merge.split(" ") if isinstance(merge, str) else merge
    return left, right


def merge_pairs(model: dict[str, Any], ranks: dict[bytes, int]) -> dict[bytes, tuple[bytes, bytes]]:
    """``{token: (left, right)}`` from ``merges``, checking condition 1 (ids grow with merge order)."""
    pairs: dict[bytes, tuple[bytes, bytes]] = {}
    previous = -1
    for index, merge in enumerate(model.get("merges", [])):
        left, right = (token_bytes(part) for part in _pair(merge))
        rank = ranks.get(left + right)
        if rank is None or rank <= previous or left + right in pairs:
            raise NotConvertible(f"merge #{index} {merge!r}: its token's id does not grow with the merge "
                                 "order, so merge priority and token rank disagree")
        pairs[left + right] = (left, right)
        previous = rank
    return pairs


def _rank_merge_last(piece: bytes, ranks: dict[bytes, int]) -> tuple[list[bytes], tuple[bytes, bytes] | None]:
    """tiktoken's algorithm on ``piece`` (no whole-piece shortcut): final parts and the last merged pair."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    last = None
    get = ranks.get
    while len(parts) > 1:
        best, at = None, 0
        for i in range(len(parts) - 1):
            rank = get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None:
            break
        last = (parts[at], parts[at + 1])
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts, last


def rank_merge_violations(ranks: dict[bytes, int], pairs: dict[bytes, tuple[bytes, bytes]]) -> list[bytes]:
    """Tokens breaking condition 2; empty when tiktoken and the merges list always agree."""
    violations = []
    for token in ranks:
        if len(token) < 2:
            continue
        parts, last = _rank_merge_last(token, ranks)
        if parts != [token] or last != pairs.get(token):
            violations.append(token)
    return violations
