"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedule.

Norm weights and embeddings get no weight decay by default (the usual choice for LLM
pre-training: decaying a norm's gain or rare tokens' embeddings towards zero only hurts).
A tied LM head is an embedding too. ``weight_decay_embeddings`` decays the embedding (and
so a tied head) as Megatron does: Megatron exempts only 1-D parameters (norms, biases) and
decays every matrix, the embedding and output layer included. The norms and the Gated
DeltaNet's per-head decay parameters stay undecayed either way (1-D in Megatron too).

The schedule is a pure function of the step, so resuming needs nothing but the step
number. Step ``k`` is 0-based: the k-th optimizer step runs at ``lr_at(k)``. Two warm-up
conventions (``lr_warmup_from_zero``):

    default:   lr(k) = peak * (k + 1) / W   for k < W    (the first step already moves the weights)
    Megatron:  lr(k) = peak * k / W         for k <= W   (its scheduler is stepped after each
                                                          optimizer step from 0: the first step runs at lr 0)

The decay that follows is the same in both: progress (k - W) / (D - W) with D =
``lr_decay_steps`` (empty: total_steps), min_lr after D. Megatron's warm-up thus ends one step
later and its step W is the peak, where ours holds the peak at W - 1 and W. ``wsd``
(warmup-stable-decay) holds the peak until D - ``lr_wsd_decay_steps`` and anneals to
min_lr over the last ``lr_wsd_decay_steps`` steps in the shape ``lr_wsd_decay_style``.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from qwen3_pretrain.hardware import optimizer_impl
from qwen3_pretrain.models.qwen3.init import is_norm_weight
from qwen3_pretrain.models.qwen3.model import EMBEDDING, HEAD
from qwen3_pretrain.train.config import TrainConfig


# Gated DeltaNet's per-head decay parameters (the log of the decay rate and the time step's bias) are not
# weights of a projection: like norms, decaying them would pull the decay towards a constant, not regularise.
_DECAY_PARAMETERS = ("linear_attn.A_log", "linear_attn.dt_bias")


def _no_decay(name: str, tied: bool, qk_norm_decay: bool = False, embedding_decay: bool = False) -> bool:
    """``qk_norm_decay``: the attention's q/k norms are decayed (``apply_wd_to_qk_layernorm``);
    ``embedding_decay``: the embedding and a tied head are (``weight_decay_embeddings``)."""
    if qk_norm_decay and name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
        return False
    if is_norm_weight(name) or name.endswith(_DECAY_PARAMETERS):
        return True
    return not embedding_decay and (name == EMBEDDING or (tied and name == HEAD))


def decays(name: str, cfg: TrainConfig, tied: bool) -> bool:
    """Whether parameter ``name`` (as the model names it) is in the weight-decay group under ``cfg``."""
    return not _no_decay(name, tied, cfg.apply_wd_to_qk_layernorm, bool(cfg.weight_decay_embeddings))


def build_optimizer(parts: Iterable[nn.Module], cfg: TrainConfig, tied: bool) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for part in parts:
        for name, param in part.named_parameters():
            (decay if decays(name, cfg, tied) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = optimizer_impl((decay or no_decay)[0].device.type) == "fused"
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr_at(0, cfg),
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused or None)


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """What the built optimizer runs, for the start-up kernel table."""
    if optimizer.defaults.get("fused"):
        return "AdamW fused"
    return "AdamW foreach (no fused AdamW kernel for this device: hardware.optimizer_impl)"


def _anneal(style: str, ratio: float) -> float:
    """The share of (peak - min_lr) left at ``ratio`` (0 to 1) of an anneal of shape ``style``."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * ratio))
    if style == "exponential":  # 1 at the start, 0 at the end, falling fastest at the start
        return 2.0 * 0.5 ** ratio - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up to ``learning_rate`` over
    ``warmup_steps`` (from lr/W, or from 0 with ``lr_warmup_from_zero``), then cosine/linear/WSD decay to
    ``min_lr`` at ``lr_decay_steps`` (empty: total_steps), min_lr after it (or constant)."""
    warmup = cfg.warmup_steps
    if warmup and cfg.lr_warmup_from_zero and step <= warmup:
        return cfg.learning_rate * step / warmup
    if warmup and step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.learning_rate
    end = cfg.total_steps if cfg.lr_decay_steps is None else cfg.lr_decay_steps
    if cfg.lr_decay_style == "wsd":
        anneal_from = end - cfg.lr_wsd_decay_steps
        progress = min(1.0, max(0.0, (step - anneal_from) / cfg.lr_wsd_decay_steps))
        factor = _anneal(cfg.lr_wsd_decay_style, progress)
    else:
        progress = min(1.0, (step - warmup) / max(1, end - warmup))
        factor = _anneal(cfg.lr_decay_style, progress)
    return cfg.min_lr + (cfg.learning_rate - cfg.min_lr) * factor


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
