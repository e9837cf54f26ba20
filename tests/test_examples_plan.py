"""The full-size example configs (examples/*.yaml with a ``plan:`` line) load with the training config's
loader and fit by the planner, at the figures written in their header.

Each header holds the planner command it was checked with (``#   plan: --config FILE --nodes ...``) and
the predicted total memory per device; the planner is a formula, so this runs in about a second.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.plan import cli as plan_cli
from qwen3_pretrain.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if "#   plan:" in p.read_text())


def test_the_full_size_examples_are_there():
    names = {p.name for p in EXAMPLES}
    assert {"qwen3_30b_a3b_16xh100.yaml", "qwen3.5_9b_8x910b.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_and_fits(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(TrainConfig, path)
    assert cfg.conventions == "megatron" and cfg.lr_warmup_from_zero and cfg.weight_decay_embeddings
    text = path.read_text()
    args = shlex.split(re.search(r"#   plan: (.*)", text).group(1))
    assert plan_cli.main([*args, "--json", "--top", "1"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["fits"], best["memory_gib"]
    # the planner's best layout is the file's own (nothing left to search that the file does not fix)
    for key in ("tp", "pp", "cp", "ep", "batch_size", "gradient_accumulation_steps", "activation_checkpointing",
                "keep_params_gathered", "rank_size"):
        assert best["config"][key] == getattr(cfg, key), key
    # the header's figure is still the planner's, to 10% (rerun the header's command when the planner moves)
    written = float(re.search(r"([0-9.]+) GiB of [0-9.]+ per device", text).group(1))
    total = best["memory_gib"]["total"]
    assert abs(total - written) <= 0.1 * written, f"planner now predicts {total:.2f} GiB; update {path.name}"
