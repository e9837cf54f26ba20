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
import sys
import threading
from collections import deque
from typing import Any, Callable, Iterable, Iterator, TypeVar

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


def ordered_map(func: Callable[[T], R], items: Iterable[T], workers: int,
                initializer: Callable[..., Any] | None = None, initargs: tuple = (),
                max_in_flight: int | None = None) -> Iterator[R]:
    """Yield ``func(item)`` for every item, in order, computed by ``workers`` processes.

    ``workers <= 1`` runs everything in this process (no pool, same results).
    ``func`` and ``initializer`` must be module-level functions so that a
    spawned worker can import them.
    """
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(func, items)
        return
    limit = max_in_flight or 2 * workers
    # Forked workers inherit this process's objects (tokenizer tables: millions of them). Frozen,
    # the workers' garbage collector neither walks them nor copies their pages by touching them.
    gc.freeze()
    try:
        pool = _context().Pool(workers, initializer, initargs)
    finally:
        gc.unfreeze()
    with pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(func, (item,)))
            if len(pending) >= limit:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def put_unless_stopped(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Wait for room in ``out``, giving up when ``stop`` is set; whether the item went in."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
