"""Denormal floats flushed to zero on CPU runs (``cpu_flush_denormal``, parallel/env.py ``set_cpu_denormals``).

An x86 core computes denormals in microcode, many times slower; the Qwen3.5 hybrid's delta rule reaches them
(bench/denormal_cpu.py). Tested here: a CPU training run sets the flag before its intra-op threads start, so
that every thread flushes, and says so at start-up; the key false leaves denormals computed; and the delta
rule with gates strong enough to produce denormals, flushed, stays as close to a token-by-token fp64
recurrence (written here) as fp32 allows. Each check that sets the flag runs in a process of its own: the
flag is per thread and stays for the process.
"""

from __future__ import annotations

import subprocess
import sys

from tests._train_helpers import check_ok, child_env, make_corpus, run_train, write_config

# Prints whether a product that underflows into fp32's denormals is 0 on every one of two intra-op threads
# after set_cpu_denormals, then the line it returns.
_THREADS = r"""
import sys, torch
from qwen3_pretrain.parallel import env
torch.set_num_threads(2)
line = env.set_cpu_denormals(sys.argv[1] == "1")
tiny = torch.full((1 << 18,), 1e-20)
print(not bool((tiny * tiny).any()))
print(line)
"""


def _threads_run(flush: bool, before: str = "") -> list[str]:
    script = _THREADS.replace("torch.set_num_threads(2)\n", "torch.set_num_threads(2)\n" + before)
    proc = subprocess.run([sys.executable, "-c", script, "1" if flush else "0"], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-2:]


def test_flushing_reaches_every_intra_op_thread():
    flushed, line = _threads_run(True)
    assert flushed == "True" and "on every intra-op thread" in line


def test_the_key_false_leaves_denormals_computed():
    flushed, line = _threads_run(False)
    assert flushed == "False" and "cpu_flush_denormal: false" in line


def test_threads_started_before_are_reported():
    # a parallel kernel before the call starts the pool without the flag: the line must not claim every thread
    flushed, line = _threads_run(True, before="torch.full((1 << 18,), 1.0).exp()\n")
    assert flushed == "False" and "on this thread only" in line


def test_a_cpu_run_logs_the_setting(tmp_path):
    make_corpus(tmp_path / "corpus", vocab=500)
    for flush, said in ((True, "CPU denormals: flushed to zero (FTZ/DAZ) on every intra-op thread"),
                        (False, "cpu_flush_denormal: false")):
        config = write_config(tmp_path / f"f{flush}.yaml", tmp_path / "corpus", tmp_path / f"out_{flush}",
                              total_steps=1, cpu_flush_denormal=flush)
        proc = run_train(config)
        check_ok(proc)
        assert said in proc.stderr + proc.stdout


# The delta rule, flushed, against a plain fp64 recurrence; gates as strong as a Qwen3.5 layer's at the start
# (A up to 16 per token): in-chunk decays reach e^-1000, some of them in fp32's denormal range.
_DELTA = r"""
import torch
torch.set_flush_denormal(True)
torch.set_num_threads(2)
from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule

gen = torch.Generator().manual_seed(0)
B, T, H, D = 2, 128, 2, 16
q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1) for _ in range(2))
v = torch.randn(B, T, H, D, generator=gen)
g = -torch.tensor([4.0, 16.0]) * torch.nn.functional.softplus(torch.randn(B, T, H, generator=gen) + 1.0)
beta = torch.rand(B, T, H, generator=gen)
cum = g[:, :64].double().cumsum(1)
pair = (cum[:, :, None] - cum[:, None, :]).exp()  # [B, i, j, H] within the first chunk, in fp64 (no flush there)
denormal = (pair > 2.0 ** -149) & (pair < torch.finfo(torch.float32).tiny)
assert denormal.any(), "no decay in fp32's denormal range: the case tests nothing"

out, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0)
qd, kd, vd, gd, bd = (x.double() for x in (q, k, v, g, beta))
ref = torch.zeros(B, T, H, D, dtype=torch.float64)
state = torch.zeros(B, H, D, D, dtype=torch.float64)
for t in range(T):
    state = state * gd[:, t].exp()[..., None, None]
    err = vd[:, t] - torch.einsum("bhkv,bhk->bhv", state, kd[:, t])
    state = state + bd[:, t][..., None, None] * kd[:, t][..., :, None] * err[..., None, :]
    ref[:, t] = torch.einsum("bhkv,bhk->bhv", state, qd[:, t])
print(((out.double() - ref).abs().max() / ref.abs().max()).item())
"""


def test_the_delta_rule_flushed_matches_fp64():
    proc = subprocess.run([sys.executable, "-c", _DELTA], capture_output=True, text=True, env=child_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1]) < 1e-5

