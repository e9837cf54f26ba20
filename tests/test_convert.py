"""parquet -> Megatron shards: contents equal the `tokenizers` ids, layout rules, atomicity, bad input."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from tokenizers import Tokenizer

from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.convert import shards as convert_module
from qwen3_pretrain.convert import wiki
from qwen3_pretrain.convert.config import DataConvertConfig
from qwen3_pretrain.convert.run import convert
from qwen3_pretrain.data.indexed_dataset import IndexedDataset
from qwen3_pretrain.data.manifest import validate_manifest
from qwen3_pretrain.errors import ConfigError, UserError
from test_wiki import write_extracted

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "assets" / "qwen3-tokenizer"
DUMP = REPO / "assets" / "enwiki-sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
EOD = 151643
REFERENCE_KEYS = ["input_path", "tokenizer_path", "output_path", "seq_length", "shards", "do_lower_case",
                  "max_doc_length", "chunk_size"]


@pytest.fixture(scope="module")
def reference() -> Tokenizer:
    return Tokenizer.from_file(str(QWEN / "tokenizer.json"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "wiki.parquet"
    wiki.wiki_to_parquet(DUMP, path, workers=1)
    return path


@pytest.fixture(scope="module")
def reference_ids(corpus: Path, reference: Tokenizer) -> list[list[int]]:
    texts = pq.read_table(corpus).column("text").to_pylist()
    return [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]


def run(input_path: Path, output: Path, **overrides) -> dict:
    cfg = DataConvertConfig(input_path=str(input_path), tokenizer_path=str(QWEN), output_path=str(output),
                            **overrides)
    return convert(cfg)


def read_shards(output: Path, manifest: dict) -> list[list[list[int]]]:
    shards = [IndexedDataset(output / shard["prefix"]) for shard in manifest["shards"]]
    return [[shard[i].tolist() for i in range(len(shard))] for shard in shards]


def by_hand(lengths: list[int], num_shards: int) -> list[list[int]]:
    """The documented rule: each document to the shard with the fewest tokens so far, lowest index on ties."""
    load, members = [0] * num_shards, [[] for _ in range(num_shards)]
    for doc, length in enumerate(lengths):
        shard = min(range(num_shards), key=lambda k: (load[k], k))
        members[shard].append(doc)
        load[shard] += length
    return members


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith("shard_")}


# ---------------------------------------------------------------- contents and layout

def test_shards_hold_the_reference_ids_plus_eod(corpus: Path, reference_ids: list[list[int]], tmp_path: Path) -> None:
    manifest = run(corpus, tmp_path / "out", shards=4, workers=1)
    expected = [[reference_ids[d] + [EOD] for d in docs]
                for docs in by_hand([len(ids) + 1 for ids in reference_ids], 4)]
    assert read_shards(tmp_path / "out", manifest) == expected
    assert manifest["num_documents"] == manifest["num_sequences"] == 106
    assert manifest["num_tokens"] == sum(len(ids) + 1 for ids in reference_ids)


def test_manifest_schema(corpus: Path, tmp_path: Path) -> None:
    manifest = run(corpus, tmp_path / "out", shards=3, workers=1)
    assert manifest == json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert set(manifest) == {"format", "format_version", "dtype", "tokenizer", "seq_length", "num_documents",
                             "num_sequences", "num_tokens", "shards", "source", "config", "created", "elapsed_s"}
    assert (manifest["format"], manifest["format_version"], manifest["dtype"]) == ("megatron-indexed-dataset", 1,
                                                                                  "int32")
    assert manifest["tokenizer"] == {"path": str(QWEN.resolve()), "sha256":
                                     "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
                                     "vocab_size": 151669, "eod_id": EOD, "backend": "fast"}
    assert [s["prefix"] for s in manifest["shards"]] == ["shard_00000", "shard_00001", "shard_00002"]
    for key in ("num_documents", "num_sequences", "num_tokens"):
        assert manifest[key] == sum(s[key] for s in manifest["shards"])
    assert manifest["source"] == {"path": str(corpus.resolve()), "size_bytes": corpus.stat().st_size}
    assert set(REFERENCE_KEYS) <= set(manifest["config"]) and manifest["config"]["workers"] == 1
    assert datetime.fromisoformat(manifest["created"]).tzinfo is not None and manifest["elapsed_s"] > 0
    for shard in manifest["shards"]:
        data = IndexedDataset(tmp_path / "out" / shard["prefix"])
        assert (len(data), data.num_tokens) == (shard["num_sequences"], shard["num_tokens"])


def test_training_reader_accepts_the_output(corpus: Path, tmp_path: Path) -> None:
    run(corpus, tmp_path / "out", shards=2, workers=1)
    validate_manifest(tmp_path / "out", 151936, tokenizer_path=QWEN, seq_length=8192)


def test_byte_identical_whatever_workers_or_chunk_size(corpus: Path, tmp_path: Path) -> None:
    run(corpus, tmp_path / "one", shards=5, workers=1, chunk_size=1000)
    run(corpus, tmp_path / "two", shards=5, workers=2, chunk_size=7)
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")
    assert len(files_of(tmp_path / "one")) == 10


def test_long_documents_are_split_not_dropped(corpus: Path, reference_ids: list[list[int]], tmp_path: Path) -> None:
    manifest = run(corpus, tmp_path / "out", shards=3, max_doc_length=500, workers=2, chunk_size=20)
    docs = [ids + [EOD] for ids in reference_ids]
    pieces = [[doc[i:i + 500] for i in range(0, len(doc) - 1, 500)] for doc in docs]
    for doc, parts in zip(docs, pieces, strict=True):  # EOD rides on the last piece, even when that makes 501 tokens
        if (len(doc) - 1) % 500 == 0:
            parts[-1] = parts[-1] + [EOD]
    expected = [[p for d in members for p in pieces[d]] for members in by_hand(list(map(len, docs)), 3)]
    assert read_shards(tmp_path / "out", manifest) == expected
    assert manifest["num_sequences"] == sum(math.ceil(len(ids) / 500) for ids in reference_ids) > 106
    # The pieces of a document stay one document in the index (Megatron's end_document boundaries).
    for i, members in enumerate(by_hand(list(map(len, docs)), 3)):
        shard = IndexedDataset(tmp_path / "out" / f"shard_{i:05d}")
        assert np.diff(shard.document_indices).tolist() == [len(pieces[d]) for d in members]


def _megatron_idx(path: Path) -> dict:
    """The .idx fields, parsed from the published layout with struct alone (independent of our reader)."""
    raw = path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, num_seqs, num_docs = struct.unpack_from("<QBQQ", raw, 9)
    off = 9 + 8 + 1 + 8 + 8
    lengths = struct.unpack_from(f"<{num_seqs}i", raw, off)
    pointers = struct.unpack_from(f"<{num_seqs}q", raw, off + 4 * num_seqs)
    docs = struct.unpack_from(f"<{num_docs}q", raw, off + 12 * num_seqs)
    assert len(raw) == off + 12 * num_seqs + 8 * num_docs
    return dict(version=version, code=code, lengths=lengths, pointers=pointers, docs=docs)


def test_shards_follow_the_megatron_layout_byte_for_byte(corpus: Path, reference_ids: list[list[int]],
                                                          tmp_path: Path) -> None:
    manifest = run(corpus, tmp_path / "out", shards=2, max_doc_length=700, workers=1)
    docs = [ids + [EOD] for ids in reference_ids]
    for i, members in enumerate(by_hand(list(map(len, docs)), 2)):
        idx = _megatron_idx(tmp_path / "out" / f"shard_{i:05d}.idx")
        data = (tmp_path / "out" / f"shard_{i:05d}.bin").read_bytes()
        assert (idx["version"], idx["code"]) == (1, 4)  # int32 for Qwen's vocabulary
        tokens = struct.unpack(f"<{len(data) // 4}i", data)
        sequences = [list(tokens[p // 4:p // 4 + n]) for p, n in zip(idx["pointers"], idx["lengths"], strict=True)]
        assert [t for seq in sequences for t in seq] == [t for d in members for t in docs[d]]
        bounds = [0]
        for d in members:  # a document longer than 700 tokens is several sequences, still one document
            bounds.append(bounds[-1] + max(1, math.ceil((len(docs[d]) - 1) / 700)))
        assert list(idx["docs"]) == bounds
        assert manifest["shards"][i]["num_sequences"] == len(sequences)


def _parquet(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_lower_case_no_eod_special_strings_and_empty_rows(tmp_path: Path, reference: Tokenizer) -> None:
    texts = ["Hello World", "", None, "A <|endoftext|> B <think>"]
    source = _parquet(tmp_path / "small.parquet", {"text": pa.array(texts, pa.string())})
    manifest = run(source, tmp_path / "out", shards=1, do_lower_case=True, append_eod=False)
    expected = [reference.encode(t, add_special_tokens=False).ids for t in ("hello world", "a <|endoftext|> b <think>")]
    assert read_shards(tmp_path / "out", manifest) == [expected]
    assert EOD in expected[1] and manifest["num_documents"] == 2


def test_both_wiki_routes_give_identical_shards(corpus: Path, tmp_path: Path) -> None:
    write_extracted(tmp_path / "wiki_text", pq.read_table(corpus).to_pylist(), "doc")
    wiki.wiki_to_parquet(tmp_path / "wiki_text", tmp_path / "extracted.parquet")
    run(corpus, tmp_path / "direct", shards=2, workers=1)
    run(tmp_path / "extracted.parquet", tmp_path / "via_folder", shards=2, workers=1)
    assert files_of(tmp_path / "direct") == files_of(tmp_path / "via_folder")


def test_folder_and_glob_inputs_read_files_in_order(corpus: Path, tmp_path: Path) -> None:
    table = pq.read_table(corpus)
    (tmp_path / "parts").mkdir()
    pq.write_table(table.slice(0, 50), tmp_path / "parts" / "a.parquet")
    pq.write_table(table.slice(50), tmp_path / "parts" / "b.parquet")
    run(corpus, tmp_path / "single", shards=2, workers=1)
    run(tmp_path / "parts", tmp_path / "folder", shards=2, workers=1)
    run(tmp_path / "parts" / "*.parquet", tmp_path / "glob", shards=2, workers=1)
    assert files_of(tmp_path / "single") == files_of(tmp_path / "folder") == files_of(tmp_path / "glob")


# ---------------------------------------------------------------- output folder handling

def test_rerun_replaces_output_and_removes_stale_shards(corpus: Path, tmp_path: Path) -> None:
    run(corpus, tmp_path / "out", shards=4, workers=1)
    (tmp_path / "out" / "notes.txt").write_text("mine")
    manifest = run(corpus, tmp_path / "out", shards=2, workers=1)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["manifest.json", "notes.txt", "shard_00000.bin", "shard_00000.idx", "shard_00001.bin",
                     "shard_00001.idx"]
    assert len(manifest["shards"]) == 2


def test_output_from_another_tokenizer_is_refused(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"tokenizer": {"sha256": "0123456789ab" + "0" * 52}}))
    (out / "shard_00000.bin").write_bytes(b"old")
    with pytest.raises(UserError, match="made with another tokenizer .*0123456789ab.*choose another output_path"):
        run(corpus, out, shards=1)
    assert (out / "shard_00000.bin").read_bytes() == b"old" and (out / "manifest.json").exists()


def test_interrupted_run_leaves_no_manifest_and_no_shards(corpus: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run(corpus, tmp_path / "out", shards=2, workers=1)
    add, calls = convert_module.ShardWriter.add, []

    def add_then_die(self, doc) -> None:
        calls.append(1)
        if len(calls) == 50:
            raise KeyboardInterrupt
        add(self, doc)

    monkeypatch.setattr(convert_module.ShardWriter, "add", add_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(corpus, tmp_path / "out", shards=2, workers=2, chunk_size=10)
    assert list((tmp_path / "out").iterdir()) == []


# ---------------------------------------------------------------- bad input

def test_bad_parquet_inputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="input_path .*missing.parquet' does not exist"):
        run(tmp_path / "missing.parquet", out)
    (tmp_path / "garbage.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(UserError, match="garbage.parquet: not a readable parquet file"):
        run(tmp_path / "garbage.parquet", out)
    wrong = _parquet(tmp_path / "wrong.parquet", {"id": ["1"], "body": ["x"]})
    with pytest.raises(UserError, match=r"wrong.parquet: no column 'text' \(columns: id, body\)"):
        run(wrong, out)
    numbers = _parquet(tmp_path / "numbers.parquet", {"text": [1, 2]})
    with pytest.raises(UserError, match="column 'text' holds int64, not text"):
        run(numbers, out)
    empty = _parquet(tmp_path / "empty.parquet", {"text": pa.array(["", None], pa.string())})
    with pytest.raises(UserError, match="no document has any text"):
        run(empty, out)
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.parametrize("key, value, message", [
    ("shards", 0, "shards: 0 is too small; give at least 1"),
    ("seq_length", 1, "seq_length: 1 is too small; give at least 2"),
    ("chunk_size", 0, "chunk_size: 0 is too small; give at least 1"),
    ("max_doc_length", 0, "max_doc_length: 0 is too small"),
])
def test_config_values_are_checked_before_anything_is_written(corpus: Path, tmp_path: Path, key: str, value: int,
                                                              message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run(corpus, tmp_path / "out", **{key: value})
    assert not (tmp_path / "out").exists()


def test_example_config_mirrors_the_reference(tmp_path: Path) -> None:
    cfg = load_config(DataConvertConfig, REPO / "examples" / "pretain_data_config.yaml")
    assert (cfg.input_path, cfg.tokenizer_path, cfg.output_path) == ("runs/data/wiki.parquet",
                                                                     "assets/qwen3-tokenizer", "runs/data/d_convert")
    assert (cfg.seq_length, cfg.shards, cfg.do_lower_case, cfg.max_doc_length, cfg.chunk_size) == (
        8192, 16, False, 100000, 5000)
    with pytest.raises(ConfigError, match="unknown key 'chunk_sise'; did you mean 'chunk_size'"):
        load_config(DataConvertConfig, None, ["chunk_sise=3", "input_path=a", "tokenizer_path=b", "output_path=c"])


def _cli(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_cli_success_and_errors_without_traceback(tmp_path: Path) -> None:
    source = _parquet(tmp_path / "small.parquet", {"text": ["First document.", "Second one, longer."]})
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"input_path": str(source), "tokenizer_path": str(QWEN),
                                      "output_path": str(tmp_path / "out"), "shards": 0}))
    bad = _cli("-m", "qwen3_pretrain", "convert", "--config", config, cwd=REPO)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: ") and "shards: 0 is too small" in bad.stderr
    missing = _cli(REPO / "tools" / "data_convert.py", "--config", config, "shards=2",
                   "input_path=nope.parquet", cwd=tmp_path)
    assert missing.returncode == 2 and "error: input_path 'nope.parquet' does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr and not (tmp_path / "out").exists()
    ok = _cli(REPO / "tools" / "data_convert.py", "--config", config, "shards=2", "seq_length=1e3", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "convert: 2 documents" in ok.stdout and "tokenizer: fast" in ok.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["seq_length"] == 1000


def test_documents_without_tokens_keep_the_counts_true(tmp_path: Path) -> None:
    """A document whose text tokenizes to nothing is its EOD alone (a sequence of one token), or, without
    EOD, not written at all; the manifest's counts always match what the shard holds."""
    shards = convert_module.ShardWriter([tmp_path / "shard_00000"], np.int32, 4, eod=True)
    assert shards.add(np.array([7, 8, EOD], dtype=np.int32)) and shards.add(np.array([EOD], dtype=np.int32))
    assert not shards.add(np.array([], dtype=np.int32))
    shards.finalize()
    shard = IndexedDataset(tmp_path / "shard_00000")
    counts = shards.counts[0]
    assert (counts.num_documents, counts.num_sequences, counts.num_tokens) == (2, 2, 4)
    assert shard.sequence_lengths.tolist() == [3, 1] and shard.document_indices.tolist() == [0, 1, 2]


