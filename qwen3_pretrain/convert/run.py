"""parquet -> tokenized Megatron indexed-dataset shards: the ``convert`` stage.

``qwen3-pretrain convert --config pretain_data_config.yaml [key=value ...]``
writes ``shard_00000.bin/.idx`` ... and, last, ``manifest.json`` into
``output_path``. The input (parquet or JSON lines, see ``inputs.py``) is
cut into units of at most ``chunk_size`` documents and ``chunk_bytes`` bytes,
tokenized by ``workers`` processes (ordered, at most two units per worker in
flight, so memory stays bounded), and each document (its tokens, then
``<|endoftext|>``) goes to the shard holding the fewest tokens so far (the
lowest shard index on ties). The rule depends only on the documents and their
order, so the shards are byte-identical whatever the number of workers or how
the input is cut into units.

``manifest.json`` is the commit marker: it is removed before anything else is
touched and written only once every shard is complete, so a run that dies
leaves no manifest (and only ``*.tmp`` files, cleaned by the next run).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.convert.config import DataConvertConfig
from qwen3_pretrain.convert.inputs import check_inputs, input_files
from qwen3_pretrain.convert.shards import (ShardWriter, backend_line, conversion_manifest, prepare_output, summary,
                                           tokenize_into, warn_fewer_shards)
from qwen3_pretrain.convert.tokenizer import load_tokenizer
from qwen3_pretrain.data.indexed_dataset import dtype_for_vocab
from qwen3_pretrain.data.manifest import write_manifest
from qwen3_pretrain.data.pool import available_cores
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.parallel.launch import LaunchInfo, detect_launch

# What torchrun, mpirun and srun export as the number of processes (see parallel.launch.detect_launch).
_WORLD_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


def convert(cfg: DataConvertConfig) -> dict[str, Any]:
    """Run the conversion described by ``cfg``; returns the manifest it wrote (on several ranks: rank 0
    returns it, the others an empty dict)."""
    start = time.perf_counter()
    cfg.validate()
    files = input_files(cfg.input_path)
    launch = _launch(cfg)
    if launch is not None:
        # Imported here: it imports torch (the process group), which a one-process conversion never needs.
        from qwen3_pretrain.convert.ranks import convert_on_ranks

        return convert_on_ranks(cfg, files, launch, start)
    total_docs = check_inputs(files, cfg.text_column)
    tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.tokenizer_backend)
    print(backend_line(tokenizer), file=sys.stderr)
    output, workers = Path(cfg.output_path), cfg.workers or available_cores()
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    prepare_output(output, tokenizer.sha256)
    shards = ShardWriter([output / f"shard_{i:05d}" for i in range(cfg.shards)], dtype, cfg.max_doc_length,
                     cfg.append_eod)
    try:
        progress = tokenize_into(shards, cfg, files, tokenizer, workers, total_docs)
        if not any(c.num_documents for c in shards.counts):
            raise UserError(f"input_path {cfg.input_path!r}: no document has any text; nothing to write")
        kept = shards.finalize()
    except BaseException:
        shards.abort()
        raise
    named = [(f"shard_{i:05d}", shards.counts[i]) for i in kept]
    manifest = conversion_manifest(cfg, tokenizer, dtype, named, files, workers, time.perf_counter() - start)
    write_manifest(output, manifest)
    warn_fewer_shards(manifest)
    print(summary(manifest, progress, output))
    return manifest


def _launch(cfg: DataConvertConfig) -> LaunchInfo | None:
    """The launch, when a launcher started several processes. Without a launcher's variables the
    environment is left as it is: a conversion called from a program must not make it look launched."""
    if not any(int(os.environ.get(name, "1") or 1) > 1 for name in _WORLD_VARIABLES):
        return None
    launch = detect_launch(cfg.master_addr, cfg.master_port)
    return launch if launch.world_size > 1 else None


def main(argv: list[str]) -> int:
    """``convert --config FILE.yaml [key=value ...]``."""
    parser = CommandParser("convert", description=__doc__.split("\n\n")[0], config=DataConvertConfig)
    parser.add_argument("--config", help="YAML config file (e.g. examples/pretain_data_config.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override a config key")
    args = parser.parse_args(argv)
    convert(load_config(DataConvertConfig, args.config, args.overrides))
    return 0
