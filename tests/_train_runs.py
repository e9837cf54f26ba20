"""Training runs shared by several test modules: each layout trains once per session, on first request.

Every run starts from the same HF directory, written by ``transformers`` (so the independent
reference loop can start from the very same weights), and trains 5 steps of global batch 4 with the
optimizer settings spelled out, not left to defaults the reference loop would have to copy.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tests._reference_loop import write_transformers_init
from tests._train_helpers import TINY_MODEL, check_ok, make_corpus, run_train, step_records, write_config

GLOBAL_BATCH = 4
TOTAL_STEPS = 5
OPTIMIZER = {"learning_rate": 3e-3, "warmup_steps": 1, "total_steps": TOTAL_STEPS, "min_lr": 3e-4,
             "lr_decay_style": "cosine", "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.95,
             "adam_eps": 1e-8, "clip_grad": 1.0, "seq_length": 64, "seed": 7}

# name -> (processes, overrides); each gives a global batch of 4 (batch_size 2 by default), unless named.
LAYOUTS = {
    "single": (1, ["gradient_accumulation_steps=2"]),
    "tp2": (2, ["tp=2", "gradient_accumulation_steps=2"]),
    "pp2-1f1b": (2, ["pp=2", "gradient_accumulation_steps=2"]),
    "pp2-interleaved": (2, ["pp=2", "pp_schedule=interleaved", "gradient_accumulation_steps=2"]),
    "pp2-gpipe": (2, ["pp=2", "pp_schedule=gpipe", "gradient_accumulation_steps=2"]),
    "dp2-distributed-optimizer": (2, ["distributed_optimizer=true"]),
    "dp2-replicated": (2, ["distributed_optimizer=false"]),
    "dp2-reduce-every-microbatch": (2, ["batch_size=1", "gradient_accumulation_steps=2",
                                        "reduce_grads_every_microbatch=true"]),
    "tp2-pp2-dp2": (8, ["tp=2", "pp=2", "batch_size=2"]),
    # compiled layers under tensor parallelism: alone, with FSDP and full recompute, with pp and MLP recompute
    "tp2-compiled": (2, ["tp=2", "gradient_accumulation_steps=2", "compile=true"]),
    "tp2-dp2-compiled-full": (4, ["tp=2", "batch_size=1", "gradient_accumulation_steps=2", "compile=true",
                                  "activation_checkpointing=full"]),
    "tp2-pp2-compiled-mlp": (4, ["tp=2", "pp=2", "gradient_accumulation_steps=2", "compile=true",
                                 "activation_checkpointing=mlp"]),
    # Megatron's accumulation: weights gathered once per step, gradients reduced once
    "dp2-keep-params-gathered": (2, ["batch_size=1", "gradient_accumulation_steps=2", "keep_params_gathered=true"]),
    "pp2-dp2-keep-params-gathered": (4, ["pp=2", "batch_size=1", "gradient_accumulation_steps=2",
                                         "keep_params_gathered=true"]),
    # HSDP: 2 replicas of 2 shards, each micro-batch's gradients reduce-scattered in the shard group and
    # all-reduced across replicas; global batch 8, against the one-process run of the same batch
    "dp4-hsdp2-reduce-every-microbatch": (4, ["batch_size=1", "gradient_accumulation_steps=2", "dp_shard=2",
                                              "reduce_grads_every_microbatch=true"]),
    "single-batch8": (1, ["gradient_accumulation_steps=4"]),
    # Context parallelism (each sequence over 2 ranks); cp2 also saves step 3 for a resume under cp 1.
    "cp2": (2, ["cp=2", "gradient_accumulation_steps=2", "save_steps=3"]),
    "cp2-tp2": (4, ["cp=2", "tp=2", "gradient_accumulation_steps=2"]),
    "single-document-mask": (1, ["gradient_accumulation_steps=2", "document_mask=true"]),
    "cp2-pp2-document-mask": (4, ["cp=2", "pp=2", "gradient_accumulation_steps=2", "document_mask=true"]),
    "cp2-dp2-document-mask": (4, ["cp=2", "document_mask=true"]),
    "single-ac-full": (1, ["gradient_accumulation_steps=2", "activation_checkpointing=full"]),
    "single-ac-selective": (1, ["gradient_accumulation_steps=2", "activation_checkpointing=selective"]),
    "single-ac-mlp": (1, ["gradient_accumulation_steps=2", "activation_checkpointing=mlp"]),
    # bf16 rounding depends on the shapes of the matmuls: every bf16 run works on one-sample micro-batches,
    # as the pipeline does (pp_microbatch_size 1).
    "single-bf16": (1, ["batch_size=1", "gradient_accumulation_steps=4", "mixed_precision=bf16"]),
    "dp2-bf16": (2, ["batch_size=1", "gradient_accumulation_steps=2", "mixed_precision=bf16"]),
    "pp2-bf16": (2, ["pp=2", "gradient_accumulation_steps=2", "mixed_precision=bf16"]),
    "dp2-bf16-grads-keep-params-gathered": (2, ["batch_size=1", "gradient_accumulation_steps=2",
                                                "mixed_precision=bf16", "grad_reduce_dtype=bf16",
                                                "keep_params_gathered=true"]),
}


class LayoutRuns:
    """The corpus, the initial weights and the runs of ``LAYOUTS``, made on first use under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, Path] = {}

    @functools.cached_property
    def corpus(self) -> Path:
        return make_corpus(self.root / "corpus")

    @functools.cached_property
    def hf_init(self) -> Path:
        return write_transformers_init(self.root / "hf_init", dict(TINY_MODEL), seed=0)

    def config(self, path: Path, output_path: Path, **overrides) -> Path:
        """A config of the shared set-up (data, initial weights, optimizer) writing to ``output_path``."""
        return write_config(path, self.corpus, output_path, model_name="tiny-test", model_path=str(self.hf_init),
                            model_overrides={}, **{**OPTIMIZER, **overrides})

    def output(self, name: str) -> Path:
        """The output directory of layout ``name``'s finished run (metrics.jsonl, the final checkpoint)."""
        if name not in self._done:
            nproc, overrides = LAYOUTS[name]
            run = self.root / name
            run.mkdir()
            check_ok(run_train(self.config(run / "c.yaml", run / "out"), nproc, *overrides, timeout=600))
            self._done[name] = run / "out"
        return self._done[name]

    def records(self, name: str) -> list[dict]:
        return step_records(self.output(name))
