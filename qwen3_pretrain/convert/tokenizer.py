"""Tokenizers for data conversion: an exact fast path on tiktoken, and the reference (``tokenizers``).

``load_tokenizer(path)`` reads ``tokenizer.json`` and returns an object with
``encode_batch(texts) -> list[list[int]]``, ``vocab_size``, ``eod_id``,
``sha256`` and ``backend`` (``"fast"`` or ``"reference"``). Both backends give
the ids of ``tokenizers.Tokenizer.encode(text, add_special_tokens=False)``,
which is what Megatron's preprocessing feeds to training:

* added/special tokens written in the text (``"<|endoftext|>"``) are matched
  in the raw text, leftmost-longest, and become their ids;
* the text between them is normalized (NFC), split by the pre-tokenizer regex
  and byte-level BPE encoded. The fast path does the last step with tiktoken,
  whose rank-order merging equals the ``merges`` list order for the
  vocabularies ``bpe.py`` accepts (see its proof).

Python's ``unicodedata`` and the Rust normalizer inside ``tokenizers`` ship
different Unicode versions, so a handful of rare combining marks normalize
differently; they are found by probing both, and a document that contains one
is encoded by the reference tokenizer instead.

Two derived results are kept in ``$QWEN3_PRETRAIN_CACHE`` (default
``~/.cache/qwen3-pretrain``; safe to delete, never required): those probed
characters, per pair of library versions, and the fast path's tables (ranks,
regex, end-of-document id), per content hash of tokenizer.json and
tokenizer_config.json; both keys also hold a hash of the code that derives
them, so a change to it never meets an old result. With both there, loading
takes a quarter second instead of two thirds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import unicodedata
import zipfile
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import tiktoken
import tokenizers

from qwen3_pretrain.convert import bpe
from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.fsutil import atomic_path

Backend = Literal["auto", "fast", "reference"]
_NONE: frozenset[str] = frozenset()
EOD_TOKEN = "<|endoftext|>"
# sha256 of tokenizer.json files for which tests/test_tokenizer.py runs the full
# rank-vs-merges proof (bpe.rank_merge_violations); others are proven at load.
PROVEN_TOKENIZERS = {
    "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",  # Qwen3 (all sizes)
}


def tokenizer_file(path: str | os.PathLike) -> Path:
    """``path/tokenizer.json`` (a HF model folder) or ``path`` itself when it is that file."""
    path = Path(path)
    candidate = path / "tokenizer.json" if path.is_dir() else path
    if not candidate.is_file():
        raise MissingFileError(f"tokenizer_path {str(path)!r}: no tokenizer.json there; give the folder of a "
                               "HuggingFace model (it holds tokenizer.json) or the tokenizer.json file")
    return candidate


class _Tokenizer:
    """What both backends share: identity (path, sha256), vocabulary facts, pickling by path."""

    backend: str = ""

    def __init__(self, path: Path, raw: bytes, spec: dict[str, Any]) -> None:
        self.path = path
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.added_tokens = _added_tokens(spec)
        self.vocab_size = 0  # all ids, added tokens included (Tokenizer.get_vocab_size(True))
        self.eod_id = 0
        self.fallback_reason: str | None = None

    def __reduce__(self) -> tuple:
        # Spawned workers rebuild the tokenizer from its file instead of pickling Rust objects.
        return load_tokenizer, (self.path, self.backend)

    def encode(self, text: str) -> list[int]:
        """Token ids of one text (no BOS/EOS added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no BOS/EOS added)."""
        raise NotImplementedError

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text as an integer array (what conversion writes; no Python ints needed)."""
        return [np.asarray(ids, dtype=np.int32) for ids in self.encode_batch(texts)]


class ReferenceTokenizer(_Tokenizer):
    """The HuggingFace ``tokenizers`` library itself: slow, exact by definition, any tokenizer.json."""

    backend = "reference"

    def __init__(self, path: Path, raw: bytes, spec: dict[str, Any]) -> None:
        super().__init__(path, raw, spec)
        self._tokenizer = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod_id = _eod_id(path, self._tokenizer.token_to_id)
        # encode_batch_fast skips offsets, which conversion does not need; same ids.
        self._encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._encode(texts, add_special_tokens=False)]


