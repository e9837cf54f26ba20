"""The training data reader: packed samples, shuffling, splits, global batches, resume, manifest checks.

Synthetic documents encode ``(document, position)`` in every token id, so a
sample can be checked by hand: a window of the packed stream must consist of
whole documents in order, each followed by EOD.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen3_pretrain.data.indexed_dataset import IndexedDatasetWriter
from qwen3_pretrain.data.reader import BadToken, GlobalBatchLoader, PackedDataset, open_corpus
from qwen3_pretrain.data.manifest import validate_manifest
from qwen3_pretrain.data.synthetic import write_synthetic_dataset
from qwen3_pretrain.errors import UserError

EOD = 0
STRIDE = 100_000  # token id = 1 + doc * STRIDE + position in doc
NUM_DOCS = 200
PIECE = 25  # documents longer than this are stored as several sequences


def make_docs(num_docs: int = NUM_DOCS, seed: int = 0, max_len: int = 60) -> list[np.ndarray]:
    lengths = np.random.default_rng(seed).integers(1, max_len, num_docs)
    return [1 + d * STRIDE + np.arange(n) for d, n in enumerate(lengths)]


def stream_of(docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.append(d, EOD) for d in docs])


def decode(token: int) -> tuple[int, int]:
    return (token - 1) // STRIDE, (token - 1) % STRIDE


@pytest.fixture
def data(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    docs = make_docs()
    write_synthetic_dataset(tmp_path / "data", docs, EOD, docs_per_shard=70, max_piece_length=PIECE)
    return tmp_path / "data", docs


def window_of(sample: dict[str, torch.Tensor]) -> np.ndarray:
    return np.append(sample["input_ids"].numpy(), sample["labels"].numpy()[-1])


def check_packed_window(window: np.ndarray, docs: list[np.ndarray]) -> None:
    """Every token is followed by the next token of its document, or EOD, and EOD by a document start."""
    for a, b in zip(window[:-1].tolist(), window[1:].tolist()):
        if a == EOD:
            assert b != EOD and decode(b)[1] == 0
        else:
            doc, pos = decode(a)
            assert b == (EOD if pos + 1 == len(docs[doc]) else a + 1)


def expected_positions(input_ids: np.ndarray) -> np.ndarray:
    """Hand reference: each document's own positions, shifted to start at 0 where the sample cuts it."""
    eods = np.flatnonzero(input_ids == EOD)
    first_eod = int(eods[0]) if len(eods) else len(input_ids)
    shift = decode(int(input_ids[0]))[1] if first_eod > 0 else 0
    out = np.zeros(len(input_ids), dtype=np.int64)
    for t, token in enumerate(input_ids.tolist()):
        if token != EOD:
            out[t] = decode(token)[1] - (shift if t < first_eod else 0)
        elif t > 0:
            out[t] = out[t - 1] + 1
    return out


@pytest.mark.parametrize("seq_length", [7, 16, 100])
def test_unshuffled_windows_cover_the_corpus_in_order(data, seq_length):
    path, docs = data
    stream = stream_of(docs)
    ds = PackedDataset(path, seq_length, shuffle=False)
    assert len(ds) == (len(stream) - 1) // seq_length
    for j in range(len(ds)):
        s = ds[j]
        assert s["input_ids"].dtype == s["labels"].dtype == s["positions"].dtype == torch.int64
        np.testing.assert_array_equal(s["input_ids"].numpy(), stream[j * seq_length:(j + 1) * seq_length])
        np.testing.assert_array_equal(s["labels"].numpy(), stream[j * seq_length + 1:(j + 1) * seq_length + 1])
    # Unshuffled epochs repeat exactly.
    np.testing.assert_array_equal(ds[len(ds) + 3]["input_ids"].numpy(), ds[3]["input_ids"].numpy())


def test_shuffled_samples_are_packed_whole_documents_with_document_positions(data):
    path, docs = data
    ds = PackedDataset(path, 32, seed=7)
    for i in list(range(0, len(ds), 5)) + [len(ds) + 1, 3 * len(ds) + 2]:
        s = ds[i]
        ids = s["input_ids"].numpy()
        np.testing.assert_array_equal(s["labels"].numpy()[:-1], ids[1:])
        check_packed_window(window_of(s), docs)
        np.testing.assert_array_equal(s["positions"].numpy(), expected_positions(ids))


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), seq_length=st.integers(1, 50),
       piece=st.one_of(st.none(), st.integers(1, 12)), docs_per_shard=st.integers(1, 10), seed=st.integers(0, 99))
