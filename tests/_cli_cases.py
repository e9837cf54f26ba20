"""Several ``qwen3-pretrain`` command lines in one child process, each with its own stdout, stderr and exit code.

Tests of what a mistake prints (one line, exit 2, no traceback) each started ``python -m qwen3_pretrain`` once:
~3.5 s of imports per case on a 2-core CPU, for a command that stops before any heavy work. The child calls the
command line's entry point (``qwen3_pretrain.cli.main``, what ``python -m qwen3_pretrain`` runs) once per case,
with the case's environment variables set (and restored after it) and its output caught; an exception that
escapes ``main`` is printed as a traceback into that case's stderr (exit ``"raised"``). The cases must stop
before a process group or any other process-wide state is made that the next case could see: each test's
assertions (exit 2 and its message) show that they did, and one that went on to train would come back with
exit 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = """
import contextlib, io, json, os, sys, traceback
from qwen3_pretrain.cli import main
results = {}
for name, env, argv in json.loads(sys.argv[1]):
    before = dict(os.environ)
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
    os.environ.clear()
    os.environ.update(before)  # the next case sees the environment it was started with, not this one's
    results[name] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


def run_cases(cases: list[tuple[str, dict, list[str]]], env: dict, cwd: Path | None = None,
              timeout: float = 300) -> dict[str, tuple]:
    """``[(name, environment variables, argv after qwen3-pretrain)]`` -> ``{name: (exit code, stdout, stderr)}``,
    in that order in one process started with ``env``. Nothing may reach the process's own stderr (what a case
    writes to the file descriptor directly, or an import prints, bypassing the per-case capture)."""
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    assert not proc.stderr.strip(), proc.stderr[-3000:]
    return {name: tuple(result) for name, result in json.loads(proc.stdout.splitlines()[-1]).items()}
