"""FP8 against bf16 over a few hundred steps on the CPU (torchao's emulation): do the loss curves stay together?

    python bench/fp8_cpu.py                                  # dense and MoE, 200 steps, rowwise (~15 min)
    python bench/fp8_cpu.py --steps 100 --models dense --recipes tensorwise,rowwise
    python bench/fp8_cpu.py --data runs/data/d_fp8           # convert there once, reuse after

Each model trains from the same initialization (seed 7) on the same batches of the bundled Wikipedia sample
(converted by the project into a temporary folder unless ``--data`` holds converted data): once under
``mixed_precision: bf16`` and once per recipe with ``fp8: <recipe>`` and ``fp8_emulate: true``, each a fresh
``qwen3-pretrain train`` process. Model: Qwen3 with hidden 128, 4 layers, 4 heads of 32 (2 KV heads),
intermediate 384, the full 151,936 vocabulary, tied embeddings; MoE: 8 experts of 128, top-2, in every layer
(``moe_aux_loss: none``). seq 128, batch 4, lr 1e-3 (warm-up 20 steps, cosine). The emulation computes FP8's
numerics in high precision, so its step time says nothing of a device's; only the losses are compared.

Reported per model and recipe: the mean loss over windows of 50 steps (of the losses logged every 10 steps)
for each precision, the largest gap of those window means (relative to bf16's), the gap over the last 50
steps, and whether any loss was not finite.
Figures: bench/README.md ("FP8 against bf16 on CPU").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MODEL = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True}
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True}
WINDOW = 50


def ensure_data(path: str | None, tmp: Path) -> str:
    """``path`` when it holds converted data; else the bundled Wikipedia sample converted into ``path`` (into
    ``tmp`` when None)."""
    if path and (Path(path) / "manifest.json").is_file():
        return path
    dump = next((REPO / "assets/enwiki-sample").glob("*.bz2"))
    parquet, out = tmp / "wiki.parquet", Path(path) if path else tmp / "d_convert"
    print(f"converting {dump.name} into {out}", flush=True)
    for cmd in (["wiki2parquet", "--input", str(dump), "--output", str(parquet)],
                ["convert", "--config", "examples/pretain_data_config.yaml", f"input_path={parquet}",
                 f"output_path={out}", "seq_length=128", "shards=2"]):
        subprocess.run([sys.executable, "-m", "qwen3_pretrain", *cmd], cwd=REPO, check=True, capture_output=True)
    return str(out)


def train(name: str, data: str, tmp: Path, steps: int, model: str, keys: dict) -> dict[int, float]:
    """The logged losses of one run (every 10th step's), by step."""
    out = tmp / name
    overrides = dict(MODEL, **(MOE if model == "moe" else {}))
    cfg = {"model_name": "qwen3-0.6b", "model_overrides": overrides, "data_path": data, "output_path": str(out),
           "seq_length": 128, "batch_size": 4, "total_steps": steps, "log_steps": 10, "save_steps": 0,
           "learning_rate": 1e-3, "warmup_steps": 20, "mixed_precision": "bf16", "seed": 7,
           **({"moe_aux_loss": "none"} if model == "moe" else {}), **keys}
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, "-m", "qwen3_pretrain", "train", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    by_step = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec and "loss" in rec:
            by_step[rec["step"]] = rec["loss"]
    return dict(sorted(by_step.items()))


def windows(losses: dict[int, float]) -> list[float]:
    """The mean logged loss in each window of ``WINDOW`` steps (steps 1-50, 51-100, ...)."""
    groups: dict[int, list[float]] = {}
    for step, loss in losses.items():
        groups.setdefault((step - 1) // WINDOW, []).append(loss)
    return [sum(v) / len(v) for _, v in sorted(groups.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--recipes", default="rowwise")
    parser.add_argument("--data", default=None)
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        data = ensure_data(args.data, tmp)
        for model in args.models.split(","):
            bf16 = train(f"{model}-bf16", data, tmp, args.steps, model, {})
            want = windows(bf16)
            first = next(iter(bf16.values()))
            print(f"\n{model}: bf16 loss {first:.3f} -> {want[-1]:.3f} (last {WINDOW}-step mean)")
            print(f"  {'steps':18s}" + " ".join(f"{i * WINDOW + 1:>4d}-{min((i + 1) * WINDOW, args.steps):<4d}"
                                              for i in range(len(want))))
            print(f"  {'bf16':18s}" + " ".join(f"{v:9.4f}" for v in want), flush=True)
            for recipe in args.recipes.split(","):
                fp8 = train(f"{model}-{recipe}", data, tmp, args.steps, model,
                            {"fp8": recipe, "fp8_emulate": True})
                got = windows(fp8)
                gaps = [(g - w) / w for g, w in zip(got, want, strict=True)]
                finite = all(math.isfinite(v) for v in fp8.values())
                print(f"  {'fp8 ' + recipe:18s}" + " ".join(f"{v:9.4f}" for v in got))
                print(f"  {'gap':18s}" + " ".join(f"{100 * v:+8.2f}%" for v in gaps)
                      + f"   largest {100 * max(map(abs, gaps)):.2f}%, last {100 * gaps[-1]:+.2f}%"
                      + ("" if finite else "   NOT FINITE"), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
