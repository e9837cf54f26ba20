"""Activation checkpointing without renaming parameters.

Wrapping a layer in a checkpoint wrapper module would insert a prefix into
every parameter name and so into every checkpoint; instead the layer's own
``forward`` is replaced by a checkpointed call of the original.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpoint_forward(module: nn.Module) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """``full``: recompute each decoder layer in backward; ``selective``: recompute only the MLPs,
    whose intermediate activations (3 x intermediate_size per token) dominate a layer's memory."""
    if mode == "none":
        return
    for layer in model.layers.values():
        _checkpoint_forward(layer if mode == "full" else layer.mlp)
