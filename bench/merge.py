"""Throughput and peak memory of merging a training checkpoint into a HF directory, and of saving it.

    python bench/merge.py                                  # vocab 151,936, hidden 1024, 8 layers, untied: 1.75 GB fp32
    python bench/merge.py --layers 4 --shard-sizes 5GB

Builds the state dict training saves (fp32 master weights, separate head),
times ``torch.distributed.checkpoint.save`` of it in one process, then merges
it once per ``--shard-sizes`` entry. Every step runs in a fresh process that
reports its own peak resident memory (``ru_maxrss``), so the merge's figure
is not inflated by the process that built the model. The "import" row is a
process that only imports the merge module: the floor under every other row.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.init import init_param

MODEL_NAME = "bench"
STEP = 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--tied", action="store_true", help="tied embeddings (the checkpoint still holds a head)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dtype of the merged weights")
    parser.add_argument("--shard-sizes", default="5GB,200MB", help="comma-separated max_shard_size values to try")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir, removed at the end)")
    parser.add_argument("--worker", choices=["save", "import", "merge"], help=argparse.SUPPRESS)
    parser.add_argument("--shard-size", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> Qwen3Config:
    return Qwen3Config(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=args.vocab,
                       tie_word_embeddings=args.tied)


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def save_worker(args: argparse.Namespace, run: Path) -> dict:
    """Write a training checkpoint of the model: DCP files, meta.json, latest; time the DCP save alone."""
    import torch.distributed.checkpoint as dcp

    from qwen3_pretrain.models.qwen3.hf_io import expected_shapes

    config = model_config(args)
    shapes = expected_shapes(config)
    shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)  # training keeps a tied head too
    state = {name: init_param(name, shape, config, seed=0) for name, shape in shapes.items()}
    ckpt = run / f"step_{STEP:07d}"
    start = time.perf_counter()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    seconds = time.perf_counter() - start
    meta = {"format": "qwen3-pretrain-checkpoint", "format_version": 1, "step": STEP, "model_name": MODEL_NAME,
            "model_config": config.to_hf_dict(), "padded_vocab_size": config.vocab_size,
            "tied": config.tie_word_embeddings, "tokenizer_path": None}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (run / "latest").write_text(ckpt.name + "\n")
    size = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
    return {"bytes": size, "seconds": seconds, "params": sum(t.numel() for t in state.values()),
            "largest": max(t.nbytes for t in state.values())}


def merge_worker(args: argparse.Namespace, run: Path) -> dict:
    from qwen3_pretrain.checkpoint.merge import DTYPES, merge_checkpoint

    before = max_rss_bytes()
    result = merge_checkpoint(run, run.parent / f"hf-{args.shard_size}", MODEL_NAME, dtype=DTYPES[args.dtype],
                              max_shard_size=args.shard_size, progress=False)
    shutil.rmtree(result.output_path)
    return {"bytes": result.num_bytes, "seconds": result.seconds, "rss_before": before}


def worker(args: argparse.Namespace) -> None:
    run = Path(args.workdir) / "run"
    if args.worker == "save":
        out = save_worker(args, run)
    elif args.worker == "merge":
        out = merge_worker(args, run)
    else:
        import qwen3_pretrain.checkpoint.merge  # noqa: F401  (the floor: torch + DCP + safetensors)

        out = {}
    print(json.dumps(dict(out, max_rss=max_rss_bytes())))


def spawn(args: argparse.Namespace, workdir: Path, role: str, *extra: str) -> dict:
    cmd = [sys.executable, __file__, *sys.argv[1:], "--workdir", str(workdir), "--worker", role, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{role} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(args: argparse.Namespace, workdir: Path) -> None:
    saved = spawn(args, workdir, "save")
    floor = spawn(args, workdir, "import")
    gb = saved["bytes"] / 1e9
    print(f"model: {saved['params'] / 1e6:.0f}M params, vocab {args.vocab}, hidden {args.hidden}, {args.layers} "
          f"layers, tied={args.tied}; checkpoint {gb:.2f} GB fp32, largest tensor {saved['largest'] / 1e9:.2f} GB")
    print(f"{'step':<26}{'GB':>7}{'s':>8}{'MB/s':>8}{'peak RSS GB':>13}")
    print(f"{'dcp.save (1 process)':<26}{gb:>7.2f}{saved['seconds']:>8.1f}"
          f"{saved['bytes'] / 1e6 / saved['seconds']:>8.0f}{saved['max_rss'] / 1e9:>13.2f}")
    print(f"{'import only':<26}{'':>7}{'':>8}{'':>8}{floor['max_rss'] / 1e9:>13.2f}")
    for size in args.shard_sizes.split(","):
        merged = spawn(args, workdir, "merge", "--shard-size", size)
        label = f"merge {args.dtype}, {size} shards"
        print(f"{label:<26}{merged['bytes'] / 1e9:>7.2f}{merged['seconds']:>8.1f}"
              f"{merged['bytes'] / 1e6 / merged['seconds']:>8.0f}{merged['max_rss'] / 1e9:>13.2f}")
    print("merge MB/s counts the bytes written (the output dtype); peak RSS includes the import floor")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="merge-bench-"))
    try:
        report(args, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
