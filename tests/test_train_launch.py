"""Launchers and the reference layout: torchrun (1 and 2 nodes), mpirun with a hostfile, srun, the reference
config's tp 4 x pp 2 on 8 processes, each training like one process of the same config; bad input stops
every rank with one clear message."""

from __future__ import annotations

import datetime
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from tests._train_helpers import (TINY_MODEL, assert_same_training, check_ok, child_env, free_port, make_corpus,
                                  run_train, step_records, write_config)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory) -> list[dict]:
    """Per-step records of the launch tests' config (2 steps) trained by one plain process."""
    tmp = tmp_path_factory.mktemp("one_process")
    check_ok(run_train(write_config(tmp / "c.yaml", corpus, tmp / "out", total_steps=2), 1))
    return step_records(tmp / "out")


@pytest.mark.distributed
def test_reference_config_layout_tp4_pp2_on_8_processes(corpus, tmp_path):
    """examples/pretrain_config.yaml as shipped (rank_size 8, tp 4, pp 2, distributed optimizer, gradient
    checkpointing) with paths and model size changed to fit a CPU, and fp32 instead of bf16 so that it can
    be held to one process of the same config at fp32 tolerance (bf16 layouts: test_train_equivalence)."""
    reference = yaml.safe_load((REPO / "examples/pretrain_config.yaml").read_text())
    assert (reference["rank_size"], reference["tp"], reference["pp"]) == (8, 4, 2)
    model = dict(TINY_MODEL, num_attention_heads=8, num_key_value_heads=4)
    overrides = [f"data_path={corpus}", "model_path=", "tokenizer_path=", "model_name=qwen3-0.6b",
                 f"model_overrides={model}", "seq_length=64", "batch_size=2", "total_steps=3", "log_steps=1",
                 "warmup_steps=1", "learning_rate=3e-3", "save_steps=0", "mixed_precision=fp32"]
    proc = run_train(REPO / "examples/pretrain_config.yaml", 8, *overrides, f"output_path={tmp_path / 'out'}",
                     timeout=400)
    check_ok(proc)
    assert "tp 4 pp 2 dp 1" in proc.stdout
    single = run_train(REPO / "examples/pretrain_config.yaml", 1, *overrides, f"output_path={tmp_path / 'one'}",
                       "rank_size=1", "tp=1", "pp=1")
    check_ok(single)
    assert_same_training(step_records(tmp_path / "out"), step_records(tmp_path / "one"), label="tp4 x pp2")