class FastTokenizer(_Tokenizer):
    """tiktoken with the tokenizer's own ranks, regex and added tokens: same ids as the reference."""

    backend = "fast"

    def __init__(self, path: Path, raw: bytes, tables: FastTables) -> None:
        super().__init__(path, raw, {})
        self.added_tokens = dict(tables.added_tokens)
        self.vocab_size, self.eod_id = tables.vocab_size, tables.eod_id
        # Added tokens are split off before tiktoken sees a text, and none is ever allowed, so they are
        # encoded as ordinary text there; but with no special token at all, tiktoken's array-returning
        # encoder searches an empty pattern at every position and runs at half speed.
        special = dict(self.added_tokens) or {"<|no-special-token|>": max(tables.ranks.values()) + 1}
        self._encoding = tiktoken.Encoding(f"bpe-{self.sha256[:12]}", pat_str=tables.pattern,
                                           mergeable_ranks=tables.ranks, special_tokens=special)
        self._nfc = tables.nfc
        self._added = _alternation(self.added_tokens)
        self._guard = _nfc_disagreements() if self._nfc else None
        self._raw = raw
        self._reference: ReferenceTokenizer | None = None

    def _segment(self, text: str, normalize: bool) -> np.ndarray:
        if normalize:
            text = unicodedata.normalize("NFC", text)
        # The ids straight from tiktoken's buffer, without building a list of Python ints.
        return self._encoding.encode_to_numpy(text, allowed_special=_NONE, disallowed_special=())

    def _needs_reference(self, text: str, normalize: bool) -> bool:
        guard = self._guard
        return guard is not None and (normalize or guard.checks_every_text) and guard.found_in(text)

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of one text (no BOS/EOS added) as a uint32 array."""
        # ASCII is NFC in every Unicode version, and most prose is NFC already (MediaWiki stores NFC).
        normalize = self._nfc and not text.isascii() and not unicodedata.is_normalized("NFC", text)
        if self._needs_reference(text, normalize):
            return np.asarray(self._reference_tokenizer().encode(text), dtype=np.uint32)
        if self._added is None or self._added.search(text) is None:
            return self._segment(text, normalize)
        parts: list[np.ndarray] = []
        start = 0
        for match in self._added.finditer(text):
            parts.append(self._segment(text[start:match.start()], normalize))
            parts.append(np.array([self.added_tokens[match.group()]], dtype=np.uint32))
            start = match.end()
        parts.append(self._segment(text[start:], normalize))
        return np.concatenate(parts)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_array(text) for text in texts]

    def _reference_tokenizer(self) -> ReferenceTokenizer:
        if self._reference is None:
            self._reference = ReferenceTokenizer(self.path, self._raw, json.loads(self._raw))
        return self._reference


def _added_tokens(spec: dict[str, Any]) -> dict[str, int]:
    return {tok["content"]: int(tok["id"]) for tok in spec.get("added_tokens", [])}


@dataclasses.dataclass
class FastTables:
    """What the fast path needs from tokenizer.json, derived once and kept in the cache."""

    pattern: str
    ranks: dict[bytes, int]
    added_tokens: dict[str, int]
    vocab_size: int
    eod_id: int
    nfc: bool

    @classmethod
    def from_spec(cls, file: Path, spec: dict[str, Any], sha256: str) -> "FastTables":
        pattern, ranks = _tiktoken_parts(spec, sha256)
        vocab, added = spec["model"]["vocab"], _added_tokens(spec)
        eod_id = _eod_id(file, lambda token: added.get(token, vocab.get(token)))
        return cls(pattern, ranks, added, len(set(vocab.values()) | set(added.values())), eod_id,
                   spec.get("normalizer") is not None)

    # Cached as one .npz: the ranks as concatenated bytes, their lengths and ids, plus the rest as JSON.
    # Reading it takes a tenth of parsing tokenizer.json and deriving the ranks again.
    def save(self, file: Path) -> None:
        """Write the tables to ``file`` (an .npz)."""
        tokens = list(self.ranks)
        meta = {"pattern": self.pattern, "added_tokens": self.added_tokens, "vocab_size": self.vocab_size,
                "eod_id": self.eod_id, "nfc": self.nfc}
        np.savez(file, meta=np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8),
                 data=np.frombuffer(b"".join(tokens), dtype=np.uint8),
                 lengths=np.fromiter(map(len, tokens), dtype=np.int32, count=len(tokens)),
                 ids=np.fromiter(self.ranks.values(), dtype=np.int64, count=len(tokens)))

    @classmethod
    def load(cls, file: Path) -> "FastTables":
        with np.load(file) as saved:
            meta = json.loads(saved["meta"].tobytes().decode("utf-8"))
            data, lengths, ids = saved["data"].tobytes(), saved["lengths"], saved["ids"]
        ends = np.cumsum(lengths, dtype=np.int64)
        if len(ids) != len(lengths) or (len(ends) and ends[-1] != len(data)):
            raise ValueError(f"{file}: inconsistent tables")
        starts = (ends - lengths).tolist()
        ranks = dict(zip(map(data.__getitem__, map(slice, starts, ends.tolist())), ids.tolist()))
        return cls(meta["pattern"], ranks, {k: int(v) for k, v in meta["added_tokens"].items()},
                   int(meta["vocab_size"]), int(meta["eod_id"]), bool(meta["nfc"]))


def _tables_cache_file(sha256: str, file: Path) -> Path | None:
    # tokenizer_config.json may name the end-of-document token, so its content is part of the key;
    # so is the code that derives the tables.
    config = file.with_name("tokenizer_config.json")
    config_sha = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else "none"
    return _cache_file("tokenizers", f"{sha256[:32]}-{config_sha}-{_code_fingerprint()}.npz")


def _fast_tables(file: Path, raw: bytes, sha256: str) -> tuple[FastTables | None, str | None, dict | None]:
    """The fast path's tables (from the cache when there), or None and why the fast path is not exact;
    and the parsed tokenizer.json when it had to be parsed."""
    try:
        cached = _tables_cache_file(sha256, file)
    except OSError:
        cached = None
    if cached is not None:
        try:
            return FastTables.load(cached), None, None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile):
            pass  # missing or damaged: derive again
    spec = _parse(file, raw)
    reason = unsupported_reason(spec)
    if reason is not None:
        return None, reason, spec
    try:
        tables = FastTables.from_spec(file, spec, sha256)
    except bpe.NotConvertible as exc:
        return None, str(exc), spec
    if cached is not None:
        _write_cache(cached, tables.save)
    return tables, None, spec


class _CharGuard:
    """Finds any of a set of characters in a text quickly.

    ``re`` checks a class of BMP characters with a lookup table but a class
    holding astral characters one by one, so astral members are checked
    only when the text has an astral character at all (rare in prose).
    """

    def __init__(self, chars: set[str]) -> None:
        bmp = "".join(re.escape(c) for c in sorted(chars) if ord(c) < 0x10000)
        self._candidates = re.compile(f"[{bmp}\U00010000-\U0010ffff]")
        self._astral = frozenset(c for c in chars if ord(c) >= 0x10000)
        # When Python knows every differing character (the reference's tables are the older ones),
        # a text Python finds NFC is left alone by both, so only texts NFC changes need a look.
        self.checks_every_text = any(unicodedata.category(c) == "Cn" for c in chars)

    def found_in(self, text: str) -> bool:
        """True when ``text`` holds one of the characters."""
        for match in self._candidates.finditer(text):
            char = match.group()
            if ord(char) < 0x10000 or char in self._astral:
                return True
        return False


def _eod_id(path: Path, token_id: Callable[[str], int | None]) -> int:
    """``<|endoftext|>``'s id, else that of the ``eos_token`` in tokenizer_config.json beside tokenizer.json."""
    candidates = [EOD_TOKEN]
    config = path.with_name("tokenizer_config.json")
    if config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (ValueError, AttributeError):
            raise UserError(f"{config}: not a valid tokenizer_config.json (a JSON object)") from None
        candidates.append(eos.get("content") if isinstance(eos, dict) else eos)
    for token in candidates:
        if isinstance(token, str) and token_id(token) is not None:
            return int(token_id(token))
    raise UserError(f"{path}: no end-of-document token: neither {EOD_TOKEN!r} nor an eos_token of "
                    "tokenizer_config.json is in the vocabulary")


