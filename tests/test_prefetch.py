"""Batches read ahead in a thread: the same batches in the same order, an exact position, no hangs."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from qwen3_pretrain.data.prefetch import Prefetcher
from qwen3_pretrain.data.reader import GlobalBatchLoader, PackedDataset
from qwen3_pretrain.data.synthetic import write_synthetic_dataset
from qwen3_pretrain.errors import UserError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> PackedDataset:
    lengths = np.random.default_rng(0).integers(1, 60, 120)
    docs = [1 + d * 1000 + np.arange(n) for d, n in enumerate(lengths)]
    path = tmp_path_factory.mktemp("prefetch") / "data"
    write_synthetic_dataset(path, docs, 0, docs_per_shard=40, max_piece_length=25)
    return PackedDataset(path, 16, seed=3)


def loader(dataset, consumed: int = 0) -> GlobalBatchLoader:
    return GlobalBatchLoader(dataset, 8, 1, 2, 2, consumed_samples=consumed)  # dp rank 1 of 2, 2 micro-batches


def assert_same(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_batches_in_the_same_order_and_the_position_of_those_handed_out(dataset):
    steps = 3 * len(dataset) // 8  # across epoch boundaries
    plain, ahead = loader(dataset), Prefetcher(loader(dataset), CPU, depth=3)
    try:
        for _ in range(steps):
            assert_same(next(ahead), next(plain))
            time.sleep(0.002)  # let the thread run ahead
            assert ahead.consumed_samples == plain.consumed_samples
            assert ahead.state_dict() == plain.state_dict()
    finally:
        ahead.close()


def test_resume_from_a_state_saved_while_reading_ahead_is_exact(dataset):
    ahead = Prefetcher(loader(dataset), CPU, depth=2)
    for _ in range(3):
        next(ahead)
    time.sleep(0.2)  # the thread has read steps 4 and 5 by now
    state = ahead.state_dict()
    ahead.close()
    reference = loader(dataset, consumed=3 * 8)
    resumed = Prefetcher(loader(dataset), CPU)
    resumed.load_state_dict(state)
    try:
        for _ in range(4):
            assert_same(next(resumed), next(reference))
        resumed.load_state_dict(state)  # while its thread runs: starts over from the state
        assert_same(next(resumed), next(loader(dataset, consumed=3 * 8)))
    finally:
        resumed.close()


class FailingDataset:
    """The dataset, until sample ``bad``: reading it raises what a damaged shard would."""

    def __init__(self, dataset: PackedDataset, bad: int) -> None:
        self.dataset, self.bad = dataset, bad
        self.seed, self.seq_length = dataset.seed, dataset.seq_length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index >= self.bad:
            raise UserError(f"shard_00001.bin is truncated (sample {index})")
        return self.dataset[index]


def test_an_error_in_the_thread_is_raised_by_next_after_the_good_batches(dataset):
    ahead = Prefetcher(GlobalBatchLoader(FailingDataset(dataset, bad=20), 8, 0, 1, 2), CPU)
    plain = loader(dataset)
    plain.dp_rank, plain.dp_size = 0, 1
    for _ in range(2):  # samples 0-15
        assert_same(next(ahead), next(plain))
    with pytest.raises(UserError, match="shard_00001.bin is truncated"):
        next(ahead)
    assert ahead._thread is None and ahead.consumed_samples == 16  # stopped; the position is the last good step


def test_close_returns_while_the_thread_waits_for_room(dataset):
    ahead = Prefetcher(loader(dataset), CPU, depth=1)
    next(ahead)
    thread = ahead._thread
    time.sleep(0.3)  # the queue is full: the thread waits to put the next batch
    start = time.perf_counter()
    ahead.close()
    assert time.perf_counter() - start < 2 and not thread.is_alive()
    assert ahead.consumed_samples == 8


def test_the_thread_pins_on_this_ranks_device(dataset, monkeypatch):
    """Pinned memory belongs to the current device of the thread that pins it; a fresh thread's is device 0,
    so rank 1's batches would be pinned for device 0. The thread sets the rank's device before it pins
    (no accelerator here: the two calls are recorded in order)."""
    import queue
    import threading

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: calls.append(("device", index)))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append(("pin", threading.get_ident())) or t)
    prefetcher = Prefetcher(loader(dataset), torch.device("cuda", 1))
    out: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    thread = threading.Thread(target=prefetcher._produce, args=(loader(dataset), out, stop))
    thread.start()
    out.get(timeout=10)
    stop.set()
    thread.join(timeout=10)
    assert calls[0] == ("device", 1)
    assert {kind for kind, _ in calls[1:]} == {"pin"} and all(ident == thread.ident for _, ident in calls[1:])


def test_global_positions_under_cp_are_made_on_the_device():
    """Under cp without document masks each rank's global positions are made where they are used: no copy
    from the host every micro-batch (a device stands in as ``meta``: a host tensor would have to be copied)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from qwen3_pretrain.parallel.context_parallel import sequence_positions, shard_sequence

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.copies += func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
            return func(*args, **(kwargs or {}))

    with Copies() as mode:
        positions = sequence_positions((2, 16), 2, 1, torch.device("meta"))
    assert positions.device.type == "meta" and positions.shape == (2, 8) and mode.copies == 0
    assert torch.equal(sequence_positions((2, 16), 2, 1, CPU), shard_sequence(torch.arange(16).expand(2, 16), 2, 1))
