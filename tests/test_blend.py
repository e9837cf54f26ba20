"""Blended training data: the config forms of data_path, the proportions each source gets, per-source
order and epochs, layout-independent global batches, exact resume, tokenizer checks, the log line.

Each source's tokens lie in a range of their own, so which source a sample came from is read from its
tokens, not from the blend's own bookkeeping.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qwen3_pretrain.analysis.parse_log import parse_metrics
from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.data.blend import BlendedDataset, validate_sources
from qwen3_pretrain.data.reader import GlobalBatchLoader, PackedDataset
from qwen3_pretrain.data.synthetic import write_synthetic_dataset
from qwen3_pretrain.data.sources import DataSource, parse_data_path
from qwen3_pretrain.errors import ConfigError, UserError
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.metrics import format_line

EOD = 0
RANGE = 100_000  # source s's token ids lie in [1 + s * RANGE, 1 + (s + 1) * RANGE)
SEQ = 16
VOCAB = 4 * RANGE


def write_source(path: Path, source: int, num_docs: int, seed: int, **kw) -> str:
    lengths = np.random.default_rng(seed).integers(1, 40, num_docs)
    docs = [1 + source * RANGE + d * 40 + np.arange(n) for d, n in enumerate(lengths)]  # no id in two documents
    write_synthetic_dataset(path, docs, EOD, docs_per_shard=50, vocab_size=VOCAB, **kw)
    return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    """Three sources of different sizes: the last is small, so it runs through several epochs."""
    root = tmp_path_factory.mktemp("sources")
    return [write_source(root / name, s, n, seed=s) for s, (name, n) in
            enumerate((("wiki", 300), ("books", 200), ("code", 40)))]


def blend(paths: list[str], weights: list[float], split: str = "train", valid_fraction: float = 0.0):
    sources = parse_data_path([{"path": p, "weight": w} for p, w in zip(paths, weights)])
    return BlendedDataset.open(sources, SEQ, seed=3, split=split, valid_fraction=valid_fraction)


def source_of(sample: dict[str, torch.Tensor]) -> int:
    """The source a sample was read from, by its tokens (every window holds a non-EOD token)."""
    ids = torch.cat([sample["input_ids"], sample["labels"]])
    sources = set(((ids[ids != EOD] - 1) // RANGE).tolist())
    assert len(sources) == 1, sources
    return sources.pop()


# --- proportions, order, epochs -----------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1, 1, 8]])
def test_measured_proportions_match_the_weights(paths, weights):
    """Probe: quotas apportioned by equal shares instead of by weight -> the 0.7/0.3 blend measured 0.5/0.5."""
    ds = blend(paths[:len(weights)], weights)
    expected = np.asarray(weights) / sum(weights)
    loader, global_batch, steps = GlobalBatchLoader(ds, 32, 0, 1, 8), 32, 150
    counts = np.zeros(len(weights), dtype=np.int64)
    worst_batch = 0.0
    for _ in range(steps):
        batch = [source_of({k: mb[k][i] for k in mb}) for mb in next(loader) for i in range(len(mb["input_ids"]))]
        in_batch = np.bincount(batch, minlength=len(weights))
        worst_batch = max(worst_batch, float(np.abs(in_batch - expected * global_batch).max()))
        counts += in_batch
    measured = counts / counts.sum()
    print(f"weights {expected.round(4).tolist()}: measured {measured.round(4).tolist()} over {counts.sum()} "
          f"samples; worst global batch off by {worst_batch:.2f} samples")
    assert np.abs(measured - expected).max() <= 0.01, (measured, expected)
    assert worst_batch <= 2, "each global batch should already hold the weights' shares to within 2 samples"
    assert ds.samples_by_dataset(steps * global_batch) == dict(zip(paths, counts.tolist()))


def test_each_source_reads_its_own_samples_in_order_through_its_own_epochs(paths):
    """Source s's n-th sample in the blend is sample n of that source alone (epochs included)."""
    ds = blend(paths, [0.2, 0.2, 0.6])
    alone = [PackedDataset(p, SEQ, seed=3) for p in paths]
    drawn: list[list[dict]] = [[], [], []]
    for i in range(3 * len(alone[2])):
        sample = ds[i]
        drawn[source_of(sample)].append(sample)
    assert len(drawn[2]) > 1.5 * len(alone[2]), "the small source should have started another epoch"
    for source, samples in enumerate(drawn):
        for n, sample in enumerate(samples):
            want = alone[source][n]
            assert all(torch.equal(sample[k], want[k]) for k in want), (source, n)


