"""Steady CPU steps: the C heap's free pages handed back after every step, with values unchanged.

A bf16 MoE run's resident memory grew step after step on a CPU, in part from glibc's heap (holes left by
buffers whose sizes follow the routing): train/host_memory.py (``cpu_malloc_trim``) trims it after every
step. Tested here: the trim runs once per step on CPU runs only, is found where the C library is glibc,
says so at start-up, and gives a fragmented heap's free pages back (its own process); a training run gives the same losses bit for bit with it on and off. Resident
memory itself is measured, not asserted (too noisy beside other processes on a shared machine): the
curve per step at the benchmark's shapes is bench/train_cpu.py's (bench/README.md).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from qwen3_pretrain.train.host_memory import HostMemory, _glibc_trim
from tests._train_helpers import TINY_MODEL, check_ok, make_corpus, run_train, step_records, write_config


class CountingTrim:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, pad: int) -> int:
        self.calls.append(pad)
        return 1


def test_the_trim_runs_once_per_step_on_cpu_runs_only():
    trim = CountingTrim()
    cpu = HostMemory("cpu", True, trim=trim)
    for _ in range(3):
        cpu.after_step()
    assert trim.calls == [0, 0, 0] and cpu.trims == 3 and "malloc_trim" in cpu.line()
    for device, enabled in (("cuda", True), ("npu", True), ("cpu", False)):
        other, idle = CountingTrim(), None
        idle = HostMemory(device, enabled, trim=other)
        idle.after_step()
        assert other.calls == [] and not idle.active
    assert "cpu_malloc_trim: false" in HostMemory("cpu", False).line()


def test_glibc_is_found_where_it_is_the_c_library():
    if _glibc_trim() is None:
        pytest.skip("the C library has no malloc_trim (not glibc)")
    assert HostMemory("cpu", True).active and not HostMemory("cuda", True).active


MOE = dict(TINY_MODEL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def test_losses_are_the_same_bits_with_the_trim_on_and_off(tmp_path):
    make_corpus(tmp_path / "corpus", vocab=500)
    runs = {}
    for trim in (True, False):
        out = tmp_path / f"trim_{trim}"
        config = write_config(tmp_path / f"trim_{trim}.yaml", tmp_path / "corpus", out, model_overrides=MOE,
                              mixed_precision="bf16", total_steps=4, cpu_malloc_trim=trim)
        proc = run_train(config)
        check_ok(proc)
        assert ("handed back after every step" if trim else "cpu_malloc_trim: false") in proc.stderr + proc.stdout
        runs[trim] = [(r["loss"].hex(), r["grad_norm"].hex()) for r in step_records(out)]
    assert len(runs[True]) == 4 and runs[True] == runs[False]


# A heap left with 200 MiB of free blocks under one live block at its top: glibc cannot shrink the heap past
# a live block, so the free pages stay resident until trimmed. Its own process: this one's heap is not ours.
_FRAGMENTED_HEAP = r"""
import ctypes, sys
from qwen3_pretrain.train.host_memory import HostMemory

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 100 KiB blocks come from the heap, never a mapping of their own

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

blocks = [libc.malloc(100 * 1024) for _ in range(2048)]
for b in blocks:
    ctypes.memset(b, 1, 100 * 1024)  # resident
pin = libc.malloc(100 * 1024)  # the heap's top stays in use
for b in blocks:
    libc.free(b)
before = rss_mib()
HostMemory("cpu", enabled=sys.argv[1] == "on").after_step()
print(before, rss_mib())
"""


@pytest.mark.skipif(_glibc_trim() is None, reason="the C library is not glibc")
def test_the_trim_hands_free_heap_pages_back(tmp_path):
    """The real ``malloc_trim`` call (symbol, argument types) gives a fragmented heap's free pages back;
    with the trim off they stay resident (so the measurement can tell the two apart)."""
    script = tmp_path / "heap.py"
    script.write_text(_FRAGMENTED_HEAP)
    drops = {}
    for mode in ("on", "off"):
        proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        before, after = map(float, proc.stdout.split())
        assert before > 150, (mode, before)  # the 200 MiB freed are still resident before the call
        drops[mode] = before - after
    assert drops["on"] > 150 and drops["off"] < 20, drops
