"""The on-disk layout of training checkpoints: ``output_path/step_<N>/`` and ``latest``, and the questions asked
of a folder of them (which exist, which is complete, which is newest, what a checkpoint's meta.json says).

    latest                 name of the newest complete checkpoint ("step_0000100")
    step_0000100/          .metadata + __<rank>_<n>.distcp (torch.distributed.checkpoint),
                           meta.json (step, model, layout, data position, config, format_version and
                           tensor_layout: versions.py), rng/rank_<r>.pt
    .tmp-step_0000200-save a checkpoint being written (ignored; removed by the next save)
    carried/               tensors of the starting HF checkpoint that are not trained (vision, MTP), as stored

``manager.py`` writes and reads them; ``merge.py`` reads them into a HuggingFace model.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from qwen3_pretrain.errors import MissingFileError, UserError

FORMAT = "qwen3-pretrain-checkpoint"
LATEST = "latest"
DCP_METADATA = ".metadata"
META_FILE = "meta.json"
# What the checkpoint training started from holds beyond the text model (a vision tower, an MTP layer), kept
# once per output_path for merge to write back unchanged.
CARRIED_DIR = "carried"
_STEP_DIR = re.compile(r"step_(\d+)")

log = logging.getLogger("qwen3_pretrain.checkpoint")


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path / 'meta.json'}: unreadable checkpoint metadata ({exc})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path / 'meta.json'}: not a {FORMAT} checkpoint")
    return meta


def list_checkpoints(root: Path) -> dict[int, Path]:
    """Step -> directory of each ``step_<N>`` directory, complete or not; unfinished saves' temp dirs are skipped."""
    found = {}
    for path in root.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def find_checkpoint(input_path: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint to merge: ``step_<step>``, else the one ``latest`` names, else the newest complete one."""
    root = Path(input_path)
    if not root.is_dir():
        raise MissingFileError(f"input_path {root}: no such directory; pass the training run's output_path "
                               f"(the directory holding {LATEST} and step_*/)")
    steps = list_checkpoints(root)
    if step is not None:
        if step not in steps:
            available = ", ".join(map(str, steps)) or "none"
            raise UserError(f"{root}: no checkpoint {step_dir_name(step)} for --step {step}; "
                            f"available steps: {available}")
        return steps[step]
    if not steps:
        raise UserError(f"{root}: no checkpoint in this directory (no step_* directory); is it the training "
                        "run's output_path, and did the run save (save_steps)?")
    named = _named_by_latest(root)
    if named is not None:
        return named
    for path in reversed(steps.values()):
        if problem(path) is None:
            return path
    newest = list(steps.values())[-1]
    raise UserError(f"{root}: no complete checkpoint; the newest, {newest.name}, is incomplete: {problem(newest)}")


def _named_by_latest(root: Path) -> Path | None:
    """The checkpoint ``latest`` names when it is complete; otherwise warn and return None."""
    latest = root / LATEST
    if not latest.is_file():
        log.warning("%s is missing; using the newest complete checkpoint", latest)
        return None
    named = root / latest.read_text(encoding="utf-8").strip()
    why = problem(named) if named.is_dir() else "no such directory"
    if why is None:
        return named
    log.warning("%s names %s, which is unusable (%s); using the newest complete checkpoint",
                latest, named.name, why)
    return None


def problem(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be merged, or None when it is complete."""
    try:
        check_complete(path)
    except (UserError, FileNotFoundError) as exc:
        return str(exc)
    return None


def check_complete(path: Path) -> Metadata:
    """The DCP metadata of checkpoint ``path`` after checking every file it needs is there in full."""
    for name in (DCP_METADATA, META_FILE):
        if not (path / name).is_file():
            raise MissingFileError(f"{path / name} is missing: checkpoint {path} is incomplete "
                                   "(interrupted save or copy); copy it again or choose another --step")
    metadata = read_dcp_metadata(path)
    for relative_path, needed in _bytes_needed(metadata).items():
        data_file = path / relative_path
        if not data_file.is_file():
            raise MissingFileError(f"{data_file} is missing: {path / DCP_METADATA} lists it; checkpoint {path} "
                                   "is incomplete; copy it again or choose another --step")
        size = data_file.stat().st_size
        if size < needed:
            raise UserError(f"{data_file} is truncated ({size} bytes, {path / DCP_METADATA} needs {needed}); "
                            f"checkpoint {path} is incomplete; copy it again or choose another --step")
    return metadata


def read_dcp_metadata(path: Path) -> Metadata:
    """The ``.metadata`` of a DCP checkpoint directory (tensor shapes, chunks and where their bytes are)."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # unpickling a damaged file can raise almost any exception type
        raise UserError(f"{path / DCP_METADATA}: not a readable checkpoint metadata file ({exc!r})") from None
    if not isinstance(metadata, Metadata) or metadata.storage_data is None:
        raise UserError(f"{path / DCP_METADATA}: not a torch.distributed.checkpoint metadata file")
    return metadata


def _bytes_needed(metadata: Metadata) -> dict[str, int]:
    """Data file -> the size it must have at least: the end of the last item stored in it."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed


def find_latest(output_path: str | os.PathLike) -> Path | None:
    """The checkpoint a run in ``output_path`` resumes from, or None when it has none yet."""
    root = Path(output_path)
    if not root.is_dir():
        return None
    for tmp in root.glob(".tmp-step_*"):
        log.warning("ignoring %s: a checkpoint that was being written when a run stopped", tmp)
    return find_checkpoint(root) if list_checkpoints(root) else None


