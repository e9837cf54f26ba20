"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedule.

Norm weights and embeddings get no weight decay (the usual choice for LLM
pre-training: decaying a norm's gain or rare tokens' embeddings towards zero
only hurts). A tied LM head is an embedding too. The schedule is a pure
function of the step, so resuming needs nothing but the step number.
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


def _no_decay(name: str, tied: bool, qk_norm_decay: bool = False) -> bool:
    """``qk_norm_decay``: the attention's q/k norms are decayed (``apply_wd_to_qk_layernorm``)."""
    if qk_norm_decay and name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
        return False
    return is_norm_weight(name) or name.endswith(_DECAY_PARAMETERS) or name == EMBEDDING or (tied and name == HEAD)


def build_optimizer(parts: Iterable[nn.Module], cfg: TrainConfig, tied: bool) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for part in parts:
        for name, param in part.named_parameters():
            (no_decay if _no_decay(name, tied, cfg.apply_wd_to_qk_layernorm) else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = optimizer_impl((decay or no_decay)[0].device.type) == "fused"
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr_at(0, cfg),
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused or None)


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """What the built optimizer runs, for the start-up kernel table."""
    if optimizer.defaults.get("fused"):
        return "AdamW fused"
    return "AdamW foreach (no fused AdamW kernel for this device: hardware.optimizer_impl)"


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up to ``learning_rate`` over
    ``warmup_steps``, then cosine/linear decay to ``min_lr`` at ``total_steps`` (or constant)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.lr_decay_style == "constant":
        return cfg.learning_rate
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.learning_rate - cfg.min_lr) * factor


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
