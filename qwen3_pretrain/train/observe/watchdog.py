"""Hangs named: a watchdog thread per rank, and NCCL's flight recorder.

The watchdog wakes every second and compares the running step's age with
``hang_factor`` x the median of the last steps (at least ``hang_min_s``;
armed once ``ARM_AFTER`` steps have run, so compilation and warm-up never
trip it). A hung collective keeps every rank in the same step, so every
rank's watchdog fires within a second or two of the others. Each then:

1. writes its Python stacks (all threads, ``faulthandler``) to
   ``output_path/hang/rank<r>.txt`` with its step, its phase and its default
   process group's collective sequence number; on CUDA also the flight
   recorder's entries, ``output_path/hang/nccl_trace_rank<r>.pickle`` (the
   watchdog fires before the collective timeout would dump them);
2. posts the same to the rendezvous store (a TCP connection of its own, which
   works while the collectives are stuck);
3. rank 0 waits a few seconds for every rank's post and logs which ranks are
   behind: those at the earliest (step, phase), or that posted nothing (a
   process that is gone, or stuck where Python cannot run);
4. the process ends with ``HANG_EXIT_CODE`` (the launcher then stops the
   ranks that remain).

The flight recorder: on CUDA, NCCL's last collectives per rank are kept in a
ring buffer (``TORCH_NCCL_TRACE_BUFFER_SIZE``) and dumped to
``output_path/hang/nccl_trace_rank_<r>`` when a collective times out; the
variables are set before the process group starts, unless the environment
sets them already.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import statistics
import threading
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from qwen3_pretrain.train.observe.phases import PHASES, PhaseClock

log = logging.getLogger("qwen3_pretrain.train")

HANG_DIR = "hang"
HANG_EXIT_CODE = 3
ARM_AFTER = 3  # steps timed before the watchdog is armed
RECENT = 20  # steps the median is taken over
GATHER_S = 10.0  # how long rank 0 waits for the other ranks' posts
# a test-only hook: QWEN3_PRETRAIN_TEST_SLEEP="rank:first-last:seconds" sleeps in that rank's data phase of
# those steps (a straggler, or a hang)
TEST_SLEEP_ENV = "QWEN3_PRETRAIN_TEST_SLEEP"


def flight_recorder_env(device_type: str, buffer_size: int, output_path: str,
                        environ: dict | None = None) -> dict[str, str]:
    """Set (where unset) the variables that keep NCCL's flight recorder on and dump it on a timeout;
    returns what it set. Nothing off CUDA, nor with ``buffer_size`` 0."""
    environ = os.environ if environ is None else environ
    if device_type != "cuda" or buffer_size <= 0:
        return {}
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(buffer_size), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(output_path) / HANG_DIR / "nccl_trace_rank_")}
    set_now = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(set_now)
    if set_now:
        (Path(output_path) / HANG_DIR).mkdir(parents=True, exist_ok=True)
    return set_now


def test_sleep(rank: int) -> tuple[int, int, float] | None:
    """(first step, last step, seconds) of the test-only sleep for this rank, or None."""
    spec = os.environ.get(TEST_SLEEP_ENV)
    if not spec:
        return None
    who, steps, seconds = spec.split(":")
    first, _, last = steps.partition("-")
    return (int(first), int(last or first), float(seconds)) if int(who) == rank else None


def _sequence_number() -> int | None:
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - not every backend or version keeps one
        return None


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None


def behind(posts: dict[int, dict], world: int) -> list[int]:
    """The ranks behind: those that posted nothing, else those at the earliest (step, phase)."""
    missing = [r for r in range(world) if r not in posts]
    if missing:
        return missing
    order = {p: i for i, p in enumerate(PHASES)}
    where = {r: (p["step"], order.get(p["phase"], len(PHASES))) for r, p in posts.items()}
    earliest = min(where.values())
    return sorted(r for r, w in where.items() if w == earliest)


class Watchdog:
    """One rank's watchdog thread over ``clock`` (see the module's docstring); ``exit`` ends the process
    (``os._exit``; a test passes a recorder)."""

    def __init__(self, clock: PhaseClock, output_path: str, rank: int, world: int, factor: float,
                 min_s: float, exit=os._exit, poll_s: float = 1.0, nccl: bool = False) -> None:
        self.clock, self.rank, self.world = clock, rank, world
        self.dir = Path(output_path) / HANG_DIR
        self.factor, self.min_s, self.exit, self.poll_s, self.nccl = factor, min_s, exit, poll_s, nccl
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.in_step = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self.thread.start()

    def begin(self) -> None:
        self.in_step = True

    def end(self, seconds: float | None) -> None:
        self.in_step = False
        if seconds is not None:
            self.recent.append(seconds)

    def limit(self) -> float | None:
        if len(self.recent) < ARM_AFTER:
            return None
        return max(self.min_s, self.factor * statistics.median(self.recent))

    def close(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            limit = self.limit()
            if limit is not None and self.in_step and time.monotonic() - self.clock.started > limit:
                self.fire(limit)
                return

    def fire(self, limit: float) -> None:
        clock, age = self.clock, time.monotonic() - self.clock.started
        post = {"rank": self.rank, "step": clock.step, "phase": clock.phase, "age_s": round(age, 1),
                "collective_seq": _sequence_number()}
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.txt"
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(post) + "\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        log.error("rank %d: step %d has run %.0f s, over the hang limit of %.0f s (hang_factor x the median step, at "
                  "least hang_min_s), in phase %s; Python stacks written to %s", self.rank, clock.step, age, limit,
                  clock.phase, path)
        if self.nccl:
            self._dump_flight_recorder()
        store = _store()
        if store is not None:
            self._exchange(store, post)
        log.error("rank %d: ending the run (exit code %d) after a hang; stacks in %s", self.rank, HANG_EXIT_CODE,
                  self.dir)
        for handler in logging.getLogger("qwen3_pretrain").handlers:
            handler.flush()
        self.exit(HANG_EXIT_CODE)

    def _dump_flight_recorder(self) -> None:
        try:
            from torch._C._distributed_c10d import _dump_nccl_trace
            (self.dir / f"nccl_trace_rank{self.rank}.pickle").write_bytes(_dump_nccl_trace())
        except Exception as e:  # noqa: BLE001 - a torch without it, or the recorder off: the stacks remain
            log.warning("rank %d: NCCL flight recorder not dumped: %s", self.rank, e)

    def _exchange(self, store, post: dict) -> None:
        try:
            store.set(f"hang/rank{self.rank}", json.dumps(post))
            if self.rank != 0:
                store.wait(["hang/reported"], timedelta(seconds=GATHER_S + 5))
                return
            posts, deadline = {}, time.monotonic() + GATHER_S
            while time.monotonic() < deadline and len(posts) < self.world:
                for r in range(self.world):
                    if r not in posts and store.check([f"hang/rank{r}"]):
                        posts[r] = json.loads(store.get(f"hang/rank{r}"))
                time.sleep(0.2)
            late = behind(posts, self.world)
            where = "; ".join(f"rank {r}: step {p['step']} {p['phase']}, collective #{p['collective_seq']}"
                              for r, p in sorted(posts.items()))
            log.error("hang: rank(s) %s behind (%s)%s", ",".join(map(str, late)), where,
                      "; no post from those ranks" if any(r not in posts for r in late) else "")
            (self.dir / "summary.json").write_text(json.dumps({"behind": late, "ranks": posts}, indent=1))
            store.set("hang/reported", "1")
        except Exception as e:  # noqa: BLE001 - the store may be gone with its host; the stacks are on disk
            log.error("rank %d: could not exchange hang reports through the rendezvous store: %s", self.rank, e)
