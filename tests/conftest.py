"""Fixtures shared by the test files: paths of the repository and a tiny model config factory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Derived-data cache of this test session only (inherited by the processes tests start)."""
    os.environ["QWEN3_PRETRAIN_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    """Directory of the bundled Qwen3 tokenizer (tokenizer.json, vocab.json, merges.txt)."""
    return REPO_ROOT / "assets" / "qwen3-tokenizer"


@pytest.fixture
def tiny_config() -> Callable[..., Any]:
    """``tiny_config(**overrides)`` -> a Qwen3Config small enough for a CPU test in milliseconds.

    The defaults keep Qwen3's quirks: grouped-query attention and a head_dim
    that is not hidden_size / num_attention_heads.
    """
    from qwen3_pretrain.models.qwen3.config import Qwen3Config

    def make(**overrides: Any) -> Qwen3Config:
        fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
        fields.update(overrides)
        return Qwen3Config(**fields)

    return make


@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory: pytest.TempPathFactory):
    """Training runs of every parallel layout from one shared set-up, each made once per session when
    a test first asks for it (equivalence tests and merge tests read the same runs)."""
    from tests._train_runs import LayoutRuns

    return LayoutRuns(tmp_path_factory.mktemp("layout_runs"))


@pytest.fixture(scope="session")
def test_device() -> Any:
    """The device of tests marked ``device``: QWEN3_PRETRAIN_TEST_DEVICE (cpu, cuda or npu) if set, else
    the first of CUDA and an Ascend NPU; such a test is skipped on a machine with neither."""
    import torch

    from qwen3_pretrain.parallel.env import pick_device

    wanted = os.environ.get("QWEN3_PRETRAIN_TEST_DEVICE", "auto")
    device = pick_device(wanted, 0)
    if wanted == "auto" and device.type == "cpu":
        pytest.skip("no CUDA or NPU device (set QWEN3_PRETRAIN_TEST_DEVICE=cpu to run it on the CPU)")
    return torch.device(device)


@pytest.fixture
def world_of_one():
    """A one-rank gloo process group for the test's duration (checkpoint code that calls collectives)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
