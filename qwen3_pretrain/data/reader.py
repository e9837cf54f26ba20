"""Packed training samples from a converted data directory, and layout-independent global batches.

The shards' sequences, concatenated in manifest order, form one corpus of
documents (a long document the converter cut into pieces is one document: its
pieces stay together and in order). Like Megatron's GPTDataset, each epoch
lays the documents out in a shuffled order, cuts the resulting token stream
into windows of ``seq_length + 1`` tokens that cross document boundaries (the
last token of one window is the first of the next), and visits the windows in
a shuffled order. Each rank builds these indices itself in memory from the
seed: nothing is written, nothing is waited for, so nodes need not share a
filesystem.

``GlobalBatchLoader`` hands out step ``k`` as the dataset samples
``[k * G, (k + 1) * G)``, each data-parallel rank taking a contiguous slice,
so the sequence of global batches is the same for every parallel layout and a
resume (even with another dp size) continues at the exact next sample.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qwen3_pretrain.data.indexed_dataset import IndexedDataset
from qwen3_pretrain.data.manifest import read_manifest
from qwen3_pretrain.errors import UserError

SPLITS = ("train", "valid")
# The validation documents are drawn with this fixed seed, not the training
# seed, so runs with different seeds on the same data evaluate on the same text.
_SPLIT_SEED = 0x5A11D
# An epoch index is cached for the current epoch and the one before it, which
# covers a global batch straddling an epoch boundary.
_CACHED_EPOCHS = 2


@dataclass(frozen=True)
class Corpus:
    """Every shard's sequences as one corpus, grouped into documents."""

    tokens: list[np.ndarray]  # per shard: memory-mapped token ids
    seq_shard: np.ndarray  # [num_sequences] shard of each sequence
    seq_start: np.ndarray  # [num_sequences] offset of its first token in that shard
    seq_len: np.ndarray  # [num_sequences] int64
    doc_first: np.ndarray  # [num_documents] first sequence of each document
    doc_num_seqs: np.ndarray  # [num_documents] sequences (pieces) in each document
    doc_len: np.ndarray  # [num_documents] tokens in each document

    @property
    def num_documents(self) -> int:
        return len(self.doc_first)


