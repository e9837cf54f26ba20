"""Benchmark of the dump route: ``wiki2parquet`` on a ~120 MB dump, 1 vs 2 workers, against wikiextractor.

    python bench/wiki_dump.py [--mb 120] [--wikiextractor-python PYTHON]

Builds a dump of ``--mb`` MB of XML by repeating the pages of the bundled
sample (its header once, its pages as many times as needed), compressed as
concatenated bzip2 streams (a multistream dump; one stream per repetition, so
building it costs one compression of the sample). Then prints, on that file:
bzip2 decompression alone (the standard library, ``indexed_bzip2`` on 1 and 2
threads), ``wiki2parquet`` with 1 worker held to one core, 1 worker (its
decompressing thread free to use another core), 2 workers (the default: one
decompressing thread) and 2 workers with 2 decompressing threads, and
``wikiextractor --processes 2`` (run by ``--wikiextractor-python``, or by this
interpreter when it has the package; the row is skipped otherwise), each in
MB/s of XML, with CPU seconds and the peak memory of the process tree. Last, a
projection for a dump of ``--project-gb`` GB of XML on ``--project-cores``
cores from the measured per-MB CPU figures: the workers', parallel
decompression's (``indexed_bzip2`` on 2 threads) and the main process's part
that holds the interpreter lock (its CPU less the decompression's), which
cannot spread over cores.
"""

from __future__ import annotations

import argparse
import bz2
import importlib.util
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import indexed_bzip2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_convert import DUMP, TreeMemory  # noqa: E402

from qwen3_pretrain.data.pool import available_cores  # noqa: E402
from qwen3_pretrain.convert.wiki import wiki_to_parquet  # noqa: E402


def build_dump(path: Path, megabytes: float) -> int:
    """Write a multistream dump of about ``megabytes`` MB of XML; returns its XML size in bytes."""
    xml = bz2.decompress(DUMP.read_bytes())
    head_end, tail_start = xml.index(b"<page>"), xml.rindex(b"</mediawiki>")
    head, pages, tail = xml[:head_end], xml[head_end:tail_start], xml[tail_start:]
    repeats = max(1, round((megabytes * 1e6 - len(head) - len(tail)) / len(pages)))
    compressed = bz2.compress(pages)
    with open(path, "wb") as f:
        f.write(bz2.compress(head))
        for _ in range(repeats):
            f.write(compressed)
        f.write(bz2.compress(tail))
    return len(head) + repeats * len(pages) + len(tail)


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


