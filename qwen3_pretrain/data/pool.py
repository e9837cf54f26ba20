"""Ordered, memory-bounded parallel map over worker processes.

``multiprocessing.Pool.imap`` drains its input iterator as fast as it can, so a
slow consumer (a file writer) lets the whole input pile up in memory. Here at
most ``max_in_flight`` items are submitted and not yet consumed, and results
come back in input order, which keeps every output independent of the number
of workers.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import queue
import signal
import sys
import threading
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator, TypeVar

from qwen3_pretrain.errors import UserError

T = TypeVar("T")
R = TypeVar("R")


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _context() -> multiprocessing.context.BaseContext:
    # On Linux, fork hands the parent's loaded state (tokenizer tables) to workers for free;
    # elsewhere fork is unsafe with threaded libraries, and workers rebuild that state.
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


class WorkerDied(UserError):
    """A worker process ended without returning its result (killed, typically by the out-of-memory killer)."""


def _start_worker(initializer: Callable[..., Any] | None, initargs: tuple) -> None:
    # Ctrl-C reaches every process of the terminal's group: the consumer stops the work, the workers
    # finish what they hold and exit when told, rather than each dying with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer(*initargs)


def _ready() -> None:
    """A no-op task: submitted first, it starts the workers."""


def ordered_map(func: Callable[[T], R], items: Iterable[T], workers: int,
                initializer: Callable[..., Any] | None = None, initargs: tuple = (),
                max_in_flight: int | None = None) -> Iterator[R]:
    """Yield ``func(item)`` for every item, in order, computed by ``workers`` processes.

    ``workers <= 1`` runs everything in this process (no pool, same results).
    ``func`` and ``initializer`` must be module-level functions so that a
    spawned worker can import them. An error anywhere (in ``func``, in
    ``items``, or in the consumer, which should close the generator, e.g. with
    ``contextlib.closing``) ends the map: work not started is cancelled, work
    started is finished and its results read (a pool torn down with large
    results in flight can hang; this one never tears down), and the workers
    exit before the error goes on. A worker killed from outside is a
    ``WorkerDied`` error. Workers ignore SIGINT: Ctrl-C stops the consumer.
    """
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(func, items)
        return
    limit = max_in_flight or 2 * workers
    executor = ProcessPoolExecutor(workers, mp_context=_context(), initializer=_start_worker,
                                   initargs=(initializer, initargs))
    try:
        # Forked workers inherit this process's objects (tokenizer tables: millions of them). Frozen,
        # the workers' garbage collector neither walks them nor copies their pages by touching them.
        # The workers start with the first task, before ``items`` starts any thread of its own.
        gc.freeze()
        try:
            _result(executor.submit(_ready))
        finally:
            gc.unfreeze()
        pending: deque[Future] = deque()
        for item in items:
            pending.append(executor.submit(func, item))
            if len(pending) >= limit:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _result(future: Future) -> Any:
    try:
        return future.result()
    except BrokenProcessPool:
        raise WorkerDied("a worker process died before returning its result: killed (most often by the "
                         "out-of-memory killer: see `dmesg`; then use fewer workers or smaller units of work), "
                         "crashed, or its start-up failed (see the messages above)") from None


def put_unless_stopped(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Wait for room in ``out``, giving up when ``stop`` is set; whether the item went in."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
