"""The fast tokenizer gives exactly the ids of the `tokenizers` library, or is not used."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import unicodedata
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from qwen3_pretrain.convert import bpe
from qwen3_pretrain.convert.tokenizer import PROVEN_TOKENIZERS, load_tokenizer
from qwen3_pretrain.convert.wiki_dump import iter_dump_articles
from qwen3_pretrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "assets" / "qwen3-tokenizer"
DUMP = REPO / "assets" / "enwiki-sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
ADDED = [t["content"] for t in json.loads((QWEN / "tokenizer.json").read_text())["added_tokens"]]


@pytest.fixture(scope="module")
def reference() -> Tokenizer:
    return Tokenizer.from_file(str(QWEN / "tokenizer.json"))


@pytest.fixture(scope="module")
def fast():
    tokenizer = load_tokenizer(QWEN)
    assert tokenizer.backend == "fast"
    return tokenizer


@pytest.fixture(scope="module")
def articles() -> list[str]:
    return [text for *_, text in iter_dump_articles([DUMP], workers=1)]


def ids(reference: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]


def test_reference_check_string(fast, reference: Tokenizer) -> None:
    expected = [9707, 1879, 11, 220, 108386, 99489, 0, 220, 16, 17, 18, 19, 20]
    assert fast.encode("Hello world, 你好世界! 12345") == expected
    assert load_tokenizer(QWEN, "reference").encode("Hello world, 你好世界! 12345") == expected


def test_identity(fast, reference: Tokenizer) -> None:
    assert fast.vocab_size == reference.get_vocab_size(with_added_tokens=True) == 151669
    assert fast.eod_id == reference.token_to_id("<|endoftext|>") == 151643
    assert fast.sha256 == hashlib.sha256((QWEN / "tokenizer.json").read_bytes()).hexdigest()
    assert load_tokenizer(QWEN / "tokenizer.json").sha256 == fast.sha256
    ref = load_tokenizer(QWEN, "reference")
    assert (ref.backend, ref.vocab_size, ref.eod_id, ref.sha256) == ("reference", 151669, 151643, fast.sha256)


def test_fast_equals_reference_on_every_dump_article(fast, reference: Tokenizer, articles: list[str]) -> None:
    assert len(articles) == 106
    assert fast.encode_batch(articles) == ids(reference, articles)
    lowered = [text.lower() for text in articles[:30]]
    assert fast.encode_batch(lowered) == ids(reference, lowered)


def test_merge_order_equals_rank_order_for_qwen3() -> None:
    """The proof behind PROVEN_TOKENIZERS: every token is built the same way by ranks and by merges."""
    spec = json.loads((QWEN / "tokenizer.json").read_text())
    ranks = bpe.mergeable_ranks(spec["model"])
    pairs = bpe.merge_pairs(spec["model"], ranks)  # raises unless ids grow with merge order
    assert len(pairs) == len(ranks) - 256 == 151387
    assert bpe.rank_merge_violations(ranks, pairs) == []
    assert hashlib.sha256((QWEN / "tokenizer.json").read_bytes()).hexdigest() in PROVEN_TOKENIZERS


# ---------------------------------------------------------------- other tokenizers

def _byte_alphabet() -> list[str]:
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _write(folder: Path, spec: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return folder


def _tiny_spec(extra: list[str], merges: list[list[str]]) -> dict:
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    vocab.update({token: 256 + i for i, token in enumerate(extra)})
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": 256 + len(extra), "content": "<|endoftext|>", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False, "special": True}],
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": True},
            "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": merges}}


def test_proof_catches_rank_order_that_differs_from_merges(tmp_path: Path) -> None:
    # "abc" is listed as a + bc, but by rank a+b merges first and then ab + c gives abc.
    spec = _tiny_spec(["ab", "bc", "abc"], [["a", "b"], ["b", "c"], ["a", "bc"]])
    folder = _write(tmp_path / "tiny", spec)
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert reference.encode("abc", add_special_tokens=False).tokens == ["ab", "c"]
    ranks = bpe.mergeable_ranks(spec["model"])
    naive = tiktoken.Encoding("naive", pat_str=bpe.GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    assert naive.encode_ordinary("abc") == [258]  # what an unchecked conversion would give
    assert bpe.rank_merge_violations(ranks, bpe.merge_pairs(spec["model"], ranks)) == [b"abc"]
    auto = load_tokenizer(folder)
    assert auto.backend == "reference" and "rank order" in auto.fallback_reason
    assert auto.encode("abc abc") == reference.encode("abc abc", add_special_tokens=False).ids
    with pytest.raises(UserError, match="cannot be reproduced exactly by tiktoken"):
        load_tokenizer(folder, "fast")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, articles: list[str]) -> Path:
    """A GPT-2-style byte-level BPE trained here (its special tokens sit in the vocabulary too)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<pad>"], show_progress=False)
    tokenizer.train_from_iterator(articles[:40], trainer)
    return _write(tmp_path_factory.mktemp("trained"), json.loads(tokenizer.to_str()))


