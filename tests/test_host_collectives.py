"""Host-side collectives on a device's process group: NCCL and HCCL take only device tensors, so the
group the engine makes for a device must also carry CPU tensors (checkpoint agreement, DCP's metadata
exchange and asynchronous save). A CPU build reproduces the failure: ``tests/_device_group.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.distributed_c10d import Backend, BackendConfig

from qwen3_pretrain.parallel import env
from tests._device_group import stand_in
from tests._train_helpers import check_ok, child_env, losses, make_corpus, ranks_launch, write_config

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("device_type", sorted(env.DEVICE_BACKENDS))
def test_a_device_group_has_gloo_for_cpu_tensors_beside_the_device_library(device_type):
    backends = BackendConfig(Backend(env.backend_spec(device_type))).get_device_backend_map()
    assert backends == {"cpu": "gloo", device_type: env.DEVICE_BACKENDS[device_type]}


def test_the_stand_in_keeps_each_library_on_its_device_types():
    assert stand_in("nccl") == "cuda:gloo"
    assert stand_in("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:gloo"


def _train_on_device_group(cfg: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [*ranks_launch(nproc), sys.executable, str(REPO / "tests" / "_device_group.py"), "train", "--config",
           str(cfg), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=child_env(), cwd=REPO)


@pytest.mark.distributed
def test_training_saves_and_resumes_on_a_device_process_group(tmp_path):
    """Every collective of a run, under the group a GPU run gets: resume agreement, loss and stop
    agreement (which also decides the non-finite skip), gradient norm over pp, tied weights,
    evaluation, metrics, an asynchronous then a synchronous save with their publication, and a
    resume under another layout."""
    corpus = make_corpus(tmp_path / "corpus", num_docs=120)
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.yaml", corpus, out, total_steps=2, save_steps=1, async_save=True, pp=2,
                       eval_steps=2, eval_iters=1, valid_fraction=0.1)
    first = _train_on_device_group(cfg, 2)
    check_ok(first)
    assert "process group backend: cpu:gloo,cuda:gloo" in first.stdout
    assert (out / "latest").read_text().strip() == "step_0000002"
    second = _train_on_device_group(cfg, 2, "total_steps=3", "pp=1", "async_save=false")
    check_ok(second)
    assert "resumed from" in second.stdout and (out / "latest").read_text().strip() == "step_0000003"
    assert len(losses(out)) == 3
