"""The multi-device stages of ``bench/device_check.py``: short training runs over two ranks (tp 2, pp 2, cp 2,
FSDP 2, ep 2 on a MoE model in fp32 and with the grouped GEMM in bf16, document masks under cp, an asynchronous
save and the resume from it, compiled layers), each compared step by step with the same run on one device.

On a device the stages run when torch sees two or more devices (``env``'s ``device_count``); with ``--cpu``
they run as two gloo processes with tiny sizes. Every run is ``qwen3-pretrain train`` under torchrun; the
data is a small synthetic corpus of short documents (so document masks have boundaries to respect), written by

    python bench/device_check_multi.py data --out DIR --seq-length N --vocab V
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from device_check_stages import TRAIN_CHECK_MODEL, Context, Stage, StageFailed, fresh, tail

DATA = "multi/data"


@dataclass(frozen=True)
class MultiSizes:
    model: dict  # model_overrides of the dense runs (the MoE runs add MOE to them)
    seq_length: int
    batch_size: int  # per rank and micro-batch; every run's global batch is 2 x batch_size
    steps: int
    compile: bool  # the compiled runs (device only: inductor's C++ kernels take minutes to build on a CPU)
    cap_s: float  # longest one run may take (a compiled one: twice that)
    # fsdp2 trains with the asynchronous save and fsdp2-async_save resumes from its checkpoint instead of
    # training again: one launch fewer (~9 s of the CPU check's ~200 on 2 cores, where a launch's imports cost
    # more than its 4 steps). A device keeps them apart, so multi/fsdp2 stays the plain FSDP figure.
    share_async_save: bool = False


DEVICE_MULTI = MultiSizes(
    model={"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 4096, "tie_word_embeddings": True},
    seq_length=1024, batch_size=2, steps=4, compile=True, cap_s=120)
CPU_MULTI = MultiSizes(
    model={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": True},
    seq_length=64, batch_size=2, steps=4, compile=False, cap_s=240, share_async_save=True)
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}


@dataclass(frozen=True)
class Tolerance:
    """Relative difference allowed from the one-device run: at the first step, where both runs hold the same
    weights and differ only in how their sums were rounded, and at every step, after the rounding
    differences have moved the weights apart."""

    first_loss: float
    first_grad_norm: float
    loss: float
    grad_norm: float


# fp32: the suite's bounds for runs that differ only in the order of sums (1e-5, 3e-5; measured ~1e-7 and
# ~3e-6 on a CPU), with room for device kernels that pick their algorithm by shape (split-K, attention tiles);
# a dropped or doubled reduction moves the loss by ~3e-3 and the gradient norm by ~0.3. bf16: on the CPU the
# MoE runs' first step differs by 0 in the loss and 3e-5 in the gradient norm, but after three bf16 updates
# by up to 6e-5 and 8e-3 (dp 2 without ep: 5e-5 and 6e-3), so the first step carries the tight check.
FP32_TOL = Tolerance(2e-5, 1e-4, 2e-5, 1e-4)
BF16_TOL = Tolerance(1e-5, 1e-3, 1e-3, 5e-2)


@dataclass(frozen=True)
class Run:
    """One training run: ``nproc`` ranks with ``overrides``, compared with the run ``reference`` (None: it
    is a one-device reference itself)."""

    nproc: int
    overrides: dict
    reference: str | None = None
    tol: Tolerance = FP32_TOL
    device_only: bool = False
    trained_by: str | None = None  # the run whose output this one reads instead of training (same overrides)
    resume: bool = False  # then resume from its asynchronous save (resume_from_async_save)


def runs(s: MultiSizes) -> dict[str, Run]:
    """Name -> run. The global batch is 2 x batch_size samples in every run."""
    b, bf16 = s.batch_size, {"mixed_precision": "bf16"}
    # cpu_bf16_matmul bf16: a CPU runs the grouped GEMM too (auto multiplies fp32 copies, one expert at a time,
    # on a CPU without native bf16); a device ignores it
    moe = {"model_overrides": {**s.model, **MOE}, "moe_aux_loss": "global_batch", "moe_aux_loss_coef": 0.01,
           "cpu_bf16_matmul": "bf16"}
    out = {
        "one_device": Run(1, {"gradient_accumulation_steps": 2}),
        "tp2": Run(2, {"tp": 2, "gradient_accumulation_steps": 2}, "one_device"),
        "pp2": Run(2, {"pp": 2, "gradient_accumulation_steps": 2}, "one_device"),
        "cp2": Run(2, {"cp": 2, "gradient_accumulation_steps": 2}, "one_device"),
        "fsdp2": Run(2, {"distributed_optimizer": True}, "one_device"),
        "one_device-document_mask": Run(1, {"gradient_accumulation_steps": 2, "document_mask": True}),
        "cp2-document_mask": Run(2, {"cp": 2, "gradient_accumulation_steps": 2, "document_mask": True},
                                 "one_device-document_mask"),
        # One micro-batch per step: moe_aux_loss global_batch pools each micro-batch's routing over the ranks,
        # so the one-device run must see the same micro-batches (dp 2 accumulating would pool samples 0 and 2).
        # fp32 (one matmul per expert) holds ep to the fp32 bound, which a router gradient lost in the token
        # exchange exceeds (1.0e-2 in the gradient norm on the CPU); bf16 runs the grouped GEMM.
        "one_device-moe": Run(1, {**moe, "batch_size": 2 * b}),
        "ep2-moe": Run(2, {**moe, "ep": 2}, "one_device-moe"),
        "one_device-moe-bf16": Run(1, {**moe, **bf16, "batch_size": 2 * b}),
        "ep2-moe-bf16": Run(2, {**moe, **bf16, "ep": 2}, "one_device-moe-bf16", BF16_TOL),
        "fsdp2-async_save": Run(2, {"distributed_optimizer": True, "async_save": True, "save_steps": 2},
                                "one_device", resume=True),
        "tp2-compile": Run(2, {"tp": 2, "gradient_accumulation_steps": 2, "compile": True}, "one_device",
                           device_only=True),
        "fsdp2-compile": Run(2, {"distributed_optimizer": True, "compile": True}, "one_device", device_only=True),
        # compiled ep: the grouped GEMM and the dispatch's all-to-alls with their symbolic split sizes
        "ep2-moe-bf16-compile": Run(2, {**moe, **bf16, "ep": 2, "compile": True}, "one_device-moe-bf16", BF16_TOL,
                                    device_only=True),
    }
    if s.share_async_save:
        out["fsdp2"] = Run(2, out["fsdp2-async_save"].overrides, "one_device")
        out["fsdp2-async_save"] = Run(2, out["fsdp2"].overrides, "one_device", trained_by="fsdp2", resume=True)
    return {name: run for name, run in out.items() if s.compile or not run.device_only}


def sizes(ctx: Context) -> MultiSizes:
    return CPU_MULTI if ctx.mode == "cpu" else DEVICE_MULTI


def too_few_devices(ctx: Context) -> str | None:
    """Why the multi-device stages do not apply here (None: they do). A CPU runs them as gloo processes."""
    if ctx.mode == "cpu" or ctx.device_count >= 2:
        return None
    return f"torch sees {ctx.device_count} {ctx.device} device(s); the multi-device runs need 2"


# --- data and runs -----------------------------------------------------------------------------------------------


def write_data(out: Path, seq_length: int, vocab: int, num_docs: int = 300, seed: int = 0) -> dict:
    """Documents of a third to four sequences' length whose tokens follow a learnable pattern (so the loss
    falls); most samples hold a document boundary, which a document mask must respect."""
    import numpy as np

    from qwen3_pretrain.data.synthetic import write_synthetic_dataset

    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        start, step = rng.integers(0, vocab - 1), rng.integers(1, 4)
        length = rng.integers(max(seq_length // 3, 2), 4 * seq_length)
        docs.append(((start + step * np.arange(length)) % (vocab - 1)).astype(np.int32))
    # the last token id is the end-of-document token, outside the documents' own ids
    return write_synthetic_dataset(out, docs, eod_id=vocab - 1, docs_per_shard=100, vocab_size=vocab,
                                   seq_length=seq_length)


def stage_data(ctx: Context, deadline: float) -> dict:
    s, data = sizes(ctx), fresh(ctx.work / "multi") / "data"
    ctx.run([ctx.python, "bench/device_check_multi.py", "data", "--out", data, "--seq-length", s.seq_length,
             "--vocab", s.model["vocab_size"]], deadline, fresh(ctx.out / "multi") / "data.log")
    ranks = "2 gloo processes" if ctx.mode == "cpu" else f"2 of {ctx.device_count} {ctx.device} devices"
    return {"seq_length": s.seq_length, "vocab_size": s.model["vocab_size"], "ranks": ranks}


def run_config(ctx: Context, name: str, output: Path, overrides: dict) -> Path:
    s = sizes(ctx)
    cfg = {"model_name": TRAIN_CHECK_MODEL, "model_overrides": s.model, "data_path": str(ctx.work / "multi" / "data"),
           "output_path": str(output), "seq_length": s.seq_length, "batch_size": s.batch_size,
           "total_steps": s.steps, "save_steps": 0, "log_steps": 1, "learning_rate": 3e-3, "warmup_steps": 1,
           "mixed_precision": "fp32", "seed": 7, "device": "cpu" if ctx.mode == "cpu" else "auto", **overrides}
    path = ctx.out / "multi" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(ctx: Context, name: str, run: Run, output: Path, deadline: float) -> list[dict]:
    """Launch one run under torchrun on ``run.nproc`` ranks; its step records (later records of a step win)."""
    log = ctx.out / "multi" / f"{name}.log"
    log.unlink(missing_ok=True)
    cmd = [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", run.nproc,
           "-m", "qwen3_pretrain", "train", "--config", run_config(ctx, name, output, run.overrides)]
    # One thread per rank on a CPU: the ranks share its cores, and the one-device run computes like them.
    try:
        ctx.run(cmd, deadline, log, extra_env={"OMP_NUM_THREADS": "1"} if ctx.mode == "cpu" else None)
    finally:
        if (output / "metrics.jsonl").is_file():
            shutil.copy(output / "metrics.jsonl", ctx.out / "multi" / f"{name}_metrics.jsonl")
    return step_records(output)


def step_records(output: Path) -> list[dict]:
    by_step = {}
    path = output / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if "event" not in record and "loss" in record:
            by_step[record["step"]] = record
    return [by_step[k] for k in sorted(by_step)]


def run_output(ctx: Context, name: str) -> Path:
    return ctx.work / "multi" / name


# --- comparison --------------------------------------------------------------------------------------------------


def relative_diffs(got: list[dict], want: list[dict], key: str) -> float:
    return max((abs(g[key] - w[key]) / max(abs(w[key]), 1e-12) for g, w in zip(got, want)), default=0.0)


def compare(got: list[dict], want: list[dict], tol: Tolerance, what: str) -> dict:
    """Figures of ``got`` against the one-device records ``want``; StageFailed when a step is missing or a
    loss or gradient norm is further than ``tol`` (relative) from the one device's."""
    figures = {"steps": [r["step"] for r in got], "tolerance": vars(tol),
               "first_rel_loss_diff": relative_diffs(got[:1], want[:1], "loss"),
               "first_rel_grad_norm_diff": relative_diffs(got[:1], want[:1], "grad_norm"),
               "max_rel_loss_diff": relative_diffs(got, want, "loss"),
               "max_rel_grad_norm_diff": relative_diffs(got, want, "grad_norm"),
               "final_loss": got[-1]["loss"] if got else None}
    if not got or [r["step"] for r in got] != [r["step"] for r in want]:
        raise StageFailed(f"{what}: logged steps {figures['steps']}, the one-device run {[r['step'] for r in want]}",
                          "", figures)
    checks = [("first_rel_loss_diff", "the loss at the first step", tol.first_loss),
              ("first_rel_grad_norm_diff", "the gradient norm at the first step", tol.first_grad_norm),
              ("max_rel_loss_diff", "the loss", tol.loss), ("max_rel_grad_norm_diff", "the gradient norm", tol.grad_norm)]
    over = [f"{figures[key]:.2e} in {label} (allowed {allowed:.0e})" for key, label, allowed in checks
            if figures[key] > allowed]
    if over:
        raise StageFailed(f"{what}: differs from one device by {'; '.join(over)}: losses {[r['loss'] for r in got]} "
                          f"vs {[r['loss'] for r in want]}", "", figures)
    return figures


