"""The C heap of a CPU training process: its free memory handed back to the OS after every step.

On a CPU the step's tensors live in memory from the C library's ``malloc`` (torch's CPU allocator keeps
no cache of its own). glibc serves a request above its mmap threshold with a fresh mapping, returned to
the OS on ``free``, but raises the threshold to the size of every such block freed (up to 32 MiB); from
then on the step's large buffers come from the heap, and from one heap per thread that allocates
(OpenMP's workers have their own arenas). Buffers whose sizes change from step to step (a MoE layer's
expert groups follow the routing) leave holes there that the next step's buffers do not fit exactly, and
glibc gives the top of a heap back only: the resident memory of a MoE bf16 run grew by tens of MB per
step. ``malloc_trim(0)`` hands every free page of every arena back (``madvise``), whatever lies above
it; after each optimizer step the step's buffers are all free, so the process keeps what it holds between
steps plus the largest step's working set. It changes where memory comes from, never a value: losses are
the same bit for bit (tests/test_cpu_steady.py). Its cost is the trim itself (a walk over the arenas'
free lists) and the page faults of touching those pages again in the next step (bench/README.md,
"bf16 memory that grows step by step", gives both).

The rest of that growth is state the CPU's grouped matmul keeps per group shape (row count), which levels
off once most row counts have been met; padding the groups to buckets of rows would bound it sooner but
changed the losses' last bits in training (bench/README.md).

Only on CPU runs (an accelerator's tensors are in its caching allocator; the host heap holds little that
changes per step) and only where the C library is glibc (``malloc_trim`` found in the process's own
symbols); elsewhere a no-op, and the start-up line says which. ``cpu_malloc_trim: false`` turns it off.
"""

from __future__ import annotations

import ctypes
from typing import Callable


def _glibc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` from this process's symbols; None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HostMemory:
    """Hands the C heap's free pages back to the OS once per training step (``after_step``), on a CPU run
    with glibc when ``enabled``; ``line`` says what it does, for the start-up log."""

    def __init__(self, device_type: str, enabled: bool, trim: Callable[[int], int] | None = None) -> None:
        self.device_type, self.enabled = device_type, enabled
        wanted = device_type == "cpu" and enabled
        self._trim = (trim if trim is not None else _glibc_trim()) if wanted else None
        self.trims = 0  # calls made (tests read it)

    @property
    def active(self) -> bool:
        return self._trim is not None

    def after_step(self) -> None:
        """Every step's buffers are free here (the trainer calls it as the update ends: its time is the
        optimizer phase's): their pages go back to the OS (a no-op where inactive)."""
        if self._trim is not None:
            self._trim(0)
            self.trims += 1

    def line(self) -> str:
        if self._trim is not None:
            return "host memory: the C heap's free pages handed back after every step (malloc_trim, cpu_malloc_trim)"
        if not self.enabled:
            return "host memory: free heap pages kept between steps (cpu_malloc_trim: false)"
        return "host memory: free heap pages kept between steps (the C library is not glibc: no malloc_trim)"
