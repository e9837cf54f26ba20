"""Several converted datasets blended by weight into one sequence of training samples.

Global sample ``i`` (the index ``GlobalBatchLoader`` asks for) is assigned to a
source by its index alone, so every parallel layout sees the same global
batches and a resume, under any layout, recomputes where each source stands
from ``consumed_samples``. The assignment repeats every ``PERIOD`` samples:
each source gets its quota of a period (its weight x ``PERIOD``, rounded by
largest remainder, so the long-run shares are the weights to within
1 / ``PERIOD``), and within a period the slots go out in the order of every
source's evenly spaced ideal times ``(k + 1/2) / quota``, so any run of
consecutive samples (one global batch) is already close to the weights. Like
Megatron's BlendedDataset, each source keeps its own sample counter: source
``s``'s ``n``-th sample is its ``PackedDataset``'s sample ``n``, which starts a
new, reshuffled epoch of that source alone when it runs out.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch

from qwen3_pretrain.data.reader import PackedDataset
from qwen3_pretrain.data.manifest import MANIFEST_NAME, validate_manifest
from qwen3_pretrain.data.sources import PERIOD, DataSource
from qwen3_pretrain.errors import UserError

# What every source of a blend must share: token ids mean the same text in all of them.
_SAME_TOKENIZER_KEYS = ("sha256", "vocab_size", "eod_id")


class BlendSchedule:
    """Source and per-source sample number of every global sample index, from the weights alone."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.period = 1 if len(weights) == 1 else PERIOD
        self.quotas = _apportion(np.asarray(weights, dtype=np.float64), self.period)
        assert self.quotas.min() > 0, self.quotas  # sources.py refuses shares below 1 / PERIOD
        source = np.repeat(np.arange(len(weights)), self.quotas)
        k = np.arange(self.period) - np.repeat(np.cumsum(self.quotas) - self.quotas, self.quotas)
        # Stable: equal ideal times go to the source listed first, on every machine.
        order = np.argsort((2 * k + 1) / (2.0 * self.quotas[source]), kind="stable")
        self.slot_source = source[order].astype(np.int32)  # [period] source of each slot
        self.slot_sample = k[order].astype(np.int32)  # [period] its sample number in that source's quota
        self._slots_of = [np.flatnonzero(self.slot_source == s).astype(np.int32) for s in range(len(weights))]

    def locate(self, index: int) -> tuple[int, int]:
        """(source, sample number in that source) of global sample ``index``."""
        cycle, slot = divmod(index, self.period)
        source = int(self.slot_source[slot])
        return source, cycle * int(self.quotas[source]) + int(self.slot_sample[slot])

    def counts(self, num_samples: int) -> list[int]:
        """Samples each source gave to the first ``num_samples`` global samples."""
        cycle, slot = divmod(num_samples, self.period)
        return [cycle * int(q) + int(np.searchsorted(slots, slot)) for q, slots in zip(self.quotas, self._slots_of)]


def _apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Integers summing to ``total`` proportional to ``weights`` (largest remainder; ties to the first)."""
    exact = weights / weights.sum() * total
    quotas = np.floor(exact).astype(np.int64)
    short = total - int(quotas.sum())
    quotas[np.argsort(-(exact - quotas), kind="stable")[:short]] += 1
    return quotas


class BlendedDataset(torch.utils.data.Dataset):
    """``dataset[i]`` for any ``i >= 0``: global sample ``i`` of the blend, a sample of one source's
    ``PackedDataset`` (same keys and shapes). One source is that source's samples, in its order."""

    def __init__(self, sources: Sequence[DataSource], datasets: Sequence[PackedDataset]) -> None:
        assert len(sources) == len(datasets) > 0
        self.sources, self.datasets = tuple(sources), list(datasets)
        self.schedule = BlendSchedule([s.weight for s in self.sources])
        self.seq_length, self.seed = datasets[0].seq_length, datasets[0].seed

    @classmethod
    def open(cls, sources: Sequence[DataSource], seq_length: int, seed: int, split: str = "train",
             valid_fraction: float = 0.0) -> BlendedDataset:
        """Each source's ``split`` (the same ``valid_fraction`` of each source's documents held out), blended
        with the same weights: evaluation draws from the sources in the proportions training does."""
        return cls(sources, [PackedDataset(s.path, seq_length, seed=seed, split=split, valid_fraction=valid_fraction)
                             for s in sources])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            raise IndexError(f"sample index {index} is negative")
        source, sample = self.schedule.locate(int(index))
        return self.datasets[source][sample]

    def samples_by_dataset(self, num_samples: int) -> dict[str, int]:
        """Samples drawn from each source (keyed by its path) in the first ``num_samples`` global samples."""
        return dict(zip((s.path for s in self.sources), self.schedule.counts(num_samples)))

    def blend_state(self) -> dict[str, Any]:
        """What a resume must find unchanged, beyond seed and seq_length: the weights of a blend and which
        dataset holds each (by its size, not its path, which may move with a copy of the data). Empty for
        one source, as before blending."""
        if len(self.sources) == 1:
            return {}
        return {"blend_weights": [s.weight for s in self.sources],
                "blend_sources": [d.fingerprint for d in self.datasets]}


def validate_sources(sources: Sequence[DataSource], model_vocab_size: int,
                     tokenizer_path: str | os.PathLike | None = None,
                     seq_length: int | None = None) -> list[dict[str, Any]]:
    """``validate_manifest`` for every source, then that all were converted with the same tokenizer;
    returns the manifests."""
    manifests = [validate_manifest(s.path, model_vocab_size, tokenizer_path, seq_length) for s in sources]
    first = manifests[0]["tokenizer"]
    for source, manifest in zip(sources[1:], manifests[1:]):
        for key in _SAME_TOKENIZER_KEYS:
            if manifest["tokenizer"][key] != first[key]:
                ours = manifest["tokenizer"][key]
                raise UserError(f"data_path: {source.path} was converted with another tokenizer than "
                                f"{sources[0].path} (tokenizer {key} {ours} vs {first[key]} in their "
                                f"{MANIFEST_NAME}); blend only datasets converted with the same tokenizer: "
                                "re-convert one of them")
    return manifests
