"""``deterministic: true``: deterministic kernels for the process, and a training step torch can run that way.

No GPU here, so the CUDA side is checked by what the step asks for: torch refuses, in deterministic mode,
operators it has no deterministic CUDA kernel for; the step must use none of them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwen3_pretrain.models.qwen3.model import LossHead, ModelOptions, Qwen3Model


def test_the_switch_sets_deterministic_kernels_before_any_runs():
    script = textwrap.dedent("""
        import os, torch
        from qwen3_pretrain.parallel.env import set_deterministic
        set_deterministic(False)
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # flash's deterministic backward
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["HCCL_DETERMINISTIC"] == "true"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG",)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self.seen.append((func.overloadpacket.__name__, first.dim() if first is not None else -1))
        return func(*args, **(kwargs or {}))


# Operators torch's deterministic mode refuses on CUDA (no deterministic kernel), as (name, smallest input
# rank refused): scatter_add is deterministic on CUDA only for 1-D input.
REFUSED_ON_CUDA = {"scatter_add": 2, "scatter_add_": 2, "scatter_reduce": 1, "scatter_reduce_": 1, "put_": 1,
                   "bincount": 1, "histc": 1, "kthvalue": 1, "median": 1, "nanmedian": 1, "index_reduce": 1,
                   "index_reduce_": 1}


def test_a_training_step_uses_no_operator_deterministic_mode_refuses_on_cuda(tiny_config):
    cfg = tiny_config()
    model = Qwen3Model(cfg, ModelOptions(document_mask=True, loss_head=LossHead(chunk_tokens=16)))
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    with _Ops() as ops:
        hidden = model(ids, positions)
        model.lm_head(hidden, ids).backward()
    refused = sorted({(name, dim) for name, dim in ops.seen if name in REFUSED_ON_CUDA and dim >= REFUSED_ON_CUDA[name]})
    assert not refused, refused
