"""Checkpoints: bit-exact resume (also after kill -9 and from an asynchronous save), half-written
checkpoints ignored, graceful stop on SIGTERM, elastic restart under torchrun, non-finite steps.
Resuming under another layout is in test_checkpoint_layouts.py."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests._checkpoint_helpers import (assert_identical_states, checkpoint_state, kill_then_resume, records, resume_from,
                                       step_dir, wait_for_step)
from tests._train_helpers import (check_ok, child_env, free_port, losses, make_corpus, run_train, step_records,
                                  train_command, write_config)

TOTAL = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """One process, 6 steps, a checkpoint every 3 (global batch 4 = 2 x accumulation 2)."""
    out = tmp_path_factory.mktemp("full") / "out"
    cfg = write_config(out.parent / "c.yaml", corpus, out, total_steps=TOTAL, save_steps=3,
                       gradient_accumulation_steps=2)
    check_ok(run_train(cfg, 1))
    return out


def test_resume_is_bit_exact(uninterrupted, corpus, tmp_path):
    out = tmp_path / "out"
    resume_from(uninterrupted, 3, out)
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=TOTAL, save_steps=3, gradient_accumulation_steps=2)
    proc = run_train(cfg, 1)
    check_ok(proc)
    assert f"resumed from {out / 'step_0000003'} at step 3" in proc.stdout
    assert len(records(out)) == TOTAL - 3
    assert records(out) == records(uninterrupted)[3:]  # losses and grad norms, exact float equality
    assert_identical_states(checkpoint_state(step_dir(uninterrupted, TOTAL), tmp_path),
                            checkpoint_state(step_dir(out, TOTAL), tmp_path))


def test_one_stage_stores_a_tied_weight_once(uninterrupted, tmp_path):
    dcp_to_torch_save(uninterrupted / "step_0000006", tmp_path / "flat.pt")
    state = torch.load(tmp_path / "flat.pt", weights_only=False)
    model, optim = state["model"], state["optim"]
    assert "embed_tokens.weight" in model and "lm_head.weight" not in model, sorted(model)[:5]
    assert any(k.startswith("state.embed_tokens.weight.") for k in optim), sorted(optim)[:5]
    assert not any(".lm_head." in k for k in optim), [k for k in optim if ".lm_head." in k]


def test_kill_9_then_resume_gives_identical_losses_and_weights(corpus, tmp_path):
    total, kill_after = 20, 5  # many steps left after the kill: it lands mid-run even on a slow machine
    ref = tmp_path / "ref"
    cfg_ref = write_config(tmp_path / "r.yaml", corpus, ref, total_steps=total, save_steps=2)
    check_ok(run_train(cfg_ref, 1, timeout=900))
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=total, save_steps=2)
    proc = kill_then_resume(cfg, out, kill_after, total)
    assert "resumed from" in proc.stdout
    assert records(out) == records(ref)
    assert_identical_states(checkpoint_state(step_dir(ref, total), tmp_path),
                            checkpoint_state(step_dir(out, total), tmp_path))


def test_blended_run_killed_then_resumed_gives_identical_losses_weights_and_mix(corpus, tmp_path):
    """Two datasets blended 0.7/0.3: the resumed run recomputes each source's position from the consumed
    samples. Probe: a blended resume one sample late changed the loss of the first step after the resume."""
    books = make_corpus(tmp_path / "books", num_docs=60, seed=1)  # small: it runs through several epochs
    data_path = f"0.7 {corpus} 0.3 {books}"
    total, kill_after = 16, 4
    ref, out = tmp_path / "ref", tmp_path / "out"
    check_ok(run_train(write_config(tmp_path / "r.yaml", data_path, ref, total_steps=total, save_steps=2), 1,
                       timeout=900))
    cfg = write_config(tmp_path / "c.yaml", data_path, out, total_steps=total, save_steps=2)
    proc = kill_then_resume(cfg, out, kill_after, total)
    assert "resumed from" in proc.stdout and f"| mix {corpus.name}=" in proc.stdout
    assert records(out) == records(ref)
    mixes = [r["samples_by_dataset"] for r in step_records(out)]
    assert mixes == [r["samples_by_dataset"] for r in step_records(ref)]
    drawn = total * 2  # global batch 2
    assert sorted(mixes[-1]) == sorted([str(corpus), str(books)]) and sum(mixes[-1].values()) == drawn
    assert abs(mixes[-1][str(books)] - 0.3 * drawn) <= 1, mixes[-1]
    assert_identical_states(checkpoint_state(step_dir(ref, total), tmp_path),
                            checkpoint_state(step_dir(out, total), tmp_path))


def test_half_written_checkpoint_is_ignored(uninterrupted, corpus, tmp_path):
    """A save killed before its rename leaves a temp dir; a 'latest' naming an incomplete dir falls back."""
    out = tmp_path / "out"
    resume_from(uninterrupted, 3, out)
    partial = out / ".tmp-step_0000005-save"
    shutil.copytree(uninterrupted / "step_0000006", partial)
    (partial / "meta.json").unlink()
    broken = out / "step_0000004"
    broken.mkdir()
    (broken / "__0_0.distcp").write_bytes(b"truncated")
    (out / "latest").write_text("step_0000004\n")
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=TOTAL, save_steps=3, gradient_accumulation_steps=2)
    proc = run_train(cfg, 1)
    check_ok(proc)
    assert "resumed from" in proc.stdout and "step_0000003 at step 3" in proc.stdout
    assert "which is unusable" in proc.stdout and "being written when a run stopped" in proc.stdout
    assert losses(out) == losses(uninterrupted)[3:]


def test_sigterm_saves_and_exits_zero(corpus, tmp_path):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=10_000, save_steps=0)
    proc = subprocess.Popen(train_command(cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env())
    wait_for_step(out / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout
    last = len(losses(out))
    assert last < 10_000, "the run finished before it was stopped"
    assert (out / "latest").read_text().strip() == f"step_{last:07d}"
    assert "stopped on request" in stdout


@pytest.mark.distributed
def test_elastic_restart_after_a_rank_is_killed(corpus, tmp_path):
    """torchrun --max-restarts restarts the job when one rank dies; it resumes from 'latest' by itself."""
    total = 10
    ref = tmp_path / "ref"
    check_ok(run_train(write_config(tmp_path / "r.yaml", corpus, ref, total_steps=total), 2, "batch_size=2"))
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=total, save_steps=2, batch_size=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "3",
           "--master_port", str(free_port()), "-m", "qwen3_pretrain", "train", "--config", str(cfg)]
    log = open(tmp_path / "train.log", "w")  # a file, not a pipe nobody reads while waiting
    agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=child_env())
    wait_for_step(out / "metrics.jsonl", 3, agent)
    workers = _children(agent.pid)
    assert workers, "no worker processes found"
    subprocess.run(["kill", "-9", str(workers[-1])], check=True)
    agent.wait(timeout=300)
    stdout = (tmp_path / "train.log").read_text()
    assert agent.returncode == 0, stdout[-3000:]
    assert "resumed from" in stdout, "the job was not restarted: the kill did not land before the run ended"
    assert losses(out) == losses(ref)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return sorted(kids)


def test_non_finite_steps_are_skipped_then_the_run_stops(corpus, tmp_path):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=50, learning_rate=1e30, warmup_steps=0,
                       clip_grad=0, max_nonfinite_steps=3, save_steps=1)
    proc = run_train(cfg, 1)
    assert proc.returncode == 2
    assert "consecutive steps with a non-finite" in proc.stderr
    assert "optimizer step skipped" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert (out / "latest").read_text().strip() == "step_0000001"


def test_async_save_gives_the_same_checkpoints(uninterrupted, corpus, tmp_path):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=TOTAL, save_steps=3, gradient_accumulation_steps=2,
                       async_save=True)
    check_ok(run_train(cfg, 1))
    assert records(out) == records(uninterrupted)
    for step in (3, 6):
        assert_identical_states(checkpoint_state(step_dir(uninterrupted, step), tmp_path),
                                checkpoint_state(step_dir(out, step), tmp_path))
    # resumed from the checkpoint written in the background, the run goes on exactly as without a stop
    resumed = tmp_path / "resumed"
    resume_from(out, 3, resumed)
    proc = run_train(cfg, 1, f"output_path={resumed}")
    check_ok(proc)
    assert "at step 3" in proc.stdout
    assert len(records(resumed)) == TOTAL - 3
    assert records(resumed) == records(uninterrupted)[3:]
    assert_identical_states(checkpoint_state(step_dir(uninterrupted, TOTAL), tmp_path),
                            checkpoint_state(step_dir(resumed, TOTAL), tmp_path))


def test_failed_save_keeps_the_previous_checkpoint(uninterrupted, corpus, tmp_path):
    """A save that cannot write (here: a file-size limit, as on a full disk) stops the run with a clear
    message; 'latest' still names the previous checkpoint, which resumes normally."""
    import resource

    out = tmp_path / "out"
    resume_from(uninterrupted, 3, out)
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=TOTAL, save_steps=3, gradient_accumulation_steps=2)

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    proc = subprocess.run(train_command(cfg), capture_output=True, text=True, env=child_env(), timeout=300,
                          preexec_fn=limit_file_size)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "saving checkpoint" in proc.stderr and "the previous checkpoint is intact" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / "latest").read_text().strip() == "step_0000003"
    check_ok(run_train(cfg, 1))
    assert losses(out)[-3:] == losses(uninterrupted)[3:]


def _save_with_a_full_disk_on_rank_1(rank: int, port: int, root: str, report: str) -> None:
    """Rank 1 may write only 100 kB per file (as on a full disk); both ranks then save a checkpoint whose
    shards are 2 MB each. Each rank writes the message it raised; rank 1 also what a direct write of a
    shard-sized file fails with under the same limit (the cause the message must name)."""
    import resource

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qwen3_pretrain.checkpoint.manager import Checkpointer
    from qwen3_pretrain.errors import UserError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = torch.nn.Linear(1024, 1024)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        checkpointer = Checkpointer(root, [model], [torch.optim.SGD(model.parameters(), lr=0.1)])
        if rank == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
            try:
                torch.save(torch.zeros(2**19), Path(report) / "direct.pt")
            except Exception as exc:  # what the filesystem does to this rank's writes
                (Path(report) / "cause").write_text(str(exc).splitlines()[0])
        try:
            checkpointer.save(1, {})
        except UserError as exc:
            (Path(report) / f"rank_{rank}").write_text(str(exc))
    finally:
        dist.destroy_process_group()


def test_a_failed_save_names_each_failing_rank_and_its_cause(tmp_path):
    import torch.multiprocessing as mp

    report = tmp_path / "report"
    report.mkdir()
    mp.start_processes(_save_with_a_full_disk_on_rank_1, args=(free_port(), str(tmp_path / "out"), str(report)),
                       nprocs=2, join=True, start_method="fork")
    cause = (report / "cause").read_text()
    messages = [(report / f"rank_{r}").read_text() for r in (0, 1)]
    assert messages[0] == messages[1], messages  # every rank stops with the same message
    assert f"rank 1: RuntimeError: {cause};" in messages[0] and "rank 0:" not in messages[0], (messages[0], cause)
    assert messages[0].startswith(f"saving checkpoint {tmp_path / 'out' / '.tmp-step_0000001-save'} failed")
    assert not (tmp_path / "out" / "latest").exists()