def test_one_source_gives_that_dataset_unchanged(paths):
    ds, alone = blend(paths[:1], [3.0]), PackedDataset(paths[0], SEQ, seed=3)
    for i in list(range(10)) + [len(alone) - 1, len(alone), 5 * len(alone) + 7]:
        assert torch.equal(ds[i]["input_ids"], alone[i]["input_ids"]), i
    assert ds.blend_state() == {}


def test_valid_split_blends_each_sources_held_out_documents(paths):
    train, valid = (blend(paths[:2], [0.7, 0.3], split, valid_fraction=0.2) for split in ("train", "valid"))
    valid_samples = [valid[i] for i in range(200)]
    shares = np.bincount([source_of(s) for s in valid_samples], minlength=2) / 200
    assert np.abs(shares - [0.7, 0.3]).max() <= 0.02, shares
    # No token id is in two documents: a held-out document's tokens never appear in a training sample.
    train_tokens = {t for ds in train.datasets for i in range(len(ds)) for t in ds[i]["input_ids"].tolist()}
    valid_tokens = {t for s in valid_samples for t in s["input_ids"].tolist()}
    assert valid_tokens & train_tokens == {EOD}


# --- layouts and resume -----------------------------------------------------------------------------------------


def global_batches(ds, dp: int, mbs: int, steps: int, loaders=None) -> list[torch.Tensor]:
    loaders = loaders or [GlobalBatchLoader(ds, 8, r, dp, mbs) for r in range(dp)]
    return [torch.cat([mb["input_ids"] for loader in loaders for mb in next(loader)]) for _ in range(steps)]


def test_global_batches_are_the_same_for_any_dp(paths):
    ds = blend(paths, [0.5, 0.3, 0.2])
    want = [torch.stack([ds[step * 8 + i]["input_ids"] for i in range(8)]) for step in range(6)]
    for dp, mbs in ((1, 8), (2, 1), (2, 4), (4, 2)):
        got = global_batches(ds, dp, mbs, 6)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (dp, mbs)


def test_resume_under_another_dp_continues_exactly(paths):
    straight = global_batches(blend(paths, [0.5, 0.3, 0.2]), 2, 2, 6)
    first = [GlobalBatchLoader(blend(paths, [0.5, 0.3, 0.2]), 8, r, 2, 2) for r in range(2)]
    global_batches(None, 2, 2, 3, loaders=first)
    state = first[0].state_dict()
    assert state["consumed_samples"] == 24 and state["blend_weights"] == [0.5, 0.3, 0.2]
    resumed = [GlobalBatchLoader(blend(paths, [5, 3, 2]), 8, r, 4, 1) for r in range(4)]
    for loader in resumed:
        loader.load_state_dict(state)
    after = global_batches(None, 4, 1, 3, loaders=resumed)
    assert all(torch.equal(g, w) for g, w in zip(after, straight[3:], strict=True))


