"""The start-up threads line says how OpenMP's idle workers wait (parallel/env.py ``openmp_wait_note``):
the choice that decides speed on a shared CPU, and one only the user's environment can make."""

from __future__ import annotations

import pytest

from qwen3_pretrain.parallel.env import openmp_wait_note


@pytest.mark.parametrize("env, threads, expected", [
    ({}, 1, ""),  # one thread: no idle workers to speak of
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}, 1, ""),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, 2, ", OpenMP wait policy PASSIVE"),
    ({"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "3000"}, 4, ", OpenMP wait policy active"),
    ({"GOMP_SPINCOUNT": "3000"}, 2, ", OpenMP spin count 3000"),
    ({"KMP_BLOCKTIME": "1"}, 2, ", OpenMP block time 1"),
])
def test_the_line_names_what_the_user_set(monkeypatch, env, threads, expected):
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert openmp_wait_note(threads) == expected


def test_unset_it_points_at_the_shared_cpu_setting(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    note = openmp_wait_note(2)
    assert "spin" in note and "OMP_WAIT_POLICY=PASSIVE" in note
