"""The learning-rate schedule against values computed by hand from its definition (linear warm-up to
the peak, then cosine, linear or no decay to min_lr at total_steps, min_lr after that)."""

from __future__ import annotations

import pytest

from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.optim import lr_at

# Peak 1.0, min_lr 0.1, 2 warm-up steps, total 6: the decay spans steps 2..6 (4 steps).
# cosine: 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2 for k = 0..4 -> 1, 0.86819805, 0.55, 0.23180195, 0.1
# linear: 0.1 + 0.9 * (1 - k / 4) -> 1, 0.775, 0.55, 0.325, 0.1
HAND = {
    "cosine": [0.5, 1.0, 1.0, 0.8681980515339464, 0.55, 0.23180194846605365, 0.1, 0.1, 0.1],
    "linear": [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1],
    "constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
}


def config(**changes) -> TrainConfig:
    fields = dict(learning_rate=1.0, min_lr=0.1, warmup_steps=2, total_steps=6)
    return TrainConfig(**{**fields, **changes})


@pytest.mark.parametrize("style", list(HAND))
def test_each_schedule_against_hand_values(style):
    cfg = config(lr_decay_style=style)
    assert [lr_at(step, cfg) for step in range(9)] == pytest.approx(HAND[style], rel=1e-12, abs=0)


def test_without_warm_up_the_first_step_has_the_peak():
    # total 4, no warm-up: cosine over 4 steps, k = step.
    cfg = config(lr_decay_style="cosine", warmup_steps=0, total_steps=4)
    want = [1.0, 0.8681980515339464, 0.55, 0.23180194846605365, 0.1]
    assert [lr_at(step, cfg) for step in range(5)] == pytest.approx(want, rel=1e-12, abs=0)


def test_warm_up_longer_than_the_run_never_decays():
    # 8 warm-up steps in a 4-step run: step k gets (k + 1) / 8 of the peak.
    cfg = config(lr_decay_style="linear", warmup_steps=8, total_steps=4, learning_rate=2e-4, min_lr=0.0)
    assert [lr_at(step, cfg) for step in range(4)] == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4], rel=1e-12, abs=0)
