"""Checkpoint format versions: what a training checkpoint's saved tensors mean, recorded in every checkpoint and
checked (converted or refused) on every read.

Two numbers in meta.json. ``format_version`` is the container's (DCP files, meta.json's keys, ``rng/``).
``tensor_layout`` is ``{"family": ..., "version": N}``: the layout of the saved tensors of that model family,
what each row of each tensor is. The families are ``dense``, ``moe``, ``hybrid`` and ``hybrid_moe``, read off
the parameter names (``family``), so that a change to one family's tensors moves only its counter. A change
to how any saved tensor is laid out (a row order, a stacking, a split, a fused projection) bumps the version
of every family holding that tensor, and adds here either a conversion from the previous version (``CHANGES``)
or nothing, in which case reading an older checkpoint is refused with a message naming both versions.

The history (docs/checkpoints.md, "Format versions"):

* ``dense`` 1, ``moe`` 1: every layout since checkpoints were first written (the HF files' row order; a MoE
  layer's experts stacked per projection, [experts, out, in]).
* ``hybrid`` / ``hybrid_moe`` 1: the Gated DeltaNet layers as first written, their [q | k | v] channels (the
  rows of ``conv1d.weight`` and of Qwen3.5's ``in_proj_qkv.weight``) in the HF files' order, q of all key
  heads, then k, then v.
* ``hybrid`` / ``hybrid_moe`` 2: those rows grouped per key head (its q, its k, its value heads' v), so that
  tensor parallelism splits them by heads with plain row shards (models/qwen3/gated_deltanet.py
  ``hf_row_order``). Converted from 1 on read: each such row ``i`` of version 2 is row ``hf_row_order[i]`` of
  version 1, for the weight and for each of its optimizer states. (Qwen3-Next's fused ``in_proj_qkvz`` was
  grouped per key head in both.)

A checkpoint without ``tensor_layout`` was written before the layout was recorded: it is read as version 1 of
its family. For a hybrid that is right for checkpoints written before the regrouping and wrong for those
written between the regrouping and the recording (a few hours of the project's history, said in the docs);
such a checkpoint is marked by adding ``"tensor_layout": {"family": "hybrid", "version": 2}`` to its meta.json.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.gated_deltanet import hf_row_order

log = logging.getLogger("qwen3_pretrain.checkpoint")

# The container's version (meta.json's keys, DCP, rng/): unchanged since checkpoints were first written.
FORMAT_VERSION = 1
LAYOUT_KEY = "tensor_layout"
# Each family's current layout version: bumped with every change to how one of its saved tensors is laid out.
LAYOUT_VERSIONS = {"dense": 1, "moe": 1, "hybrid": 2, "hybrid_moe": 2}
# The version a checkpoint that records none is read as (written before versions were recorded): for the
# hybrids, the layout the code wrote last before recording began (54ac416 onwards), and the longer-lived one;
# a checkpoint of the earlier layout 1 must say so in its meta.json (docs/checkpoints.md 'Format versions').
UNRECORDED = {"dense": 1, "moe": 1, "hybrid": 2, "hybrid_moe": 2}

# When hybrid layout 2 came in (commit 54ac416), for the message that tells how to mark a layout-1 checkpoint.
REGROUPED_AT = "2026-12-05 21:18 UTC"
# A Gated DeltaNet layer's tensors whose rows version 2 regrouped per key head (the MTP layer has none).
_REGROUPED = ("linear_attn.conv1d.weight", "linear_attn.in_proj_qkv.weight")


def family(names: Iterable[str]) -> str:
    """The model family of a model with these parameter names (a checkpoint's or a model's, any prefix), or
    of a model whose parts (pipeline stages) have these families."""
    names = list(names)
    hybrid = any(".linear_attn." in name or name.startswith("hybrid") for name in names)
    moe = any(".mlp.experts." in name or name.endswith((".mlp.gate.weight", "moe")) for name in names)
    return ("hybrid" if hybrid else "") + ("_" if hybrid and moe else "") + ("moe" if moe else "") or "dense"


def layout_record(names: Iterable[str]) -> dict[str, Any]:
    """meta.json's ``tensor_layout`` for a checkpoint of a model with these parameter names (or its parts'
    families)."""
    fam = family(names)
    return {"family": fam, "version": LAYOUT_VERSIONS[fam]}


@dataclasses.dataclass(frozen=True)
class Change:
    """One layout change of a family: from ``version`` to ``version + 1``. ``applies(name)``: whether a
    parameter's tensor (and its optimizer states) changed; ``convert(config, name, full tensor)`` -> the
    tensor in the new layout."""

    families: tuple[str, ...]
    version: int
    applies: Callable[[str], bool]
    convert: Callable[[Qwen3Config, str, torch.Tensor], torch.Tensor]


def _regroup_per_key_head(config: Qwen3Config, name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.index_select(0, hf_row_order(config).to(tensor.device))


def _ungroup(config: Qwen3Config, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_regroup_per_key_head``: version 2's rows back in version 1's order (the tests write
    old checkpoints with it)."""
    return tensor.index_select(0, hf_row_order(config).argsort().to(tensor.device))