class PythonThreadsCPU:
    """CPU seconds that this process's Python threads (not the native ones of a C++ library) spend while
    the block runs, by thread, sampled from /proc (Linux)."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval, self.seconds = interval, {}
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True, name="bench-sampler")

    @staticmethod
    def _read() -> dict[tuple[int, str], float]:
        tick, seconds = os.sysconf("SC_CLK_TCK"), {}
        for thread in threading.enumerate():
            try:
                fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            seconds[(thread.native_id, thread.name)] = (int(fields[11]) + int(fields[12])) / tick
        return seconds

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            self.seconds.update(self._read())  # a thread that ended keeps its last sample

    def __enter__(self) -> "PythonThreadsCPU":
        self._before = self._read()
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._sampler.join()
        self.seconds.update(self._read())

    def total(self, excluding: tuple[str, ...] = (), only: str | None = None) -> float:
        return sum(cpu - self._before.get(key, 0.0) for key, cpu in self.seconds.items()
                   if key[1] not in excluding and only in (None, key[1]))


def measure(label: str, megabytes: float, work: Callable[[], Any]) -> dict[str, float]:
    """Run ``work``; print MB/s of XML, CPU seconds (this process: all, its main thread, its Python threads
    but the reader; children) and peak memory."""
    # Memory is sampled once a second: reading the workers' page tables more often takes CPU from the run.
    with TreeMemory(interval=1.0) as memory, PythonThreadsCPU() as threads:
        start, (own, children), main_thread = time.perf_counter(), _cpu(), time.thread_time()
        work()
        seconds, main_thread = time.perf_counter() - start, time.thread_time() - main_thread
        own_end, children_end = _cpu()
    own, children = own_end - own, children_end - children
    serial = threads.total(excluding=("wiki2parquet-read", "bench-sampler", "tree-memory"))
    print(f"{label:<44} {megabytes / seconds:6.1f} MB/s  {seconds:6.1f} s  CPU {own:5.1f} s here ({main_thread:4.1f} "
          f"main thread, {serial:4.1f} Python threads but the reader) + {children:5.1f} s in workers  "
          f"peak memory {memory.peak / 2**30:4.2f} GiB", flush=True)
    # The CPU of the run itself: without the memory sampler's.
    cpu = own + children - threads.total(only="tree-memory")
    return {"seconds": seconds, "own": own, "children": children, "main_thread": main_thread, "serial": serial,
            "cpu": cpu}


def read_all(open_stream: Callable[[], Any]) -> int:
    total = 0
    with open_stream() as stream:
        while block := stream.read(4 << 20):
            total += len(block)
    return total


def wikiextractor_python(option: str | None) -> str | None:
    if option:
        return option if Path(option).exists() or shutil.which(option) else None
    return sys.executable if importlib.util.find_spec("wikiextractor") else None


def project(args: argparse.Namespace, ours: dict[str, float], parallel_decode: dict[str, float],
            megabytes: float) -> None:
    """Rate on ``--project-cores`` cores: the workers' CPU and parallel decompression's spread over all
    cores, capped by the main process's part that holds the interpreter lock (cutting pages, moving batches
    and results, writing parquet): the CPU of its Python threads but the reader."""
    workers = ours["children"] / megabytes  # CPU s per MB
    decode = parallel_decode["own"] / megabytes
    serial = max(ours["serial"], 1e-9) / megabytes
    rate = min(args.project_cores / (workers + decode + serial), 1 / serial)
    hours = args.project_gb * 1e3 / rate / 3600
    print(f"per MB of XML: {workers * 1e3:.1f} ms CPU in the workers, {decode * 1e3:.1f} ms decompressing on "
          f"parallel threads, {serial * 1e3:.1f} ms holding the main process's lock; projected {rate:.0f} MB/s on "
          f"{args.project_cores} cores: {args.project_gb:.0f} GB of XML in {hours:.2f} h (capped by the serial "
          f"part: {rate >= 1 / serial - 1e-6})")


def on_one_core(work: Callable[[], Any]) -> Callable[[], Any]:
    """``work`` with this thread (and the threads and processes it starts) held to one core."""
    def pinned() -> Any:
        cores = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(cores)})
        try:
            return work()
        finally:
            os.sched_setaffinity(0, cores)
    return pinned


def compare(python: str, dump: Path, tmp: Path, megabytes: float, ours: dict[str, float], pairs: int) -> None:
    """wikiextractor --processes 2 after ``ours``, then ``pairs`` more runs of both, alternating. On a shared
    machine the load drifts from minute to minute, so each ratio is taken between neighbouring runs."""
    command = [python, "-m", "wikiextractor.WikiExtractor", "--processes", "2", "-q", "-o", str(tmp / "wx"),
               str(dump)]
    ratios = []
    for pair in range(pairs + 1):
        if pair:
            ours = measure("wiki2parquet, 2 workers (again)", megabytes,
                           lambda: wiki_to_parquet(dump, tmp / "out.parquet", 2))
        wx = measure("wikiextractor --processes 2", megabytes,
                     lambda: subprocess.run(command, check=True, capture_output=True))
        ratios.append((wx["seconds"] / ours["seconds"], wx["cpu"] / ours["cpu"]))
    print("wiki2parquet 2 workers vs wikiextractor --processes 2, neighbouring runs: "
          + ", ".join(f"{wall:.2f}x the speed ({cpu:.2f}x less CPU)" for wall, cpu in ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=120, help="MB of XML in the built dump (default 120)")
    parser.add_argument("--wikiextractor-python", help="Python interpreter that has wikiextractor installed "
                                                       "(default: this one, when it has it; else skipped)")
    parser.add_argument("--pairs", type=int, default=0,
                        help="more runs of wiki2parquet (2 workers) and wikiextractor, alternating (default 0)")
    parser.add_argument("--project-gb", type=float, default=100, help="XML size to project for (GB; default 100)")
    parser.add_argument("--project-cores", type=int, default=64, help="cores to project for (default 64)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "enwiki-pages-articles.xml.bz2"
        megabytes = build_dump(dump, args.mb) / 1e6
        print(f"{megabytes:.1f} MB of XML, {dump.stat().st_size / 1e6:.1f} MB of bzip2, "
              f"{available_cores()} cores", flush=True)
        measure("bz2 (standard library) alone", megabytes, lambda: read_all(lambda: bz2.open(dump)))
        measure("indexed_bzip2 alone, 1 thread", megabytes,
                      lambda: read_all(lambda: indexed_bzip2.open(str(dump), parallelization=1)))
        parallel_decode = measure("indexed_bzip2 alone, 2 threads", megabytes,
                                  lambda: read_all(lambda: indexed_bzip2.open(str(dump), parallelization=2)))
        runs = {}
        # "2 workers" last, next to wikiextractor's run, which it is compared with.
        for name, workers, threads, pin in (("1 worker on 1 core", 1, 0, True), ("1 worker", 1, 0, False),
                                            ("2 workers, 2 decoding threads", 2, 2, False), ("2 workers", 2, 0, False)):
            work = lambda w=workers, t=threads: wiki_to_parquet(dump, Path(tmp) / "out.parquet", w, t)  # noqa: E731
            runs[name] = measure(f"wiki2parquet, {name}", megabytes, on_one_core(work) if pin else work)
        python = wikiextractor_python(args.wikiextractor_python)
        if python is None:
            print("wikiextractor --processes 2: not installed here (give --wikiextractor-python), skipped")
        else:
            compare(python, dump, Path(tmp), megabytes, runs["2 workers"], args.pairs)
        print(f"wiki2parquet 2 workers vs 1 worker on 1 core: "
              f"{runs['1 worker on 1 core']['seconds'] / runs['2 workers']['seconds']:.2f}x, vs 1 worker: "
              f"{runs['1 worker']['seconds'] / runs['2 workers']['seconds']:.2f}x")
        project(args, runs["2 workers"], parallel_decode, megabytes)


if __name__ == "__main__":
    main()
