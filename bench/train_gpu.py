"""One GPU training benchmark run (called by ``bench/train_gpu.sh``, under ``torchrun``).

    python bench/train_gpu.py data --out DIR                  # synthetic data (full Qwen3 vocab)
    torchrun --nproc_per_node N bench/train_gpu.py run --config C.yaml --steps 12
    python bench/train_gpu.py table --runs DIR                # one line per run from its metrics.jsonl
    python bench/train_gpu.py devices                         # "COUNT NAME" of the devices torch sees

``run`` drives the engine's ``Trainer.train_step`` and writes the same
``metrics.jsonl`` records as ``qwen3-pretrain train`` (tokens/s, tokens/s per
device, MFU, HFU and the full-square MFU by the trainer's formulas, peak memory allocated and reserved) but skips the end-of-run checkpoint, which for a
1.7B model with its optimizer state would write ~20 GB and take longer than
the steps measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np


def write_data(out: Path, num_tokens: int = 4_000_000, vocab: int = 151_643, eod: int = 151_643) -> None:
    """Random documents of 1k-16k tokens over the full vocabulary: the speed does not depend on the text."""
    from qwen3_pretrain.data.synthetic import write_synthetic_dataset

    rng = np.random.default_rng(0)
    docs, total = [], 0
    while total < num_tokens:
        docs.append(rng.integers(0, vocab, rng.integers(1024, 16384)).astype(np.int32))
        total += len(docs[-1])
    write_synthetic_dataset(out, docs, eod_id=eod, docs_per_shard=64, vocab_size=151_669)
    print(f"wrote {total} tokens in {len(docs)} documents to {out}")


def run(config: str, steps: int, warmup: int) -> None:
    from qwen3_pretrain.config.loader import load_config
    from qwen3_pretrain.hardware import matmul_precision
    from qwen3_pretrain.models.ops.precision import matmul_dtype
    from qwen3_pretrain.plan.flops import token_flops
    from qwen3_pretrain.train.config import TrainConfig
    from qwen3_pretrain.train.metrics import MetricsWriter, device_peak_tflops, step_memory, utilization
    from qwen3_pretrain.train.trainer import Trainer

    trainer = Trainer(load_config(TrainConfig, config))
    cfg, world = trainer.cfg, trainer.launch.world_size
    # The peak of what the matmuls run in (bf16, TF32 or fp32), as the trainer's; on a CPU measured in the
    # dtype the engine multiplies in.
    precision = matmul_precision(cfg.mixed_precision, cfg.allow_tf32, trainer.device.type)
    peak, _ = device_peak_tflops(trainer.device, cfg.peak_tflops,
                                 matmul_dtype(cfg.mixed_precision, trainer.fp32_matmul), precision)
    flops = token_flops(trainer.source.config, cfg.seq_length, cfg.ac_mode, cfg.mtp_loss_weight > 0)
    writer = MetricsWriter(cfg.output_path) if trainer.launch.rank == 0 else None
    try:
        for _ in range(warmup + steps):
            rec = trainer.train_step()
            tps = trainer.global_tokens / rec["step_time_s"]
            record = {"step": rec["step"], "loss": rec["loss"], "tokens_per_sec": tps,
                      "tokens_per_sec_per_device": tps / world, "step_time_s": rec["step_time_s"],
                      **utilization(flops, tps / world, peak), **step_memory(trainer.device),
                      "warmup": rec["step"] <= warmup}
            if writer is not None:
                writer.write(record)
                print(json.dumps(record), flush=True)
    finally:
        if writer is not None:
            writer.close()
        trainer.close()


def summarize(metrics: Path) -> dict | None:
    """Medians over the timed steps of one run's metrics.jsonl (None without a timed step)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    timed = [r for r in records if "step" in r and not r.get("warmup")]
    if not timed:
        return None
    keys = ("step_time_s", "tokens_per_sec_per_device", "mfu", "hfu")
    # runs recorded before HFU was logged have none: nan in the table
    summary = {k: statistics.median(r.get(k, float("nan")) for r in timed) for k in keys}
    reserved = [r["memory_reserved_gib"] for r in timed if "memory_reserved_gib" in r]
    return {"steps": len(timed), **summary, "memory_gib": max(r["memory_gib"] for r in timed),
            "memory_reserved_gib": max(reserved, default=None), "last_loss": timed[-1]["loss"]}


def table(runs: Path) -> None:
    print(f"{'run':<34} {'steps':>5} {'step s':>7} {'tokens/s/device':>15} {'MFU':>6} {'HFU':>6} {'peak GiB':>9} "
          f"{'reserved':>8}")
    for metrics in sorted(runs.glob("*/metrics.jsonl")):
        med = summarize(metrics)
        if med is None:
            print(f"{metrics.parent.name:<34} no timed steps (see {metrics.parent}/log.txt)")
            continue
        print(f"{metrics.parent.name:<34} {med['steps']:>5} {med['step_time_s']:>7.3f} "
              f"{med['tokens_per_sec_per_device']:>15.0f} {100 * med['mfu']:>5.1f}% {100 * med['hfu']:>5.1f}% "
              f"{med['memory_gib']:>9.1f} "
              f"{med['memory_reserved_gib'] or float('nan'):>8.1f}")
    print("MFU: model FLOPs (attention's causal half) over the dense peak of what the matmuls run in (bf16: "
          "H100/H200 989 TFLOP/s); HFU: with recompute; target: >= 45% MFU")


def devices() -> None:
    """``COUNT NAME``: how many accelerators torch sees (honouring CUDA_VISIBLE_DEVICES /
    ASCEND_RT_VISIBLE_DEVICES) and the first one's name; ``0 none`` without one."""
    from device_check_env import visible_accelerators

    kind, count = visible_accelerators()
    if count == 0:
        print("0 none")
        return
    import torch

    print(count, getattr(torch, kind).get_device_name(0))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["data", "run", "table", "devices"])
    parser.add_argument("--out", type=Path, help="data: folder to write")
    parser.add_argument("--tokens", type=int, default=4_000_000, help="data: tokens to write")
    parser.add_argument("--config", help="run: training config YAML")
    parser.add_argument("--steps", type=int, default=10, help="run: timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="run: untimed steps first")
    parser.add_argument("--runs", type=Path, help="table: folder of run folders")
    args = parser.parse_args(argv)
    if args.what == "data":
        write_data(args.out, args.tokens)
    elif args.what == "run":
        run(args.config, args.steps, args.warmup)
    elif args.what == "table":
        table(args.runs)
    else:
        devices()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