def test_trained_gpt2_style_tokenizer_takes_the_exact_fast_path(trained: Path, articles: list[str]) -> None:
    tokenizer = load_tokenizer(trained)
    reference = Tokenizer.from_file(str(trained / "tokenizer.json"))
    assert (tokenizer.backend, tokenizer.eod_id, tokenizer.vocab_size) == ("fast", 0, 1200)
    texts = articles + ["x<|endoftext|>y<pad>", "<pad><|endoftext|>"]
    assert tokenizer.encode_batch(texts) == ids(reference, texts)


@pytest.mark.parametrize("edit, reason", [
    (lambda s: s.update(normalizer={"type": "NFKC"}), "normalizer 'NFKC'"),
    (lambda s: s.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                                       "split": True}), "is not [ByteLevel]"),
    (lambda s: s["added_tokens"][0].update(lstrip=True), "uses lstrip matching"),
    (lambda s: s["model"].update(byte_fallback=True), "byte_fallback"),
    (lambda s: s["model"].update(type="WordLevel", unk_token="<|endoftext|>"), "model type 'WordLevel'"),
])
def test_unconvertible_tokenizers_fall_back_to_reference(trained: Path, tmp_path: Path, edit, reason: str) -> None:
    spec = json.loads((trained / "tokenizer.json").read_text())
    edit(spec)
    folder = _write(tmp_path / "edited", spec)
    tokenizer = load_tokenizer(folder)
    assert tokenizer.backend == "reference" and reason in tokenizer.fallback_reason
    text = "Ünïcode text, <|endoftext|> and more"
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids
    with pytest.raises(UserError, match=re.escape(reason)):
        load_tokenizer(folder, "fast")


# ---------------------------------------------------------------- properties

def test_normalization_differences_are_routed_to_the_reference(fast, reference: Tokenizer) -> None:
    # Python's unicodedata and the Rust normalizer disagree on marks added to Unicode after the latter's tables.
    text = "x\u1df6\u0301 a\u0316\u1df6 \U00011935\U00011930 e\u0301"
    assert unicodedata.normalize("NFC", text) != normalizers.NFC().normalize_str(text)
    assert fast.encode(text) == reference.encode(text, add_special_tokens=False).ids


SAMPLES = ["Hello world", "naïve café\u0301 <|im_end|> 東京", "x = [1, 2]\n\n\t  end  ", "<|endoftext|>"]


def test_fast_tables_are_cached_and_give_the_same_tokenizer(tmp_path: Path, monkeypatch) -> None:
    from qwen3_pretrain.convert import tokenizer as T

    monkeypatch.setenv("QWEN3_PRETRAIN_CACHE", str(tmp_path))
    T._load.cache_clear()
    try:
        built = load_tokenizer(QWEN)
        (file,) = (tmp_path / "tokenizers").glob("*.npz")
        T._load.cache_clear()
        monkeypatch.setattr(T, "_parse", lambda *a: pytest.fail("tokenizer.json parsed despite the cache"))
        cached = load_tokenizer(QWEN)
        assert cached is not built and cached.backend == "fast"
        assert (cached.vocab_size, cached.eod_id, cached.added_tokens) == (built.vocab_size, built.eod_id,
                                                                           built.added_tokens)
        assert cached._encoding._mergeable_ranks == built._encoding._mergeable_ranks
        assert [cached.encode(t) for t in SAMPLES] == [built.encode(t) for t in SAMPLES]
        monkeypatch.undo()
        monkeypatch.setenv("QWEN3_PRETRAIN_CACHE", str(tmp_path))
        for damage in (b"not a zip file", file.read_bytes()[:1000]):  # garbage, truncated: derived again
            file.write_bytes(damage)
            T._load.cache_clear()
            assert [load_tokenizer(QWEN).encode(t) for t in SAMPLES] == [built.encode(t) for t in SAMPLES]
            assert T.FastTables.load(file).ranks == built._encoding._mergeable_ranks  # and rewritten
    finally:
        T._load.cache_clear()


def test_cached_results_are_keyed_by_the_code_that_derived_them(tmp_path: Path, monkeypatch) -> None:
    from qwen3_pretrain.convert import tokenizer as T

    monkeypatch.setenv("QWEN3_PRETRAIN_CACHE", str(tmp_path))
    T._load.cache_clear(), T._nfc_disagreements.cache_clear()
    try:
        load_tokenizer(QWEN)
        before = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
        monkeypatch.setattr(T, "_code_fingerprint", lambda: "changedcode0")
        T._load.cache_clear(), T._nfc_disagreements.cache_clear()
        load_tokenizer(QWEN)
        after = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
        assert len(before) == 2 and len(after) == 4 and all("changedcode0" not in n for n in before)
    finally:
        T._load.cache_clear(), T._nfc_disagreements.cache_clear()


