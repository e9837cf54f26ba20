"""``convert`` on two ranks (torchrun, mpirun; gloo): the same corpus as one process, and a failure anywhere
stops every rank with no manifest."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from qwen3_pretrain.convert import wiki
from qwen3_pretrain.convert.config import DataConvertConfig
from qwen3_pretrain.convert.run import convert
from qwen3_pretrain.convert.shards import Progress
from qwen3_pretrain.data.manifest import ShardCounts
from qwen3_pretrain.convert.ranks import _check_shared, _finish, _Rank, split_files
from qwen3_pretrain.data.indexed_dataset import IndexedDataset
from qwen3_pretrain.data.reader import PackedDataset, open_corpus
from qwen3_pretrain.data.manifest import validate_manifest
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.parallel.launch import LaunchInfo
from tests._train_helpers import check_ok, child_env, free_port

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "assets" / "qwen3-tokenizer"
DUMP = REPO / "assets" / "enwiki-sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# Small enough shards and pieces that documents are split and every shard gets documents from both ranks.
SETTINGS = {"shards": 3, "max_doc_length": 3000, "seq_length": 64, "workers": 1}


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample (all.parquet), and its first 40 articles as five parquet files of uneven size."""
    root = tmp_path_factory.mktemp("multi")
    wiki.wiki_to_parquet(DUMP, root / "all.parquet", workers=1)
    table = pq.read_table(root / "all.parquet").slice(0, 40)
    folder = root / "in"
    folder.mkdir()
    cuts = [0, 3, 12, 15, 28, 40]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        pq.write_table(table.slice(a, b - a), folder / f"part-{i}.parquet")
    return folder


def overrides(input_path: Path, output: Path) -> list[str]:
    return [f"input_path={input_path}", f"tokenizer_path={QWEN}", f"output_path={output}",
            *(f"{k}={v}" for k, v in SETTINGS.items())]


def torchrun(input_path: Path, output: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "qwen3_pretrain", "convert", *overrides(input_path, output)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=child_env())


def stream(output: Path) -> tuple[list[int], list[int]]:
    """All tokens in manifest order, and where each document ends in that stream (the reader's view)."""
    manifest = json.loads((output / "manifest.json").read_text())
    tokens = np.concatenate([np.asarray(IndexedDataset(output / s["prefix"]).tokens, dtype=np.int64)
                             for s in manifest["shards"]])
    corpus = open_corpus(output, manifest)
    return tokens.tolist(), np.cumsum(corpus.doc_len).tolist()


def assert_same_corpus(got: Path, want: Path) -> None:
    assert stream(got) == stream(want)
    validate_manifest(got, 151936, QWEN, SETTINGS["seq_length"])
    a, b = PackedDataset(got, SETTINGS["seq_length"], seed=3), PackedDataset(want, SETTINGS["seq_length"], seed=3)
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        assert a[i]["input_ids"].tolist() == b[i]["input_ids"].tolist(), f"sample {i}"
    assert sorted(p.name for p in got.iterdir() if not p.name.startswith("shard_")) == ["manifest.json"]