def _alternation(tokens: dict[str, int]) -> re.Pattern[str] | None:
    """Leftmost-longest matcher of the added tokens, as ``tokenizers`` matches them."""
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def unsupported_reason(spec: dict[str, Any]) -> str | None:
    """Why ``spec`` (a parsed tokenizer.json) cannot take the fast path, or None when it can."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer != {"type": "NFC"}:
        return f"normalizer {normalizer.get('type')!r} is not NFC"
    for token in spec.get("added_tokens", []):
        flags = [flag for flag in ("lstrip", "rstrip", "single_word") if token.get(flag)]
        if flags or (token.get("normalized") and normalizer is not None):
            return f"added token {token['content']!r} uses {', '.join(flags) or 'normalized'} matching"
    try:
        bpe.check_model(spec["model"])
        bpe.split_pattern(spec.get("pre_tokenizer"))
    except bpe.NotConvertible as exc:
        return str(exc)
    return None


def _tiktoken_parts(spec: dict[str, Any], sha256: str) -> tuple[str, dict[bytes, int]]:
    """tiktoken's regex and ranks for ``spec``, after proving rank order equals merge order."""
    pattern = bpe.split_pattern(spec.get("pre_tokenizer"))
    ranks = bpe.mergeable_ranks(spec["model"])
    if sha256 not in PROVEN_TOKENIZERS:
        pairs = bpe.merge_pairs(spec["model"], ranks)
        if not spec["model"].get("ignore_merges"):
            # Entries no merge builds (e.g. special tokens a trainer put in the vocab) never come out
            # of the reference's BPE, so tiktoken must not produce them either.
            ranks = {token: rank for token, rank in ranks.items() if len(token) == 1 or token in pairs}
        violations = bpe.rank_merge_violations(ranks, pairs)
        if violations:
            raise bpe.NotConvertible(f"{len(violations)} tokens (e.g. {violations[0]!r}) are built "
                                     "differently by rank order than by the merges list")
    return pattern, ranks


