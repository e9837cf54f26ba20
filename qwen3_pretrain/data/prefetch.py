"""Global batches prepared in a background thread while the current step runs.

``Prefetcher`` wraps a ``GlobalBatchLoader``: a thread reads the next steps'
samples (index look-ups, memory-mapped reads, stacking) and, for an
accelerator, pins them in page-locked memory; the training thread then starts
their copies to the device without waiting (``non_blocking``), so the device's
queue orders each copy before its use and neither reading nor copying holds the
step up. The batches come in the loader's order, and ``state_dict`` describes
the batches handed out, not those read ahead: a checkpoint resumes exactly
after the last batch trained on (``bad_token`` too is the loader's record of
the batch last handed out). An error in the thread is raised in the
training thread by the ``next`` that would have returned its batch; ``close``
stops the thread without waiting for a batch nobody will take.
"""

from __future__ import annotations

import copy
import queue
import threading
from typing import Any

import torch

from qwen3_pretrain.data.pool import put_unless_stopped
from qwen3_pretrain.data.reader import BadToken, GlobalBatchLoader

Batches = list[dict[str, torch.Tensor]]


class Prefetcher:
    """Iterator over ``loader``'s steps, ``depth`` of them read ahead in a thread, moved to ``device``."""

    def __init__(self, loader: GlobalBatchLoader, device: torch.device, depth: int = 2,
                 join_timeout_s: float = 30.0) -> None:
        self.loader = loader  # stays at the position of the batches handed out; the thread reads a copy
        self.device = device
        self.depth = depth
        self.join_timeout_s = join_timeout_s
        self._pin = device.type in ("cuda", "npu")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)

    @property
    def consumed_samples(self) -> int:
        """Samples (global) in the batches handed out so far."""
        return self.loader.consumed_samples

    @property
    def bad_token(self) -> BadToken | None:
        """The loader's record of a token id outside the vocabulary in the batch last handed out."""
        return self.loader.bad_token

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batches:
        if self._thread is None:
            self._start()
        kind, value, consumed, bad_token = self._get()
        if kind == "error":
            self.close()
            raise value
        self.loader.consumed_samples, self.loader.bad_token = consumed, bad_token
        return [{k: t.to(self.device, non_blocking=self._pin) for k, t in mb.items()} for mb in value]

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.depth)
        # A daemon thread on its own copy of the loader: one that outlives close() (stuck in a read) can
        # neither keep the process alive nor move the position of the batches handed out.
        self._thread = threading.Thread(target=self._produce, args=(copy.copy(self.loader), self._queue, self._stop),
                                        name="batch-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, loader: GlobalBatchLoader, out: queue.Queue, stop: threading.Event) -> None:
        if self._pin and self.device.index is not None:
            # Pinned memory belongs to the thread's current device (a fresh thread's is device 0): set this
            # rank's, as torch's DataLoader does for its pinning thread.
            torch.accelerator.set_device_index(self.device.index)
        while not stop.is_set():
            try:
                batches = next(loader)
                if self._pin:
                    batches = [{k: t.pin_memory() for k, t in mb.items()} for mb in batches]
                item = ("batches", batches, loader.consumed_samples, loader.bad_token)
            except Exception as exc:  # handed to the training thread, which raises it
                item = ("error", exc, None, None)
            if not put_unless_stopped(out, item, stop) or item[0] == "error":
                return

    def _get(self) -> tuple:
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the batch prefetch thread ended without handing over a batch") from None

    def close(self) -> None:
        """Stop the thread and drop what it read ahead; the position stays at the last batch handed out."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(self.join_timeout_s)
        self._stop = threading.Event()  # the next thread's; a stuck old one keeps its own, set

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.loader.load_state_dict(state)