def test_token_ids_that_do_not_fit_a_uint16_shard_are_refused(tmp_path: Path) -> None:
    from qwen3_pretrain.data.indexed_dataset import IndexedDatasetWriter

    writer = IndexedDatasetWriter(tmp_path / "small", np.uint16)
    writer.add_sequence(np.array([1, 65535]))
    with pytest.raises(UserError, match="token id 70000 does not fit"):
        writer.add_sequence(np.array([70000, 3]))
    writer.abort()


def test_fewer_documents_than_shards_writes_no_empty_shard(tmp_path: Path, capsys) -> None:
    """Megatron's reader cannot open a shard without documents: only shards that hold some are written and
    listed, with a warning naming ``shards``; the reader reads the rest."""
    source = _parquet(tmp_path / "three.parquet", {"text": pa.array(["one doc", "two docs", "three"], pa.string())})
    manifest = run(source, tmp_path / "out", shards=16, seq_length=4)
    assert [s["prefix"] for s in manifest["shards"]] == ["shard_00000", "shard_00001", "shard_00002"]
    assert all(s["num_documents"] == 1 for s in manifest["shards"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        ["manifest.json"] + [f"shard_{i:05d}.{x}" for i in range(3) for x in ("bin", "idx")]
    assert "warning: shards: 16 asked, but the input has only 3 documents: wrote 3 shards" in capsys.readouterr().err
    validate_manifest(tmp_path / "out", 151936, QWEN, 4)