CHANGES = [Change(("hybrid", "hybrid_moe"), 1, lambda name: name.endswith(_REGROUPED), _regroup_per_key_head)]
# For the tests: each change's inverse, by (family, version it starts from).
INVERSES = {("hybrid", 1): _ungroup, ("hybrid_moe", 1): _ungroup}


@dataclasses.dataclass
class Conversion:
    """The changes a checkpoint's tensors go through to today's layout (none when already current)."""

    family: str
    saved: int
    changes: list[Change]
    config: Qwen3Config | None

    def applies(self, name: str) -> bool:
        return any(change.applies(name) for change in self.changes)

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        for change in self.changes:
            if change.applies(name):
                tensor = change.convert(self.config, name, tensor)
        return tensor

    @property
    def needed(self) -> bool:
        return bool(self.changes)


def saved_layout(meta: dict[str, Any], saved_names: Iterable[str], path: Path) -> tuple[str, int]:
    """(family, version) of the tensors of checkpoint ``path`` (its meta.json, its saved parameter names)."""
    where = path / "meta.json"
    found = family(saved_names)
    record = meta.get(LAYOUT_KEY)
    if record is None:
        if found.startswith("hybrid"):
            log.warning("checkpoint %s records no %s: read as %s layout version %d (the Gated DeltaNet's rows "
                        "grouped per key head, as written from %s on); if it was written before, add \"%s\": "
                        "{\"family\": \"%s\", \"version\": 1} to %s so that its rows are converted",
                        path, LAYOUT_KEY, found, UNRECORDED[found], REGROUPED_AT, LAYOUT_KEY, found, where)
        return found, UNRECORDED[found]
    if not isinstance(record, dict) or not isinstance(record.get("version"), int) or record.get("family") is None:
        raise UserError(f"{where}: {LAYOUT_KEY} {record!r} is not {{'family': ..., 'version': <int>}}")
    if record["family"] != found:
        raise UserError(f"{where}: {LAYOUT_KEY} names family {record['family']!r}, but the checkpoint's tensors "
                        f"are a {found} model's; the checkpoint's meta.json was edited or copied from another")
    return found, record["version"]


def conversion(meta: dict[str, Any], saved_names: Iterable[str], path: Path) -> Conversion:
    """What reading checkpoint ``path`` with today's layouts takes; refused (UserError, naming both versions
    and what to do) where no conversion exists."""
    fam, saved = saved_layout(meta, saved_names, path)
    current = LAYOUT_VERSIONS[fam]
    where = path / "meta.json"
    if saved > current:
        raise UserError(f"checkpoint {path}: its {fam} tensor layout is version {saved} ({where}: {LAYOUT_KEY}), "
                        f"newer than this qwen3-pretrain reads (version {current}); read it with the version "
                        "of qwen3-pretrain that wrote it (or a newer one), e.g. merge it to a HF model there")
    changes = []
    for version in range(saved, current):
        change = next((c for c in CHANGES if fam in c.families and c.version == version), None)
        if change is None:
            raise UserError(f"checkpoint {path}: its {fam} tensor layout is version {saved}, this qwen3-pretrain's "
                            f"is version {current}, and no conversion from version {version} exists; merge it "
                            "to a HF model with the qwen3-pretrain version that wrote it and start from that")
        changes.append(change)
    config = None
    if changes:
        if not isinstance(meta.get("model_config"), dict):
            raise UserError(f"checkpoint {path}: converting its {fam} tensor layout from version {saved} to "
                            f"{current} needs the model's sizes, and {where} has no model_config")
        config = Qwen3Config.from_hf_dict(meta["model_config"], source=f"{where}: model_config")
    return Conversion(fam, saved, changes, config)