@pytest.mark.parametrize("weights", [[0.6, 0.4, 0.0], [0.5, 0.3]])
def test_resume_refuses_another_blend(paths, weights):
    saved = GlobalBatchLoader(blend(paths, [0.5, 0.3, 0.2]), 8, 0, 1, 1).state_dict()
    used = [w for w in weights if w]
    loader = GlobalBatchLoader(blend(paths[:len(used)], used), 8, 0, 1, 1)
    with pytest.raises(UserError, match=r"checkpoint drew from a blend of weights 0.5, 0.3, 0.2 but this run"):
        loader.load_state_dict(saved)
    single = GlobalBatchLoader(blend(paths[:1], [1]), 8, 0, 1, 1)
    with pytest.raises(UserError, match="but this run's data_path gives one dataset"):
        single.load_state_dict(saved)


# --- config forms and errors --------------------------------------------------------------------------------------


WIKI_BOOKS = (DataSource("/data/wiki", 0.7), DataSource("/data/books", 0.3))


@pytest.mark.parametrize("yaml_text,overrides", [
    ("data_path:\n  - {path: /data/wiki, weight: 0.7}\n  - {path: /data/books, weight: 0.3}\n", []),
    ("data_path:\n  - path: /data/wiki\n    weight: 7\n  - path: /data/books\n    weight: 3\n", []),
    ('data_path: "0.7 /data/wiki 0.3 /data/books"\n', []),
    ("data_path: 7 /data/wiki 3 /data/books\n", []),
    ("", ["data_path=0.7 /data/wiki 0.3 /data/books"]),
    ("", ["data_path=[{path: /data/wiki, weight: 0.7}, {path: /data/books, weight: 0.3}]"]),
])
def test_config_forms_parse_to_the_same_sources(tmp_path, yaml_text, overrides):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    assert load_config(TrainConfig, path, overrides).data_sources == WIKI_BOOKS


def test_one_path_is_one_source_even_with_a_space():
    assert TrainConfig(data_path="/data/d_convert").data_sources == (DataSource("/data/d_convert", 1.0),)
    assert TrainConfig(data_path="/data/my corpus").data_sources == (DataSource("/data/my corpus", 1.0),)
    # only a string that starts with a number is a blend: a folder named with a year is one folder
    assert TrainConfig(data_path="/data/wiki 2024").data_sources == (DataSource("/data/wiki 2024", 1.0),)


def test_weights_after_the_paths_are_one_missing_folder_with_a_hint(tmp_path):
    value = f"{tmp_path}/wiki 0.7 {tmp_path}/books 0.3"
    (source,) = TrainConfig(data_path=value).data_sources
    with pytest.raises(UserError, match=r"no such directory; .*; a blend of several datasets is written weight "
                                        r"first: \"0.7 /data/wiki 0.3 /data/books\""):
        validate_sources([source], VOCAB)


def test_resume_refuses_the_same_weights_on_other_datasets(paths):
    """Two sources of equal weight swapped, or one replaced by another dataset: the weights alone match, the
    datasets do not, and the error says which position changed."""
    saved = GlobalBatchLoader(blend(paths[:2], [0.5, 0.5]), 8, 0, 1, 1).state_dict()
    swapped = GlobalBatchLoader(blend(paths[1::-1], [0.5, 0.5]), 8, 0, 1, 1)
    with pytest.raises(UserError, match=r"data_path's dataset 1 \(books, \d+ documents, \d+ tokens\) is not the "
                                        r"one the checkpoint drew from there \(wiki,"):
        swapped.load_state_dict(saved)
    other = GlobalBatchLoader(blend([paths[0], paths[2]], [0.5, 0.5]), 8, 0, 1, 1)
    with pytest.raises(UserError, match=r"dataset 2 \(code, .* \(books,"):
        other.load_state_dict(saved)
    same = GlobalBatchLoader(blend(paths[:2], [0.5, 0.5]), 8, 0, 1, 1)
    same.load_state_dict(saved)
    assert same.consumed_samples == saved["consumed_samples"]