def _nfc_candidates() -> list[str]:
    """Characters whose NFC behaviour can depend on the Unicode version: marks, decomposables, unassigned."""
    planes = [*range(0xD800), *range(0xE000, 0x30000), *range(0xE0000, 0xE1000)]  # no surrogates
    out = []
    for char in map(chr, planes):
        decomposition = unicodedata.decomposition(char)
        if (unicodedata.combining(char) or (decomposition and not decomposition.startswith("<"))
                or unicodedata.category(char) == "Cn"):
            out.append(char)
    return out


def _differing(probes: list[str], reference: tokenizers.normalizers.Normalizer) -> list[bool]:
    # One joined call each; "\n" never composes or reorders, so probes stay independent.
    joined = "\n".join(probes)
    ours = unicodedata.normalize("NFC", joined).split("\n")
    theirs = reference.normalize_str(joined).split("\n")
    return [a != b for a, b in zip(ours, theirs)]


def cache_dir() -> Path | None:
    """Where derived data that is slow to compute is kept between runs (safe to delete); None when no
    home directory can be found (an arbitrary uid in a container): then nothing is cached."""
    try:
        root = os.environ.get("QWEN3_PRETRAIN_CACHE")
        if root:
            return Path(root).expanduser()
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen3-pretrain"
    except (RuntimeError, KeyError):
        return None


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """Hash of the code that derives the cached results: a change to it invalidates them."""
    digest = hashlib.sha256()
    for module_file in (__file__, bpe.__file__):
        digest.update(Path(module_file).read_bytes())
    return digest.hexdigest()[:12]


def _cache_file(*parts: str) -> Path | None:
    root = cache_dir()
    return None if root is None else root.joinpath(*parts)


def _write_cache(file: Path, write: Callable[[Path], None]) -> None:
    """``write`` to a temporary beside ``file``, then rename it into place; a failure only means no cache."""
    with contextlib.suppress(OSError):
        file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(file) as tmp:
            write(tmp)


