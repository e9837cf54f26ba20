"""Sharded training checkpoints: the one module that writes and reads ``output_path/step_<N>/``.

Layout of ``output_path``::

    latest                 name of the newest complete checkpoint ("step_0000100")
    step_0000100/          .metadata + __<rank>_<n>.distcp (torch.distributed.checkpoint),
                           meta.json (step, model, layout, data position, config), rng/rank_<r>.pt
    .tmp-step_0000200-save a checkpoint being written (ignored; removed by the next save)

A checkpoint is written under its temporary name by every rank, then rank 0
adds ``meta.json`` and publishes it with one atomic rename, and only then
replaces ``latest``. A run killed at any moment therefore leaves ``latest``
naming a complete checkpoint. Model and optimizer states are saved by
parameter name (DCP), so a checkpoint resumes under any other (tp, pp, dp);
the vocabulary rows, padded to a multiple of tp, are re-padded or trimmed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.fsutil import write_json_atomic, write_text_atomic

log = logging.getLogger("qwen3_pretrain.checkpoint")

FORMAT = "qwen3-pretrain-checkpoint"
LATEST = "latest"
DCP_METADATA = ".metadata"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"step_(\d+)")
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Parameters whose dim 0 is the vocabulary padded to a multiple of tp; rows past vocab_size are zero.
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")


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
        if _problem(path) is None:
            return path
    newest = list(steps.values())[-1]
    raise UserError(f"{root}: no complete checkpoint; the newest, {newest.name}, is incomplete: {_problem(newest)}")


def _named_by_latest(root: Path) -> Path | None:
    """The checkpoint ``latest`` names when it is complete; otherwise warn and return None."""
    latest = root / LATEST
    if not latest.is_file():
        log.warning("%s is missing; using the newest complete checkpoint", latest)
        return None
    named = root / latest.read_text(encoding="utf-8").strip()
    problem = _problem(named) if named.is_dir() else "no such directory"
    if problem is None:
        return named
    log.warning("%s names %s, which is unusable (%s); using the newest complete checkpoint",
                latest, named.name, problem)
    return None


def _problem(path: Path) -> str | None:
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


class Checkpointer:
    """Saves and restores model parts + optimizers + trainer metadata with torch.distributed.checkpoint."""

    def __init__(self, output_path: str | os.PathLike, parts: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer], keep_last_n: int = 3, async_save: bool = False,
                 aliases: dict[str, str] | None = None, vocab_size: int | None = None) -> None:
        self.root = Path(output_path)
        self.parts, self.optimizers = parts, optimizers
        # parameter name -> the one whose weight and optimizer state stand in when a checkpoint has none
        # for it (a tied head of its own under pp > 1, resumed from one stage where it is the embedding)
        self.aliases = aliases or {}
        # the real vocabulary: a checkpoint saved under another tp pads the VOCAB_TENSORS' rows to
        # another size, and only these rows are carried over
        self.vocab_size = vocab_size
        self.keep_last_n = keep_last_n
        self.async_save = async_save
        # An asynchronous save runs DCP's collectives in a background thread while training goes on:
        # on a group of their own, so they never interleave with the training's (collective: every rank
        # builds its Checkpointer at the same point). The group takes the default group's backends: its
        # object collectives run on the CPU one (gloo), and a device bound at init needs one of its own.
        self._async_group = dist.new_group() if async_save else None
        self._pending: tuple[Any, Path, Path, dict] | None = None

    # --- state ----------------------------------------------------------------------

    def _part_state_dicts(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [(get_model_state_dict(part), get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS))
                for part, opt in zip(self.parts, self.optimizers)]

    @staticmethod
    def _merge(per_part: list[tuple[dict, dict]]) -> dict[str, Any]:
        """One state dict for DCP; parameter names are unique across the parts of a rank."""
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for m, o in per_part:
            model.update(m)
            optim.update(o)
        return {"model": model, "optim": optim}

    def _state_dict(self) -> dict[str, Any]:
        return self._merge(self._part_state_dicts())

    # --- save -----------------------------------------------------------------------

    def save(self, step: int, meta: dict[str, Any]) -> None:
        """Write checkpoint ``step`` (collective: every rank calls it)."""
        self.wait()
        rank = dist.get_rank()
        tmp = self.root / f".tmp-{step_dir_name(step)}-save"
        final = self.root / step_dir_name(step)
        # Each step a rank takes on its own is agreed on before the next collective one: a rank that
        # failed alone would otherwise leave the others waiting in DCP's collectives until the timeout.
        what = f"saving checkpoint {tmp}"
        self._agree(what, _attempt(lambda: _fresh_dir(tmp)) if rank == 0 else None)
        rng = {"cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        self._agree(what, _attempt(lambda: torch.save(rng, tmp / "rng" / f"rank_{rank:05d}.pt")))
        start = time.perf_counter()
        meta = dict(meta, format=FORMAT, format_version=1, step=step,
                    created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        if self.async_save:
            future = dcp.async_save(self._state_dict(), checkpoint_id=str(tmp), process_group=self._async_group)
            self._pending = (future, tmp, final, dict(meta, _start=start))
            return
        self._run_collective_io(lambda: dcp.save(self._state_dict(), checkpoint_id=str(tmp)), tmp)
        self._publish(tmp, final, meta, start)

    def wait(self) -> None:
        """Finish a pending asynchronous save (collective)."""
        if self._pending is None:
            return
        future, tmp, final, meta = self._pending
        self._pending = None
        self._run_collective_io(future.result, tmp)
        self._publish(tmp, final, meta, meta.pop("_start"))

    def _run_collective_io(self, fn, tmp: Path) -> None:
        try:
            fn()
        except CheckpointException as exc:  # raised on every rank, with each failing rank's own exception
            failures = {rank: _failure(error, stack) for rank, (error, stack) in exc.failures.items()}
            _raise_failures(f"saving checkpoint {tmp}", failures, self.root, exc)

    def _agree(self, what: str, error: Exception | None) -> None:
        """Collective: raise on every rank when ``what`` failed on any, naming each failing rank's cause."""
        reports: list[Failure | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, None if error is None else _failure(error))
        failures = {rank: report for rank, report in enumerate(reports) if report is not None}
        if error is not None and not _failure(error)[0]:
            raise error  # a bug on this rank: its own traceback
        if failures:
            _raise_failures(what, failures, self.root)

    def _publish(self, tmp: Path, final: Path, meta: dict, start: float) -> None:
        """Rank 0 renames the finished temp dir into place and updates ``latest``; all ranks agree on success."""
        def publish() -> None:
            write_json_atomic(tmp / META_FILE, meta, indent=1)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_atomic(self.root / LATEST, final.name + "\n")
            self._prune()

        self._agree(f"publishing checkpoint {final}", _attempt(publish) if dist.get_rank() == 0 else None)
        if dist.get_rank() == 0:
            size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
            secs = time.perf_counter() - start
            log.info("saved checkpoint %s (%.1f MB in %.1f s, %.0f MB/s)", final, size / 1e6, secs,
                     size / 1e6 / max(secs, 1e-9))

    def _prune(self) -> None:
        if self.keep_last_n <= 0:
            return
        done = [p for p in list_checkpoints(self.root).values() if _problem(p) is None]
        for old in done[: -self.keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)

    # --- load -----------------------------------------------------------------------

    def _aliased_keys(self, part: str, ours: dict[str, Any], saved: set[str]) -> dict[str, str]:
        """{our key: the checkpoint's key to read it from} for keys of ``part`` ("model" or "optim") that
        the checkpoint lacks and an alias provides. Model keys are parameter names; flattened optimizer
        keys are ``state.<param>.<name>`` and ``param_groups.<param>.<name>``."""
        renamed = {}
        for key in ours:
            if f"{part}.{key}" in saved:
                continue
            for name, alias in self.aliases.items():
                if part == "model":
                    other = alias if key == name else None
                else:
                    kind, _, rest = key.partition(".")
                    other = f"{kind}.{alias}{rest[len(name):]}" if rest.startswith(name + ".") else None
                if other is not None and f"{part}.{other}" in saved and other not in ours:
                    renamed[key] = other
        return renamed

    def _repadded_vocab_rows(self, state: dict[str, dict[str, Any]], saved: dict[str, Any]) -> dict[str, torch.Size]:
        """{flattened DCP key: our shape} of the vocabulary tensors (weights and their optimizer states)
        that the checkpoint holds with another number of padding rows, i.e. saved under another tp."""
        if self.vocab_size is None:
            return {}
        found = {}
        for part, entries in state.items():
            for key, value in entries.items():
                md = saved.get(f"{part}.{key}")
                if (isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata)
                        and md.size != value.shape and _is_vocab_tensor(part, key)
                        and md.size[1:] == value.shape[1:] and min(md.size[0], value.shape[0]) >= self.vocab_size):
                    found[f"{part}.{key}"] = value.shape
        return found

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model and optimizer from ``path`` (any layout); return its meta.json."""
        meta = read_meta(path)
        per_part = self._part_state_dicts()
        state = self._merge(per_part)
        saved = read_dcp_metadata(path).state_dict_metadata
        renamed = {part: self._aliased_keys(part, state[part], set(saved)) for part in ("model", "optim")}
        _rename(state, renamed)  # read those entries under the checkpoint's names ...
        repadded = self._repadded_vocab_rows(state, saved)
        for key in repadded:  # the planner writes the real rows only: padding rows stay zero, as in a fresh run
            part, _, name = key.partition(".")
            with torch.no_grad():
                state[part][name].zero_()
        planner = _VocabRowsPlanner(repadded, self.vocab_size) if repadded else None
        try:
            dcp.load(state, checkpoint_id=str(path), planner=planner)
        except (Exception, CheckpointException) as exc:
            raise UserError(f"loading checkpoint {path} failed: {_root_cause(exc)}") from None
        _rename(state, renamed, back=True)  # ... and give them ours again
        # DCP fills tensors in place but replaces other values (optimizer hyper-parameters) in the
        # merged dict: give each part its own keys back from there.
        for part, opt, (m, o) in zip(self.parts, self.optimizers, per_part):
            set_model_state_dict(part, {k: state["model"][k] for k in m})
            set_optimizer_state_dict(part, opt, {k: state["optim"][k] for k in o}, options=_OPTIM_OPTIONS)
        rng = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
        if rng.is_file() and meta.get("layout", {}).get("world") == dist.get_world_size():
            saved = torch.load(rng, weights_only=False)
            torch.set_rng_state(saved["cpu"])
            if saved.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(saved["cuda"])
        return meta


class _VocabRowsPlanner(DefaultLoadPlanner):
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


def _rename(state: dict[str, dict[str, Any]], renamed: dict[str, dict[str, str]], back: bool = False) -> None:
    """Move ``state[part][ours]`` to ``state[part][saved]`` for each ``renamed[part]`` entry (or back)."""
    for part, keys in renamed.items():
        for ours, saved in keys.items():
            src, dst = (saved, ours) if back else (ours, saved)
            state[part][dst] = state[part].pop(src)


def _fresh_dir(tmp: Path) -> None:
    """``tmp`` emptied of what an interrupted save of the same step left, with its ``rng`` folder."""
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "rng").mkdir(parents=True)


def _attempt(fn) -> BaseException | None:
    """Run ``fn``; return what it raised (reported by ``_agree`` on every rank) instead of raising it."""
    try:
        fn()
    except Exception as exc:
        return exc
    return None


# (a storage failure?, its description): one line for a failure to write (a full disk, a quota, a file-size
# limit, permissions: the user's to fix); the traceback for anything else (a bug, whose cause is in there)
Failure = tuple[bool, str]
# torch's file writers: a short write surfaces from them as a RuntimeError ("unexpected pos"), not an OSError
_WRITERS = (os.path.join("torch", "serialization.py"), os.path.join("torch", "distributed", "checkpoint", "filesystem.py"))


def _failure(error: BaseException, stack: traceback.StackSummary | None = None) -> Failure:
    stack = stack if stack is not None else traceback.extract_tb(error.__traceback__)
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    if isinstance(error, OSError) or (stack and stack[-1].filename.endswith(_WRITERS)):
        return True, text.splitlines()[0]
    return False, "".join(traceback.format_list(stack)) + text


def _raise_failures(what: str, failures: dict[int, Failure], root: Path, cause: BaseException | None = None) -> None:
    """A UserError naming every failing rank and its cause when all are storage failures; otherwise a
    RuntimeError (chained to ``cause``) carrying each rank's traceback."""
    ranks = sorted(failures)
    if all(storage for storage, _ in failures.values()):
        listed = "; ".join(f"rank {rank}: {failures[rank][1]}" for rank in ranks)
        raise UserError(f"{what} failed: {listed}; check free space, quotas and permissions under {root}; "
                        f"the previous checkpoint is intact ({root / LATEST})")
    listed = "\n".join(f"rank {rank}:\n{failures[rank][1]}" for rank in ranks)
    raise RuntimeError(f"{what} failed:\n{listed}") from cause


def _root_cause(exc: BaseException) -> str:
    """Each failing rank's exception of a DCP failure (else the exception itself), one line each."""
    failures = exc.failures if isinstance(exc, CheckpointException) else {None: (exc, None)}
    lines = ["".join(traceback.format_exception_only(type(error), error)).strip().splitlines()[-1]
             for error, _ in failures.values()]
    return "; ".join(line if rank is None else f"rank {rank}: {line}" for rank, line in zip(failures, lines))
