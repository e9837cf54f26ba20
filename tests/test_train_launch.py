"""Launchers and the reference layout: torchrun (1 and 2 nodes), mpirun with a hostfile, srun, the reference
config's tp 4 x pp 2 on 8 processes, each training like one process of the same config; bad input stops
every rank with one clear message."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from tests._checkpoint_helpers import wait_for_step
from tests._train_helpers import (TINY_MODEL, assert_same_training, check_ok, child_env, free_port, make_corpus,
                                  run_train, step_records, train_command, write_config)

REPO = Path(__file__).resolve().parent.parent
# What a CPU rank's share of its node is made of, whatever the launcher bound each rank to: the cores this test
# (and so the launcher it starts) may use, over the 2 processes of every launch here.
NODE_SHARE = f"x {len(os.sched_getaffinity(0))} cores / 2 process(es) on this node"


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
                     timeout=400, torchrun=True)
    check_ok(proc)
    assert "tp 4 pp 2 dp 1" in proc.stdout
    single = run_train(REPO / "examples/pretrain_config.yaml", 1, *overrides, f"output_path={tmp_path / 'one'}",
                       "rank_size=1", "tp=1", "pp=1")
    check_ok(single)
    assert_same_training(step_records(tmp_path / "out"), step_records(tmp_path / "one"), label="tp4 x pp2")


@pytest.mark.distributed
def test_two_node_torchrun_on_loopback(corpus, one_process, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", total_steps=2, pp=2,
                       peak_tflops=None)  # the MFU probe runs: its log line names the node's share
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--master_addr", "127.0.0.1", "--master_port", port]
    train = ["-m", "qwen3_pretrain", "train", "--config", str(cfg)]
    agents = [subprocess.Popen(cmd + ["--node_rank", str(n)] + train, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=child_env()) for n in (0, 1)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    # two torchrun "nodes" of one process each on one host: the host's cores are shared by both
    assert NODE_SHARE in outs[0] + outs[1], outs
    assert_same_training(step_records(tmp_path / "out"), one_process, label="two nodes, pp 2")


@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_mpirun_with_hostfile(corpus, one_process, tmp_path):
    """The reference launch line: mpirun -np N -hostfile hostfile python tools/train.py --config ..."""
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", total_steps=2, tp=2, rank_size=2,
                       master_addr="127.0.0.1", master_port=free_port(), hostfile="./hostfile",
                       peak_tflops=None)  # the MFU probe runs: its log line names the node's share
    env = dict(child_env(), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = ["mpirun", "-np", "2", "-hostfile", "hostfile", "-x", "PATH", "-x", "OMP_NUM_THREADS",
           sys.executable, str(REPO / "tools/train.py"), "--config", str(cfg)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    check_ok(proc)
    assert "launcher mpirun" in proc.stdout
    # mpirun binds each rank to a core of its own; the MFU peak is still the node's cores over its processes,
    # as under torchrun (which binds nothing)
    assert NODE_SHARE in proc.stdout, proc.stdout
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
    from qwen3_pretrain.parallel.launch import first_host

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
    "data_blend": (1, ["data_path=0.7 /data/wiki 0.3"], "data_path '0.7 /data/wiki 0.3': the flat form is pairs"),
    "seq": (1, ["seq_length=999999"], "max_position_embeddings"),
    "number": (1, ["learning_rate=fast"], "learning_rate"),
    "compile_tp": (2, ["tp=2", "compile=true", "activation_checkpointing=selective"], "compile with tp > 1 and"),
    "reduce_pp": (2, ["pp=2", "gradient_accumulation_steps=2", "reduce_grads_every_microbatch=true"],
                  "reduce_grads_every_microbatch needs pp 1"),
    "unknown_key": (1, ["learning_rat=1e-5"], "did you mean 'learning_rate'"),
    "dp_shard": (4, ["dp_shard=3"], "dp_shard = 3 does not divide the data-parallel degree dp = 4"),
    "dp_shard_replicas": (2, ["dp_shard=2", "distributed_optimizer=false"],
                          "dp_shard 2 shards weights, gradients and optimizer state, but distributed_optimizer"),
    "vocab": (1, ["model_overrides={vocab_size: 256}"], "tokenized with a tokenizer"),
    "microbatches": (2, ["pp=2", "batch_size=1"], "pp=2 needs at least 2 pipeline micro-batches per step, got 1"),
    "interleaved": (2, ["pp=2", "pp_schedule=interleaved", "batch_size=5"], "cannot split 5 pipeline micro-batches"),
    "output_path": (1, ["output_path=/dev/null/run"], "output_path '/dev/null/run': cannot create this directory"),
}


# (pp_schedule, batch_size) that no pipeline of 2 stages can feed: test_too_few_micro_batches_is_the_planners_error
TOO_FEW = [("1f1b", 1), ("gpipe", 1), ("interleaved", 5)]

@pytest.fixture(scope="module")
def bad_input_runs(corpus, tmp_path_factory) -> dict[str, tuple]:
    """name -> (exit code, stdout, stderr) of ``qwen3-pretrain train`` given each case of ``BAD`` (and
    ``TOO_FEW`` as ``too_few-SCHEDULE-BATCH``) as rank 0 of a launch of the case's size, every case with a config
    and output_path of its own, all in one process (tests/_cli_cases.py: a process per case cost ~3.5 s of
    imports each, ~73 s for the 20 on the 2-core CI). A case that got past its check would hang in the
    rendezvous (rank 0 of 2 waiting) until the child's timeout."""
    from tests._cli_cases import run_cases

    tmp = tmp_path_factory.mktemp("bad_input")
    cases = [(name, world, overrides) for name, (world, overrides, _) in BAD.items()]
    cases += [(f"too_few-{schedule}-{batch}", 2, ["pp=2", f"pp_schedule={schedule}", f"batch_size={batch}"])
              for schedule, batch in TOO_FEW]
    return run_cases([(name, {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0"},
                       ["train", "--config", str(write_config(tmp / f"{name}.yaml", corpus, tmp / name)), *overrides])
                      for name, world, overrides in cases],
                     dict(child_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_stops_before_any_heavy_work(name, bad_input_runs):
    """Checked before the process group exists, so one process posing as rank 0 of a launch of N
    shows what every rank prints: one line, no traceback, exit 2 (and no hang)."""
    code, _, stderr = bad_input_runs[name]
    assert code == 2, stderr
    assert BAD[name][2] in stderr
    assert stderr.count("error: ") == 1 and "Traceback" not in stderr, stderr


@pytest.mark.distributed
def test_bad_input_under_torchrun_stops_every_rank(corpus, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out")
    proc = run_train(cfg, 2, "rank_size=4", timeout=120, torchrun=True)
    text = proc.stderr + proc.stdout
    assert proc.returncode == 1  # torchrun's own status when a worker fails (the worker's is 2)
    # Printed once (rank 0; rank 1 would print later but the launcher stops it first), and named as the root
    # cause in torchrun's failure summary (the error file), not "<N/A>"; the only traceback is torchrun's.
    message = "error: rank_size is 4 but 2 processes were launched"
    assert [line for line in text.splitlines() if line.startswith("error: ")] == [
        line for line in text.splitlines() if line.startswith(message)], text
    assert len([line for line in text.splitlines() if line.startswith(message)]) == 1, text
    root_cause = text[text.index("Root Cause"):]
    assert f"traceback : {message}" in root_cause and "error_file: <N/A>" not in root_cause, root_cause
    assert text.count("Traceback") == text.count("elastic.multiprocessing.errors.ChildFailedError: "), text
    # The rest is torchrun's own, and no worker can shorten it: any non-zero exit of a worker makes torchrun raise
    # ChildFailedError out of its main (its traceback, then the failure summary). Before that traceback, the
    # only line that is not one of torchrun's log lines is the error; after it, nothing but the summary.
    lines = proc.stderr.splitlines()
    before = lines[:lines.index("Traceback (most recent call last):")]
    assert [line for line in before if not re.match(r"[IWE]\d{4} ", line)] == [line for line in lines
                                                                             if line.startswith(message)], text
    assert lines[-1].startswith("=====") and proc.stdout.strip() == "", text


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm-to-a-worker"])
def test_stopping_a_torchrun_launch(how, corpus, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) reaches torchrun alone, its workers running in sessions of
    their own: torchrun forwards SIGINT to them, they finish the step, save a checkpoint and exit 0, and torchrun
    then raises its own SignalException out of its main (a traceback, status 1), whatever they did: torchrun's
    doing, which no worker can prevent (docs/checkpoints.md). SIGTERM to one worker stops the run without it:
    status 0, no traceback."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=10_000, save_steps=0)
    with open(tmp_path / "log", "w+") as log:
        proc = subprocess.Popen(train_command(cfg, 2, torchrun=True), stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(), start_new_session=True)  # its own process group, as a terminal's job
        try:
            wait_for_step(out / "metrics.jsonl", 2, proc, timeout=300)
            if how == "ctrl-c":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                os.kill(_children(proc.pid)[0], signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        log.seek(0)
        text = log.read()
    stopped = re.search(r"stopped on request after step (\d+); checkpoint saved", text)
    assert stopped and (out / "latest").read_text().strip() == f"step_{int(stopped.group(1)):07d}", text
    if how == "ctrl-c":
        assert proc.returncode == 1, text
        assert "received SIGINT: finishing step" in text and "death signal, shutting down workers" in text
        assert text.count("Traceback") == 1 and text.rstrip().splitlines()[-1].startswith(
            "torch.distributed.elastic.multiprocessing.api.SignalException: Process "), text
    else:
        assert proc.returncode == 0, text
        assert "received SIGTERM: finishing step" in text and "Traceback" not in text, text


def test_unreachable_master_is_a_clear_error_not_a_hang(corpus, tmp_path):
    """A rank launched by mpirun whose rank 0 never comes up gives up after init_timeout_s."""
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", master_addr="127.0.0.1",
                       master_port=free_port(), init_timeout_s=1)  # the least it takes: 8.3 s here, 11.0 at 3
    env = dict(child_env(), OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1")
    env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, "-m", "qwen3_pretrain", "train", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "could not reach the rendezvous" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("schedule, batch", TOO_FEW)
def test_too_few_micro_batches_is_the_planners_error_in_train(schedule, batch, bad_input_runs):
    """The planner refuses a pipeline its micro-batches cannot feed; training refuses it with the same words
    (as rank 0 of 2, in the child of ``bad_input_runs``)."""
    from qwen3_pretrain.errors import UserError
    from qwen3_pretrain.models.qwen3.config import get_preset
    from qwen3_pretrain.plan.layout import Layout, check_model_fits_layout

    with pytest.raises(UserError) as planned:
        check_model_fits_layout(get_preset("qwen3-0.6b"), Layout(pp=2, pp_schedule=schedule, micro_batch_size=batch))
    code, _, stderr = bad_input_runs[f"too_few-{schedule}-{batch}"]
    assert code == 2, stderr
    assert str(planned.value).replace("micro_batch_size", "batch_size") in stderr


# --- the rendezvous host and the device of each process (monkeypatched launcher environments) ---

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS",
               "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID",
               "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def launch_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def detect(launch_env, master_addr: str):
    """``detect_launch`` as a fresh process sees it (the variables an earlier call exported are gone)."""
    from qwen3_pretrain.parallel.launch import detect_launch

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        launch_env.delenv(name, raising=False)
    return detect_launch(master_addr, 29500)


MPI_TWO_NODES = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
SRUN_TWO_NODES = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2",
                  "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}


@pytest.mark.parametrize("loopback", ["127.0.0.1", "localhost", "127.0.1.1", "::1"])
def test_mpirun_across_nodes_refuses_a_loopback_master_addr(launch_env, loopback):
    from qwen3_pretrain.errors import UserError

    for key, value in MPI_TWO_NODES.items():
        launch_env.setenv(key, value)
    with pytest.raises(UserError, match=f"master_addr is {loopback}, a loopback address, but this mpirun launch "
                                        "spans several nodes .OMPI_COMM_WORLD_SIZE 4 > OMPI_COMM_WORLD_LOCAL_SIZE 2"):
        detect(launch_env, loopback)


def test_mpirun_takes_an_exported_master_addr_or_a_real_host(launch_env):
    for key, value in MPI_TWO_NODES.items():
        launch_env.setenv(key, value)
    info = detect(launch_env, "node01")
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("mpirun", 3, 4, 1, 2)
    assert os.environ["MASTER_ADDR"] == "node01"
    launch_env.setenv("MASTER_ADDR", "10.0.0.7")
    assert detect(launch_env, "127.0.0.1").launcher == "mpirun"
    assert os.environ["MASTER_ADDR"] == "10.0.0.7"


def test_one_node_keeps_a_loopback_master_addr(launch_env):
    for key, value in dict(MPI_TWO_NODES, OMPI_COMM_WORLD_LOCAL_SIZE="4").items():
        launch_env.setenv(key, value)
    assert detect(launch_env, "127.0.0.1").launcher == "mpirun"
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"


def test_srun_across_nodes_resolves_a_loopback_master_addr_or_refuses(launch_env):
    from qwen3_pretrain.errors import UserError

    for key, value in SRUN_TWO_NODES.items():
        launch_env.setenv(key, value)
    info = detect(launch_env, "127.0.0.1")
    assert (info.launcher, info.local_world_size) == ("srun", 2) and os.environ["MASTER_ADDR"] == "gpu07"
    launch_env.delenv("MASTER_ADDR")
    launch_env.setenv("SLURM_STEP_NODELIST", "")
    with pytest.raises(UserError, match="master_addr is 127.0.0.1, a loopback address, but this srun launch spans "
                                        "several nodes .SLURM_STEP_NUM_NODES 2"):
        detect(launch_env, "127.0.0.1")


def test_a_cpu_ranks_share_of_its_node_ignores_how_the_launcher_bound_it(launch_env):
    """A launched rank counts its launcher's cores with its own (mpirun binds each rank to a core of its own,
    torchrun binds none); a process started by hand counts only its own (taskset on it means it)."""
    from qwen3_pretrain.parallel.env import node_cpu_share, share_of_node

    launch_env.setattr(os, "sched_getaffinity", lambda pid: {1} if pid == 0 else {0, 1, 2, 3})
    launch_env.setattr(os, "getppid", lambda: 4242)  # a launcher (pytest run detached has init, pid 1, instead)
    assert node_cpu_share(launched=True) == (4, 1)
    assert node_cpu_share(launched=False) == (1, 1)
    # every rank's (host, cores): the cores of a node's ranks together, over how many they are
    ranks = [("a", [0]), ("a", [1]), ("b", [0, 1, 2, 3]), ("b", [0, 1, 2, 3]), ("b", [4, 5])]
    assert share_of_node(ranks, "a") == (2, 2) and share_of_node(ranks, "b") == (6, 3)


def test_slurm_tasks_on_this_node():
    from qwen3_pretrain.parallel.launch import slurm_local_tasks

    assert [slurm_local_tasks({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": str(n)})
            for n in range(3)] == [4, 4, 3]
    assert slurm_local_tasks({"SLURM_STEP_TASKS_PER_NODE": "8"}) == 8
    assert slurm_local_tasks({}) is None


@pytest.fixture
def two_gpus(launch_env):
    """torch.cuda as a node with two GPUs shows it (a CPU build has none)."""
    import torch

    chosen = []
    launch_env.setattr(torch.cuda, "is_available", lambda: True)
    launch_env.setattr(torch.cuda, "device_count", lambda: 2)
    launch_env.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_each_local_rank_gets_its_own_device(two_gpus):
    import torch

    from qwen3_pretrain.parallel.env import pick_device

    assert [pick_device("cuda", r, 2) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert two_gpus == [0, 1]


@pytest.mark.parametrize("local_rank, local_world_size", [(0, 4), (2, 4), (2, None)])
def test_more_processes_than_devices_on_a_node_is_an_error(two_gpus, local_rank, local_world_size):
    from qwen3_pretrain.errors import UserError
    from qwen3_pretrain.parallel.env import pick_device

    with pytest.raises(UserError, match=r"processes on this node but 2 cuda device\(s\) visible"):
        pick_device("cuda", local_rank, local_world_size)
    assert two_gpus == []


def test_a_launcher_binding_one_device_per_process_is_not_sharing(launch_env):
    import torch

    from qwen3_pretrain.parallel.env import pick_device

    launch_env.setattr(torch.cuda, "is_available", lambda: True)
    launch_env.setattr(torch.cuda, "device_count", lambda: 1)
    launch_env.setattr(torch.cuda, "set_device", lambda index: None)
    launch_env.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert pick_device("cuda", 3, 4) == torch.device("cuda", 0)