def convert_here(input_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("one")
    convert(DataConvertConfig(input_path=str(input_path), tokenizer_path=str(QWEN), output_path=str(output),
                              **SETTINGS))
    return output


@pytest.fixture(scope="module")
def one_process(multi: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_here(multi, tmp_path_factory)


@pytest.mark.parametrize("sizes,world", [([5, 1, 1, 1, 1, 1], 2), ([1, 2, 3, 4, 5, 6, 7], 3), ([9, 1], 4),
                                         ([3, 3, 3, 3], 2), ([], 2)])
def test_split_is_contiguous_and_balanced_by_bytes(sizes: list[int], world: int) -> None:
    runs = split_files(sizes, world)
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    prefix = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    for rank, run in enumerate(runs[:-1], 1):
        # Each boundary is one of the prefixes nearest to this rank's share (or clamped to the one before).
        best = min(abs(p - sum(sizes) * rank / world) for p in prefix[run.start:])
        assert abs(prefix[run.stop] - sum(sizes) * rank / world) == best or run.stop == run.start


@pytest.mark.distributed
def test_two_ranks_under_torchrun_give_the_one_process_corpus(multi: Path, one_process: Path,
                                                              tmp_path: Path) -> None:
    proc = torchrun(multi, tmp_path / "out")
    check_ok(proc)
    assert "from 2 ranks" in proc.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    # Every shard got documents from both ranks: the test covers the loads passed from rank to rank.
    assert sorted(s["prefix"] for s in manifest["shards"]) == [f"shard_{s:05d}-{r:05d}" for s in range(3)
                                                              for r in range(2)]
    assert_same_corpus(tmp_path / "out", one_process)


@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_two_ranks_under_mpirun_with_a_hostfile(multi: Path, tmp_path_factory: pytest.TempPathFactory,
                                                tmp_path: Path) -> None:
    """The bundled sample is one file: rank 1 converts it all, rank 0 idles, the corpus is the same."""
    sample = multi.parent / "all.parquet"
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    env = dict(child_env(), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = ["mpirun", "-np", "2", "-hostfile", "hostfile", "-x", "PATH", "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH",
           sys.executable, "-m", "qwen3_pretrain", "convert", *overrides(sample, tmp_path / "out"),
           "master_addr=127.0.0.1", f"master_port={free_port()}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    check_ok(proc)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {s["prefix"][-5:] for s in manifest["shards"]} == {"00001"}
    assert_same_corpus(tmp_path / "out", convert_here(sample, tmp_path_factory))


@pytest.mark.distributed
def test_a_bad_file_on_one_rank_stops_both_and_leaves_no_manifest(tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    # Rank 1's file: a good start (passes the up-front check), a broken line further on.
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": f"more {i}"}) + "\n" for i in range(15))
                                    + "{not json\n" + json.dumps({"text": "after"}) + "\n")
    output = tmp_path / "out"
    proc = torchrun(folder, output)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "rank 1 of 2 stopped the conversion:" in errors[0] and "b.jsonl:16: not a JSON object" in errors[0], errors[0]
    # torchrun reports the failed children with its own traceback; none comes from our code.
    frames = [line for line in proc.stderr.splitlines() if line.strip().startswith("File")]
    assert not [line for line in frames if "qwen3_pretrain/" in line]
    assert sorted(p.name for p in output.iterdir()) == []  # no manifest, no shard, nothing staged


def _rank(tmp_path: Path, rank: int) -> _Rank:
    cfg = DataConvertConfig(input_path="in", tokenizer_path=str(QWEN), output_path=str(tmp_path), **SETTINGS)
    return _Rank(cfg, LaunchInfo(rank, 2, 0, "torchrun"), [], [])


def test_a_rank_that_does_not_share_the_output_folder_says_so(tmp_path: Path) -> None:
    view = ("sha", [("in/a.parquet", 10)])
    (tmp_path / ".convert-ranks").write_text("nonce-of-rank-0")
    _check_shared(_rank(tmp_path, 1), "nonce-of-rank-0", [view, view])  # the same folder: fine
    with pytest.raises(UserError, match="output_path .* is not the folder rank 0 prepared .* shared filesystem"):
        _check_shared(_rank(tmp_path, 1), "another-run", [view, view])
    with pytest.raises(UserError, match="input_path 'in': this rank sees other files .* shared filesystem"):
        _check_shared(_rank(tmp_path, 1), "nonce-of-rank-0", [view, ("sha", [("in/a.parquet", 11)])])


def test_rank_0_refuses_a_manifest_over_pieces_it_cannot_see(tmp_path: Path) -> None:
    gathered = [([("shard_00000-00001", ShardCounts(1, 1, 5))], Progress())]
    with pytest.raises(UserError, match="shard_00000-00001.bin: written by another rank but not visible from rank 0"):
        _finish(_rank(tmp_path, 0), gathered, 0.0)
    assert not (tmp_path / "manifest.json").exists()


def _stores(world: int) -> list:
    import datetime

    import torch.distributed as dist

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    return [master] + [dist.TCPStore("127.0.0.1", port, world, is_master=False,
                                     timeout=datetime.timedelta(seconds=10)) for _ in range(world - 1)]


def test_a_waiting_rank_names_a_rank_gone_silent_within_the_timeout() -> None:
    """Rank 1 neither finishes its step nor makes progress (killed, stuck): rank 0 stops after
    rank_timeout_s of silence, naming it, rather than waiting out a collective's timeout."""
    import time

    from qwen3_pretrain.convert.ranks import Liveness

    stores = _stores(2)
    ranks = [Liveness(store, LaunchInfo(r, 2, 0, "torchrun"), timeout_s=1.0, beat_s=0.1)
             for r, store in enumerate(stores)]
    try:
        ranks[0].post("tokenize", None)
        start = time.monotonic()
        with pytest.raises(UserError, match=r"rank 1 of 2 made no progress for 1 s \(rank_timeout_s\) before "
                                            r"finishing the step 'tokenize'"):
            ranks[0].wait_for_all("tokenize", poll_s=0.05)
        assert 1.0 <= time.monotonic() - start < 5.0
    finally:
        for live in reversed(ranks):
            live.close(linger_s=0.1)


def test_a_slow_rank_that_keeps_making_progress_is_waited_for() -> None:
    """A rank whose share takes longer than rank_timeout_s is not stopped while its work goes on."""
    import threading
    import time

    from qwen3_pretrain.convert.ranks import Liveness

    stores = _stores(2)
    ranks = [Liveness(store, LaunchInfo(r, 2, 0, "torchrun"), timeout_s=0.6, beat_s=0.05)
             for r, store in enumerate(stores)]

    def slow_share() -> None:
        for _ in range(40):  # 2 s of work, more than three timeouts
            time.sleep(0.05)
            ranks[1].tick()
        ranks[1].post("tokenize", "rank 1's problem")

    worker = threading.Thread(target=slow_share)
    try:
        worker.start()
        ranks[0].post("tokenize", None)
        assert ranks[0].wait_for_all("tokenize", poll_s=0.05) == [None, "rank 1's problem"]
    finally:
        worker.join()
        for live in reversed(ranks):  # rank 0 last: it waits for the others to be done with the store
            live.close()


def test_rank_0_keeps_the_store_until_every_rank_is_done_with_it() -> None:
    """Under mpirun rank 0's process holds the store: it leaves only once every rank has closed, so a rank
    still reading the last agreement does not lose the store under it."""
    import threading
    import time

    from qwen3_pretrain.convert.ranks import Liveness

    stores = _stores(2)
    ranks = [Liveness(store, LaunchInfo(r, 2, 0, "mpirun"), timeout_s=5.0, beat_s=0.05)
             for r, store in enumerate(stores)]
    closed_at: dict[int, float] = {}

    def close(r: int, delay: float) -> None:
        time.sleep(delay)
        ranks[r].close(linger_s=10)
        closed_at[r] = time.monotonic()

    threads = [threading.Thread(target=close, args=(0, 0.0)), threading.Thread(target=close, args=(1, 0.5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert closed_at[0] >= closed_at[1] - 0.05


def test_a_failure_upstream_in_the_load_chain_stops_the_next_rank_instead_of_leaving_it_waiting(tmp_path) -> None:
    """The shard loads pass from rank to rank: a rank that fails before passing them on (here rank 0, whose
    staged dataset is missing) passes None, and the next rank stops at once; both then reach the step's
    agreement. Before, the next rank waited in a receive until the collective timeout."""
    import numpy as np

    from qwen3_pretrain.convert import ranks as convert_ranks
    from qwen3_pretrain.convert.shards import ShardWriter

    stores = _stores(2)
    lives = [convert_ranks.Liveness(store, LaunchInfo(r, 2, 0, "torchrun"), timeout_s=5.0, beat_s=0.05)
             for r, store in enumerate(stores)]
    ranks = [_rank(tmp_path, r) for r in range(2)]
    ShardWriter([ranks[1].staging_prefix()], np.int32, 100, True).finalize(drop_empty=False)  # rank 1: empty, staged
    try:
        with pytest.raises(Exception):  # rank 0: no staged dataset
            convert_ranks._assign(ranks[0], lives[0])
        with pytest.raises(convert_ranks._Stop):
            convert_ranks._assign(ranks[1], lives[1])
    finally:
        for live in reversed(lives):
            live.close(linger_s=1)


def test_a_rank_waiting_on_the_load_chain_is_not_taken_for_a_silent_one() -> None:
    """Ranks pass the shard loads down a chain: rank 2 waits for rank 1, which waits for rank 0's slow
    assignment. Rank 1 is alive and waiting, so rank 2 must keep waiting (before, rank 1's still count
    read as silence after rank_timeout_s, and rank 2 stopped the run naming it)."""
    import threading
    import time

    from qwen3_pretrain.convert.ranks import Liveness

    stores = _stores(3)
    lives = [Liveness(store, LaunchInfo(r, 3, 0, "torchrun"), timeout_s=0.6, beat_s=0.05)
             for r, store in enumerate(stores)]
    got: dict[int, object] = {}

    def head() -> None:  # rank 0: 1.5 s of work, ticking, then its loads
        for _ in range(30):
            time.sleep(0.05)
            lives[0].tick()
        lives[0].post("loads", [1, 2])

    def middle() -> None:  # rank 1: waits for rank 0, then passes on
        got[1] = lives[1].wait_for(0, "loads", poll_s=0.05)
        lives[1].post("loads", [3, 4])

    threads = [threading.Thread(target=head), threading.Thread(target=middle)]
    try:
        for t in threads:
            t.start()
        got[2] = lives[2].wait_for(1, "loads", poll_s=0.05)
        for t in threads:
            t.join()
        assert got == {1: [1, 2], 2: [3, 4]}
    finally:
        for live in reversed(lives):
            live.close(linger_s=1)
