"""Writing a HuggingFace model directory: ``HFCheckpointWriter`` streams tensors into it by internal name,
``save_hf_model`` writes a whole model.

Saving holds one shard at a time and becomes visible only once complete (written
into a sibling temp directory, then renamed). The names, shapes and file names are
``hf_layout``'s; experts are written one tensor per expert, as the released
checkpoints hold them, and a Gated DeltaNet layer's regrouped rows go back to the
files' order.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.fsutil import write_json_atomic
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.hf_carried import Carried
from qwen3_pretrain.models.qwen3.hf_layout import (CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE, SINGLE_FILE,
                                                   _STACKED, expected_shapes, expert_hf_name, internal_to_hf,
                                                   regrouped_rows)
from qwen3_pretrain.models.qwen3.model import HEAD, Qwen3Model

_UMASK = os.umask(0o022)
os.umask(_UMASK)

_SAVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def parse_size(size: int | str) -> int:
    """Bytes from ``5_000_000``, ``"5GB"`` (10^9), ``"500MB"``, ``"2GiB"`` (2^30) or ``"100KB"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if not match:
            raise UserError(f"max_shard_size {size!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a byte count")
        unit = match.group(2) or "B"
        base = 1024 if "I" in unit else 1000
        value = int(float(match.group(1)) * base ** "BKMGT".index(unit[0]))
    if value < 1:
        raise UserError(f"max_shard_size must be positive, got {size!r}")
    return value


