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
        self.seen: list[tuple[str, str, tuple]] = []  # (operator, overload, its arguments but tensors' dtypes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        described = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args)
        self.seen.append((func.overloadpacket.__name__, func._overloadname, described))
        return func(*args, **(kwargs or {}))


def _refused_on_cuda(name: str, overload: str, args: tuple) -> bool:
    """Whether torch 2.13's deterministic mode refuses this call on CUDA (its documented list: no
    deterministic kernel for it)."""
    if name in ("cumsum", "cumsum_"):
        return len(args) > 0 and isinstance(args[0], torch.dtype) and args[0].is_floating_point
    if name in ("scatter_reduce", "scatter_reduce_"):
        return "prod" in args
    if name == "median":
        return overload == "dim"  # with indices
    return name in REFUSED_ON_CUDA


# Operators torch's deterministic mode refuses on CUDA, from its documented list (torch.use_deterministic_
# algorithms): NLLLoss, CTCLoss backward, EmbeddingBag's max backward, put_, histc, bincount, grid_sample
# and pooling/padding/interpolation backwards; floating-point cumsum, scatter_reduce "prod" and median with
# indices are checked above.
REFUSED_ON_CUDA = {"nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward", "_ctc_loss_backward",
                   "_embedding_bag_backward", "put_", "put", "histc", "bincount", "grid_sampler_2d_backward",
                   "grid_sampler_3d_backward", "avg_pool3d_backward", "adaptive_avg_pool2d_backward",
                   "_adaptive_avg_pool2d_backward", "adaptive_avg_pool3d_backward", "adaptive_max_pool2d_backward",
                   "fractional_max_pool2d_backward", "fractional_max_pool3d_backward", "max_unpool2d",
                   "max_unpool3d", "reflection_pad1d_backward", "reflection_pad2d_backward",
                   "reflection_pad3d_backward", "upsample_linear1d_backward", "upsample_bilinear2d_backward",
                   "upsample_bicubic2d_backward", "upsample_trilinear3d_backward"}


def test_a_training_step_uses_no_operator_deterministic_mode_refuses_on_cuda(tiny_config):
    cfg = tiny_config()
    model = Qwen3Model(cfg, ModelOptions(document_mask=True, loss_head=LossHead(chunk_tokens=16)))
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    with _Ops() as ops:
        hidden = model(ids, positions)
        model.lm_head(hidden, ids).backward()
    assert any(name == "cumsum" for name, _, _ in ops.seen)  # the document ids: an integer cumsum, allowed
    refused = sorted({(name, overload) for name, overload, args in ops.seen if _refused_on_cuda(name, overload, args)})
    assert not refused, refused