@pytest.mark.parametrize("value,message", [
    ("0.7 /data/wiki 0.3", r"'0.7 /data/wiki 0.3'.* 3 words \(an odd count\)"),
    ("0.7 /data/wiki 0 /data/books", r"the weight of /data/books is '0'; weights must be positive"),
    ("-0.2 /data/wiki 1 /data/books", r"the weight of /data/wiki is '-0.2'; weights must be positive"),
    ("0.7 /data/wiki /data/books 0.3", r"'/data/books' stands where a weight belongs"),
    ([{"weight": 0.5}, {"path": "/data/books", "weight": 0.5}], r"data_path\[0\]: \{'weight': 0.5\} has no 'path'"),
    ([{"path": "/data/wiki"}], r"data_path\[0\]: .* has no 'weight'"),
    ([{"path": "/data/wiki", "weight": -1}], r"data_path\[0\]: the weight of /data/wiki is -1; weights must be"),
    ([{"path": "/data/wiki", "weight": "lots"}], r"the weight of /data/wiki is 'lots', not a number"),
    ([{"path": "/data/wiki", "wieght": 1}], r"unknown key\(s\) 'wieght'"),
    ([0.7, "/data/wiki"], r"data_path\[0\]: 0.7 is not a mapping"),
    ([], r"data_path is empty"),
    ("0.5 /data/wiki 0.5 /data/wiki", r"/data/wiki listed more than once"),
    ("1 /data/wiki 1e-7 /data/books", r"/data/books gets 1e-07 of the samples"),
])
def test_bad_data_path_is_refused_naming_the_value(value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(data_path=value)


def test_sources_converted_with_another_tokenizer_are_refused(paths, tmp_path):
    other_sha = write_source(tmp_path / "other_sha", 1, 20, seed=9, tokenizer_sha256="ab" * 32)
    other_vocab = str(tmp_path / "other_vocab")
    write_synthetic_dataset(other_vocab, [np.arange(1, 50)], EOD, vocab_size=VOCAB // 2)
    other_eod = str(tmp_path / "other_eod")
    write_synthetic_dataset(other_eod, [np.arange(2, 50)], 1, vocab_size=VOCAB)
    validate_sources(parse_data_path(f"1 {paths[0]} 1 {paths[1]}"), VOCAB, seq_length=SEQ)
    for other, key in ((other_sha, "sha256"), (other_vocab, "vocab_size"), (other_eod, "eod_id")):
        with pytest.raises(UserError, match=rf"data_path: {other} was converted with another tokenizer than "
                                            rf"{paths[0]} \(tokenizer {key} "):
            validate_sources(parse_data_path(f"1 {paths[0]} 1 {other}"), VOCAB, seq_length=SEQ)
    with pytest.raises(UserError, match=str(tmp_path / "missing")):
        validate_sources(parse_data_path(f"1 {paths[0]} 1 {tmp_path / 'missing'}"), VOCAB)


# --- the log line ---------------------------------------------------------------------------------------------


RECORD = {"step": 3, "total_steps": 10, "loss": 2.5, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_sec": 100.0,
          "tokens_per_sec_per_device": 50.0, "step_time_s": 1.0, "mfu": 0.1, "memory_gib": 1.0, "eta_s": 7.0}


def test_log_line_shows_the_mix_and_still_parses(tmp_path):
    line = format_line({**RECORD, "samples_by_dataset": {"/data/wiki": 21, "/mnt/x/books/": 9}})
    assert line.endswith(" | mix wiki=70.0% books=30.0%"), line
    (tmp_path / "train.log").write_text(f"2026-12-02 14:05:31 INFO {line}\n")
    (row,) = parse_metrics(tmp_path / "train.log").rows
    assert row["loss"] == 2.5 and row["mix"] == "wiki=70.0% books=30.0%"
    same_names = format_line({**RECORD, "samples_by_dataset": {"/a/d": 1, "/b/d": 3}})
    assert same_names.endswith(" | mix /a/d=25.0% /b/d=75.0%"), same_names
    assert "mix" not in format_line({**RECORD, "samples_by_dataset": {"/data/wiki": 30}})