# --- stages ------------------------------------------------------------------------------------------------------


def stage_run(name: str, run: Run) -> Callable[[Context, float], dict]:
    def stage(ctx: Context, deadline: float) -> dict:
        if run.trained_by:  # its training is another stage's (MultiSizes.share_async_save)
            output = run_output(ctx, run.trained_by)
            got = step_records(output)
        else:
            output = run_output(ctx, name)
            shutil.rmtree(output, ignore_errors=True)
            got = train(ctx, name, run, output, deadline)
        if run.reference is None:
            if len(got) != sizes(ctx).steps:
                raise StageFailed(f"{name}: {len(got)} steps logged of {sizes(ctx).steps}",
                                  tail(ctx.out / "multi" / f"{name}.log"))
            return {"nproc": 1, "losses": [r["loss"] for r in got]}
        figures = {"nproc": run.nproc, **compare(got, step_records(run_output(ctx, run.reference)), run.tol, name)}
        if run.resume:
            figures |= resume_from_async_save(ctx, name, run, output, deadline)
        return figures

    return stage


def resume_from_async_save(ctx: Context, name: str, run: Run, output: Path, deadline: float) -> dict:
    """A run resumed from the checkpoint the asynchronous save wrote at step 2 (while steps 3 and on trained)
    logs the one-device run's losses from step 3."""
    from qwen3_pretrain.checkpoint.layout import LATEST, step_dir_name

    saved = run.overrides["save_steps"]
    resumed = run_output(ctx, f"{name}-resumed")
    shutil.rmtree(resumed, ignore_errors=True)
    shutil.copytree(output / step_dir_name(saved), resumed / step_dir_name(saved))
    (resumed / LATEST).write_text(step_dir_name(saved) + "\n")
    got = train(ctx, f"{name}-resumed", run, resumed, deadline)
    want = [r for r in step_records(run_output(ctx, run.reference)) if r["step"] > saved]
    figures = compare(got, want, run.tol, f"{name} resumed from step {saved}")
    return {"resumed_from": saved, "resumed_max_rel_loss_diff": figures["max_rel_loss_diff"],
            "resumed_max_rel_grad_norm_diff": figures["max_rel_grad_norm_diff"]}


def multi_stages(ctx: Context) -> list[Stage]:
    """``multi/data``, then each run as ``multi/<name>``, a one-device reference before the runs compared
    with it."""
    s = sizes(ctx)
    out = [Stage(DATA, stage_data, 120, ("env",), skip=too_few_devices)]
    for name, run in runs(s).items():
        needs = ("env", DATA) + tuple(f"multi/{n}" for n in (run.reference, run.trained_by) if n)
        cap = s.cap_s * (2 if run.overrides.get("compile") or run.overrides.get("async_save") else 1)
        out.append(Stage(f"multi/{name}", stage_run(name, run), cap, needs, 30.0, skip=too_few_devices))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["data"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    args = parser.parse_args(argv)
    manifest = write_data(args.out, args.seq_length, args.vocab)
    print(f"wrote {manifest['num_tokens']} tokens in {manifest['num_documents']} documents to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
