"""Which gated-delta-rule kernel a Gated DeltaNet layer runs, chosen when the model is built (as attention's).

``TorchDeltaRule``: this project's chunked rule in plain torch (gated_delta.py), exact on packed documents;
every device, the reference of the tests. ``FlaDeltaRule``: flash-linear-attention's Triton kernel
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``; CUDA, and NPUs through its Ascend backend), an
optional dependency, never needed on a CPU; packed documents reach it as ``cu_seqlens`` over the batch
flattened into one row, its variable-length mode. ``bench/device_check.sh`` compares the two on a device.
"""

from __future__ import annotations

import importlib.util
import weakref
from typing import Protocol

import torch

from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule


class DeltaRuleKernel(Protocol):
    """``q``, ``k`` [batch, seq, k_heads, dk] (L2-normalised inside), ``v`` [batch, seq, v_heads, dv], ``g``
    (log decay) and ``beta`` [batch, seq, v_heads], ``starts`` [batch, seq] (bool, where documents begin; None:
    each row one sequence) -> [batch, seq, v_heads, dv]."""

    name: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 starts: torch.Tensor | None) -> torch.Tensor: ...


class TorchDeltaRule:
    name = "torch"

    def __call__(self, q, k, v, g, beta, starts):
        return chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, use_qk_l2norm=True)[0]


class FlaDeltaRule:
    """flash-linear-attention's kernel (``chunk``: its ``chunk_gated_delta_rule`` unless given) on the batch
    flattened into one row. The offsets of a micro-batch's documents are found once, by the first layer, and
    handed as the same tensor to every other layer and to the recompute in backward: finding them reads the
    device's values on the host (``nonzero``), and flash-linear-attention keeps what it derives from them
    (its chunk indices, another host read) for the tensor object it last saw."""

    name = "fla"

    def __init__(self, chunk=None) -> None:
        if chunk is None:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        self.chunk = chunk
        # (weak reference to a micro-batch's ``starts``, its offsets); one per micro-batch still in flight
        self._offsets: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._rows: dict[tuple[int, int, str], torch.Tensor] = {}

    def __call__(self, q, k, v, g, beta, starts):
        batch, seq, v_heads = v.shape[:3]
        group = v_heads // q.shape[2]
        if group > 1:  # each key head serves consecutive value heads
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        flat = [t.reshape(1, batch * seq, *t.shape[2:]) for t in (q, k, v, g, beta)]
        out, _ = self.chunk(*flat, cu_seqlens=self.offsets(starts, batch, seq, q.device),
                            use_qk_l2norm_in_kernel=True)
        return out.view(batch, seq, v_heads, -1)

    def offsets(self, starts: torch.Tensor | None, batch: int, seq: int, device: torch.device) -> torch.Tensor:
        """``cu_seqlens(starts, ...)``, computed once per ``starts`` tensor (a micro-batch's) while it lives."""
        if starts is None:  # rows of one sequence each: the same offsets for every micro-batch of the shape
            key = (batch, seq, str(device))
            if key not in self._rows:
                self._rows[key] = cu_seqlens(None, batch, seq, device)
            return self._rows[key]
        self._offsets = {key: entry for key, entry in self._offsets.items() if entry[0]() is not None}
        entry = self._offsets.get(id(starts))
        if entry is None or entry[0]() is not starts:
            entry = self._offsets[id(starts)] = (weakref.ref(starts), cu_seqlens(starts, batch, seq, device))
        return entry[1]


def cu_seqlens(starts: torch.Tensor | None, batch: int, seq: int, device: torch.device | None = None
               ) -> torch.Tensor:
    """The offsets (int32, from 0 to batch * seq, on ``device``) of the sequences of a batch flattened into one
    row: every row starts one, and so does every document start. Without documents a multiple of ``seq``
    each, with no host read."""
    if starts is None:
        return torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
    first = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    first[:, 0] = True
    first |= starts.to(first.device)
    bounds = first.flatten().nonzero().flatten()
    end = torch.tensor([batch * seq], device=bounds.device)
    return torch.cat([bounds, end]).to(torch.int32)


def delta_rule_kernel(device_type: str) -> DeltaRuleKernel:
    """flash-linear-attention's kernel on a CUDA device or an NPU where it is installed, else ours."""
    if device_type in ("cuda", "npu") and importlib.util.find_spec("fla") is not None:
        return FlaDeltaRule()
    return TorchDeltaRule()
