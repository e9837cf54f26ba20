"""The C heap of a CPU training process: its free memory handed back to the OS after a step.

On a CPU the step's tensors live in memory from the C library's ``malloc`` (torch's CPU allocator keeps
no cache of its own). glibc serves a request above its mmap threshold with a fresh mapping, returned to
the OS on ``free``, but raises the threshold to the size of every such block freed (up to 32 MiB); from
then on the step's large buffers come from the heap, and from one heap per thread that allocates
(OpenMP's workers have their own arenas). Buffers whose sizes change from step to step (a MoE layer's
expert groups follow the routing) leave holes there that the next step's buffers do not fit exactly, and
glibc gives the top of a heap back only: the resident memory of a MoE bf16 run grew by tens of MB per
step, a dense one's by a few. ``malloc_trim(0)`` hands every free page of every arena back (``madvise``),
whatever lies above it. It changes where memory comes from, never a value: losses are the same bit for bit
(tests/test_cpu_steady.py).

Its cost is that the pages it gives back are mostly the next step's working set, faulted in again: 30,000
page faults per dense bf16 step at the benchmark's shapes against 7,000 untrimmed, about 1.3 us each, 1-1.5%
of a step's CPU time. At the roofline bench's shapes (its vocabulary cut to 16,384, so a shorter step) a
dense eager step ran 3.5-5% slower with the trim (0.855 / 0.878 s against 0.826 / 0.836, about 20,000
faults against 500-2,100, transparent huge pages on as the CLI sets them) and 12% without huge pages
(0.924 against 0.827 s, 62,000 faults against 16,000-26,000).

By default (``growth`` 0) it runs after every step, which keeps resident memory flat;
with ``growth`` a fraction it runs only after a step whose resident memory exceeds the one measured after
the first step since the last trim (the working set at its natural level) by more than that fraction of it
(and at least 64 MiB): steady memory is then never trimmed, growing memory is trimmed every few steps and
saw-tooths within the margin. Figures: bench/README.md, "bf16 memory that grows step by step".

The rest of a MoE bf16 run's growth was oneDNN's kernels per group shape, bounded where it arises: the
CPU's expert groups are padded to row buckets (models/ops/moe.py, ``bucket_rows``).

Only on CPU runs (an accelerator's tensors are in its caching allocator; the host heap holds little that
changes per step) and only where the C library is glibc (``malloc_trim`` found in the process's own
symbols); elsewhere a no-op, and the start-up line says which. ``cpu_malloc_trim: false`` turns it off,
``cpu_malloc_trim_growth`` chooses when.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable


def _glibc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` from this process's symbols; None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


# The least growth (bytes) that triggers a trim whatever the fraction: a small process's few MB of drift
# are not worth a step's page faults.
MIN_GROWTH = 64 * 2**20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident memory now (``/proc/self/statm``), None where there is no such file."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class HostMemory:
    """Hands the C heap's free pages back to the OS after a training step (``after_step``) on a CPU run with
    glibc when ``enabled``: after every step where ``growth`` is 0 (the default) or the resident memory cannot
    be read; else when the resident memory (``resident``, by default ``resident_bytes``) has grown by more
    than ``growth`` of its level after the first step since the last trim (at least ``MIN_GROWTH``).
    ``line`` says what it does, for the start-up log."""

    def __init__(self, device_type: str, enabled: bool, trim: Callable[[int], int] | None = None,
                 growth: float = 0.0, resident: Callable[[], int | None] = resident_bytes) -> None:
        self.device_type, self.enabled, self.growth = device_type, enabled, growth
        wanted = device_type == "cpu" and enabled
        self._trim = (trim if trim is not None else _glibc_trim()) if wanted else None
        self._resident = resident
        self.base: int | None = None  # resident bytes after the first step since the last trim
        self.trims = 0  # calls made (tests read it)

    @property
    def active(self) -> bool:
        return self._trim is not None

    def after_step(self) -> None:
        """Every step's buffers are free here (the trainer calls it as the update ends: its time is the
        optimizer phase's): their pages go back to the OS if the memory has grown enough (a no-op where
        inactive)."""
        if self._trim is None:
            return
        now = self._resident() if self.growth > 0 else None
        if now is not None:
            if self.base is None:
                self.base = now
                return
            if now - self.base <= max(MIN_GROWTH, self.growth * self.base):
                return
        self._trim(0)
        self.trims += 1
        self.base = None

    def line(self) -> str:
        if self._trim is not None:
            when = ("after every step" if self.growth <= 0 else
                    f"after a step whose resident memory grew by more than {self.growth:.0%} "
                    f"(and {MIN_GROWTH >> 20} MiB) since the last")
            return f"host memory: the C heap's free pages handed back {when} (malloc_trim, cpu_malloc_trim)"
        if not self.enabled:
            return "host memory: free heap pages kept between steps (cpu_malloc_trim: false)"
        return "host memory: free heap pages kept between steps (the C library is not glibc: no malloc_trim)"
