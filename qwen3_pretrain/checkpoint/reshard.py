"""Reading a checkpoint saved under another layout: the parts of ``Checkpointer.load`` that map what a
checkpoint holds onto what this run's model and optimizer hold.

Checkpoints are saved by parameter name (DCP), so most of any (tp, pp, dp, cp) layout reads as it is. Two
things differ between layouts and are handled here: a tied head saved once, as the embedding, that a
pipeline's last stage holds as a parameter of its own (aliases: read it under the embedding's name), and
the vocabulary's padding rows, a multiple of tp (re-padded or trimmed: only the real rows are read).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

from qwen3_pretrain.models.qwen3.model import VOCAB_TENSORS


def aliased_keys(aliases: dict[str, str], part: str, ours: dict[str, Any], saved: set[str]) -> dict[str, str]:
    """{our key: the checkpoint's key to read it from} for keys of ``part`` ("model" or "optim") that
    the checkpoint lacks and an alias provides. Model keys are parameter names; flattened optimizer
    keys are ``state.<param>.<name>`` and ``param_groups.<param>.<name>``."""
    renamed = {}
    for key in ours:
        if f"{part}.{key}" in saved:
            continue
        for name, alias in aliases.items():
            if part == "model":
                other = alias if key == name else None
            else:
                kind, _, rest = key.partition(".")
                other = f"{kind}.{alias}{rest[len(name):]}" if rest.startswith(name + ".") else None
            if other is not None and f"{part}.{other}" in saved and other not in ours:
                renamed[key] = other
    return renamed


def repadded_vocab_rows(vocab_size: int | None, state: dict[str, dict[str, Any]],
                        saved: dict[str, Any]) -> dict[str, torch.Size]:
    """{flattened DCP key: our shape} of the vocabulary tensors (weights and their optimizer states)
    that the checkpoint holds with another number of padding rows, i.e. saved under another tp."""
    if vocab_size is None:
        return {}
    found = {}
    for part, entries in state.items():
        for key, value in entries.items():
            md = saved.get(f"{part}.{key}")
            if (isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata)
                    and md.size != value.shape and _is_vocab_tensor(part, key)
                    and md.size[1:] == value.shape[1:] and min(md.size[0], value.shape[0]) >= vocab_size):
                found[f"{part}.{key}"] = value.shape
    return found


class VocabRowsPlanner(DefaultLoadPlanner):
    """DCP's load planner for a checkpoint whose vocabulary tensors have another number of padding
    rows: of each such tensor it reads the first ``rows`` rows into ours, whatever our size and
    sharding, and nothing else. DCP reads the overlap of every saved chunk with every local one, so
    the saved entry is described to it as having our shape and chunks that end at ``rows``."""

    def __init__(self, shapes: dict[str, torch.Size], rows: int) -> None:
        super().__init__()
        self.shapes, self.rows = shapes, rows

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        entries = dict(metadata.state_dict_metadata)
        for key, shape in self.shapes.items():
            md = entries[key]
            chunks = [ChunkStorageMetadata(c.offsets, torch.Size((min(c.sizes[0], self.rows - c.offsets[0]),
                                                                   *c.sizes[1:])))
                      for c in md.chunks if c.offsets[0] < self.rows]
            entries[key] = TensorStorageMetadata(md.properties, shape, chunks)
        super().set_up_planner(state_dict, dataclasses.replace(metadata, state_dict_metadata=entries), is_coordinator)


def _is_vocab_tensor(part: str, key: str) -> bool:
    """Whether ``key`` of ``part`` is a VOCAB_TENSORS weight or (flattened ``state.<param>.<name>``)
    one of its optimizer states."""
    if part == "model":
        return key in VOCAB_TENSORS
    kind, _, rest = key.partition(".")
    return kind == "state" and any(rest.startswith(name + ".") for name in VOCAB_TENSORS)


def rename(state: dict[str, dict[str, Any]], renamed: dict[str, dict[str, str]], back: bool = False) -> None:
    """Move ``state[part][ours]`` to ``state[part][saved]`` for each ``renamed[part]`` entry (or back)."""
    for part, keys in renamed.items():
        for ours, saved in keys.items():
            src, dst = (saved, ours) if back else (ours, saved)
            state[part][dst] = state[part].pop(src)
