"""data/pool.py: the ordered parallel map ends every error path with the error, promptly, leaving no worker.

The teardown of a pool with large results still in flight is where process pools hang (a result bigger
than a pipe's buffer blocks the worker writing it while the pool waits for the worker). Each scenario
runs many trials in a child process under a deadline, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from qwen3_pretrain.data.pool import WorkerDied, ordered_map

STRESS = textwrap.dedent("""
    import os, sys, time
    from contextlib import closing
    from qwen3_pretrain.data.pool import ordered_map

    BIG = 4 << 20  # results of 4 MiB: larger than any pipe buffer

    class Boom(Exception):
        pass

    def work(i):
        if i == FAIL_AT and MODE == "worker":
            raise Boom(f"worker failed on item {i}")
        return bytes(BIG)

    def items():
        for i in range(64):
            if i == FAIL_AT and MODE == "iterator":
                raise Boom(f"input failed at item {i}")
            yield i

    MODE, TRIALS = sys.argv[1], int(sys.argv[2])
    for trial in range(TRIALS):
        FAIL_AT = 3 + trial % 5
        start = time.perf_counter()
        try:
            with closing(ordered_map(work, items(), 2)) as results:
                for n, result in enumerate(results):
                    assert len(result) == BIG
                    if MODE == "consumer" and n == FAIL_AT:
                        raise Boom(f"consumer failed after {n} results")
        except Boom as exc:
            print(f"trial {trial}: {exc} in {time.perf_counter() - start:.2f} s", flush=True)
        else:
            sys.exit(f"trial {trial}: no error")
""")


def _children() -> set[int]:
    """Live processes whose parent is this one (Linux), but multiprocessing's resource tracker, which a
    process keeps for good once anything started it."""
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"resource_tracker" not in cmdline:
                out.add(int(name))
    return out


@pytest.mark.parametrize("mode", ["consumer", "worker", "iterator"])
def test_every_error_path_ends_with_the_error_promptly(mode, tmp_path):
    trials = 24
    script = tmp_path / "stress.py"
    script.write_text(STRESS)
    try:
        run = subprocess.run([sys.executable, str(script), mode, str(trials)], capture_output=True, text=True,
                             timeout=90, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{mode}: a trial hung; output so far:\n{exc.stdout}")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == trials, run.stdout
    assert all("failed" in line for line in lines)


def _square(x: int) -> int:
    return x * x


def test_results_in_order_for_any_worker_count():
    items = range(50)
    expected = [x * x for x in items]
    for workers in (1, 2, 3):
        assert list(ordered_map(_square, items, workers, max_in_flight=4)) == expected


def _kill_self(x: int) -> int:
    if x == 5:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
    return x


def test_a_killed_worker_is_an_error_not_a_hang():
    before = _children()
    start = time.perf_counter()
    with pytest.raises(WorkerDied, match="worker process died before returning its result: killed"):
        list(ordered_map(_kill_self, range(20), 2))
    assert time.perf_counter() - start < 30
    assert not _children() - before


def _sleep_then_square(x: int) -> int:
    time.sleep(0.05)
    return x * x


def test_workers_ignore_sigint_and_the_consumer_stops_cleanly():
    """Ctrl-C reaches the whole process group; only the consumer stops, and the workers go with it."""
    # Python's own Ctrl-C behaviour, whatever an earlier test in this process installed (a Trainer's fit()
    # keeps its stop-request handler)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_the_consumer()
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_the_consumer() -> None:
    before = _children()
    results = ordered_map(_sleep_then_square, range(200), 2)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for n, value in enumerate(results):
            got.append(value)
            if n == 3:
                for pid in _children() - before:
                    os.kill(pid, signal.SIGINT)
                time.sleep(0.2)  # a worker that does not ignore it has died by now
                os.kill(os.getpid(), signal.SIGINT)
    results.close()
    assert got == [x * x for x in range(4)]
    assert not _children() - before
