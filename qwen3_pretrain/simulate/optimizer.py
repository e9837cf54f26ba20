"""AdamW as the simulated target runs it.

The engine builds its optimizer for the device its parameters live on
(``train/optim.py``: fused where ``hardware.optimizer_impl`` says the device has
the fused kernel). In the simulation the parameters live on the CPU device
type, where AdamW is fused, whatever the target; an NPU without the fused
kernel (``hardware.optimizer_impl``: the foreach path) steps with one fp32
temporary per tensor of a parameter group (``sqrt`` of the second moment),
whole groups at a time (Qwen3-8B, tp 4, pp 2, full recompute, on the 910B:
3.2 and 3.8 GiB on its two stages, which makes the optimizer step the peak:
18.56 and 19.13 GiB simulated, against 18.11 and 17.78 with the CPU's fused
step). So the simulation rebuilds each optimizer with the target's kernel,
same groups and settings, before any state exists.
"""

from __future__ import annotations

import inspect

import torch


def target_optimizer(optimizer: torch.optim.Optimizer, impl: str) -> torch.optim.Optimizer:
    """``optimizer`` (no state yet) rebuilt to step as ``impl`` (``Layout.optimizer_impl``: "fused",
    "foreach" or "for-loop") does: the same parameter groups, hyperparameters and settings."""
    cls = type(optimizer)
    accepted = set(inspect.signature(cls).parameters) - {"params", "fused", "foreach"}
    groups = [{k: v for k, v in g.items() if k == "params" or k in accepted} for g in optimizer.param_groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if impl == "fused":
        return cls(groups, **defaults, fused=True)
    return cls(groups, **defaults, foreach=impl == "foreach")


def play_optimizer(engine, impl: str) -> None:
    """The engine's optimizers rebuilt for the target's ``impl``, in place, where they step otherwise."""
    built = "fused" if engine.optimizers[0].defaults.get("fused") else None
    if built == impl:
        return
    engine.optimizers = [target_optimizer(opt, impl) for opt in engine.optimizers]