@functools.lru_cache(maxsize=1)
def _nfc_disagreements() -> _CharGuard | None:
    """Matcher of the characters whose NFC differs between Python and ``tokenizers`` (None if none).

    Probing takes a third of a second; the answer depends only on the two
    libraries' Unicode tables, so it is kept on disk per pair of versions.
    A missing, unreadable or unwritable cache only means probing again.
    """
    file = _cache_file(f"nfc-disagreements-python{unicodedata.unidata_version}"
                       f"-tokenizers{tokenizers.__version__}-{_code_fingerprint()}.json")
    try:
        if file is None:
            raise OSError("no cache")
        chars = json.loads(file.read_text(encoding="utf-8"))["chars"]
        if not isinstance(chars, str):
            raise ValueError(file)
    except (OSError, ValueError, KeyError, TypeError):
        chars = "".join(sorted(_probe_nfc_disagreements()))
        if file is not None:
            _write_cache(file, lambda tmp: tmp.write_text(json.dumps({"chars": chars}), encoding="utf-8"))
    return _CharGuard(set(chars)) if chars else None


def _probe_nfc_disagreements() -> set[str]:
    """The characters whose NFC differs between Python and ``tokenizers``, by probing both."""
    chars = _nfc_candidates()
    reference_nfd = tokenizers.normalizers.NFD().normalize_str("\n".join(chars)).split("\n")
    python_nfd = [unicodedata.normalize("NFD", c) for c in chars]
    # The char alone; after a ccc-240 mark (reordered iff its ccc is known and below 240);
    # each library's decomposition (recomposed iff that composition is known).
    probe_sets = [chars, ["x\u0345" + c for c in chars], python_nfd, reference_nfd]
    flags = [_differing(probes, tokenizers.normalizers.NFC()) for probes in probe_sets]
    guard: set[str] = set()
    for i, char in enumerate(chars):
        if any(f[i] for f in flags):
            # A composition is triggered by its non-first parts, so those go on the list too.
            guard.update(char, python_nfd[i][1:], reference_nfd[i][1:])
    return guard


def load_tokenizer(path: str | os.PathLike, backend: Backend = "auto") -> _Tokenizer:
    """The tokenizer in ``path`` (folder or tokenizer.json): fast when exact, else the reference.

    ``backend="fast"`` raises UserError when the fast path cannot be exact;
    ``"auto"`` then falls back and records why in ``fallback_reason``.
    """
    if backend not in ("auto", "fast", "reference"):
        raise UserError(f"tokenizer_backend {backend!r}: choose auto, fast or reference")
    file = tokenizer_file(path)
    raw = file.read_bytes()
    return _load(file, raw, hashlib.sha256(raw).hexdigest(), backend)


# Keyed by content hash: a tokenizer is immutable once built, and building one takes a while.
@functools.lru_cache(maxsize=8)
def _load(file: Path, raw: bytes, sha256: str, backend: Backend) -> _Tokenizer:
    reason, spec = "tokenizer_backend: reference was asked for", None
    if backend != "reference":
        tables, reason, spec = _fast_tables(file, raw, sha256)
        if tables is not None:
            return FastTokenizer(file, raw, tables)
    if backend == "fast":
        raise UserError(f"tokenizer_backend: fast: {file} cannot be reproduced exactly by tiktoken "
                        f"({reason}); use tokenizer_backend: auto or reference")
    tokenizer = _reference(file, raw, spec if spec is not None else _parse(file, raw))
    tokenizer.fallback_reason = None if backend == "reference" else reason
    return tokenizer


def _parse(file: Path, raw: bytes) -> dict[str, Any]:
    try:
        spec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{file}: not a valid tokenizer.json ({exc})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise UserError(f"{file}: not a tokenizer.json (no 'model' section)")
    return spec


def _reference(file: Path, raw: bytes, spec: dict[str, Any]) -> ReferenceTokenizer:
    try:
        return ReferenceTokenizer(file, raw, spec)
    except Exception as exc:  # tokenizers raises plain Exception for a spec it cannot read
        raise UserError(f"{file}: the tokenizers library cannot load it ({exc})") from None
