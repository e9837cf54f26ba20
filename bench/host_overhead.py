"""Host overhead: operators dispatched and host time per decoder layer per micro-batch, at tiny shapes.

    python bench/host_overhead.py                    # every variant (~2 min on 2 cores)
    python bench/host_overhead.py --variants eager-tp1,plain --iters 30

At hidden 64 (4 heads of 16, 2 KV heads, MLP 128), seq 32 and one sample
the arithmetic is negligible, so the time of a forward + backward is what the
host spends issuing it: Python, the dispatcher, DTensor's sharding
propagation, FSDP's hooks. Each variant builds the model with 2 and with 4
decoder layers and takes the difference over 2 layers, so the embedding,
the loss and the per-step work drop out:

* ``eager-tp1``, ``eager-tp2``, ``compiled-tp1``, ``compiled-tp2``: the
  engine's ``forward_backward`` (``train/engine.py``) on one micro-batch, the
  stage built and parallelized as training does it (FSDP over the data-parallel
  ranks, tensor parallelism with sequence parallelism over 2 processes for
  ``tp2``); ``compile: true`` compiles each decoder layer;
* ``plain``: ``transformers``' ``Qwen3ForCausalLM`` of the same shape in one
  process, forward, ``F.cross_entropy`` and backward: plain PyTorch.

Operators are counted with the profiler: every ``aten::`` call the host
makes, nested ones included (``aten::linear`` and the ``aten::mm`` under
it count two), so the figures compare variants, not absolute dispatch work;
``detach`` is shown apart. Host time is the median wall time of
``--iters`` calls after warm-up. Under tp 2 on gloo it includes the
collectives (on 2 processes sharing 2 cores, mostly waiting for the other
rank); the ``-fakepg`` variants run rank 0 of the same world alone on torch's
fake process group (collectives return at once, values meaningless), which
leaves the host's own work: what it would spend with an instant interconnect.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qwen3_pretrain.parallel.launch import free_port

REPO = Path(__file__).resolve().parents[1]
MODEL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": False}
SEQ = 32
LAYERS = (2, 4)
# name -> (kind, processes, config keys)
VARIANTS = {
    "plain": ("plain", 1, {}),
    "eager-tp1": ("engine", 1, {"tp": 1}),
    "eager-tp2": ("engine", 2, {"tp": 2}),
    "compiled-tp1": ("engine", 1, {"tp": 1, "compile": True}),
    "compiled-tp2": ("engine", 2, {"tp": 2, "compile": True}),
    "eager-tp2-fakepg": ("fakepg", 2, {"tp": 2}),
    "compiled-tp2-fakepg": ("fakepg", 2, {"tp": 2, "compile": True}),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--iters", type=int, default=30, help="timed calls per model size")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def count_ops(call) -> dict[str, int]:
    """``aten::`` calls the host makes in one ``call()``, and its ``detach`` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    return {"ops": len(names), "detach": sum(n in ("aten::detach", "aten::detach_") for n in names)}


def measure(call, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"ms": statistics.median(times) * 1e3, **count_ops(call)}


def plain_call(layers: int):
    import torch.nn.functional as F
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**MODEL, num_hidden_layers=layers)
    model = transformers.Qwen3ForCausalLM(config)
    ids = torch.randint(0, MODEL["vocab_size"], (1, SEQ))

    def call():
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
        model.zero_grad(set_to_none=True)

    return call, None


def engine_call(name: str, layers: int, data: str, out: str):
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig
    from qwen3_pretrain.train.trainer import Trainer

    keys = VARIANTS[name][2]
    cfg = from_dict(TrainConfig, {
        "model_name": "qwen3-0.6b", "model_overrides": dict(MODEL, num_hidden_layers=layers), "data_path": data,
        "output_path": out, "seq_length": SEQ, "batch_size": 1, "total_steps": 1000, "log_steps": 1000,
        "save_steps": 0, "mixed_precision": "fp32", "activation_checkpointing": "none", **keys},
        source=f"variant {name}")
    trainer = Trainer(cfg)
    batches = next(trainer.loader)
    engine = trainer.engine

    def call():
        engine.forward_backward(batches)
        for opt in engine.optimizers:
            opt.zero_grad(set_to_none=True)

    return call, trainer


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    kind, world = VARIANTS[args.worker][:2]
    if kind == "fakepg":  # rank 0 alone: the trainer finds the process group made
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    if kind == "plain":
        call, trainer = plain_call(args.layers)
    else:
        call, trainer = engine_call(args.worker, args.layers, args.data, str(Path(args.out) / "run"))
    result = measure(call, args.warmup, args.iters)
    if trainer is not None:
        trainer.close()
    if int(os.environ.get("RANK", 0)) == 0:
        Path(args.out, "result.json").write_text(json.dumps(result))


def write_data(path: Path) -> str:
    from qwen3_pretrain.data.synthetic import write_synthetic_dataset

    # token ids in the first half of the vocabulary: on the fake process group rank 0 (which holds that
    # half of the head under tp 2) must find every label itself, the other rank's reply being meaningless
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, MODEL["vocab_size"] // 2, size=500).astype(np.int32) for _ in range(40)]
    write_synthetic_dataset(path, docs, eod_id=0, vocab_size=MODEL["vocab_size"], seq_length=SEQ)
    return str(path)


def run_variant(name: str, args: argparse.Namespace, data: str, tmp: Path) -> dict | str:
    """The variant's figures per layer (the difference between its two model sizes), or why it failed."""
    kind, nproc = VARIANTS[name][:2]
    nproc = 1 if kind == "fakepg" else nproc
    raw = {}
    for layers in LAYERS:  # each size in fresh processes
        out = tmp / f"{name}-{layers}"
        out.mkdir()
        script = [str(Path(__file__).resolve()), "--worker", name, "--out", str(out), "--data", data,
                  "--iters", str(args.iters), "--warmup", str(args.warmup), "--layers", str(layers)]
        launcher = [sys.executable] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port())]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        proc = subprocess.run(launcher + script, cwd=REPO, env=env, text=True, capture_output=True)
        if proc.returncode:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
            return errors[0] if errors else f"failed ({proc.returncode}): {proc.stderr[-400:]}"
        raw[layers] = json.loads((out / "result.json").read_text())
    small, big = raw[LAYERS[0]], raw[LAYERS[1]]
    span = LAYERS[1] - LAYERS[0]
    return {k: (big[k] - small[k]) / span for k in ("ms", "ops", "detach")}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            print(f"error: unknown variant {name!r}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
            return 2
    print(f"torch {torch.__version__}; per decoder layer per micro-batch (forward + backward), hidden "
          f"{MODEL['hidden_size']}, seq {SEQ}; median of {args.iters}; load average {os.getloadavg()[0]:.1f}")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_data(Path(tmp) / "data")
        for name in names:
            rows[name] = run_variant(name, args, data, Path(tmp))
    base = rows.get("plain")
    print(f"{'variant':22s} {'aten ops':>9s} {'detach':>7s} {'host ms':>8s} {'vs plain':>9s}")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:22s} {row}")
            continue
        ratio = f"{row['ms'] / base['ms']:8.2f}x" if isinstance(base, dict) else ""
        print(f"{name:22s} {row['ops']:9.0f} {row['detach']:7.0f} {row['ms']:8.3f} {ratio:>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