def test_no_home_directory_means_no_cache_not_an_error(monkeypatch) -> None:
    from qwen3_pretrain.convert import tokenizer as T

    monkeypatch.delenv("QWEN3_PRETRAIN_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    T._load.cache_clear(), T._nfc_disagreements.cache_clear()
    try:
        assert T.cache_dir() is None
        assert load_tokenizer(QWEN).encode("no home <|im_end|>") == load_tokenizer(QWEN, "reference").encode(
            "no home <|im_end|>")
    finally:
        T._load.cache_clear(), T._nfc_disagreements.cache_clear()


def test_fast_tables_cache_key_covers_the_end_of_document_config(tmp_path: Path) -> None:
    from qwen3_pretrain.convert.tokenizer import _tables_cache_file

    (tmp_path / "tokenizer.json").write_bytes(b"{}")
    alone = _tables_cache_file("ab" * 32, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    with_config = _tables_cache_file("ab" * 32, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    assert len({alone, with_config, _tables_cache_file("ab" * 32, tmp_path / "tokenizer.json")}) == 3


def test_normalization_differences_are_cached_per_library_versions(tmp_path: Path, monkeypatch) -> None:
    from qwen3_pretrain.convert import tokenizer as T

    monkeypatch.setenv("QWEN3_PRETRAIN_CACHE", str(tmp_path))
    probed = T._probe_nfc_disagreements()
    assert "\u1df6" in probed  # a mark the two libraries' tables disagree on (see the test above)
    T._nfc_disagreements.cache_clear()
    try:
        first = T._nfc_disagreements()
        (file,) = tmp_path.glob("nfc-disagreements-*.json")
        assert set(json.loads(file.read_text(encoding="utf-8"))["chars"]) == probed
        T._nfc_disagreements.cache_clear()
        monkeypatch.setattr(T, "_probe_nfc_disagreements", lambda: pytest.fail("probed again despite the cache"))
        assert T._nfc_disagreements().found_in("x\u1df6") and first.found_in("x\u1df6")
        T._nfc_disagreements.cache_clear()
        file.write_text("{not json", encoding="utf-8")  # a damaged cache is probed again and rewritten
        monkeypatch.setattr(T, "_probe_nfc_disagreements", lambda: probed)
        assert T._nfc_disagreements().found_in("x\u1df6")
        assert set(json.loads(file.read_text(encoding="utf-8"))["chars"]) == probed
    finally:
        T._nfc_disagreements.cache_clear()


COMBINING = st.characters(codec=None, categories=("Mn", "Mc", "Me"))
LETTERS = st.characters(categories=("Lu", "Ll", "Lo"), max_codepoint=0x2FFF)
WHITESPACE = st.sampled_from(list(" \t\n\r\x0b\x0c\x85\xa0\u1680\u2000\u2007\u200b\u2028\u2029\u202f\u3000"))
EMOJI = st.one_of(st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), st.sampled_from(["\u200d", "\ufe0f"]))
CODE = st.sampled_from(["def f(x):\n", "    return x**2\n", "if (a && b) { c++; }", "x = [1, 2, 3]  # note",
                        "\t\tindent", "'s 't 're 've 'm 'll 'd", "    \n\n  ", "SELECT * FROM t;", "0x1F", "1e-5"])
SPECIALS = st.sampled_from(ADDED + ["<|endoftext|", "<|endoftext|>\u0338", "<think", "</think >", "<|im_start|><|"])


def _mixed(*parts: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.lists(st.one_of(*parts), max_size=30).map("".join)


STRATEGIES = {
    "unicode": st.text(max_size=60),
    "cjk": st.text(st.characters(min_codepoint=0x3000, max_codepoint=0x9FFF), max_size=40),
    "emoji": _mixed(EMOJI, st.text(max_size=3)),
    "code": _mixed(CODE, st.text("abcxyz_(){}[]<>=+-*/\\\"'.,:;!?#@$%^&|~`", max_size=8)),
    "whitespace": _mixed(WHITESPACE, st.text("ab1.", max_size=2)),
    "digits": st.text("0123456789١٢٣४५๖໗ ,.-+", max_size=40),
    "combining": _mixed(LETTERS, COMBINING, st.sampled_from(["\u1df6", "\u0301", "\u0338", "\u0345", "e", "A"])),
    "specials": _mixed(SPECIALS, st.text(max_size=5), COMBINING),
}


@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_fast_equals_reference_on_generated_text(fast, reference: Tokenizer, kind: str) -> None:
    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(STRATEGIES[kind])
    def check(text: str) -> None:
        assert fast.encode(text) == reference.encode(text, add_special_tokens=False).ids

    check()


def test_pickles_by_path(fast) -> None:
    clone = pickle.loads(pickle.dumps(fast))
    assert (clone.backend, clone.sha256) == ("fast", fast.sha256)
    assert clone.encode("pickled <|im_end|>") == fast.encode("pickled <|im_end|>")


def test_bad_tokenizer_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json there"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(UserError, match="choose auto, fast or reference"):
        load_tokenizer(QWEN, "quick")


def test_tokenizer_without_end_of_document_token(tmp_path: Path) -> None:
    spec = _tiny_spec(["ab"], [["a", "b"]])
    spec["added_tokens"] = []
    with pytest.raises(UserError, match="no end-of-document token"):
        load_tokenizer(_write(tmp_path, spec))