def open_corpus(root: Path, manifest: dict[str, Any]) -> Corpus:
    """Memory-map the manifest's shards (in its order) and group their sequences into documents."""
    shards = [IndexedDataset(root / shard["prefix"]) for shard in manifest["shards"]]
    counts = [len(s) for s in shards]
    seq_shard = np.repeat(np.arange(len(shards), dtype=np.int32), counts)
    seq_start = np.concatenate([np.zeros(0, np.int64)] + [s.sequence_pointers // s.dtype.itemsize for s in shards])
    seq_len = np.concatenate([np.zeros(0, np.int64)] + [s.sequence_lengths.astype(np.int64) for s in shards])
    # Plain ndarray views of the memmaps: slicing an np.memmap costs microseconds each time.
    tokens = [np.asarray(s.tokens) for s in shards]
    num_pieces = int(manifest["num_sequences"]) - int(manifest["num_documents"])
    ends = _document_ends(tokens, seq_shard, seq_start, seq_len, int(manifest["tokenizer"]["eod_id"]), num_pieces)
    doc_first = np.flatnonzero(np.concatenate([[True], ends[:-1]])) if len(ends) else np.zeros(0, np.int64)
    doc_num_seqs = np.diff(np.append(doc_first, len(seq_len)))
    doc_len = np.add.reduceat(seq_len, doc_first) if len(doc_first) else np.zeros(0, np.int64)
    return Corpus(tokens, seq_shard, seq_start, seq_len, doc_first, doc_num_seqs, doc_len)


def _document_ends(tokens: list[np.ndarray], seq_shard: np.ndarray, seq_start: np.ndarray, seq_len: np.ndarray,
                   eod_id: int, num_pieces: int) -> np.ndarray:
    """[num_sequences] bool: True where a sequence ends its document (its last token is EOD).

    The manifest says how many sequences are non-final pieces (sequences minus
    documents). The converter cuts long documents at a maximum length, so
    those pieces are among the longest sequences: only the longest are read
    first (a few pages instead of the whole corpus); everything is read only
    when that does not find them all.
    """
    ends = np.ones(len(seq_len), dtype=bool)
    nonempty = np.flatnonzero(seq_len > 0)
    if num_pieces <= 0 or len(nonempty) == 0:
        return ends
    lengths = seq_len[nonempty]
    kth = max(0, len(lengths) - num_pieces)
    longest = lengths >= np.partition(lengths, kth)[kth]
    for chosen in (nonempty[longest], nonempty[~longest]):
        last = np.empty(len(chosen), dtype=np.int64)
        for shard in np.unique(seq_shard[chosen]):
            here = seq_shard[chosen] == shard
            last[here] = tokens[shard][seq_start[chosen[here]] + seq_len[chosen[here]] - 1]
        ends[chosen] = last == eod_id
        if np.count_nonzero(~ends) >= num_pieces:
            break
    ends[-1] = True  # the corpus ends a document even when its last token is not EOD
    return ends


def split_documents(num_documents: int, valid_fraction: float, split: str) -> np.ndarray:
    """Sorted ids of the documents of ``split``: ``valid_fraction`` of them, drawn by a fixed seed, are
    held out for "valid"; "train" gets the rest."""
    num_valid = 0 if valid_fraction == 0 else max(1, round(valid_fraction * num_documents))
    if split == "valid" and num_valid == 0:
        raise UserError("split 'valid' needs valid_fraction > 0 (the fraction of documents held out)")
    if num_valid >= num_documents:
        raise UserError(f"valid_fraction {valid_fraction} holds out {num_valid} of the {num_documents} documents, "
                        "leaving none to train on; lower valid_fraction")
    in_valid = np.zeros(num_documents, dtype=bool)
    in_valid[np.random.default_rng(_SPLIT_SEED).permutation(num_documents)[:num_valid]] = True
    return np.flatnonzero(in_valid if split == "valid" else ~in_valid)


@dataclass(frozen=True)
class EpochIndex:
    """Where each sample of one epoch lies in that epoch's token stream."""

    seq_order: np.ndarray  # [sequences in split] corpus sequence ids in stream order
    sample_seq: np.ndarray  # [num_samples + 1] position in seq_order of the sequence holding sample j's first token
    sample_offset: np.ndarray  # [num_samples + 1] offset of that token in its sequence
    sample_order: np.ndarray | None  # [num_samples] shuffled window order; None when unshuffled

    @property
    def num_samples(self) -> int:
        return len(self.sample_seq) - 1


def build_epoch_index(corpus: Corpus, doc_ids: np.ndarray, seq_length: int,
                      rng: np.random.Generator | None) -> EpochIndex:
    """Lay out ``doc_ids`` (shuffled by ``rng`` unless None) and index its ``seq_length + 1``-token windows."""
    order = rng.permutation(doc_ids) if rng is not None else doc_ids
    seq_order = _expand_runs(corpus.doc_first[order], corpus.doc_num_seqs[order])
    lengths = corpus.seq_len[seq_order]
    ends = np.cumsum(lengths)  # stream offset just past each sequence
    num_samples = (int(ends[-1]) - 1) // seq_length
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    sample_seq = np.searchsorted(ends, starts, side="right")  # first sequence ending after the start
    sample_offset = starts - (ends[sample_seq] - lengths[sample_seq])
    sample_order = rng.permutation(num_samples) if rng is not None else None
    return EpochIndex(seq_order, sample_seq, sample_offset, sample_order)


def _expand_runs(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(first[i], first[i] + count[i])`` over i, without a Python loop."""
    run_start = np.cumsum(count) - count  # where run i begins in the output
    return np.repeat(first - run_start, count) + np.arange(int(count.sum()), dtype=np.int64)


def document_positions(input_ids: np.ndarray, eod_id: int) -> np.ndarray:
    """RoPE positions: 0 at the first token and after every EOD, counting up within a document."""
    doc_start = np.concatenate([[0], np.flatnonzero(input_ids[:-1] == eod_id) + 1])
    doc_len = np.diff(np.append(doc_start, len(input_ids)))
    return np.arange(len(input_ids), dtype=np.int64) - np.repeat(doc_start, doc_len)


class PackedDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length`` tokens packed across documents, reshuffled every epoch.

    ``dataset[i]`` for any ``i >= 0`` (``i // len(dataset)`` is the epoch)
    returns int64 tensors ``input_ids``, ``labels`` (the next tokens) and
    ``positions``, each ``[seq_length]``. Positions restart at 0 after every
    EOD and at a sample's first token: the true offset of a document cut by
    the sample start would be cheap to compute but carries no information
    (RoPE attention depends only on position differences, and the model's
    document mask only on where positions are 0), while staying below
    ``seq_length`` keeps positions within ``max_position_embeddings`` and
    precise in low precision. ``shuffle=False`` keeps the corpus order (for
    checks). The split holds out ``valid_fraction`` of the documents for
    ``split="valid"``, the same ones whatever ``seed`` is.
    """

    def __init__(self, data_path: str | os.PathLike, seq_length: int, seed: int = 1234, split: str = "train",
                 valid_fraction: float = 0.0, shuffle: bool = True) -> None:
        _check_dataset_args(seq_length, seed, split, valid_fraction)
        root = Path(data_path)
        manifest = read_manifest(root)
        self.seq_length, self.seed, self.split, self.shuffle = seq_length, seed, split, shuffle
        self.eod_id = int(manifest["tokenizer"]["eod_id"])
        self.corpus = open_corpus(root, manifest)
        # Which dataset this is, wherever its folder has moved: its size in documents and tokens.
        self.fingerprint = {"name": root.resolve().name, "num_documents": self.corpus.num_documents,
                            "num_tokens": int(manifest["num_tokens"])}
        if self.corpus.num_documents == 0:
            raise UserError(f"{root}: the dataset holds no tokens; convert a non-empty corpus")
        self.doc_ids = split_documents(self.corpus.num_documents, valid_fraction, split)
        self.num_tokens = int(self.corpus.doc_len[self.doc_ids].sum())
        self._num_samples = (self.num_tokens - 1) // seq_length
        if self._num_samples < 1:
            raise UserError(f"{root}: the {split} split holds {self.num_tokens} tokens, fewer than one sample of "
                            f"seq_length + 1 = {seq_length + 1}; lower seq_length or convert more text")
        self._epochs: OrderedDict[int, EpochIndex] = OrderedDict()

    def __len__(self) -> int:
        return self._num_samples

    def epoch_index(self, epoch: int) -> EpochIndex:
        """The sample index of ``epoch``, built on first use from ``(seed, epoch)``."""
        index = self._epochs.get(epoch)
        if index is None:
            rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
            index = build_epoch_index(self.corpus, self.doc_ids, self.seq_length, rng)
            assert index.num_samples == self._num_samples
            self._epochs[epoch] = index
            while len(self._epochs) > _CACHED_EPOCHS:
                self._epochs.popitem(last=False)
        return index

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            raise IndexError(f"sample index {index} is negative")
        epoch, i = divmod(int(index), self._num_samples)
        epoch_index = self.epoch_index(epoch)
        window = i if epoch_index.sample_order is None else int(epoch_index.sample_order[i])
        tokens = self._read_window(epoch_index, window)
        return {"input_ids": torch.from_numpy(tokens[:-1]),
                "labels": torch.from_numpy(tokens[1:].copy()),  # its own memory: callers may mask it in place
                "positions": torch.from_numpy(document_positions(tokens[:-1], self.eod_id))}

    def _read_window(self, index: EpochIndex, window: int) -> np.ndarray:
        # The window's last token is the next window's first, hence the + 1.
        seqs = index.seq_order[index.sample_seq[window]:index.sample_seq[window + 1] + 1]
        corpus, need = self.corpus, self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        filled, offset = 0, int(index.sample_offset[window])
        for shard, start, length in zip(*(a[seqs].tolist() for a in (corpus.seq_shard, corpus.seq_start,
                                                                      corpus.seq_len))):
            take = min(length - offset, need - filled)
            out[filled:filled + take] = corpus.tokens[shard][start + offset:start + offset + take]
            filled, offset = filled + take, 0
        assert filled == need, (filled, need)
        return out


def _check_dataset_args(seq_length: int, seed: int, split: str, valid_fraction: float) -> None:
    if not isinstance(seq_length, int) or seq_length < 1:
        raise UserError(f"seq_length must be a positive integer, got {seq_length!r}")
    if not isinstance(seed, int) or seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed!r}")
    if split not in SPLITS:
        raise UserError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    if not 0.0 <= valid_fraction < 1.0:
        raise UserError(f"valid_fraction must be in [0, 1), got {valid_fraction!r}")


@dataclass(frozen=True)
class BadToken:
    """The first token id outside the vocabulary in a rank's share of a step: the global index of the sample
    that holds it, and the id."""

    sample: int
    token: int

    def error(self, vocab_size: int) -> UserError:
        """The one message for it, which every rank raises alike (train/engine.py)."""
        return UserError(f"sample {self.sample} of the training data holds token id {self.token}, not in "
                         f"[0, {vocab_size}) (the model's vocab_size): check that the data was tokenized for "
                         "this model (its manifest.json names the tokenizer and vocab_size)")


def _find_bad_token(samples: list[dict[str, torch.Tensor]], first: int, vocab_size: int) -> BadToken | None:
    """The first id outside ``[0, vocab_size)`` in ``samples`` (global indices from ``first``): in their inputs,
    or their labels' last (the others are inputs too). Every such id is replaced by 0 in place, so the step
    that carries the record runs (an embedding would fail on it before the step could say which id it was)."""
    found = None
    for j, sample in enumerate(samples):
        inputs, labels = sample["input_ids"], sample["labels"]  # labels[:-1] are inputs[1:]
        ids = torch.cat([inputs, labels[-1:]])
        bad = (ids < 0) | (ids >= vocab_size)
        if bool(bad.any()):  # host tensors: no device is waited for
            found = found or BadToken(first + j, int(ids[bad][0]))
            inputs.masked_fill_(bad[:-1], 0)
            labels.masked_fill_(bad[1:], 0)
    return found


class GlobalBatchLoader:
    """Iterator over training steps: this data-parallel rank's share of each global batch.

    Step ``k`` (after ``consumed_samples``) is the dataset samples
    ``[consumed + k * G, consumed + (k + 1) * G)``; rank ``r`` of ``dp_size``
    takes the contiguous slice ``[r * G / dp, (r + 1) * G / dp)`` of it, as a
    list of micro-batches (dicts of ``[micro_batch_size, seq_length]``
    tensors). Ranks that differ only in tp or pp get the same data. The state
    (``state_dict``) counts samples handed out, in global terms. ``dataset`` is
    a ``PackedDataset`` or anything indexed the same way with ``seed`` and
    ``seq_length`` (a ``BlendedDataset``, whose ``blend_state`` joins the state).
    With ``vocab_size``, token ids are checked here on the host, where they
    already are: ``bad_token`` is then the first id outside ``[0, vocab_size)``
    in the batch last handed out (a ``BadToken``, its ids replaced by 0), or
    None. The loader does not raise: one rank alone would stop while the others
    wait in the step's collectives. The engine reduces the record with the
    step's figures, and every rank raises the same error before the update.
    """

    def __init__(self, dataset: PackedDataset | Any, global_batch_size: int, dp_rank: int, dp_size: int,
                 micro_batch_size: int, consumed_samples: int = 0, vocab_size: int | None = None) -> None:
        _check_batch_layout(global_batch_size, dp_rank, dp_size, micro_batch_size)
        if not isinstance(consumed_samples, int) or consumed_samples < 0:
            raise UserError(f"consumed_samples must be a non-negative integer, got {consumed_samples!r}")
        self.dataset = dataset
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self.micro_batch_size = micro_batch_size
        self.consumed_samples = consumed_samples
        self.vocab_size = vocab_size
        self.bad_token: BadToken | None = None

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one global batch (all ranks together)."""
        return self.global_batch_size * self.dataset.seq_length

    def __iter__(self) -> GlobalBatchLoader:
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        per_rank = self.global_batch_size // self.dp_size
        first = self.consumed_samples + self.dp_rank * per_rank
        samples = [self.dataset[i] for i in range(first, first + per_rank)]
        if self.vocab_size is not None:
            self.bad_token = _find_bad_token(samples, first, self.vocab_size)
        self.consumed_samples += self.global_batch_size
        mbs = self.micro_batch_size
        return [{key: torch.stack([s[key] for s in samples[i:i + mbs]]) for key in samples[0]}
                for i in range(0, per_rank, mbs)]

    def state_dict(self) -> dict[str, Any]:
        """Where the data stands, independent of the parallel layout (a blend's per-source positions follow
        from ``consumed_samples``: data/blend.py)."""
        return {"consumed_samples": self.consumed_samples, "seed": self.dataset.seed,
                "seq_length": self.dataset.seq_length, "global_batch_size": self.global_batch_size,
                **self._blend_state()}

    def _blend_state(self) -> dict[str, Any]:
        return self.dataset.blend_state() if hasattr(self.dataset, "blend_state") else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state["consumed_samples"]``; seed and seq_length must match, the batch size need not."""
        missing = [k for k in ("consumed_samples", "seed", "seq_length") if k not in state]
        if missing:
            raise UserError(f"data loader state lacks {', '.join(missing)}; it was not saved by GlobalBatchLoader")
        for key, ours in (("seed", self.dataset.seed), ("seq_length", self.dataset.seq_length)):
            if state[key] != ours:
                raise UserError(f"cannot resume the data order: the checkpoint was trained with {key} {state[key]} "
                                f"but this run has {key} {ours}; use the checkpoint's {key} to resume")
        ours = self._blend_state()
        saved_weights, weights = state.get("blend_weights"), ours.get("blend_weights")
        if saved_weights != weights:
            raise UserError(f"cannot resume the data order: the checkpoint drew from {_describe_blend(saved_weights)} "
                            f"but this run's data_path gives {_describe_blend(weights)}; use the checkpoint's "
                            "data_path (its datasets and weights) to resume")
        _check_same_sources(state.get("blend_sources"), ours.get("blend_sources"))
        consumed = state["consumed_samples"]
        if not isinstance(consumed, int) or consumed < 0:
            raise UserError(f"data loader state: consumed_samples must be a non-negative integer, got {consumed!r}")
        self.consumed_samples = consumed


def _check_same_sources(saved: list[dict] | None, ours: list[dict] | None) -> None:
    """Each position of a blend holds the dataset it held when the checkpoint was saved (checkpoints
    from before sources were recorded carry only the weights)."""
    if saved is None or ours is None:
        return
    for i, (then, now) in enumerate(zip(saved, ours)):
        if {k: then.get(k) for k in ("num_documents", "num_tokens")} != \
                {k: now.get(k) for k in ("num_documents", "num_tokens")}:
            raise UserError(f"cannot resume the data order: data_path's dataset {i + 1} ({now['name']}, "
                            f"{now['num_documents']} documents, {now['num_tokens']} tokens) is not the one the "
                            f"checkpoint drew from there ({then.get('name')}, {then.get('num_documents')} documents, "
                            f"{then.get('num_tokens')} tokens); list the checkpoint's datasets in its order, "
                            "each with its weight, to resume")


def _describe_blend(weights: list[float] | None) -> str:
    return "one dataset" if weights is None else f"a blend of weights {', '.join(f'{w:.6g}' for w in weights)}"


def _check_batch_layout(global_batch_size: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> None:
    for name, value in (("global_batch_size", global_batch_size), ("dp_size", dp_size),
                        ("micro_batch_size", micro_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}")
    if global_batch_size % (dp_size * micro_batch_size):
        raise UserError(f"global_batch_size {global_batch_size} is not divisible by dp {dp_size} x "
                        f"micro_batch_size {micro_batch_size} = {dp_size * micro_batch_size}; choose a "
                        "global_batch_size that is a multiple of it")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise UserError(f"dp_rank {dp_rank!r} is outside 0..{dp_size - 1} (dp_size {dp_size})")