def test_any_corpus_packs_into_exact_windows(tmp_path_factory, lengths, seq_length, piece, docs_per_shard, seed):
    docs = [1 + d * STRIDE + np.arange(n) for d, n in enumerate(lengths)]
    stream = stream_of(docs)
    if len(stream) < seq_length + 1:
        return
    path = tmp_path_factory.mktemp("data")
    write_synthetic_dataset(path, docs, EOD, docs_per_shard=docs_per_shard, max_piece_length=piece)
    plain, shuffled = PackedDataset(path, seq_length, shuffle=False), PackedDataset(path, seq_length, seed=seed)
    assert len(plain) == len(shuffled) == (len(stream) - 1) // seq_length
    for j in range(len(plain)):
        np.testing.assert_array_equal(window_of(plain[j]), stream[j * seq_length:(j + 1) * seq_length + 1])
        s = shuffled[j + len(shuffled)]
        check_packed_window(window_of(s), docs)
        np.testing.assert_array_equal(s["positions"].numpy(), expected_positions(s["input_ids"].numpy()))


def test_labels_are_independent_memory(data):
    s = PackedDataset(data[0], 16)[0]
    before = s["input_ids"].clone()
    s["labels"].fill_(-100)
    assert torch.equal(s["input_ids"], before)


def test_same_seed_same_samples_other_seed_other_samples(data):
    path, _ = data
    a, b, c = PackedDataset(path, 16, seed=1), PackedDataset(path, 16, seed=1), PackedDataset(path, 16, seed=2)
    idx = [0, 1, 2, len(a) - 1, len(a) + 5]
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in idx)
    assert not all(torch.equal(a[i]["input_ids"], c[i]["input_ids"]) for i in idx)


def epoch_tokens(ds: PackedDataset, epoch: int) -> np.ndarray:
    return np.concatenate([ds[epoch * len(ds) + j]["input_ids"].numpy() for j in range(len(ds))])


def test_each_epoch_reads_every_token_once_in_a_new_order(data):
    path, docs = data
    ds = PackedDataset(path, 16, seed=3)
    total = sum(len(d) for d in docs)
    orders = []
    for epoch in (0, 1):
        tokens = epoch_tokens(ds, epoch)
        words = tokens[tokens != EOD]
        assert len(np.unique(words)) == len(words)  # nothing read twice
        assert len(words) >= total - 16  # at most the tail of one window is dropped
        orders.append(tokens)
    assert not np.array_equal(orders[0], orders[1])


def global_batches(ds, dp, mbs, steps, global_batch_size=8, consumed=0):
    """Per step: every dp rank's micro-batches concatenated in rank order."""
    loaders = [GlobalBatchLoader(ds, global_batch_size, r, dp, mbs, consumed_samples=consumed) for r in range(dp)]
    out = []
    for _ in range(steps):
        parts = [mb for loader in loaders for mb in next(loader)]
        assert all(mb["input_ids"].shape == (mbs, ds.seq_length) for mb in parts)
        out.append({k: torch.cat([mb[k] for mb in parts]) for k in parts[0]})
    return out


def reference_batches(ds, steps, global_batch_size=8, consumed=0):
    return [{k: torch.stack([ds[consumed + step * global_batch_size + i][k] for i in range(global_batch_size)])
             for k in ("input_ids", "labels", "positions")} for step in range(steps)]


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for k in w:
            assert torch.equal(g[k], w[k]), k


@pytest.mark.parametrize("dp,mbs", [(1, 1), (1, 8), (2, 2), (2, 4), (4, 1), (4, 2)])
def test_global_batches_do_not_depend_on_the_layout(data, dp, mbs):
    ds = PackedDataset(data[0], 16, seed=5)
    consumed = len(ds) - 12  # the second step straddles the epoch boundary
    assert_same_batches(global_batches(ds, dp, mbs, 3, consumed=consumed), reference_batches(ds, 3, consumed=consumed))


def test_resume_continues_at_the_next_sample_even_with_another_dp(data):
    ds = PackedDataset(data[0], 16, seed=5)
    straight = global_batches(ds, 2, 2, 5)
    first = [GlobalBatchLoader(ds, 8, r, 2, 2) for r in range(2)]
    for loader in first:
        next(loader), next(loader)
    state = first[0].state_dict()
    assert state == {"consumed_samples": 16, "seed": 5, "seq_length": 16, "global_batch_size": 8}
    assert first[1].state_dict() == state
    fresh = PackedDataset(data[0], 16, seed=5)
    resumed = [GlobalBatchLoader(fresh, 8, r, 4, 1) for r in range(4)]
    for loader in resumed:
        loader.load_state_dict(state)
    after = []
    for _ in range(3):
        parts = [mb for loader in resumed for mb in next(loader)]
        after.append({k: torch.cat([mb[k] for mb in parts]) for k in parts[0]})
    assert_same_batches(after, straight[2:])


