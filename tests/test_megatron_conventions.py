"""Megatron-LM's optimizer conventions as options (``lr_warmup_from_zero``, ``weight_decay_embeddings``,
``lr_decay_steps``, the ``wsd`` schedule) and the ``conventions`` umbrella that sets them.

The schedule is checked against Megatron's scheduler written here from its definition, not from our code:
the scheduler holds a step counter n that starts at 0 and is advanced after every optimizer step, so the
optimizer step k (0-based) runs at n = k; with W warm-up steps and the decay ending at D,

    n <= W (W > 0):  init + (peak - init) * n / W                   (init 0)
    constant style:  peak
    n > D:           min
    otherwise:       min + (peak - min) * c, r = (n - W) / (D - W), c = 1 - r (linear) or (1 + cos(pi r)) / 2
    WSD:             c = 1 until n <= D - A (A anneal steps), then with s = (n - (D - A)) / A:
                     1 - s, (1 + cos(pi s)) / 2, 2 * 0.5 ** s - 1, 1 - sqrt(s)

The parameter groups are checked by name against Megatron's rule: every parameter with more than one
dimension is decayed, 1-D ones (norm gains, the Gated DeltaNet's A_log and dt_bias) are not.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from qwen3_pretrain.config.loader import from_dict
from qwen3_pretrain.errors import ConfigError
from qwen3_pretrain.models.qwen3.config import get_preset
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from qwen3_pretrain.train.config import CONVENTION_KEYS, TrainConfig
from qwen3_pretrain.train.optim import build_optimizer, decays, lr_at


def megatron_lr(n: int, peak: float, low: float, warmup: int, decay_end: int, style: str,
                anneal: int = 0, anneal_style: str = "exponential") -> float:
    if warmup > 0 and n <= warmup:
        return 0.0 + (peak - 0.0) * n / warmup
    if style == "constant":
        return peak
    if n > decay_end:
        return low
    r = (n - warmup) / (decay_end - warmup)
    if style == "linear":
        c = 1.0 - r
    elif style == "cosine":
        c = (1.0 + math.cos(math.pi * r)) / 2
    else:  # WSD
        start = decay_end - anneal
        if n <= start:
            c = 1.0
        else:
            s = (n - start) / anneal
            c = {"linear": 1.0 - s, "cosine": (1.0 + math.cos(math.pi * s)) / 2,
                 "exponential": 2.0 * 0.5 ** s - 1.0, "minus_sqrt": 1.0 - math.sqrt(s)}[anneal_style]
    return low + (peak - low) * c


CASES = [  # (our keys, Megatron's arguments)
    (dict(lr_decay_style="cosine", warmup_steps=5, total_steps=30), dict(style="cosine", warmup=5, decay_end=30)),
    (dict(lr_decay_style="linear", warmup_steps=3, total_steps=20), dict(style="linear", warmup=3, decay_end=20)),
    (dict(lr_decay_style="constant", warmup_steps=4, total_steps=12), dict(style="constant", warmup=4, decay_end=12)),
    (dict(lr_decay_style="cosine", warmup_steps=0, total_steps=10), dict(style="cosine", warmup=0, decay_end=10)),
    # --lr-decay-iters shorter than the run: min_lr after it
    (dict(lr_decay_style="cosine", warmup_steps=2, total_steps=40, lr_decay_steps=25),
     dict(style="cosine", warmup=2, decay_end=25)),
    *[(dict(lr_decay_style="wsd", warmup_steps=3, total_steps=30, lr_wsd_decay_steps=8, lr_wsd_decay_style=s),
       dict(style="wsd", warmup=3, decay_end=30, anneal=8, anneal_style=s))
      for s in ("exponential", "linear", "cosine", "minus_sqrt")],
]


@pytest.mark.parametrize("ours, theirs", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_megatron_conventions_give_megatrons_schedule(ours, theirs):
    cfg = TrainConfig(learning_rate=3e-4, min_lr=3e-5, conventions="megatron", **ours)
    assert cfg.lr_warmup_from_zero is True
    steps = range(cfg.total_steps + 5)
    got = [lr_at(k, cfg) for k in steps]
    want = [megatron_lr(k, 3e-4, 3e-5, **theirs) for k in steps]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    if theirs["warmup"]:
        assert got[0] == 0.0 and got[theirs["warmup"]] == pytest.approx(3e-4, rel=1e-15)


def test_default_warmup_is_one_step_ahead_of_megatrons():
    """The project's warm-up (unchanged by the new keys): step k at (k + 1) / W, i.e. Megatron's step k + 1;
    from W on both schedules are equal."""
    ours = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_steps=4, total_steps=12)
    assert ours.conventions == "default" and ours.lr_warmup_from_zero is False
    for k in range(4):
        assert lr_at(k, ours) == pytest.approx(megatron_lr(k + 1, 1.0, 0.1, 4, 12, "cosine"), rel=1e-15)
    for k in range(4, 15):
        assert lr_at(k, ours) == pytest.approx(megatron_lr(k, 1.0, 0.1, 4, 12, "cosine"), rel=1e-15)


def test_default_schedule_is_bit_exact_with_the_old_formula():
    """Existing runs resume on exactly the learning rates they were started with: the old expression."""
    for style in ("cosine", "linear", "constant"):
        cfg = TrainConfig(learning_rate=2.5e-4, min_lr=1e-5, warmup_steps=7, total_steps=50, lr_decay_style=style)
        for k in range(60):
            if k < 7:
                old = 2.5e-4 * (k + 1) / 7
            elif style == "constant":
                old = 2.5e-4
            else:
                p = min(1.0, (k - 7) / max(1, 50 - 7))
                f = 1.0 - p if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
                old = 1e-5 + (2.5e-4 - 1e-5) * f
            assert lr_at(k, cfg) == old  # bit-exact, not approx


def test_explicit_keys_win_over_the_conventions():
    cfg = TrainConfig(conventions="megatron", lr_warmup_from_zero=False)
    assert cfg.lr_warmup_from_zero is False and cfg.weight_decay_embeddings is True
    line = cfg.conventions_in_force()
    assert line.startswith("conventions megatron: ")
    assert "lr_warmup_from_zero false (set explicitly)" in line and "weight_decay_embeddings true," in line + ","
    cfg = TrainConfig(weight_decay_embeddings=True)
    assert cfg.lr_warmup_from_zero is False and cfg.weight_decay_embeddings is True
    assert "weight_decay_embeddings true (set explicitly)" in cfg.conventions_in_force()
    # every convention key is empty by default and resolved: none stays None after construction
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for key, (default, megatron) in CONVENTION_KEYS.items():
        assert fields[key].default is None
        assert getattr(TrainConfig(), key) == default and getattr(TrainConfig(conventions="megatron"), key) == megatron


def test_conventions_from_yaml_and_bad_values():
    cfg = from_dict(TrainConfig, {"conventions": "Megatron", "lr_decay_style": "WSD", "lr_wsd_decay_steps": 100})
    assert (cfg.conventions, cfg.lr_decay_style, cfg.weight_decay_embeddings) == ("megatron", "wsd", True)
    with pytest.raises(ConfigError, match="conventions"):
        from_dict(TrainConfig, {"conventions": "nemo"})
    with pytest.raises(ConfigError, match="lr_wsd_decay_steps"):
        TrainConfig(lr_decay_style="wsd")
    with pytest.raises(ConfigError, match="lr_wsd_decay_steps"):
        TrainConfig(lr_decay_style="wsd", total_steps=10, lr_wsd_decay_steps=11)
    with pytest.raises(ConfigError, match="lr_decay_steps"):
        TrainConfig(lr_decay_steps=0)
    with pytest.raises(ConfigError, match=r"lr_decay_steps \(10\) must be above warmup_steps \(10\)"):
        TrainConfig(lr_decay_steps=10, warmup_steps=10)
    # the umbrella's MoE value meets a loss it cannot scale: the message says where the value came from
    with pytest.raises(ConfigError, match=r"moe_aux_loss_scale megatron \(from conventions megatron\)"):
        TrainConfig(conventions="megatron", moe_aux_loss="micro_batch")
    assert TrainConfig(conventions="megatron", moe_aux_loss="micro_batch",
                       moe_aux_loss_scale="mean_over_layers").weight_decay_embeddings is True


def _model(preset: str, **changes) -> Qwen3Model:
    with torch.device("meta"):
        return Qwen3Model(dataclasses.replace(get_preset(preset), **changes))


MODELS = {  # small real presets, built on the meta device (no memory, no init)
    "dense-tied": ("qwen3-0.6b", dict(num_hidden_layers=2)),
    "dense-untied": ("qwen3-8b", dict(num_hidden_layers=2)),
    "moe": ("qwen3-30b-a3b", dict(num_hidden_layers=2)),
    "hybrid-tied": ("qwen3.5-0.8b", dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3
                                         + ["full_attention"])),
}


@pytest.mark.parametrize("case", MODELS)
def test_param_groups_by_name(case):
    preset, changes = MODELS[case]
    model = _model(preset, **changes)
    tied = get_preset(preset).tie_word_embeddings
    params = dict(model.named_parameters())
    names = set(params)
    megatron_decayed = {n for n, p in params.items() if p.dim() > 1}
    for conventions in ("default", "megatron"):
        cfg = TrainConfig(conventions=conventions)
        decayed = {n for n in names if decays(n, cfg, tied)}
        if conventions == "megatron":
            assert decayed == megatron_decayed
            assert "embed_tokens.weight" in decayed
        else:
            embedding_like = {"embed_tokens.weight"} | ({"lm_head.weight"} if tied else set())
            assert decayed == megatron_decayed - embedding_like
            assert "embed_tokens.weight" not in decayed
        if not tied:  # an untied head is a matrix like any other, decayed under both
            assert "lm_head.weight" in decayed
        assert not any(n.endswith(("norm.weight", "A_log", "dt_bias")) for n in decayed)


def test_built_optimizer_groups_hold_those_parameters():
    cfg_model = dataclasses.replace(get_preset("qwen3-0.6b"), num_hidden_layers=1, hidden_size=64,
                                    intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, vocab_size=256)
    model = Qwen3Model(cfg_model)
    by_id = {id(p): n for n, p in model.named_parameters()}
    for conventions, embedding_decay in (("default", 0.0), ("megatron", 0.1)):
        opt = build_optimizer([model], TrainConfig(conventions=conventions, weight_decay=0.1), tied=True)
        group_of = {by_id[id(p)]: g["weight_decay"] for g in opt.param_groups for p in g["params"]}
        assert set(group_of) == set(by_id.values())
        assert group_of["embed_tokens.weight"] == embedding_decay
        assert group_of["layers.0.mlp.down_proj.weight"] == 0.1
        assert group_of["norm.weight"] == 0.0