class HFCheckpointWriter:
    """Streams tensors into a HF directory, one shard in memory at a time.

    ``add`` each tensor of the model by internal name (any order), then
    ``finalize``; the head of a tied model is skipped, as HF stores it once,
    and anything else that does not belong to ``config`` is an error. Until
    ``finalize`` everything lives in a sibling temp directory, so ``path``
    holds either the previous model or the complete new one. Used as a
    context manager, an exception before ``finalize`` removes the temp files.

    ``carried``: a directory ``hf_carried.write_carried`` made from the checkpoint training started from; its
    tensors (a vision tower, an MTP layer) are written back as they were, and a multimodal source's layout
    and config.json are kept (the text model nested under ``model.language_model.``, the vision config).
    """

    def __init__(self, path: str | os.PathLike, config: Qwen3Config, dtype: torch.dtype = torch.bfloat16,
                 max_shard_size: int | str = "5GB", carried: str | os.PathLike | None = None,
                 mtp: bool = False) -> None:
        if dtype not in _SAVE_DTYPES:
            raise UserError(f"cannot save weights as {dtype}; use one of {', '.join(map(str, _SAVE_DTYPES))}")
        self.path = Path(path)
        self.config = config
        self.carried = Carried(carried) if carried is not None else None
        self.dtype = dtype
        self.max_shard_bytes = parse_size(max_shard_size)
        self._expected = expected_shapes(config, mtp)  # mtp: the model holds a trained MTP layer
        self._added: set[str] = set()
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._shards: list[list[str]] = []  # HF names per flushed shard
        self._total_bytes = 0
        self._extra_files: list[Path] = []
        _check_replaceable(self.path)  # fail before hours of merging, not after
        self.tmp_dir = self.path.parent / f"{self.path.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue tensor ``name`` (internal name) for writing; a full shard goes to disk first."""
        if name == HEAD and self.config.tie_word_embeddings:
            return  # a tied head is the embedding; HF stores it once
        if name not in self._expected:
            raise UserError(f"{name!r} ({internal_to_hf(name)}) is not a tensor of this model "
                            f"({self.config.num_hidden_layers} layers, {self.config.num_experts} experts, "
                            f"tied={self.config.tie_word_embeddings})")
        if name in self._added:
            raise UserError(f"tensor {name!r} was added twice")
        if tuple(tensor.shape) != self._expected[name]:
            raise UserError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(self._expected[name])} "
                            "from the model config")
        self._added.add(name)
        tensor = tensor.detach()
        if _STACKED.match(name):  # one tensor per expert, as the released checkpoints hold them
            for expert in range(tensor.shape[0]):
                self._queue(self._nested(expert_hf_name(name, expert)), tensor[expert])
        else:
            order = regrouped_rows(self.config, name)
            if order is not None:  # back to the files' order
                tensor = tensor.index_select(0, order.argsort().to(tensor.device))
            self._queue(self._nested(internal_to_hf(name)), tensor)

    def _nested(self, hf_name: str) -> str:
        return self.carried.nested(hf_name) if self.carried is not None else hf_name

    def _queue(self, hf_name: str, tensor: torch.Tensor, keep_dtype: bool = False) -> None:
        tensor = tensor.to("cpu", None if keep_dtype else self.dtype).contiguous()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # safetensors refuses views that share a storage
        if self._shard and self._shard_bytes + tensor.nbytes > self.max_shard_bytes:
            self._flush()
        self._shard[hf_name] = tensor
        self._shard_bytes += tensor.nbytes

    def add_file(self, source: str | os.PathLike) -> None:
        """Copy a side file (``tokenizer.json``, a ``generation_config.json``) into the directory at ``finalize``."""
        source = Path(source)
        if not source.is_file():
            raise MissingFileError(f"{source}: no such file to copy into {self.path}")
        if source.name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE) or source.name.startswith("model-"):
            raise UserError(f"{source}: would overwrite the model's own {source.name}; copy it separately")
        self._extra_files.append(source)

    def _flush(self) -> None:
        save_file(self._shard, str(self.tmp_dir / f"shard-{len(self._shards)}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._shard))
        self._total_bytes += self._shard_bytes
        self._shard, self._shard_bytes = {}, 0

    def finalize(self) -> Path:
        """Write the last shard, the index and the configs, then move the directory onto ``path``."""
        missing = [n for n in self._expected if n not in self._added]
        if missing:
            raise UserError(f"{self.path}: cannot finalize, {len(missing)} tensor(s) never added, "
                            f"first {missing[0]!r}")
        if self.carried is not None:  # as they were: names, dtypes, values
            for hf_name, tensor in self.carried.tensors():
                self._queue(hf_name, tensor, keep_dtype=True)
        if self._shard or not self._shards:
            self._flush()
        weight_map = self._name_shards()
        if len(self._shards) > 1:
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
            write_json_atomic(self.tmp_dir / INDEX_FILE, index)
        write_json_atomic(self.tmp_dir / CONFIG_FILE, self._hf_config())
        write_json_atomic(self.tmp_dir / GENERATION_CONFIG_FILE, {
            "bos_token_id": self.config.bos_token_id, "eos_token_id": self.config.eos_token_id})
        for source in self._extra_files:
            shutil.copyfile(source, self.tmp_dir / source.name)
        _replace_dir(self.tmp_dir, self.path)
        return self.path

    def _name_shards(self) -> dict[str, str]:
        """Rename the temp shards to HF's names; returns HF name -> file name."""
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        for k, names in enumerate(self._shards):
            file_name = SINGLE_FILE if count == 1 else f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.tmp_dir / f"shard-{k}.safetensors", self.tmp_dir / file_name)
            # safetensors creates its files owner-only; a model directory is meant to be shared.
            os.chmod(self.tmp_dir / file_name, 0o666 & ~_UMASK)
            weight_map.update(dict.fromkeys(names, file_name))
        return weight_map

    def _hf_config(self) -> dict:
        out = dataclasses.replace(self.config, torch_dtype=str(self.dtype).removeprefix("torch.")).to_hf_dict()
        out["dtype"] = out["torch_dtype"]  # transformers >= 5 reads "dtype", older versions "torch_dtype"
        return self.carried.config(out) if self.carried is not None else out

    def abort(self) -> None:
        """Drop everything written so far; ``path`` is left untouched."""
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> "HFCheckpointWriter":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()


def _check_replaceable(target: Path) -> None:
    """Only an empty directory or a previous model may be replaced, never unrelated files."""
    if not target.exists():
        return
    names = {p.name for p in target.iterdir()} if target.is_dir() else None
    if names is None or (names and not names & {CONFIG_FILE, SINGLE_FILE, INDEX_FILE}):
        raise UserError(f"{target} exists and is not a HuggingFace model directory; refusing to replace it "
                        "(choose another output path or remove it)")


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` onto ``target``; an existing model there is kept until the new one is in place."""
    _check_replaceable(target)
    if not target.exists():
        os.replace(new, target)
        return
    old = target.parent / f"{target.name}.old-{os.getpid()}"
    os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old)


def save_hf_model(model: Qwen3Model, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                  max_shard_size: int | str = "5GB", extra_files: Iterable[str | os.PathLike] = ()) -> Path:
    """Write ``model`` as a HF directory loadable by ``transformers.AutoModelForCausalLM``.

    ``extra_files`` (e.g. the tokenizer's files) are copied alongside.
    """
    with HFCheckpointWriter(path, model.config, dtype, max_shard_size, mtp=model.mtp is not None) as writer:
        for name, param in model.named_parameters():
            writer.add(name, param)
        for source in extra_files:
            writer.add_file(source)
        return writer.finalize()
