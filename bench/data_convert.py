"""Benchmark of the data conversion: the project's parquet -> shards against plain tokenizers and tiktoken.

    python bench/data_convert.py [--mb 100] [--workers N] [--chunk-size 50]

Builds ``--mb`` MB of text by repeating the articles of the bundled Wikipedia
dump, writes it as parquet in a temporary folder, then prints, on that same
text: the project's end-to-end conversion (parquet -> 16 shards, ``convert``)
with the reference config's ``chunk_size: 5000`` and with ``--chunk-size`` (``--pairs`` times each, alternating)
(after one small untimed conversion, so neither pays alone for loading the
tokenizer), ``tiktoken`` alone (same ranks and regex; all threads, and all
cores as processes) and plain ``tokenizers`` ``encode_batch`` (all threads, on
the first ``--tokenizers-mb`` MB), each in MB/s of raw UTF-8 text, with the
peak memory of the whole process tree (this process and its workers,
proportional set size) during each, and the CPU time they took (on a machine
shared with other jobs, MB per CPU second is the steadier figure). When the
training reader exists, also its samples/s at seq_length 8192 on the
converted shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import tiktoken
from tokenizers import Tokenizer

from qwen3_pretrain.convert import bpe
from qwen3_pretrain.convert.config import DataConvertConfig
from qwen3_pretrain.convert.run import convert
from qwen3_pretrain.data.pool import available_cores
from qwen3_pretrain.convert.wiki_dump import iter_dump_articles

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "assets" / "qwen3-tokenizer"
DUMP = REPO / "assets" / "enwiki-sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


class TreeMemory:
    """Peak memory of this process and all its descendants (Linux /proc), sampled in a thread.

    Each process counts its proportional set size (PSS): pages a forked
    worker shares with its parent are split between them, not counted twice.
    """

    # Reading smaps_rollup walks a process's page tables: at 20 samples/s it took 20% off the
    # conversion's speed on 2 cores. Peaks here last seconds, so 4 samples/s see them.
    def __init__(self, interval: float = 0.25) -> None:
        self.peak, self._interval, self._stop = 0, interval, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tree-memory")

    @staticmethod
    def _children(pid: int) -> list[int]:
        found = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                found += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return found

    @staticmethod
    def _memory(pid: int) -> int:
        for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
            try:
                for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
                    if line.startswith(key):
                        return int(line.split()[1]) * 1024
            except OSError:
                pass
        return 0

    def _sample(self) -> int:
        total, todo = 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            total += self._memory(pid)
            todo += self._children(pid)
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self._interval)

    def __enter__(self) -> "TreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def build_corpus(folder: Path, megabytes: float) -> tuple[Path, list[str]]:
    """Repeat the dump's articles until ``megabytes`` MB of text; write them as parquet."""
    articles = [text for *_, text in iter_dump_articles([DUMP], workers=available_cores())]
    texts, size = [], 0
    while size < megabytes * 1e6:
        for text in articles:
            texts.append(text)
            size += len(text.encode("utf-8"))
            if size >= megabytes * 1e6:
                break
    path = folder / "corpus.parquet"
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, row_group_size=2000)
    return path, texts


