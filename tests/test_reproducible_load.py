"""1-process CPU runs repeat bit for bit whatever else the machine runs.

The same tiny training (dense and MoE, fp32, the engine's defaults: batches read ahead in a thread, the
MFU peak measured at start-up, the observers on) runs twice as one process on all of this process's
cores, once beside CPU-burning neighbours (two busy-loop processes), and must log the same losses and
gradient norms bitwise. A source of difference that depends on load (a thread count or team size that
follows the free cores, torch work on a background thread sharing the step's thread settings, ...)
shows up as a different last bit, which routing then amplifies.

The children keep torch's own thread count (all affinity cores): the suite's usual
``OMP_NUM_THREADS=1`` would hide exactly the multi-threaded kernels this is about.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._train_helpers import TINY_MODEL, check_ok, make_corpus, step_records, train_command, write_config

# Wider than the suite's tiny model, so the matmuls and reductions are split over threads.
MODEL = dict(TINY_MODEL, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, num_hidden_layers=2)
MOE = dict(MODEL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
# peak_tflops=None: the run measures the MFU peak at start-up as a shipped config does (the probe sets the
# thread count around its matmul, one of the load-dependent suspects).
SETUP = dict(seq_length=128, batch_size=4, total_steps=3, log_steps=1, mixed_precision="fp32", peak_tflops=None)


@contextlib.contextmanager
def busy_neighbours(count: int = 2):
    """``count`` processes spinning on the CPU for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _run(tmp: Path, name: str, model: dict) -> list[tuple]:
    out = tmp / name
    config = write_config(tmp / f"{name}.yaml", tmp / "corpus", out, model_overrides=model, **SETUP)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RANK")}
    proc = subprocess.run(train_command(config), capture_output=True, text=True, timeout=300,
                          env=dict(env, PYTHONUNBUFFERED="1"))
    check_ok(proc)
    return [(r["step"], r["loss"].hex(), r["grad_norm"].hex()) for r in step_records(out)]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_loaded_run_repeats_an_unloaded_one_bitwise(tmp_path, kind):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores: one thread per process has nothing to split")
    make_corpus(tmp_path / "corpus", vocab=500)
    model = MOE if kind == "moe" else MODEL
    quiet = _run(tmp_path, "quiet", model)
    with busy_neighbours():
        loaded = _run(tmp_path, "loaded", model)
    assert loaded == quiet, f"{kind}: losses/grad norms (hex) differ under load:\n{loaded}\nvs\n{quiet}"
