"""Merge a sharded training checkpoint into one HuggingFace model directory.

    qwen3-pretrain merge --input_path runs/pretrain --output_path qwen3-8b-hf --model_name qwen3-8b

Runs in one CPU process without a process group, whatever (tp, pp, dp) wrote
the checkpoint: torch.distributed.checkpoint (DCP) records every tensor as
chunks with their offsets, so each full tensor is assembled from the chunks
that overlap it, reading only their bytes. Tensors go one at a time from the
checkpoint to the HF writer, so memory holds one output shard plus the largest
tensor twice (its saved fp32 chunk and its converted copy), not the model; the
optimizer state in the same files is never read.

Training pads the embedding and the head to a multiple of ``tp`` rows; the
padding rows are dropped here. A checkpoint of an older tensor layout is converted
tensor by tensor on the way (checkpoint/versions.py), or refused before anything is written. A tied head is stored once, as the embedding,
by a one-stage run; a pipelined run keeps it on the last stage as its own
(identical) parameter, which is not read: HF stores a tied model's head once.
"""

from __future__ import annotations

import argparse
import logging
import os

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from tqdm import tqdm

from qwen3_pretrain.checkpoint.layout import DCP_METADATA, META_FILE, check_complete, find_checkpoint, read_meta
from qwen3_pretrain.checkpoint.versions import conversion
from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.models.ops.moe import EXPERT_BIAS
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.hf_io import HFCheckpointWriter, expected_shapes, parse_size
from qwen3_pretrain.models.qwen3.model import HEAD, MTP_PREFIX, VOCAB_TENSORS

log = logging.getLogger("qwen3_pretrain.checkpoint")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# What a HF tokenizer directory may hold; tokenizer.json alone is enough for transformers' fast tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "tokenizer.model")
_MODEL_PREFIX = "model."  # training saves {"model": ..., "optim": ...}; DCP flattens the keys with a dot


@dataclass
class MergeResult:
    """What one merge did, for the summary line."""

    checkpoint: Path
    output_path: Path
    num_tensors: int
    num_bytes: int
    seconds: float
    dtype: torch.dtype

    def summary(self) -> str:
        mb = self.num_bytes / 1e6
        return (f"merged {self.checkpoint} -> {self.output_path}: {self.num_tensors} tensors, {mb:.1f} MB "
                f"{str(self.dtype).removeprefix('torch.')}, {self.seconds:.1f} s, "
                f"{mb / max(self.seconds, 1e-9):.1f} MB/s")


# --- choosing and checking the checkpoint -------------------------------------------------


# --- what the checkpoint holds --------------------------------------------------------------


def check_model_name(meta: dict[str, Any], model_name: str, checkpoint: Path) -> None:
    """``--model_name`` must name the model that was trained (case-insensitive)."""
    saved = meta.get("model_name")
    if not isinstance(saved, str) or not saved:
        return  # a model given by model_path/model_overrides has no preset name to compare with
    if saved.strip().lower() != model_name.strip().lower():
        raise UserError(f"--model_name {model_name!r} does not match model_name {saved!r} in "
                        f"{checkpoint / META_FILE}; pass --model_name {saved} or choose the right --input_path")


def model_config(meta: dict[str, Any], checkpoint: Path) -> Qwen3Config:
    """The trained model's config (real vocab_size) from meta.json."""
    source = f"{checkpoint / META_FILE}: model_config"
    data = meta.get("model_config")
    if not isinstance(data, dict):
        raise UserError(f"{source} is missing or not a mapping; the checkpoint was not written by this project's "
                        "trainer")
    config = Qwen3Config.from_hf_dict(data, source=source)
    if "tied" in meta and bool(meta["tied"]) != config.tie_word_embeddings:
        raise UserError(f"{checkpoint / META_FILE}: tied={meta['tied']} contradicts model_config's "
                        f"tie_word_embeddings={config.tie_word_embeddings}")
    return config