def _cpu_seconds() -> float:
    # Children count once reaped, which the conversion's worker pool is when it returns.
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(label: str, megabytes: float, work: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``work``; print MB/s of wall time, MB per CPU second (steadier on a shared machine), peak memory."""
    with TreeMemory() as memory:
        start, cpu = time.perf_counter(), _cpu_seconds()
        result = work()
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    print(f"{label:<40} {megabytes / seconds:6.1f} MB/s  {seconds:6.1f} s  {megabytes / cpu:5.1f} MB per CPU s  "
          f"peak memory {memory.peak / 2**30:4.2f} GiB")
    return result, megabytes / seconds


_TEXTS: dict[str, Any] = {}


def _count_tokens(part: tuple[int, int]) -> int:
    encoding, texts = _TEXTS["encoding"], _TEXTS["texts"]
    return sum(len(encoding.encode_ordinary(text)) for text in texts[part[0]:part[1]])


def tiktoken_processes(encoding: tiktoken.Encoding, texts: list[str], workers: int) -> int:
    """Token count of ``texts`` encoded by ``workers`` forked processes, one contiguous share each: the
    tokenizer's own limit on this machine (no reading, no writing, no results sent back)."""
    import multiprocessing

    _TEXTS.update(encoding=encoding, texts=texts)
    bounds = [len(texts) * i // workers for i in range(workers + 1)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return sum(pool.map(_count_tokens, list(zip(bounds, bounds[1:]))))


def bench_reader(data_path: Path, seq_length: int = 8192, samples: int = 200) -> None:
    """samples/s of the training reader on the converted shards, when that module exists."""
    if importlib.util.find_spec("qwen3_pretrain.data.reader") is None:
        print("training reader: qwen3_pretrain.data.reader not present, skipped")
        return
    from qwen3_pretrain.data.reader import PackedDataset

    dataset = PackedDataset(data_path, seq_length, seed=1234)
    count = min(samples, len(dataset))
    start = time.perf_counter()
    for i in range(count):
        dataset[i]
    rate = count / (time.perf_counter() - start)
    print(f"training reader PackedDataset, seq_length {seq_length}: {rate:,.0f} samples/s "
          f"({rate * seq_length / 1e6:.1f} M tokens/s, {count} samples of {len(dataset)})")


def warm_up(cfg: DataConvertConfig, texts: list[str], folder: Path) -> None:
    """One small conversion first, so the first measured one does not alone pay for loading the tokenizer."""
    small = folder / "warm_up.parquet"
    pq.write_table(pa.table({"text": pa.array(texts[:20], pa.string())}), small)
    convert(dataclasses.replace(cfg, input_path=str(small), output_path=str(folder / "warm_up")))


def prefix(texts: list[str], megabytes: float) -> list[str]:
    """The first texts holding ``megabytes`` MB (all of them when 0)."""
    if megabytes <= 0:
        return texts
    out, size = [], 0
    for text in texts:
        if size >= megabytes * 1e6:
            break
        out.append(text)
        size += len(text.encode("utf-8"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100, help="MB of text to convert (default 100)")
    parser.add_argument("--workers", type=int, default=0, help="conversion processes (default: all cores)")
    parser.add_argument("--chunk-size", type=int, default=50,
                        help="documents per unit of work of the second conversion (the first uses the reference "
                             "config's 5000); the sample's articles are long (27 KB on average), so 50 of them "
                             "are 1.4 MB of text, what a few hundred typical articles hold")
    parser.add_argument("--pairs", type=int, default=1,
                        help="conversions with the reference config and with --chunk-size, alternating, this "
                             "many times each (default 1)")
    parser.add_argument("--tokenizers-mb", type=float, default=20,
                        help="MB of the text plain tokenizers encodes (its rate is the same on any share, and "
                             "it is the slowest row by far); 0 = all of it")
    args = parser.parse_args()
    cores = available_cores()
    with tempfile.TemporaryDirectory() as tmp:
        source, texts = build_corpus(Path(tmp), args.mb)
        megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        print(f"{megabytes:.1f} MB of text, {len(texts)} documents, {cores} cores")
        cfg = DataConvertConfig(input_path=str(source), tokenizer_path=str(TOKENIZER), output_path=f"{tmp}/out",
                                workers=args.workers, chunk_size=5000)
        warm_up(cfg, texts, Path(tmp))
        small = dataclasses.replace(cfg, chunk_size=args.chunk_size, output_path=f"{tmp}/out_small")
        rates: dict[str, list[float]] = {"reference": [], "small": []}
        for _ in range(args.pairs):  # alternating, so a drift of the machine's speed hits both alike
            manifest, rate = measure("convert, reference config (chunk_size 5000)", megabytes, lambda: convert(cfg))
            rates["reference"].append(rate)
            rates["small"].append(measure(f"convert, chunk_size {args.chunk_size}", megabytes,
                                          lambda: convert(small))[1])
        project, small_rate = (sum(r) / len(r) for r in (rates["reference"], rates["small"]))
        spec = json.loads((TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))
        encoding = tiktoken.Encoding("qwen3", pat_str=bpe.split_pattern(spec["pre_tokenizer"]),
                                     mergeable_ranks=bpe.mergeable_ranks(spec["model"]), special_tokens={})
        # len(): a phase's ids are freed when it ends. tokenizers goes last: its allocator keeps
        # gigabytes after a large batch, which would inflate the peaks measured after it.
        _, threads = measure(f"tiktoken alone ({cores} threads)", megabytes,
                             lambda: len(encoding.encode_ordinary_batch(texts, num_threads=cores)))
        _, processes = measure(f"tiktoken alone ({cores} processes)", megabytes,
                               lambda: tiktoken_processes(encoding, texts, cores))
        alone = max(threads, processes)
        reference = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
        subset = prefix(texts, args.tokenizers_mb)
        subset_mb = sum(len(t.encode("utf-8")) for t in subset) / 1e6
        _, plain = measure(f"tokenizers encode_batch (all threads, {subset_mb:.0f} MB)", subset_mb,
                           lambda: len(reference.encode_batch(subset, add_special_tokens=False)))
        pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(rates["reference"], rates["small"]))
        print(f"reference config / chunk_size {args.chunk_size}: {project / small_rate:.2f} (mean rates; "
              f"pair by pair: {pairs})")
        print(f"reference config (mean rate) / tokenizers: {project / plain:.1f}x; "
              f"reference config / tiktoken alone: {project / alone:.2f}; {manifest['num_tokens']:,} tokens")
        bench_reader(Path(tmp) / "out")


if __name__ == "__main__":
    main()
