"""Planner vs measured peak memory for parallel layouts, with the real training engine on CPU.

    python bench/plan_validate_parallel.py [LAYOUT ...]   # every layout below (or those named) under torchrun

Each layout trains a small Qwen3 (full 151,936 vocabulary) for one warm-up step, then measures one step
with ``MemoryTracker`` (storages of parameters, optimizer state and everything the step allocates, per
rank) and prints it beside ``predict_memory(...).allocated`` for that rank's pipeline stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from qwen3_pretrain.data.synthetic import write_synthetic_dataset

MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True}
LAYOUTS = {  # name: (processes, overrides)
    "single": (1, []),
    "tp2": (2, ["tp=2"]),
    "pp2": (2, ["pp=2"]),
    "dp2": (2, ["batch_size=1"]),
    "dp2-acc2": (2, ["batch_size=1", "gradient_accumulation_steps=2"]),
    "dp2-acc2-rs": (2, ["batch_size=1", "gradient_accumulation_steps=2", "reduce_grads_every_microbatch=true"]),
    "tp2-pp2": (4, ["tp=2", "pp=2"]),
    "dp4-shard2": (4, ["batch_size=1", "dp_shard=2"]),  # HSDP: 2 replicas of 2 shards
    "dp4-shard2-acc2": (4, ["batch_size=1", "dp_shard=2", "gradient_accumulation_steps=2"]),
}


def worker(data: str, overrides: list[str]) -> None:
    import torch.distributed as dist

    from qwen3_pretrain.config.loader import load_config
    from qwen3_pretrain.plan.memory import predict_memory
    from qwen3_pretrain.simulate.memtrack import MemoryTracker
    from qwen3_pretrain.train.config import TrainConfig
    from qwen3_pretrain.train.trainer import Trainer

    out = tempfile.mkdtemp()
    cfg = load_config(TrainConfig, None, [f"data_path={data}", f"output_path={out}", "model_name=qwen3-0.6b",
                                          f"model_overrides={json.dumps(MODEL)}", "seq_length=256", "batch_size=2",
                                          "total_steps=10", "save_steps=0", "mixed_precision=bf16", *overrides])
    trainer = Trainer(cfg)
    trainer.train_step()  # optimizer state exists from here on, as in the steady state
    tracker = MemoryTracker()
    with tracker:
        tracker.track([p for part in trainer.parts for p in part.parameters()],
                      [s for opt in trainer.optimizers for s in opt.state.values()])
        trainer.train_step()
    stage = trainer.mesh.get_local_rank("pp")
    predicted = predict_memory(trainer.source.config, trainer._layout(), stage=stage).allocated
    result = {"rank": dist.get_rank(), "stage": stage, "measured": tracker.peak_bytes, "predicted": predicted}
    print("RESULT " + json.dumps(result), flush=True)
    trainer.close()


def main() -> None:
    repo = Path(__file__).resolve().parent.parent
    data = Path(tempfile.mkdtemp()) / "data"
    rng = np.random.default_rng(0)
    write_synthetic_dataset(data, [rng.integers(0, 151_000, rng.integers(20, 300)) for _ in range(300)],
                            eod_id=151_643, docs_per_shard=100)
    print(f"{'layout':10} {'rank':>4} {'stage':>5} {'measured MiB':>13} {'predicted MiB':>14} {'error':>7}")
    only = [a for a in sys.argv[1:] if not a.startswith("-")]
    for name, (nproc, overrides) in LAYOUTS.items():
        if only and name not in only:
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               __file__, "--worker", str(data), *overrides]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo)
        rows = [json.loads(l.split("RESULT ", 1)[1]) for l in proc.stdout.splitlines() if "RESULT " in l]
        if not rows:
            print(f"{name:10} failed:\n{proc.stderr[-2000:]}")
            continue
        for r in sorted(rows, key=lambda r: r["rank"]):
            err = (r["predicted"] - r["measured"]) / r["measured"]
            print(f"{name:10} {r['rank']:>4} {r['stage']:>5} {r['measured'] / 2**20:>13.1f} "
                  f"{r['predicted'] / 2**20:>14.1f} {100 * err:>+6.1f}%", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
