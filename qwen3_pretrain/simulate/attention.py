"""The target device's attention kernels, played on the CPU device type for the scale simulation.

The engine is built for the target device (say CUDA), but the simulation's
tensors are fake CPU tensors, where the target's calls cannot all run
(FlexAttention has no CPU backward; a ``CausalBias`` is no fake tensor), and
where SDPA would choose the CPU's kernel, not the target's. So each call is put
to the target's kernel rules (``hardware.attention_backend``) and recorded,
then run as a CPU SDPA call of the same shapes that keeps what the target's
kernel keeps: a fused kernel's output and log-sum-exp (the CPU's flash kernel),
or, where the target falls back to it, the math kernel's fp32 probabilities.
A CPU target runs its own kernel.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qwen3_pretrain.hardware import attention_backend
from qwen3_pretrain.models.qwen3.attention import AttentionKernel, attention_kernel
from qwen3_pretrain.models.qwen3.attention_calls import AttentionCall

_UNFUSED = ("math", "flex_unfused")


@dataclass
class KernelRecord:
    """The attention calls of a simulated rank: how many ran on each kernel, and the calls that fell to
    an unfused one."""

    counts: Counter = field(default_factory=Counter)
    unfused: dict[AttentionCall, str] = field(default_factory=dict)

    def add(self, call: AttentionCall, backend: str) -> None:
        self.counts[backend] += 1
        if backend in _UNFUSED:
            self.unfused[call] = backend

    def reset(self) -> None:
        self.counts.clear()


class _Documents:
    """The target's document mask (block mask, segments): small next to everything else, not played."""


class SimulatedAttention(AttentionKernel):
    """``target`` (a kernel built for ``device_type``) as the simulation runs it: see the module docstring."""

    def __init__(self, target: AttentionKernel, device_type: str, record: KernelRecord) -> None:
        super().__init__()
        self.target, self.device_type, self.record = target, device_type, record
        self.name, self.dense_document_mask = target.name, target.dense_document_mask

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.target.compute_dtype(dtype)

    def mask(self, doc_ids: torch.Tensor, q_len: int, dtype: torch.dtype) -> Any:
        return self.target.mask(doc_ids, q_len, dtype) if self.dense_document_mask else _Documents()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        batch, q_heads, q_len, head_dim = q.shape
        call = self.target.describe(q.dtype, batch, q_heads, k.shape[1], q_len, k.shape[2], head_dim,
                                    mask is not None)
        backend = attention_backend(self.device_type, call)
        self.record.add(call, backend)
        if self.device_type == "cpu":
            return self.target(q, k, v, mask)
        dtype = self.compute_dtype(q.dtype)
        # The causal flag stands for the target's own causal mode (lower-right for a chunk): the values
        # are never read, the shapes and what is kept are the target's.
        with sdpa_kernel([SDPBackend.MATH if backend in _UNFUSED else SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True,
                                                 enable_gqa=q_heads != k.shape[1])
        return out.to(q.dtype)


def simulated_kernels(record: KernelRecord):
    """The engine's ``make_attention`` for the simulation: the target's kernel, played on the CPU."""

    def make(device_type: str, compute_dtype: torch.dtype | None) -> AttentionKernel:
        return SimulatedAttention(attention_kernel(device_type, compute_dtype), device_type, record)

    return make