def test_resume_with_another_global_batch_size_continues_from_consumed_samples(data):
    ds = PackedDataset(data[0], 16, seed=5)
    loader = GlobalBatchLoader(ds, 4, 0, 1, 2)
    loader.load_state_dict({"consumed_samples": 16, "seed": 5, "seq_length": 16, "global_batch_size": 8})
    got = torch.cat([mb["input_ids"] for mb in next(loader)])
    assert torch.equal(got, torch.stack([ds[i]["input_ids"] for i in range(16, 20)]))
    assert loader.state_dict()["consumed_samples"] == 20
    assert loader.tokens_per_step == 4 * 16


@pytest.mark.parametrize("key,value", [("seed", 6), ("seq_length", 32)])
def test_resume_refuses_another_seed_or_seq_length(data, key, value):
    loader = GlobalBatchLoader(PackedDataset(data[0], 16, seed=5), 8, 0, 1, 1)
    state = {"consumed_samples": 8, "seed": 5, "seq_length": 16, "global_batch_size": 8, key: value}
    with pytest.raises(UserError, match=f"{key} {value}"):
        loader.load_state_dict(state)


def test_global_batch_size_must_divide_by_dp_times_micro_batch(data):
    ds = PackedDataset(data[0], 16)
    with pytest.raises(UserError, match=r"global_batch_size 10 .* dp 4 x micro_batch_size 2 = 8"):
        GlobalBatchLoader(ds, 10, 0, 4, 2)
    with pytest.raises(UserError, match="dp_rank 4"):
        GlobalBatchLoader(ds, 8, 4, 4, 2)


def test_a_token_id_outside_the_vocabulary_is_recorded_with_its_sample_and_replaced(data):
    """The loader does not raise (one rank alone would stop): it records the first bad id of its share and
    replaces every bad id by 0, so the step runs to the collective where every rank learns of it."""
    ds = PackedDataset(data[0], 16, seed=5)
    vocab = 1 + 150 * STRIDE  # documents 150 on hold ids outside it
    recorded = 0
    for dp_rank in range(2):
        loader = GlobalBatchLoader(ds, 8, dp_rank, 2, 2, vocab_size=vocab)
        for step in range(3):
            batches = next(loader)
            first = step * 8 + dp_rank * 4
            windows = [window_of(ds[i]) for i in range(first, first + 4)]
            bad = [BadToken(first + j, int(w[w >= vocab][0])) for j, w in enumerate(windows) if (w >= vocab).any()]
            assert loader.bad_token == (bad[0] if bad else None)
            recorded += loader.bad_token is not None
            want = torch.from_numpy(np.stack([np.where(w >= vocab, 0, w) for w in windows]))
            assert torch.equal(torch.cat([mb["input_ids"] for mb in batches]), want[:, :-1])
            assert torch.equal(torch.cat([mb["labels"] for mb in batches]), want[:, 1:])
    assert recorded
    assert str(BadToken(7, 600).error(512)).startswith("sample 7 of the training data holds token id 600, not in "
                                                        "[0, 512) (the model's vocab_size)")


def docs_seen(ds: PackedDataset) -> set[int]:
    tokens = epoch_tokens(ds, 0)
    return {decode(t)[0] for t in np.unique(tokens[tokens != EOD]).tolist()}


def test_validation_split_is_disjoint_deterministic_and_seed_independent(data):
    path, _ = data
    train = PackedDataset(path, 8, seed=1, valid_fraction=0.1)
    valid = PackedDataset(path, 8, seed=1, split="valid", valid_fraction=0.1)
    assert len(valid.doc_ids) == 20 and len(train.doc_ids) == NUM_DOCS - 20
    assert not docs_seen(train) & docs_seen(valid)
    assert len(docs_seen(valid)) >= 19  # the dropped tail can hide at most part of one document
    other_seed = PackedDataset(path, 8, seed=9, split="valid", valid_fraction=0.1)
    np.testing.assert_array_equal(other_seed.doc_ids, valid.doc_ids)
    with pytest.raises(UserError, match="valid_fraction > 0"):
        PackedDataset(path, 8, split="valid")