def tensors_to_merge(metadata: Metadata, config: Qwen3Config, checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Internal name -> output shape of each tensor to write, after checking the checkpoint against ``config``."""
    saved = {key[len(_MODEL_PREFIX):]: md for key, md in metadata.state_dict_metadata.items()
             if key.startswith(_MODEL_PREFIX)}
    expected = expected_shapes(config, mtp=any(name.startswith(MTP_PREFIX) for name in saved))
    where = f"checkpoint {checkpoint}"
    for name, shape in expected.items():
        md = saved.get(name)
        if not isinstance(md, TensorStorageMetadata):
            raise UserError(f"{where} has no tensor {_MODEL_PREFIX + name!r}, which its model_config "
                            f"({config.num_hidden_layers} layers, tied={config.tie_word_embeddings}) needs")
        _check_shape(name, tuple(md.size), shape, where)
    # The aux-loss-free balancing bias steers training's top-k choice only; Qwen3-MoE's HF format has no place
    # for it, so the merged model routes by the router's probabilities alone (docs/moe.md).
    biases = [name for name in saved if name.rpartition(".")[2] == EXPERT_BIAS]
    if biases:
        log.warning("%s: leaving out the %d MoE layers' aux-loss-free balancing biases (%s ...), which Qwen3-MoE's "
                    "HF format does not hold: the merged model chooses experts by the router's probabilities "
                    "alone (docs/moe.md)", where, len(biases), _MODEL_PREFIX + biases[0])
    extra = [name for name in saved if name not in expected and name != HEAD and name not in biases]
    if extra:
        raise UserError(f"{where} holds {_MODEL_PREFIX + extra[0]!r}, which its model_config "
                        f"({config.num_hidden_layers} layers) does not describe")
    return expected


def _check_shape(name: str, found: tuple[int, ...], want: tuple[int, ...], where: str) -> None:
    # The vocabulary tensors may hold padding rows beyond the real vocab_size.
    padded_ok = name in VOCAB_TENSORS and found[1:] == want[1:] and found[0] >= want[0]
    if found != want and not padded_ok:
        raise UserError(f"{where}: tensor {_MODEL_PREFIX + name!r} has shape {list(found)}, but its model_config "
                        f"gives {list(want)}")


# --- reading one tensor ------------------------------------------------------------------------


class _IntoTensor(DefaultLoadPlanner):
    """Directs every read of a plan into one destination tensor."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.target = target

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.target


class DCPTensorReader:
    """Reads single tensors of a DCP checkpoint in one process, without a process group.

    A tensor (or its leading ``rows``) is assembled from the saved chunks that
    overlap it, whatever sharding wrote them; only those chunks' bytes are read.
    """

    def __init__(self, path: Path, metadata: Metadata) -> None:
        self.path = path
        self.metadata = metadata
        self._reader = FileSystemReader(str(path))
        self._reader.set_up_storage_reader(metadata, True)

    def read(self, key: str, rows: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``key`` (its first ``rows`` rows when given), converted to ``dtype`` while copying."""
        md = self.metadata.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata), key
        shape = (md.size[0] if rows is None else rows, *md.size[1:])
        target = torch.empty(shape, dtype=dtype or md.properties.dtype)
        wanted = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))
        items = create_read_items_for_chunk_list(key, md, [wanted])
        covered = sum(torch.Size(item.lengths).numel() for item in items)
        if covered != target.numel():
            raise UserError(f"{self.path / DCP_METADATA}: the chunks of {key!r} cover {covered} of its "
                            f"{target.numel()} elements; the checkpoint is corrupt")
        self._reader.read_data(LoadPlan(items), _IntoTensor(target)).wait()
        return target


# --- merging -------------------------------------------------------------------------------------


def merge_checkpoint(input_path: str | os.PathLike, output_path: str | os.PathLike, model_name: str,
                     step: int | None = None, dtype: torch.dtype = torch.bfloat16,
                     max_shard_size: int | str = "5GB", tokenizer_path: str | os.PathLike | None = None,
                     progress: bool = True) -> MergeResult:
    """Write the model of a training checkpoint as a HF directory at ``output_path``.

    ``input_path`` is the training ``output_path``; ``step`` picks a checkpoint
    (default: the one ``latest`` names). Every check runs before the first
    byte is written, and ``output_path`` appears only once complete.
    """
    start = time.perf_counter()
    checkpoint = find_checkpoint(input_path, step)
    metadata = check_complete(checkpoint)
    meta = read_meta(checkpoint)
    check_model_name(meta, model_name, checkpoint)
    config = model_config(meta, checkpoint)
    shapes = tensors_to_merge(metadata, config, checkpoint)
    # the saved tensors in today's layout (checkpoint/versions.py), or refused before anything is written
    convert = conversion(meta, (key for key in metadata.state_dict_metadata if key.startswith(_MODEL_PREFIX)),
                         checkpoint)
    extra_files = tokenizer_files(tokenizer_path, meta, checkpoint)
    reader = DCPTensorReader(checkpoint, metadata)
    num_bytes = 0
    carried = checkpoint.parent / meta["carried"] if meta.get("carried") else None
    mtp = any(name.startswith(MTP_PREFIX) for name in shapes)  # a trained multi-token-prediction layer
    with _open_writer(output_path, config, dtype, max_shard_size, carried, mtp) as writer:
        for name in tqdm(shapes, desc="merge", unit="tensor", file=sys.stderr, disable=not progress):
            tensor = reader.read(_MODEL_PREFIX + name, rows=shapes[name][0], dtype=dtype)
            if convert.applies(name):
                tensor = convert(name, tensor)
            writer.add(name, tensor)
            num_bytes += tensor.nbytes
            del tensor  # so a tensor of a flushed shard is freed before the next read
        for source in extra_files:
            writer.add_file(source)
        out = writer.finalize()
    return MergeResult(checkpoint, out, len(shapes), num_bytes, time.perf_counter() - start, dtype)


def _open_writer(output_path: str | os.PathLike, config: Qwen3Config, dtype: torch.dtype,
                 max_shard_size: int | str, carried: Path | None = None, mtp: bool = False) -> HFCheckpointWriter:
    """The HF writer; ``carried``: the tensors the run kept from its starting checkpoint, written back;
    ``mtp``: the checkpoint holds a trained multi-token-prediction layer."""
    try:
        return HFCheckpointWriter(output_path, config, dtype, max_shard_size, carried, mtp)
    except OSError as exc:
        raise UserError(f"cannot write the merged model to output_path {output_path}: "
                        f"{exc.strerror or exc} ({exc.filename}); choose a writable --output_path") from None


def tokenizer_files(explicit: str | os.PathLike | None, meta: dict[str, Any], checkpoint: Path) -> list[Path]:
    """The tokenizer files to copy: from ``explicit`` (must exist), else from the run's tokenizer_path (may not)."""
    if explicit is not None:
        files = _tokenizer_dir_files(Path(explicit))
        if not files:
            raise MissingFileError(f"--tokenizer_path {explicit}: no tokenizer files there "
                                   f"(expected {', '.join(TOKENIZER_FILES[:4])})")
        return files
    recorded = meta.get("tokenizer_path") or (meta.get("config") or {}).get("tokenizer_path")
    if not recorded:
        log.warning("%s records no tokenizer_path: the merged model has no tokenizer files "
                    "(pass --tokenizer_path DIR to copy them)", checkpoint / META_FILE)
        return []
    files = _tokenizer_dir_files(Path(recorded))
    if not files:
        log.warning("tokenizer_path %s (from %s) has no tokenizer files: the merged model has none "
                    "(pass --tokenizer_path DIR to copy them)", recorded, checkpoint / META_FILE)
    return files


def _tokenizer_dir_files(path: Path) -> list[Path]:
    """The known tokenizer files in directory ``path`` (or beside the file ``path``, e.g. a tokenizer.json)."""
    directory = path.parent if path.is_file() else path
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


# --- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = CommandParser("merge", description=__doc__.splitlines()[0])
    parser.add_argument("--input_path", "--input-path", required=True,
                        help="the training run's output_path (holds latest and step_*/)")
    parser.add_argument("--output_path", "--output-path", required=True,
                        help="HF model directory to write (created; a previous model there is replaced)")
    parser.add_argument("--model_name", "--model-name", required=True,
                        help="the model that was trained, e.g. qwen3-8b; must match the checkpoint's meta.json")
    parser.add_argument("--step", type=int, default=None,
                        help="merge step_<N> instead of the checkpoint named by latest")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the saved weights")
    parser.add_argument("--max_shard_size", "--max-shard-size", default="5GB",
                        help="largest safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    parser.add_argument("--tokenizer_path", "--tokenizer-path", default=None,
                        help="tokenizer directory to copy (default: the one the run recorded)")
    parser.add_argument("--no_progress", "--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """``qwen3-pretrain merge``: checkpoint -> HF directory; prints one summary line."""
    args = parse_args(argv)
    parse_size(args.max_shard_size)  # a typo fails now, not after the checks
    handler = _warnings_to_stderr()
    try:
        result = merge_checkpoint(args.input_path, args.output_path, args.model_name, step=args.step,
                                  dtype=DTYPES[args.dtype], max_shard_size=args.max_shard_size,
                                  tokenizer_path=args.tokenizer_path, progress=not args.no_progress)
    finally:
        if handler is not None:
            log.removeHandler(handler)
    print(result.summary())
    return 0


def _warnings_to_stderr() -> logging.Handler | None:
    """Show this module's warnings when nothing else (the trainer's logging setup) does."""
    if logging.getLogger("qwen3_pretrain").handlers or log.handlers:
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    log.addHandler(handler)
    return handler
