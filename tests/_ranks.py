"""``python tests/_ranks.py NPROC PORT COMMAND...``: NPROC ranks of COMMAND on this host, each with the
environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), rank 0 hosting the rendezvous store on PORT. The launcher of the training tests whose point is
a parallel layout, not the launcher (tests/test_train_launch.py, test_first_hour.py and the elastic restart
keep torchrun itself).

Why not torchrun: its agent imports torch and runs a rendezvous before it starts a worker, about 2 s of CPU
per launch, over a hundred launches in the suite. Measured on the 2-core Xeon (shared, load 7-9), a tp 2 run
of tests/_train_helpers.py's tiny model, 5 steps, 3 runs each alternated: 11.7 s of CPU (median, launcher
and ranks) under torchrun, 9.5 s this way. This script imports nothing heavy. It does what torchrun does
for a test: the ranks share its stdout and stderr (the caller captures them), SIGTERM and SIGINT are passed
on to every rank, the first rank that fails has the others stopped (a rank left waiting in a collective
would hang until its timeout), and the exit status is torchrun's: 0 when every rank succeeded, else 1. The
ranks stay in the launcher's process group, so ``os.killpg`` of a launch started with ``start_new_session``
kills it whole, as a machine that dies.

Rank 0 hosts the rendezvous store here (torchrun's agent has it up before any worker starts). A rank that
asks for it before rank 0 listens is refused and torch's client backs off: 1.0-1.8 s idle, measured. So a
rank other than 0 starts through ``--after-listen``: it sets the entry point's process defaults, imports
torch (while rank 0 does the same), waits until PORT is listening (read from /proc/net/tcp, no connection
made), then runs ``-m MODULE`` or ``SCRIPT`` as ``python`` would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# How long a rank may take to end after SIGTERM, once another has failed, before it is killed.
STOP_GRACE_S = 10.0
# How long a rank other than 0 waits for rank 0's rendezvous store to listen (torch's own store timeout is
# longer; a rank 0 that ends or hangs before listening must not leave the others waiting forever).
LISTEN_WAIT_S = 300.0


def listening(port: int) -> bool:
    """Whether a socket listens on ``port`` (state 0A in /proc/net/tcp or tcp6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def after_listen(argv: list[str]) -> None:
    """``--after-listen PORT (-m MODULE | SCRIPT) ARGS...``: a rank other than 0 (module docstring)."""
    import runpy

    port, rest = int(argv[0]), argv[1:]
    from qwen3_pretrain.cli import apply_process_env_defaults

    apply_process_env_defaults()  # as the entry point does before its command imports torch
    import torch  # noqa: F401  (the slow part, while rank 0 does the same)

    deadline = time.monotonic() + LISTEN_WAIT_S
    while not listening(port):
        if time.monotonic() > deadline:  # rank 0 never opened the store (ended before, or hung)
            sys.exit(f"rank {os.environ.get('RANK')}: nothing listened on port {port} for {LISTEN_WAIT_S:.0f} s")
        time.sleep(0.005)
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        sys.path[0] = os.getcwd()  # python -m puts the working directory first
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))  # python SCRIPT puts the script's folder first
        runpy.run_path(rest[0], run_name="__main__")


def main(argv: list[str]) -> int:
    if argv[0] == "--after-listen":
        after_listen(argv[1:])
        return 0
    nproc, port, cmd = int(argv[0]), argv[1], argv[2:]
    ranks = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        command = cmd if rank == 0 else [cmd[0], os.path.abspath(__file__), "--after-listen", port, *cmd[1:]]
        ranks.append(subprocess.Popen(command, env=env))

    def forward(signum, _frame):
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rank0_done = None
    while True:
        codes = [p.poll() for p in ranks]
        if all(c == 0 for c in codes):
            return 0
        if codes[0] == 0 and any(c is None for c in codes[1:]) and rank0_done is None:
            rank0_done = time.monotonic()  # the others still run: fine while they finish, not forever
        if rank0_done is not None and time.monotonic() - rank0_done > LISTEN_WAIT_S:
            break
        if any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.02)
    forward(signal.SIGTERM, None)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in ranks:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