def test_pieces_of_a_document_stay_together_even_when_not_the_longest(tmp_path):
    # Document 0 is cut into a 5-token piece and a 3-token piece (+ EOD); document 1 is
    # longer than both pieces, so the reader's first guess (longest sequences) misses.
    path = tmp_path / "data"
    docs = [1 + np.arange(8), 1 + STRIDE + np.arange(20)]
    write_synthetic_dataset(path, docs, EOD)
    writer = IndexedDatasetWriter(path / "shard_00000", dtype=np.int32)
    for seq in (docs[0][:5], np.append(docs[0][5:], EOD), np.append(docs[1], EOD)):
        writer.add_document(seq)
    writer.finalize()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["num_sequences"] = manifest["shards"][0]["num_sequences"] = 3
    (path / "manifest.json").write_text(json.dumps(manifest))
    corpus = open_corpus(path, manifest)
    assert corpus.doc_first.tolist() == [0, 2] and corpus.doc_num_seqs.tolist() == [2, 1]
    assert corpus.doc_len.tolist() == [9, 21]


def corrupt(path: Path, **changes) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_validate_manifest_accepts_good_data_and_the_bundled_tokenizer(tmp_path, tokenizer_path):
    published = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
    write_synthetic_dataset(tmp_path, make_docs(20), 151643, vocab_size=151669, tokenizer_sha256=published)
    manifest = validate_manifest(tmp_path, 151936, tokenizer_path=tokenizer_path, seq_length=64)
    assert manifest["num_documents"] == 20


def test_missing_data_dir_or_manifest_says_run_the_converter(tmp_path):
    with pytest.raises(FileNotFoundError, match="convert"):
        validate_manifest(tmp_path / "nope", 1000)
    with pytest.raises(FileNotFoundError, match=r"manifest\.json.*convert"):
        PackedDataset(tmp_path, 16)


@pytest.mark.parametrize("changes", [{"format": "webdataset"}, {"format_version": 2}])
def test_unknown_format_or_version(data, changes):
    corrupt(data[0], **changes)
    with pytest.raises(UserError, match="unknown format"):
        validate_manifest(data[0], 1_000_000_000)


def test_missing_shard_is_named(data):
    (data[0] / "shard_00001.bin").unlink()
    for call in (lambda: validate_manifest(data[0], 1_000_000_000), lambda: PackedDataset(data[0], 16)):
        with pytest.raises(FileNotFoundError, match=r"shard_00001\.bin"):
            call()


def test_truncated_bin_is_named(data):
    bin_path = data[0] / "shard_00002.bin"
    with open(bin_path, "r+b") as f:
        f.truncate(bin_path.stat().st_size - 4)
    for call in (lambda: validate_manifest(data[0], 1_000_000_000), lambda: PackedDataset(data[0], 16)):
        with pytest.raises(UserError, match=r"shard_00002\.bin.*truncated"):
            call()


def test_manifest_counts_must_match_the_shards(data):
    corrupt(data[0], num_tokens=5)
    with pytest.raises(UserError, match="num_tokens is 5"):
        validate_manifest(data[0], 1_000_000_000)


def test_data_vocab_larger_than_model_vocab(data):
    data_vocab = json.loads((data[0] / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    with pytest.raises(UserError, match=f"tokenizer of {data_vocab} ids but the model has 1000"):
        validate_manifest(data[0], 1000)


def test_tokenizer_mismatch_names_both_paths(tmp_path):
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_text('{"model": "other"}')
    write_synthetic_dataset(tmp_path / "d", make_docs(5), EOD, tokenizer_sha256="ab" * 32)
    with pytest.raises(UserError, match=rf"{tok}.*{tmp_path / 'd' / 'manifest.json'}"):
        validate_manifest(tmp_path / "d", 1_000_000_000, tokenizer_path=tok.parent)
    write_synthetic_dataset(tmp_path / "d", make_docs(5), EOD,
                            tokenizer_sha256=hashlib.sha256(tok.read_bytes()).hexdigest())
    validate_manifest(tmp_path / "d", 1_000_000_000, tokenizer_path=tok)


def test_empty_dataset_and_too_short_dataset(tmp_path):
    write_synthetic_dataset(tmp_path / "empty", [], EOD)
    with pytest.raises(UserError, match="no tokens"):
        validate_manifest(tmp_path / "empty", 1000)
    with pytest.raises(UserError, match="no tokens"):
        PackedDataset(tmp_path / "empty", 4)
    write_synthetic_dataset(tmp_path / "short", [np.arange(1, 10)], EOD)  # 10 tokens with EOD
    with pytest.raises(UserError, match=r"seq_length \+ 1 = 11"):
        validate_manifest(tmp_path / "short", 1000, seq_length=10)
    with pytest.raises(UserError, match=r"seq_length \+ 1 = 11"):
        PackedDataset(tmp_path / "short", 10)
    assert len(PackedDataset(tmp_path / "short", 9)) == 1

