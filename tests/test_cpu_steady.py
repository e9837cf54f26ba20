"""Steady CPU steps: the C heap trimmed when resident memory has grown, and a CPU's bf16 expert groups in row
buckets, with values unchanged or no less accurate.

A bf16 MoE run's resident memory grew step after step on a CPU, from glibc's heap (holes left by buffers
whose sizes follow the routing) and from oneDNN's kernels built per expert-group shape.
train/host_memory.py trims the heap after every step, or with ``cpu_malloc_trim_growth`` once the resident
memory has grown by that fraction since the step after the last trim; models/ops/moe.py pads a CPU's bf16 groups
to row buckets (``bucket_rows``), so few shapes are met. Tested here: the trim's decisions (when memory
grows, holds, cannot be read), that it runs on CPU runs only, is found where the C library is glibc, says
so at start-up, and gives a fragmented heap's free pages back (its own process); a training run gives the
same losses bit for bit with it on and off; the buckets' sizes, and the bucketed kernel's outputs and
gradients as close to an fp64 reference as the unpadded kernel's (expert parallelism against one process
with the bucketed kernel on both sides: tests/test_expert_parallel.py). Resident memory and step time
themselves are measured, not asserted (too noisy beside other processes on a shared machine):
bench/train_cpu.py, figures in bench/README.md.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import torch

from qwen3_pretrain.models.ops.moe import CPU_BUCKET_MIN, GroupedMM, bucket_rows
from qwen3_pretrain.train.host_memory import MIN_GROWTH, HostMemory, _glibc_trim
from tests._train_helpers import TINY_MODEL, check_ok, make_corpus, run_train, step_records, write_config


class CountingTrim:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, pad: int) -> int:
        self.calls.append(pad)
        return 1


def test_with_growth_0_the_trim_runs_after_every_step_on_cpu_runs_only():
    trim = CountingTrim()
    cpu = HostMemory("cpu", True, trim=trim, growth=0.0, resident=lambda: 1 << 30)
    for _ in range(3):
        cpu.after_step()
    assert trim.calls == [0, 0, 0] and cpu.trims == 3 and "after every step" in cpu.line()
    for device, enabled in (("cuda", True), ("npu", True), ("cpu", False)):
        other, idle = CountingTrim(), None
        idle = HostMemory(device, enabled, trim=other, growth=0.0)
        idle.after_step()
        assert other.calls == [] and not idle.active
    assert "cpu_malloc_trim: false" in HostMemory("cpu", False).line()


class Resident:
    """Resident memory after each step, in MiB as listed; a trim brings the next step back to ``floor``."""

    def __init__(self, mib: list[float]) -> None:
        self.mib, self.step = mib, 0

    def __call__(self) -> int:
        value = self.mib[self.step]
        self.step += 1
        return int(value * 2**20)


def trimmed_steps(mib: list[float], growth: float) -> list[int]:
    """The steps (from 1) after which the heap was trimmed, resident memory after each step being ``mib``."""
    trim, done = CountingTrim(), []
    memory = HostMemory("cpu", True, trim=trim, growth=growth, resident=Resident(mib))
    for step in range(1, len(mib) + 1):
        memory.after_step()
        if len(trim.calls) > len(done):
            done.append(step)
    return done


def test_steady_memory_is_never_trimmed():
    assert trimmed_steps([1000.0] * 20, 0.05) == []
    assert trimmed_steps([1000 + 2 * i for i in range(20)], 0.05) == []  # 38 MiB of drift: within 5%


def test_growing_memory_is_trimmed_once_it_passes_the_margin_then_measured_anew():
    # 1000 MiB after step 1, +20 MiB a step: above 1000 x 1.05 (and +64 MiB) at step 5 (1080); the step after
    # a trim is the new reference (here back to 1000), so the next trim comes as many steps later.
    mib = [1000, 1020, 1040, 1060, 1080, 1000, 1020, 1040, 1060, 1080, 1000]
    assert trimmed_steps(mib, 0.05) == [5, 10]
    # the margin is at least MIN_GROWTH whatever the fraction: a small process drifting a few MB is left alone
    small = [100 + 10 * i for i in range(7)]
    assert trimmed_steps(small, 0.05) == [] and MIN_GROWTH == 64 * 2**20
    assert trimmed_steps([100 + 10 * i for i in range(9)], 0.05) == [8]  # 170 - 100 > 64


def test_memory_that_cannot_be_read_is_trimmed_after_every_step():
    trim = CountingTrim()
    memory = HostMemory("cpu", True, trim=trim, growth=0.05, resident=lambda: None)
    for _ in range(3):
        memory.after_step()
    assert trim.calls == [0, 0, 0]
    assert "grew by more than 5%" in HostMemory("cpu", True, trim=trim, growth=0.05).line()


def test_glibc_is_found_where_it_is_the_c_library():
    if _glibc_trim() is None:
        pytest.skip("the C library has no malloc_trim (not glibc)")
    assert HostMemory("cpu", True).active and not HostMemory("cuda", True).active


MOE = dict(TINY_MODEL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def test_bf16_moe_resume_is_bit_exact_with_bucketed_groups(tmp_path):
    """A CPU's bf16 MoE run (expert groups in row buckets) resumed from its step-2 checkpoint trains steps 3-4
    as the uninterrupted run did, bit for bit."""
    from tests._checkpoint_helpers import resume_from

    make_corpus(tmp_path / "corpus", vocab=500)
    keys = dict(model_overrides=MOE, mixed_precision="bf16", total_steps=4, save_steps=2)
    whole = tmp_path / "whole"
    check_ok(run_train(write_config(tmp_path / "whole.yaml", tmp_path / "corpus", whole, **keys)))
    resumed = tmp_path / "resumed"
    resume_from(whole, 2, resumed)
    proc = run_train(write_config(tmp_path / "resumed.yaml", tmp_path / "corpus", resumed, **keys))
    check_ok(proc)
    want = [(r["step"], r["loss"].hex(), r["grad_norm"].hex()) for r in step_records(whole)]
    got = [(r["step"], r["loss"].hex(), r["grad_norm"].hex()) for r in step_records(resumed)]
    assert [w[0] for w in want] == [1, 2, 3, 4] and got == want[2:], (got, want)


def test_losses_are_the_same_bits_with_the_trim_on_and_off(tmp_path):
    make_corpus(tmp_path / "corpus", vocab=500)
    runs = {}
    for trim in (True, False):
        out = tmp_path / f"trim_{trim}"
        config = write_config(tmp_path / f"trim_{trim}.yaml", tmp_path / "corpus", out, model_overrides=MOE,
                              mixed_precision="bf16", total_steps=4, cpu_malloc_trim=trim,
                              cpu_malloc_trim_growth=0.0)  # a trim after every step: the most it can change
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
HostMemory("cpu", enabled=sys.argv[1] == "on", growth=0.0).after_step()
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


def test_bucket_sizes_bound_the_shapes_and_the_padding():
    counts = torch.arange(0, 5000)
    sizes = bucket_rows(counts)
    assert sizes[0] == 0 and all(s >= c for s, c in zip(sizes, counts.tolist()))
    assert all(s % CPU_BUCKET_MIN == 0 for s in sizes)
    # at most 1/16 more rows from 256 rows on (smaller groups: at most CPU_BUCKET_MIN - 1 more)
    assert all(s - c <= max(c / 16, CPU_BUCKET_MIN - 1) for s, c in zip(sizes, counts.tolist()))
    # few shapes: 16 per doubling of the count
    assert len(set(sizes)) <= 16 * 5 + 256 // CPU_BUCKET_MIN + 1
    assert bucket_rows(torch.tensor([300, 513, 20, 0])) == [304, 544, 32, 0]


def _fp64_expert_block(x, counts, w, gate, up, down, grad):
    """The expert block written out in fp64, one expert at a time: output and gradients of x, gate, up, down."""
    leaves = [t.detach().double().requires_grad_() for t in (x, gate, up, down)]
    outs, start = [], 0
    for e, count in enumerate(counts.tolist()):
        rows = leaves[0][start:start + count]
        act = torch.nn.functional.silu(rows @ leaves[1][e].T) * (rows @ leaves[2][e].T) * w[start:start + count].double()
        outs.append(act @ leaves[3][e].T)
        start += count
    out = torch.cat(outs)
    out.backward(grad.double())
    return [out.detach()] + [t.grad for t in leaves]


def test_bucketed_groups_are_as_accurate_as_unpadded_ones():
    """bf16 expert block on a CPU with and without the row buckets against fp64: no larger error in the output
    or any gradient (the zero rows add nothing; only the sums' blocking may differ)."""
    experts, hidden, inter, rows = 8, 64, 32, 1500
    g = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts)
    counts[1] = 0  # an expert without rows stays empty
    counts[0] += rows - int(counts.sum())
    x = torch.randn(rows, hidden, generator=g).bfloat16()
    w = torch.rand(rows, 1, generator=g).bfloat16()
    gate, up = [(torch.randn(experts, inter, hidden, generator=g) / 8).bfloat16() for _ in range(2)]
    down = (torch.randn(experts, hidden, inter, generator=g) / 8).bfloat16()
    grad = torch.randn(rows, hidden, generator=g).bfloat16()
    want = _fp64_expert_block(x, counts, w, gate, up, down, grad)
    errors = {}
    for buckets in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, gate, up, down)]
        out = GroupedMM(1, buckets=buckets)(leaves[0], counts, w, *leaves[1:])
        out.backward(grad)
        got = [out.detach()] + [t.grad for t in leaves]
        assert [t.shape for t in got] == [t.shape for t in want]
        errors[buckets] = [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want)]
    assert all(0 < e < 2e-2 for e in errors[False]), errors
    assert all(b <= a * 1.02 + 1e-6 for a, b in zip(errors[False], errors[True])), errors
