"""Sharded training checkpoints: saving, publishing and loading ``output_path/step_<N>/`` (``layout.py`` says
what is on disk; ``reshard.py`` reads a checkpoint of another layout).

A checkpoint is written under its temporary name by every rank, then rank 0
adds ``meta.json`` and publishes it with one atomic rename, and only then
replaces ``latest``. A run killed at any moment therefore leaves ``latest``
naming a complete checkpoint. Model and optimizer states are saved by
parameter name (DCP), so a checkpoint resumes under any other (tp, pp, dp);
the vocabulary rows, padded to a multiple of tp, are re-padded or trimmed. Every checkpoint records the
layout version of its model family's saved tensors (``versions.py``); one of an older layout is converted on
load, one this code cannot read refused before anything is read.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # the share DCP reads

from qwen3_pretrain.checkpoint.layout import (FORMAT, LATEST, META_FILE, list_checkpoints, problem,
                                              read_dcp_metadata, read_meta, step_dir_name)
from qwen3_pretrain.checkpoint.reshard import VocabRowsPlanner, aliased_keys, rename, repadded_vocab_rows
from qwen3_pretrain.checkpoint.versions import (FORMAT_VERSION, LAYOUT_KEY, Conversion, conversion, family,
                                                layout_record)
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.fsutil import write_json_atomic, write_text_atomic
from qwen3_pretrain.models.ops.moe import EXPERT_BIAS

log = logging.getLogger("qwen3_pretrain.checkpoint")

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Checkpointer:
    """Saves and restores model parts + optimizers + trainer metadata with torch.distributed.checkpoint."""

    def __init__(self, output_path: str | os.PathLike, parts: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer], keep_last_n: int = 3, async_save: bool = False,
                 aliases: dict[str, str] | None = None, vocab_size: int | None = None,
                 record: Callable[[dict[str, Any]], None] | None = None) -> None:
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
        # called on every rank with each published save's figures (the trainer's metrics writer, where the
        # rank has one): this rank's time in save and what training waited for
        self.record = record
        # An asynchronous save runs DCP's collectives in a background thread while training goes on:
        # on a group of their own, so they never interleave with the training's (collective: every rank
        # builds its Checkpointer at the same point). gloo alone: DCP's collectives are on CPU objects, and
        # the default group's device library would make a communicator here that nothing uses. (A group of
        # gloo alone is possible because the process group is bound to a device only where the device's
        # library is NCCL, which gloo also registers for: parallel/env.py.)
        self._async_group = dist.new_group(backend="gloo") if async_save else None
        self._stager = _stager(parts) if async_save else None
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
        if rank == 0:  # a large save takes a while: say so when it starts, not only when it is done
            log.info("saving checkpoint %s%s ...", final, " in the background" if self.async_save else "")
        self._agree(what, _attempt(lambda: _fresh_dir(tmp)) if rank == 0 else None)
        rng = {"cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        self._agree(what, _attempt(lambda: torch.save(rng, tmp / "rng" / f"rank_{rank:05d}.pt")))
        start = time.perf_counter()
        state = self._state_dict()
        meta = dict(meta, format=FORMAT, format_version=FORMAT_VERSION, **{LAYOUT_KEY: self._layout(state)},
                    step=step, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group,
                                    async_stager=self._stager)
            # what training waited for: the state's copy into host memory (the write runs in the background)
            self._pending = (future, tmp, final, dict(meta, _start=start, _blocked=time.perf_counter() - start))
            return
        self._run_collective_io(lambda: dcp.save(state, checkpoint_id=str(tmp)), tmp)
        self._publish(tmp, final, meta, start)

    @staticmethod
    def _layout(state: dict[str, Any]) -> dict[str, Any]:
        """meta.json's tensor layout record (checkpoint/versions.py), of the whole model: a pipeline stage
        holds some of its layers only, so every rank's family counts (collective)."""
        families: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(families, family(state["model"]))  # a word per rank, not its names
        return layout_record(families)

    def wait(self) -> None:
        """Finish a pending asynchronous save (collective)."""
        if self._pending is None:
            return
        future, tmp, final, meta = self._pending
        self._pending = None
        self._run_collective_io(future.result, tmp)
        blocked = meta.pop("_blocked")
        self._publish(tmp, final, meta, meta.pop("_start"), blocked)

    def close(self) -> None:
        """Free the host memory asynchronous saves stage into (a save still being written keeps its own)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

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

    def _publish(self, tmp: Path, final: Path, meta: dict, start: float, blocked: float | None = None) -> None:
        """Rank 0 renames the finished temp dir into place and updates ``latest``; all ranks agree on success."""
        def publish() -> None:
            write_json_atomic(tmp / META_FILE, meta, indent=1)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_atomic(self.root / LATEST, final.name + "\n")
            self._prune()

        self._agree(f"publishing checkpoint {final}", _attempt(publish) if dist.get_rank() == 0 else None)
        secs = time.perf_counter() - start
        if self.record is not None:
            # an asynchronous save's whole time ran beside training; the copy to host memory held it up
            figures = {"save_s": secs} if blocked is None else {"save_s": secs, "training_waited_s": blocked}
            self.record({"event": "checkpoint", "step": meta["step"], "path": final.name, **figures})
        if dist.get_rank() == 0:
            size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
            waited = "" if blocked is None else f"; training waited {blocked:.2f} s for the copy to host memory"
            log.info("saved checkpoint %s (%.1f MB in %.1f s, %.0f MB/s%s)", final, size / 1e6, secs,
                     size / 1e6 / max(secs, 1e-9), waited)

    def _prune(self) -> None:
        if self.keep_last_n <= 0:
            return
        done = [p for p in list_checkpoints(self.root).values() if problem(p) is None]
        for old in done[: -self.keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("removed checkpoint %s (keep_last_n: %d)", old, self.keep_last_n)

    # --- load -----------------------------------------------------------------------

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model and optimizer from ``path`` (any layout); return its meta.json."""
        meta = read_meta(path)
        per_part = self._part_state_dicts()
        state = self._merge(per_part)
        metadata = read_dcp_metadata(path)
        saved = metadata.state_dict_metadata
        # refused here, before anything is read, when the saved tensors' layout has no way to today's
        convert = conversion(meta, (key for key in saved if key.startswith("model.")), path)
        renamed = {part: aliased_keys(self.aliases, part, state[part], set(saved)) for part in ("model", "optim")}
        rename(state, renamed)  # read those entries under the checkpoint's names ...
        repadded = repadded_vocab_rows(self.vocab_size, state, saved)
        for key in repadded:  # the planner writes the real rows only: padding rows stay zero, as in a fresh run
            part, _, name = key.partition(".")
            with torch.no_grad():
                state[part][name].zero_()
        planner = VocabRowsPlanner(repadded, self.vocab_size) if repadded else None
        # aux-loss-free balancing turned on at this resume: its biases, which the checkpoint lacks, start at zero
        new = [k for k in state["model"] if k.rpartition(".")[2] == EXPERT_BIAS and f"model.{k}" not in saved]
        if new:
            log.info("checkpoint %s holds no MoE expert biases (moe_bias_update_rate was 0): they start at zero", path)
        loaded = {"model": {k: v for k, v in state["model"].items() if k not in new}, "optim": state["optim"]}
        try:
            dcp.load(loaded if new else state, checkpoint_id=str(path), planner=planner)
        except (Exception, CheckpointException) as exc:
            raise UserError(f"loading checkpoint {path} failed: {_root_cause(exc)}") from None
        rename(state, renamed, back=True)  # ... and give them ours again
        if convert.needed:
            _convert(path, metadata, state, convert)
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


