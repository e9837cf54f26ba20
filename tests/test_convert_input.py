"""convert's inputs: units bounded by documents and bytes, JSON lines (plain, gzip, zstd), HF dataset folders,
and clear errors for bad files, keys and lines. Shards are compared with those of the plain parquet route."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from qwen3_pretrain.convert import inputs as convert_input
from qwen3_pretrain.convert.inputs import input_files, units
from qwen3_pretrain.errors import MissingFileError, UserError
from test_convert import corpus, files_of, run  # noqa: F401  (corpus is a fixture)


@pytest.fixture(scope="module")
def texts(corpus: Path) -> list[str]:  # noqa: F811
    return pq.read_table(corpus).column("text").to_pylist()


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


# ---------------------------------------------------------------- units of work

@pytest.mark.parametrize("chunk_size, chunk_bytes", [(5000, 200_000), (7, 1 << 40), (30, 100_000)])
def test_units_stop_at_documents_or_bytes_and_keep_order(corpus: Path, texts: list[str],  # noqa: F811
                                                         chunk_size: int, chunk_bytes: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert_input, "_READ_ROWS", 5)  # units gather several reads
    got = list(units([corpus], "text", chunk_size, chunk_bytes))
    docs = [unit.documents("text") for unit in got]
    assert [t for unit in docs for t in unit] == texts
    for unit, unit_docs in zip(got, docs, strict=True):
        sizes = [_size(t) for t in unit_docs]
        assert unit.num_bytes == sum(sizes) and 1 <= len(unit_docs) <= chunk_size
        assert sum(sizes[:-1]) < chunk_bytes  # the budget was not reached before its last document
    full = [len(d) == chunk_size or u.num_bytes >= chunk_bytes for u, d in zip(got, docs)]
    assert all(full[:-1])  # only the last unit ends early
    if chunk_size == 5000:  # the reference config's chunk_size no longer makes this input one unit
        assert len(got) >= sum(map(_size, texts)) // (chunk_bytes + max(map(_size, texts)))
        assert len(got) > 4


def test_output_identical_whatever_chunking_and_workers(corpus: Path, tmp_path: Path) -> None:  # noqa: F811
    run(corpus, tmp_path / "a", shards=3, workers=1, chunk_size=5000, chunk_bytes=1 << 40)
    run(corpus, tmp_path / "b", shards=3, workers=2, chunk_size=5000, chunk_bytes=60_000)
    run(corpus, tmp_path / "c", shards=3, workers=2, chunk_size=3, chunk_bytes=1 << 20)
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b") == files_of(tmp_path / "c")


# ---------------------------------------------------------------- JSON lines and HF folders

def _jsonl_bytes(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(row).encode("utf-8") + b"\n" for row in rows)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json.zst"])
def test_jsonl_gives_the_parquet_shards(corpus: Path, texts: list[str], tmp_path: Path,  # noqa: F811
                                        suffix: str) -> None:
    rows = [{"id": i, "content": t, "meta": {"n": i}} for i, t in enumerate(texts)]
    data = _jsonl_bytes(rows[:40]) + b"\n   \n" + _jsonl_bytes(rows[40:])  # blank lines are not documents
    compress = {".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}.get(Path(suffix).suffix)
    source = tmp_path / f"docs{suffix}"
    source.write_bytes(compress(data) if compress else data)
    run(corpus, tmp_path / "parquet", shards=3, workers=1)
    manifest = run(source, tmp_path / "jsonl", shards=3, workers=2, text_column="content", chunk_bytes=100_000)
    assert files_of(tmp_path / "parquet") == files_of(tmp_path / "jsonl")
    assert manifest["num_documents"] == len(texts)


def test_hf_dataset_folder_with_a_named_column(corpus: Path, tmp_path: Path) -> None:  # noqa: F811
    table = pq.read_table(corpus).rename_columns(["id", "title", "url", "body"])
    data = tmp_path / "hf" / "data"
    data.mkdir(parents=True)
    pq.write_table(table.slice(0, 60), data / "train-00000-of-00002.parquet", row_group_size=9)
    pq.write_table(table.slice(60), data / "train-00001-of-00002.parquet")
    (tmp_path / "hf" / "README.md").write_text("dataset card")
    run(corpus, tmp_path / "single", shards=2, workers=1)
    run(tmp_path / "hf", tmp_path / "folder", shards=2, workers=2, text_column="body", chunk_bytes=50_000)
    run(tmp_path / "hf" / "data" / "train-*.parquet", tmp_path / "glob", shards=2, workers=1, text_column="body")
    assert files_of(tmp_path / "single") == files_of(tmp_path / "folder") == files_of(tmp_path / "glob")


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("lines, message", [
    (['{"text": "a"}', '{"text": "b"', '{"text": "c"}'], r"bad.jsonl:2: not a JSON object"),
    (['{"text": "a"}', "", '{"body": "b", "id": 3}'], r"bad.jsonl:3: no key 'text' \(keys: body, id\); set text_column"),
    (['{"text": 5}'], r"bad.jsonl:1: 'text' holds a int, not text"),
    (['["text"]'], r"bad.jsonl:1: a list, not a JSON object"),
])
def test_bad_json_lines_name_file_and_line(tmp_path: Path, lines: list[str], message: str) -> None:
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=message):
        run(tmp_path / "bad.jsonl", tmp_path / "out", shards=1, workers=2, chunk_size=1)
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not any(p.name.startswith("shard_") for p in (tmp_path / "out").iterdir())


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match=r"input_path .*nothing-\*\.jsonl': no parquet or JSON-lines files"):
        run(tmp_path / "nothing-*.jsonl", tmp_path / "out")
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.csv").write_text("text\nb\n")
    with pytest.raises(UserError, match=r"b.csv is neither parquet .* nor JSON lines"):
        run(tmp_path / "*", tmp_path / "out")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"\x1f\x8b this is not gzip data")
    with pytest.raises(UserError, match=r"broken.jsonl.gz: cannot be read or decompressed"):
        run(tmp_path / "broken.jsonl.gz", tmp_path / "out")
    (tmp_path / "broken.jsonl.zst").write_bytes(b"not zstd")
    with pytest.raises(UserError, match=r"broken.jsonl.zst: cannot be decompressed"):
        run(tmp_path / "broken.jsonl.zst", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_folder_prefers_parquet_and_sorts(tmp_path: Path) -> None:
    for name in ("b/2.parquet", "a/1.parquet", "c.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        pq.write_table(pa.table({"text": ["x"]}), tmp_path / name) if name.endswith("parquet") else \
            (tmp_path / name).write_text('{"text": "x"}\n')
    assert input_files(str(tmp_path)) == [tmp_path / "a" / "1.parquet", tmp_path / "b" / "2.parquet"]
    (tmp_path / "a" / "1.parquet").unlink()
    (tmp_path / "b" / "2.parquet").unlink()
    assert input_files(str(tmp_path)) == [tmp_path / "c.jsonl"]