@pytest.mark.distributed
def test_two_node_torchrun_on_loopback(corpus, one_process, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", total_steps=2, pp=2)
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--master_addr", "127.0.0.1", "--master_port", port]
    train = ["-m", "qwen3_pretrain", "train", "--config", str(cfg)]
    agents = [subprocess.Popen(cmd + ["--node_rank", str(n)] + train, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=child_env()) for n in (0, 1)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    assert_same_training(step_records(tmp_path / "out"), one_process, label="two nodes, pp 2")


@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_mpirun_with_hostfile(corpus, one_process, tmp_path):
    """The reference launch line: mpirun -np N -hostfile hostfile python tools/train.py --config ..."""
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", total_steps=2, tp=2, rank_size=2,
                       master_addr="127.0.0.1", master_port=free_port(), hostfile="./hostfile")
    env = dict(child_env(), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = ["mpirun", "-np", "2", "-hostfile", "hostfile", "-x", "PATH", "-x", "OMP_NUM_THREADS",
           sys.executable, str(REPO / "tools/train.py"), "--config", str(cfg)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    check_ok(proc)
    assert "launcher mpirun" in proc.stdout
    assert_same_training(step_records(tmp_path / "out"), one_process, label="mpirun, tp 2")


@pytest.mark.distributed
def test_srun_one_task_per_device(corpus, one_process, tmp_path):
    """What srun gives each task of a job step, set by hand: SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS.
    The batch script's own SLURM_NTASKS must not be mistaken for a step (the third process)."""
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", total_steps=2, tp=2, rank_size=2,
                       master_addr="127.0.0.1", master_port=free_port())
    base = {k: v for k, v in child_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    procs = [subprocess.Popen([sys.executable, str(REPO / "tools/train.py"), "--config", str(cfg)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_STEP_NUM_TASKS="2",
                                       SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2"))
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "launcher srun" in outs[0][0] + outs[1][0]
    assert_same_training(step_records(tmp_path / "out"), one_process, label="srun, tp 2")
    batch = subprocess.run([sys.executable, str(REPO / "tools/train.py"), "--config", str(cfg), "rank_size=1",
                            "tp=1", f"output_path={tmp_path / 'batch'}"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, env=dict(base, SLURM_PROCID="0", SLURM_NTASKS="2"))
    check_ok(batch)
    assert "launcher none" in batch.stdout
    assert_same_training(step_records(tmp_path / "batch"), one_process, label="srun's batch script")


def test_a_reserved_port_is_held_until_the_rendezvous_listens_on_it():
    """free_port's port stays taken for every other socket, yet the rendezvous store (torch's TCPStore,
    as rank 0 or torchrun's agent creates it) can listen on it: no window for another process between
    choosing the port and using it."""
    port = free_port()
    intruder = socket.socket()
    with pytest.raises(OSError, match="in use"):
        intruder.bind(("", port))
    intruder.close()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    store.set("key", "value")
    assert store.get("key") == b"value"


def test_first_host_of_a_slurm_node_list():
    from qwen3_pretrain.parallel.env import first_host

    assert first_host("node[03-05,9],gpu1") == "node03"
    assert first_host("gnode[10,20,25,37]") == "gnode10"
    assert first_host("n1,n2") == "n1" and first_host("single") == "single"
    assert first_host("") is None
    assert first_host("n[1-2]-ib,m3") == "n1-ib"


BAD = {
    "rank_size": (2, ["rank_size=4"], "rank_size is 4 but 2 processes were launched"),
    "tp_heads": (2, ["tp=2", "model_overrides={num_attention_heads: 3, num_key_value_heads: 3}"],
                 "does not divide num_attention_heads"),
    "layout": (2, ["tp=4"], "does not divide the 2 launched processes"),
    "layers": (2, ["pp=2", "model_overrides={num_hidden_layers: 1}"], "need at least as many layers"),
    "data": (1, ["data_path=/nonexistent/d_convert"], "/nonexistent/d_convert"),
    "seq": (1, ["seq_length=999999"], "max_position_embeddings"),
    "number": (1, ["learning_rate=fast"], "learning_rate"),
    "compile_tp": (2, ["tp=2", "compile=true"], "compile with tp > 1"),
    "reduce_pp": (2, ["pp=2", "gradient_accumulation_steps=2", "reduce_grads_every_microbatch=true"],
                  "reduce_grads_every_microbatch needs pp 1"),
    "unknown_key": (1, ["learning_rat=1e-5"], "did you mean 'learning_rate'"),
    "vocab": (1, ["model_overrides={vocab_size: 256}"], "tokenized with a tokenizer"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_stops_before_any_heavy_work(name, corpus, tmp_path):
    """Checked before the process group exists, so one process posing as rank 0 of a launch of N
    shows what every rank prints: one line, no traceback, exit 2 (and no hang)."""
    world, overrides, message = BAD[name]
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out")
    env = dict(child_env(), RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-m", "qwen3_pretrain", "train", "--config", str(cfg), *overrides],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.distributed
def test_bad_input_under_torchrun_stops_every_rank(corpus, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out")
    proc = run_train(cfg, 2, "rank_size=4", timeout=120)
    text = proc.stderr + proc.stdout
    assert proc.returncode != 0
    # Each rank prints its one "error:" line; the only traceback is torchrun's own report.
    assert text.count("error: rank_size is 4 but 2 processes were launched") == 2, text
    assert text.count("Traceback") == text.count("elastic.multiprocessing.errors.ChildFailedError: "), text


def test_unreachable_master_is_a_clear_error_not_a_hang(corpus, tmp_path):
    """A rank launched by mpirun whose rank 0 never comes up gives up after init_timeout_s."""
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", master_addr="127.0.0.1",
                       master_port=free_port(), init_timeout_s=3)
    env = dict(child_env(), OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1")
    env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, "-m", "qwen3_pretrain", "train", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "could not reach the rendezvous" in proc.stderr
    assert "Traceback" not in proc.stderr
