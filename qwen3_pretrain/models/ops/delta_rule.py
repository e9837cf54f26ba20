"""Which gated-delta-rule kernel a Gated DeltaNet layer runs, chosen when the model is built (as attention's).

``TorchDeltaRule``: this project's chunked rule in plain torch (gated_delta.py), exact on packed documents;
every device, the reference of the tests. ``FlaDeltaRule``: flash-linear-attention's Triton kernel
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``; CUDA, and NPUs through its Ascend backend), an
optional dependency, never needed on a CPU; packed documents reach it as ``cu_seqlens`` over the batch
flattened into one row, its variable-length mode. ``bench/device_check.sh`` compares the two on a device.

flash-linear-attention's versions (``FLA_MIN_VERSION``, the ``fla`` extra's floor): 0.1 has no ``cu_seqlens``
(``offsets``, heads first by default), 0.3.0-0.3.2 assert that the inputs are not fp32 (a training run with
``mixed_precision: fp32`` stopped there with a raw traceback), 0.4.0 takes both. Choosing the kernel where an
older one is installed is refused with the installed version and what to do. From 0.5.0 its kernel takes
grouped value heads itself (more value heads than q/k heads, each q/k head serving consecutive value heads,
as ours: ``FLA_GROUPED_VERSION``), so q and k reach it with their own heads instead of repeated per value head
(Qwen3.5-397B: 64 value heads over 16 key heads, q and k 4x their bytes when repeated, saved for backward).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import weakref
from typing import Protocol

import torch

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule

FLA_DIST = "flash-linear-attention"
FLA_MIN_VERSION = (0, 4, 0)  # cu_seqlens and fp32 inputs (the module docstring)
FLA_GROUPED_VERSION = (0, 5, 0)  # grouped value heads taken by the kernel


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

    def __init__(self, chunk=None, grouped: bool | None = None) -> None:
        """``chunk``: the kernel (flash-linear-attention's, after checking its version, when None); ``grouped``:
        it takes q and k with their own heads (flash-linear-attention's from 0.5.0 when None; a given ``chunk``
        gets them repeated unless told)."""
        if chunk is None:
            version = check_fla_version()
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
            grouped = version >= FLA_GROUPED_VERSION if grouped is None else grouped
        self.chunk = chunk
        self.grouped = bool(grouped)
        # (weak reference to a micro-batch's ``starts``, its offsets); one per micro-batch still in flight
        self._offsets: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._rows: dict[tuple[int, int, str], torch.Tensor] = {}

    def __call__(self, q, k, v, g, beta, starts):
        batch, seq, v_heads = v.shape[:3]
        group = v_heads // q.shape[2]
        if group > 1 and not self.grouped:  # each key head serves consecutive value heads
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


def installed_fla_version() -> str | None:
    """flash-linear-attention's installed version (its distribution's metadata, else the package's
    ``__version__``), None where it is not installed."""
    try:
        return importlib.metadata.version(FLA_DIST)
    except importlib.metadata.PackageNotFoundError:
        if importlib.util.find_spec("fla") is None:
            return None
        import fla

        return str(getattr(fla, "__version__", "0"))


def check_fla_version() -> tuple[int, int, int]:
    """The installed flash-linear-attention's version as numbers; a UserError below ``FLA_MIN_VERSION``."""
    installed = installed_fla_version()
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", installed or "")
    version = tuple(int(part or 0) for part in match.groups()) if match else (0, 0, 0)
    if version < FLA_MIN_VERSION:
        floor = ".".join(map(str, FLA_MIN_VERSION))
        raise UserError(f"{FLA_DIST} {installed} is installed; the Gated DeltaNet layers need {floor} or newer "
                        f"on this device (older ones take no cu_seqlens or refuse fp32 inputs): "
                        f"pip install '{FLA_DIST}>={floor}' (or pip install -e '.[fla]'), or uninstall it to "
                        "run this project's plain-torch delta rule")
    return version


def delta_rule_kernel(device_type: str) -> DeltaRuleKernel:
    """flash-linear-attention's kernel on a CUDA device or an NPU where it is installed (refused below
    ``FLA_MIN_VERSION``), else ours."""
    if device_type in ("cuda", "npu") and importlib.util.find_spec("fla") is not None:
        return FlaDeltaRule()
    return TorchDeltaRule()