def _convert(path: Path, metadata, state: dict[str, Any], convert: Conversion) -> None:
    """Give the tensors a layout change touched (weights and their optimizer states) today's layout: each is
    read whole from the checkpoint on this rank alone (no collective, so pipeline stages holding other layers
    need not take part), converted, and this rank's share of it copied in, the share DCP itself reads."""
    from qwen3_pretrain.checkpoint.merge import DCPTensorReader  # merge reads a tensor without a process group

    reader = DCPTensorReader(path, metadata)
    log.info("converting checkpoint %s from %s tensor layout %d to %d", path, convert.family, convert.saved,
             convert.saved + len(convert.changes))
    for part, entries in state.items():
        for key, target in entries.items():
            name = key if part == "model" else _state_param(key)
            if name is None or not isinstance(target, torch.Tensor) or not convert.applies(name):
                continue
            param = state["model"].get(name)
            if param is None or tuple(target.shape) != tuple(param.shape):
                continue  # a state of another shape than its parameter's (AdamW's step count) has no rows
            full = convert(name, reader.read(f"{part}.{key}"))
            with torch.no_grad():
                if isinstance(target, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh,
                                                                          target.placements)
                    box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                    target.to_local().copy_(full[box])
                else:
                    target.copy_(full)


def _state_param(key: str) -> str | None:
    """The parameter of a flattened optimizer key holding a tensor per parameter (``state.<param>.<name>``)."""
    kind, _, rest = key.partition(".")
    return rest.rpartition(".")[0] if kind == "state" else None


def _stager(parts: list[nn.Module]) -> DefaultStager:
    """Where an asynchronous save copies the state before writing it: host memory allocated at the first save
    and reused by every later one (DCP's default allocates it afresh each time), page-locked where the
    parameters are on a CUDA device, so that the copy is one DMA per tensor and a single wait (DCP pins with
    CUDA's host registration only: an NPU's or a CPU's run stages into ordinary memory, a CPU-to-CPU copy)."""
    device = next((p.device for part in parts for p in part.parameters()), torch.device("cpu"))
    pinned = device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=pinned))


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
