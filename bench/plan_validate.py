"""Predicted vs measured peak memory of single-process training steps on CPU.

For each case: build the step the engine would run (see
``bench/plan_harness.py``), measure its allocator-level peak with
``MemoryTracker`` over a step after the first, and compare with
``predict_memory(...).allocated`` (the prediction without its overhead
allowance, which allocator statistics do not see). Also prints the measured
step time next to ``predict_step`` on the ``cpu`` device entry.

    python bench/plan_validate.py                 # every case (a few minutes on 2 cores)
    python bench/plan_validate.py --cases tiny    # one case
    python bench/plan_validate.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from qwen3_pretrain.hardware import get_device
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan.layout import Layout
from qwen3_pretrain.plan.step import predict_step

from plan_harness import measure  # bench/plan_harness.py: this script's folder is on sys.path

MiB = 2**20


def _model(hidden: int, layers: int, intermediate: int, vocab: int = 151936, tied: bool = False,
           **moe) -> Qwen3Config:
    return Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=intermediate, vocab_size=vocab, tie_word_embeddings=tied, **moe)


# A Qwen3-MoE in small: 16 experts of 256, top-4 (the published models: 128 experts, top-8).
MOE = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)


# name -> (model, layout); real Qwen3 vocabulary unless the name says otherwise
CASES: dict[str, tuple[Qwen3Config, Layout]] = {
    "tiny": (_model(64, 2, 192), Layout(micro_batch_size=2, seq_length=256, activation_checkpointing="none",
                                          loss_chunk_tokens=256)),
    "h256-none-bf16": (_model(256, 2, 768), Layout(micro_batch_size=1, seq_length=256,
                                                    activation_checkpointing="none")),
    "h512-none-bf16": (_model(512, 4, 1536), Layout(micro_batch_size=2, seq_length=1024,
                                                     activation_checkpointing="none", loss_chunk_tokens=1024)),
    # Tied (Qwen3 0.6B-4B): the head applies the embedding's weight, gathered all step.
    "h256-none-bf16-tied": (_model(256, 2, 768, tied=True), Layout(micro_batch_size=1, seq_length=256,
                                                                   activation_checkpointing="none")),
    "h512-none-fp32-tied": (_model(512, 4, 1536, tied=True), Layout(micro_batch_size=2, seq_length=1024,
                                                                    activation_checkpointing="none",
                                                                    mixed_precision="fp32", loss_chunk_tokens=1024)),
    "h512-full-bf16-gas2-tied": (_model(512, 4, 1536, tied=True), Layout(micro_batch_size=2, seq_length=1024,
                                                                         gradient_accumulation_steps=2,
                                                                         loss_chunk_tokens=1024)),
    "h512-none-fp32": (_model(512, 4, 1536), Layout(micro_batch_size=2, seq_length=1024,
                                                     activation_checkpointing="none", mixed_precision="fp32",
                                                     loss_chunk_tokens=1024)),
    "h512-full-bf16-gas2": (_model(512, 4, 1536), Layout(micro_batch_size=2, seq_length=1024,
                                                          gradient_accumulation_steps=2, loss_chunk_tokens=1024)),
    "h512-full-fp32-b4": (_model(512, 2, 1536), Layout(micro_batch_size=4, seq_length=512,
                                                        mixed_precision="fp32")),
    "h512-mlp-bf16-v32k": (_model(512, 4, 1536, vocab=32768),
                           Layout(micro_batch_size=4, seq_length=1024, activation_checkpointing="mlp")),
    "h512-none-bf16-v32k-b4": (_model(512, 4, 1536, vocab=32768),
                               Layout(micro_batch_size=4, seq_length=1024, activation_checkpointing="none",
                                      loss_chunk_tokens=1024)),
    # A small vocabulary, so that the layers' activations decide the peak.
    "h512-none-bf16-v4k-s2048": (_model(512, 4, 1536, vocab=4096),
                                 Layout(micro_batch_size=4, seq_length=2048, activation_checkpointing="none")),
    "h512-mlp-fp32-v4k-s2048": (_model(512, 4, 1536, vocab=4096),
                                Layout(micro_batch_size=2, seq_length=2048,
                                       activation_checkpointing="mlp", mixed_precision="fp32")),
    "h512-full-bf16-v4k-s2048": (_model(512, 8, 1536, vocab=4096),
                                 Layout(micro_batch_size=4, seq_length=2048)),
    "moe-h512-none-bf16-v4k-s2048": (_model(512, 4, 1536, vocab=4096, **MOE),
                                     Layout(micro_batch_size=2, seq_length=2048, activation_checkpointing="none")),
    "moe-h512-mlp-bf16-v4k-s2048": (_model(512, 4, 1536, vocab=4096, **MOE),
                                    Layout(micro_batch_size=2, seq_length=2048, activation_checkpointing="mlp")),
    "moe-h512-none-fp32-v4k-s2048": (_model(512, 4, 1536, vocab=4096, mlp_only_layers=[0], **MOE),
                                     Layout(micro_batch_size=2, seq_length=2048, activation_checkpointing="none",
                                            mixed_precision="fp32")),
}


def run_case(name: str, time_steps: bool) -> dict:
    cfg, layout = CASES[name]
    start = time.perf_counter()
    m = measure(cfg, layout, time_one_step=time_steps)
    row = {
        "case": name, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
        "seq": layout.seq_length, "micro_batch": layout.micro_batch_size,
        "grad_accum": layout.gradient_accumulation_steps, "recompute": layout.activation_checkpointing,
        "precision": layout.mixed_precision, "measured_mib": round(m.measured_peak_bytes / MiB, 1),
        "predicted_mib": round(m.predicted.allocated / MiB, 1), "error": round(m.error, 4),
        "peak_moment": m.predicted.moment, "wall_s": round(time.perf_counter() - start, 1),
    }
    if m.step_time_s is not None:
        row["step_s"] = round(m.step_time_s, 3)
        row["predicted_step_s"] = round(predict_step(cfg, layout, get_device("cpu")).step_time_s, 3)
    return row


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="all", help=f"comma-separated, or all: {', '.join(CASES)}")
    p.add_argument("--time-steps", action="store_true", help="also time one untracked step per case")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    rows = []
    print(f"{'case':26s} {'measured MiB':>12s} {'predicted MiB':>13s} {'error':>7s}  peak at")
    for name in names:
        row = run_case(name, args.time_steps)
        rows.append(row)
        timing = f"  step {row['step_s']} s (predicted {row['predicted_step_s']} s)" if "step_s" in row else ""
        print(f"{name:26s} {row['measured_mib']:12.1f} {row['predicted_mib']:13.1f} {row['error']:+7.1%}  "
              f"{row['peak_moment']}{timing}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
