"""Training throughput and peak memory on CPU: this engine vs a plain ``transformers`` loop.

    python bench/train_cpu.py                                   # every variant (~15 min on 2 idle cores)
    python bench/train_cpu.py --variants hf-bf16,bf16 --steps 3
    python bench/train_cpu.py --profile bf16                    # where one engine step spends its time
    python bench/train_cpu.py --model moe --variants hf-bf16,bf16,hf-fp32,fp32   # Qwen3-MoE
    python bench/train_cpu.py --model hybrid --variants hf-fp32,fp32,hf-bf16,bf16   # Qwen3.5 (Gated DeltaNet)
    python bench/train_cpu.py --model moe --variants bf16-grow,bf16 --repeats 2 --warmup 2 --steps 18   # RSS curve

Model: Qwen3 with hidden 256, 4 layers, 4 heads, 2 KV heads, head_dim 64,
intermediate 768, the full 151,936 vocabulary, tied embeddings; seq 512, batch
4 (2,048 tokens per optimizer step); the bundled Wikipedia sample converted by
the project (``runs/data/d_convert``, built in a temporary folder when absent).
Each variant runs in a fresh process (or ``torchrun`` group), so its peak
resident memory (``ru_maxrss``, the largest rank's) is its own. Steps after
the warm-up ones are timed in wall and CPU seconds (user + system over all
threads and ranks); the table shows medians and the spread of the timed steps
(``p90/p50``, 1.0 perfectly steady), and after it each variant's resident memory
after every step (warm-up steps included; the largest rank's; in brackets the
part in transparent huge pages, ``/proc/self/smaps_rollup``): memory that keeps
growing from step to step shows there. On a shared machine the CPU time
is the steadier figure: the load average is printed before and after.
``--repeats N`` runs the list N times, interleaved (A B A B), each run its own row.

``bf16-grow`` is ``bf16`` without the heap trim (``cpu_malloc_trim: false``), ``bf16-trim1`` with it
after every step (``cpu_malloc_trim_growth: 0``, the default), ``bf16-trim5`` once resident memory has
grown by 5% (``cpu_malloc_trim_growth: 0.05``);
``bf16-unpadded-*`` are those with a CPU's bf16 expert groups unpadded (no row buckets,
models/ops/moe.py): the befores of bench/README.md's "bf16 memory that grows step by step".

``--model moe``: the same model with a mixture of 16 experts of 256, top-4
(renormalised), in place of every MLP (the active MLP width 1,024 beside the
dense 768), and ``Qwen3MoeForCausalLM`` in the plain loop (transformers'
default expert implementation; its router loss is off there, ``moe_aux_loss:
none`` in the engine, so both compute the same objective).

``--model hybrid``: Qwen3.5 of the same widths (the 0.8B preset's pattern: 3 Gated DeltaNet layers, then
a gated full-attention one, a quarter of each head rotated; Gated DeltaNet with 2 key heads and 4 value
heads of 64) and ``Qwen3_5ForCausalLM`` in the plain loop (transformers' CPU fallback kernels).

``hf-*`` is the plain loop: ``Qwen3ForCausalLM`` in fp32, AdamW, full logits
and ``F.cross_entropy``, gradient clipping, under ``torch.autocast("cpu",
bfloat16)`` for ``hf-bf16``, in a plain environment; ``hf-bf16-thp`` is the
same with the environment defaults the engine's entry point sets (huge pages
for large host buffers, see ``qwen3_pretrain.cli``). The other variants are
the engine's ``Trainer.train_step`` with the config keys shown, with those
defaults. DP scaling efficiency is
tokens/s of ``dp2`` (2 processes x 1 thread, batch 2 each) over twice that of
``dp1-1t`` (1 process, 1 thread, batch 4): the same global batch of 4. With
one core busy the other may clock higher and has the shared cache and memory
bandwidth to itself, so ``dp1-1t-pair`` (two independent ``dp1-1t`` runs at
once; its step time is one run's divided by two) is the baseline that isolates
what data parallelism itself costs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qwen3_pretrain.cli import PROCESS_ENV_DEFAULTS

REPO = Path(__file__).resolve().parents[1]
MODEL = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "intermediate_size": 768, "vocab_size": 151936, "tie_word_embeddings": True}
MOE = {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256, "norm_topk_prob": True}
# Qwen3.5 of the same widths: 3 Gated DeltaNet layers and 1 gated full-attention layer (a quarter of each
# head rotated), 2 key heads and 4 value heads of 64 in the Gated DeltaNet layers
HYBRID = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
          "linear_value_head_dim": 64,
          "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
SEQ, BATCH = 512, 4
# not a config key: models/ops/moe.py's CPU_BF16_BUCKETS, set in the worker before the model is built
BUCKETS = "cpu_bf16_buckets"
# name -> (kind, processes, threads per process, engine config keys)
VARIANTS = {
    "hf-bf16": ("hf", 1, 2, {"mixed_precision": "bf16"}),
    "hf-fp32": ("hf", 1, 2, {"mixed_precision": "fp32"}),
    "bf16": ("engine", 1, 2, {"mixed_precision": "bf16"}),
    "fp32": ("engine", 1, 2, {"mixed_precision": "fp32"}),
    # bf16 without the heap trim (train/host_memory.py); with it after every step instead of when memory grew
    "bf16-grow": ("engine", 1, 2, {"mixed_precision": "bf16", "cpu_malloc_trim": False}),
    "bf16-trim1": ("engine", 1, 2, {"mixed_precision": "bf16", "cpu_malloc_trim_growth": 0}),
    "bf16-trim5": ("engine", 1, 2, {"mixed_precision": "bf16", "cpu_malloc_trim_growth": 0.05}),
    # the previous defaults: a CPU's bf16 expert groups unpadded (no row buckets, models/ops/moe.py), the heap
    # trimmed after every step; and unpadded without any trim
    "bf16-unpadded-trim1": ("engine", 1, 2, {"mixed_precision": "bf16", "cpu_malloc_trim_growth": 0,
                                             BUCKETS: False}),
    "bf16-unpadded-grow": ("engine", 1, 2, {"mixed_precision": "bf16", "cpu_malloc_trim": False, BUCKETS: False}),
    "bf16-ac": ("engine", 1, 2, {"mixed_precision": "bf16", "activation_checkpointing": "full"}),
    "fp32-ac": ("engine", 1, 2, {"mixed_precision": "fp32", "activation_checkpointing": "full"}),
    "hf-bf16-thp": ("hf", 1, 2, {"mixed_precision": "bf16"}),
    "bf16-c4096": ("engine", 1, 2, {"mixed_precision": "bf16", "loss_chunk_tokens": 4096}),  # the GPU default
    "bf16-c1024": ("engine", 1, 2, {"mixed_precision": "bf16", "loss_chunk_tokens": 1024}),
    "bf16-c512": ("engine", 1, 2, {"mixed_precision": "bf16", "loss_chunk_tokens": 512}),
    "fp32-c1024": ("engine", 1, 2, {"mixed_precision": "fp32", "loss_chunk_tokens": 1024}),
    "dp1-1t": ("engine", 1, 1, {"mixed_precision": "bf16"}),
    # two independent dp1-1t runs at once: what 2 busy cores give without any data parallelism
    "dp1-1t-pair": ("engine", 2, 1, {"mixed_precision": "bf16", "batch_size": BATCH}),
    "dp2": ("engine", 2, 1, {"mixed_precision": "bf16"}),
    "dp2-replicated": ("engine", 2, 1, {"mixed_precision": "bf16", "distributed_optimizer": False}),
    # the same global batch with every layer split over 2 tp ranks (sequence parallel between blocks)
    "tp2": ("engine", 2, 1, {"mixed_precision": "bf16", "tp": 2, "batch_size": BATCH}),
    # the decoder layers compiled (torch.compile); the first steps pay for compilation (warm-up)
    "fp32-compile": ("engine", 1, 2, {"mixed_precision": "fp32", "compile": True}),
    "bf16-compile": ("engine", 1, 2, {"mixed_precision": "bf16", "compile": True}),
    # compiled as before the experts' groups were bucketed under compile (models/ops/moe.py: bucket_sizes)
    "bf16-unpadded-compile": ("engine", 1, 2, {"mixed_precision": "bf16", "compile": True, BUCKETS: False}),
    "bf16-ac-compile": ("engine", 1, 2, {"mixed_precision": "bf16", "activation_checkpointing": "full",
                                         "compile": True}),
}
INDEPENDENT = {"dp1-1t-pair"}  # variants whose processes are separate single-process runs
DEFAULT_VARIANTS = "hf-bf16,bf16,fp32,bf16-ac,bf16-c4096,bf16-c512,dp1-1t,dp1-1t-pair,dp2"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=1, help="run the variant list this many times, interleaved")
    parser.add_argument("--data", default=str(REPO / "runs/data/d_convert"),
                        help="converted data folder; built from the bundled dump when absent")
    parser.add_argument("--profile", metavar="VARIANT", help="profile one step of this engine variant instead")
    parser.add_argument("--model", choices=("dense", "moe", "hybrid"), default="dense",
                        help="the dense model, the same with a mixture of experts in every layer, or Qwen3.5 of its widths")
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- measuring -----------------------------------------------------------------------


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def memory_now_gib() -> tuple[float, float]:
    """(resident memory, of it anonymous memory in transparent huge pages) of this process now, in GiB:
    ``/proc/self/smaps_rollup``'s ``Rss`` and ``AnonHugePages`` (0, 0 where the file is missing)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0.0, 0.0
    kib = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:] if line.endswith("kB")}
    return kib.get("Rss", 0) / 2**20, kib.get("AnonHugePages", 0) / 2**20


def timed_steps(step, warmup: int, steps: int, phases=None) -> dict:
    """Run ``step()`` warmup + steps times; per-step wall and CPU seconds of the timed ones, and after every
    step (the warm-up ones too) the resident memory and its share in huge pages (``memory_now_gib``), the
    page faults (minor) and the times the process was preempted (involuntary context switches: a core
    taken by another process) during the step, and ``phases()``'s figures (the engine's phase times)."""
    walls, cpus, losses, rss, huge, faults, preempted, phase_s = [], [], [], [], [], [], [], []
    for i in range(warmup + steps):
        wall, cpu, usage = time.perf_counter(), cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF)
        losses.append(step())
        after = resource.getrusage(resource.RUSAGE_SELF)
        if i >= warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(cpu_seconds() - cpu)
        faults.append(after.ru_minflt - usage.ru_minflt)
        preempted.append(after.ru_nivcsw - usage.ru_nivcsw)
        phase_s.append(phases() if phases is not None else {})
        now, thp = memory_now_gib()
        rss.append(now)
        huge.append(thp)
    return {"wall_s": walls, "cpu_s": cpus, "loss": losses[-1], "peak_gib": peak_rss_gib(), "rss_gib": rss,
            "thp_gib": huge, "faults": faults, "preempted": preempted, "phase_s": phase_s}


def spread(values: list[float]) -> float:
    """p90 / p50 of ``values`` (nearest rank; 1.0 is perfectly steady): how far the slow steps stray from the
    typical one."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return p90 / statistics.median(ordered)


def matmul_tflops(dtype: torch.dtype, n: int = 2048, reps: int = 4) -> tuple[float, float]:
    """(TFLOP/s of an n^3 matmul by wall time, the same by CPU time x threads: what idle cores would give)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    wall, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(reps):
        a @ b
    flops = 2 * n**3 * reps
    return flops / (time.perf_counter() - wall) / 1e12, flops * torch.get_num_threads() / (cpu_seconds() - cpu) / 1e12


# --- the two training loops (run in a worker process) ---------------------------------------


def model_keys(model: str) -> dict:
    return dict(MODEL, **{"moe": MOE, "hybrid": HYBRID}.get(model, {}))


def engine_config(name: str, data: str, out: str, model: str = "dense"):
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig

    _, nproc, _, keys = VARIANTS[name]
    keys = {k: v for k, v in keys.items() if k != BUCKETS}
    moe = {"moe_aux_loss": "none"} if model == "moe" else {}
    preset = "qwen3.5-0.8b" if model == "hybrid" else "qwen3-0.6b"
    cfg = {"model_name": preset, "model_overrides": model_keys(model), "data_path": data, "output_path": out,
           "seq_length": SEQ, "batch_size": BATCH // nproc, "total_steps": 1000, "log_steps": 1000,
           "save_steps": 0, "learning_rate": 3e-4, **moe, **keys}
    return from_dict(TrainConfig, cfg, source=f"variant {name}")


def engine_step_fn(name: str, data: str, out: str, model: str = "dense"):
    from qwen3_pretrain.models.ops import moe
    from qwen3_pretrain.train.trainer import Trainer

    moe.CPU_BF16_BUCKETS = VARIANTS[name][3].get(BUCKETS, True)
    trainer = Trainer(engine_config(name, data, out, model))
    return lambda: trainer.train_step()["loss"], trainer


def hf_step_fn(name: str, data: str, model_kind: str = "dense"):
    """The plain loop on the same samples the engine's loader yields."""
    import torch.nn.functional as F
    import transformers

    from qwen3_pretrain.data.reader import GlobalBatchLoader, PackedDataset

    torch.manual_seed(1234)
    if model_kind == "hybrid":
        config = transformers.Qwen3_5TextConfig(**model_keys(model_kind), max_position_embeddings=40960,
                                                rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                                 "partial_rotary_factor": 0.25})
        model = transformers.Qwen3_5ForCausalLM(config)
    else:
        family = "Qwen3Moe" if model_kind == "moe" else "Qwen3"
        config = getattr(transformers, f"{family}Config")(**model_keys(model_kind), rope_theta=1e6,
                                                          max_position_embeddings=40960)
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)
    loader = GlobalBatchLoader(PackedDataset(data, SEQ, seed=1234), BATCH, 0, 1, BATCH)
    autocast = VARIANTS[name][3]["mixed_precision"] == "bf16"

    def step() -> float:
        mb = next(loader)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=mb["input_ids"]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), mb["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def worker(args: argparse.Namespace) -> None:
    kind, _, threads, _ = VARIANTS[args.worker]
    torch.set_num_threads(threads)
    rank = int(os.environ.get("RANK", os.environ.get("BENCH_COPY", 0)))
    trainer = None
    if kind == "hf":
        step = hf_step_fn(args.worker, args.data, args.model)
    else:
        step, trainer = engine_step_fn(args.worker, args.data, str(Path(args.out) / "run"), args.model)
    before = peak_rss_gib()
    warmup = args.warmup
    if args.profile:
        profile(step, warmup)
        warmup = 0
    phases = None
    if trainer is not None:  # the engine's phase marks (host times on a CPU) of the step just run
        def phases():
            return {k[5:-2]: round(v, 4) for k, v in trainer.observer.clock.read().items()
                    if k.startswith("time_") and k[5:-2] in ("data", "forward_backward", "reduce", "optimizer")}
    result = timed_steps(step, warmup, args.steps, phases)
    result["before_gib"] = before
    if trainer is not None:
        trainer.close()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


def profile(step, warmup: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(warmup):
        step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60), flush=True)
    # Sorted by inclusive time, the first rows are the phases: loss (with its gradients), backward, optimizer.
    print(averages.table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60), flush=True)


# --- the driver -----------------------------------------------------------------------------


def ensure_data(path: str, tmp: Path) -> str:
    """``path`` when it holds converted data; else convert the bundled Wikipedia sample into ``tmp``."""
    if (Path(path) / "manifest.json").is_file():
        return path
    dump = next((REPO / "assets/enwiki-sample").glob("*.bz2"))
    parquet, out = tmp / "wiki.parquet", tmp / "d_convert"
    print(f"{path} holds no converted data: converting {dump.name} into {out}", flush=True)
    for cmd in (["wiki2parquet", "--input", str(dump), "--output", str(parquet)],
                ["convert", "--config", "examples/pretain_data_config.yaml", f"input_path={parquet}",
                 f"output_path={out}", "seq_length=512", "shards=2"]):
        subprocess.run([sys.executable, "-m", "qwen3_pretrain", *cmd], cwd=REPO, check=True, capture_output=True)
    return str(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(name: str, args: argparse.Namespace, data: str, tmp: Path) -> dict:
    """One variant in its own process(es); the per-rank results merged."""
    _, nproc, threads, _ = VARIANTS[name]
    out = Path(tempfile.mkdtemp(prefix=f"{name}_", dir=tmp))

    def worker_script(out_dir: Path) -> list[str]:
        script = [str(Path(__file__).resolve()), "--worker", name, "--data", data, "--out", str(out_dir),
                  "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model]
        return script + (["--profile=" + name] if args.profile else [])

    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
        str(free_port())]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    # The engine's processes get the environment defaults its entry point sets (huge pages for large host
    # buffers); the plain loop runs as users run it, or with the same defaults for the "-thp" variants.
    for key, value in PROCESS_ENV_DEFAULTS.items():
        if VARIANTS[name][0] == "engine" or name.endswith("-thp"):
            env.setdefault(key, value)
        else:
            env.pop(key, None)
    if name in INDEPENDENT:
        for i in range(nproc):
            (out / f"copy{i}").mkdir()
        procs = [subprocess.Popen([sys.executable, *worker_script(out / f"copy{i}")], cwd=REPO,
                                  env=dict(env, BENCH_COPY=str(i)), text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) for i in range(nproc)]
        for i, p in enumerate(procs):
            _, err = p.communicate()
            if p.returncode:
                raise RuntimeError(f"variant {name} copy {i} failed ({p.returncode}):\n{err[-3000:]}")
        ranks = [json.loads((out / f"copy{i}" / f"rank{i}.json").read_text()) for i in range(nproc)]
        # Separate runs, each with the whole batch: the pair's step time is that of one run's step,
        # counted as processing nproc batches (see print_table).
        return {"wall_s": statistics.median(w for r in ranks for w in r["wall_s"]) / nproc,
                "cpu_s": statistics.median(c for r in ranks for c in r["cpu_s"]),
                "peak_gib": max(r["peak_gib"] for r in ranks), "before_gib": max(r["before_gib"] for r in ranks),
                "loss": ranks[0]["loss"], "spread": spread([w for r in ranks for w in r["wall_s"]]),
                "rss_gib": ranks[0]["rss_gib"], "thp_gib": ranks[0]["thp_gib"]}
    proc = subprocess.run(launcher + worker_script(out), cwd=REPO, env=env, text=True, capture_output=not args.profile)
    if proc.returncode:
        raise RuntimeError(f"variant {name} failed ({proc.returncode}):\n{(proc.stderr or '')[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    # Ranks step in lock-step (the loss all-reduce): rank 0's wall time is the step's; CPU time adds up.
    cpu = [sum(r["cpu_s"][i] for r in ranks) for i in range(args.steps)]
    return {"wall_s": statistics.median(ranks[0]["wall_s"]), "cpu_s": statistics.median(cpu),
            "peak_gib": max(r["peak_gib"] for r in ranks), "before_gib": max(r["before_gib"] for r in ranks),
            "loss": ranks[0]["loss"], "spread": spread(ranks[0]["wall_s"]), "spread_cpu": spread(cpu),
            # the largest rank's resident memory after each step
            "rss_gib": [max(r["rss_gib"][i] for r in ranks) for i in range(len(ranks[0]["rss_gib"]))],
            "thp_gib": [max(r["thp_gib"][i] for r in ranks) for i in range(len(ranks[0]["thp_gib"]))],
            # rank 0's timed steps one by one: wall and CPU seconds, and for every step (warm-up included)
            # page faults, preemptions and the engine's phases
            "per_step": {"wall_s": ranks[0]["wall_s"], "cpu_s": cpu, "faults": ranks[0].get("faults", []),
                         "preempted": ranks[0].get("preempted", []), "phase_s": ranks[0].get("phase_s", [])}}


def describe(name: str) -> str:
    kind, nproc, threads, keys = VARIANTS[name]
    label = "transformers loop" if kind == "hf" else "engine"
    keys = {k: v for k, v in keys.items() if kind == "engine" or k != "mixed_precision"}
    if kind == "hf":
        keys["autocast"] = "bf16" if VARIANTS[name][3]["mixed_precision"] == "bf16" else "off"
    return f"{label} {nproc}p x {threads}t " + " ".join(f"{k}={v}" for k, v in keys.items())


def header(model: str) -> None:
    torch.set_num_threads(2)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    isa = " ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f") if f in flags) or "none of amx/avx512"
    print(f"machine: {cpu}, {os.cpu_count()} cores, flags: {isa}; torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.1f}")
    for dtype in (torch.bfloat16, torch.float32):
        wall, cpu = matmul_tflops(dtype)
        print(f"matmul 2048^3 {str(dtype)[6:]:<8} 2 threads: {wall:.3f} TFLOP/s by wall, {cpu:.3f} by CPU time")
    print(f"model: {model_keys(model)}; seq {SEQ} x batch {BATCH} = {SEQ * BATCH} tokens per step")


def rounded(value):
    return [round(v, 3) for v in value] if isinstance(value, list) else round(value, 3)


def print_table(rows: dict[str, dict]) -> None:
    print(f"{'variant':<11} {'loss':>7} {'step s':>7} {'p90/p50':>7} {'CPU s':>6} {'tokens/s':>9} {'tok/CPU-s':>9} "
          f"{'before GiB':>10} {'peak GiB':>9}  what")
    for name, r in rows.items():
        tokens = SEQ * BATCH
        print(f"{name:<11} {r['loss']:>7.3f} {r['wall_s']:>7.2f} {r['spread']:>7.2f} {r['cpu_s']:>6.2f} "
              f"{tokens / r['wall_s']:>9.0f} {tokens / r['cpu_s']:>9.0f} {r['before_gib']:>10.2f} "
              f"{r['peak_gib']:>9.2f}  {describe(name.split('#')[0])}")
    # Resident memory after each step (warm-up steps included; in huge pages in brackets): a run whose memory
    # plateaus shows the same figure from its third step on.
    for name, r in rows.items():
        curve = " ".join(f"{m:.2f}({h:.2f})" for m, h in zip(r["rss_gib"], r["thp_gib"]))
        print(f"RSS GiB after each step, {name}: {curve}")
    # Step by step (timed steps; the warm-up steps' faults and phases left out): what a slow step did more of.
    for name, r in rows.items():
        steps = r.get("per_step")
        if not steps:
            continue
        skip = len(steps["faults"]) - len(steps["wall_s"])
        for i, (wall, cpu) in enumerate(zip(steps["wall_s"], steps["cpu_s"])):
            phase = steps["phase_s"][skip + i] if steps["phase_s"] else {}
            parts = " ".join(f"{k}={v:.3f}" for k, v in phase.items())
            print(f"  {name} step {skip + i + 1}: wall {wall:.3f} s, CPU {cpu:.3f} s, "
                  f"{steps['faults'][skip + i]} page faults, {steps['preempted'][skip + i]} preemptions; {parts}")
    # Wall-time spread beside CPU-time spread: slow steps that took no more CPU time waited for a core (load),
    # slow steps that took more did more work (page faults, cache misses, a kernel's slower path).
    for name, r in rows.items():
        if "spread_cpu" in r:
            print(f"p90/p50 of step times, {name}: {r['spread']:.2f} by wall, {r['spread_cpu']:.2f} by CPU time")
    if "dp1-1t" in rows and "dp2" in rows:
        one, two = rows["dp1-1t"], rows["dp2"]
        print(f"DP scaling efficiency dp2 vs 2 x dp1-1t: {one['wall_s'] / (2 * two['wall_s']):.0%} by wall time, "
              f"{one['cpu_s'] / two['cpu_s']:.0%} by CPU time (work added by the second rank)")
    if "dp1-1t-pair" in rows and "dp2" in rows:
        pair, two = rows["dp1-1t-pair"], rows["dp2"]
        print(f"DP scaling efficiency dp2 vs two dp1-1t runs at once (both cores busy, no communication): "
              f"{pair['wall_s'] / two['wall_s']:.0%} by wall time")
    # Each variant against bf16-grow (no trim) where both ran: medians over the interleaved repeats' steps.
    runs: dict[str, list] = {}
    for n, r in rows.items():
        runs.setdefault(n.split("#")[0], []).append(r)
    if "bf16-grow" in runs:
        def median_of(v: str, k: str) -> float:
            return statistics.median(x for r in runs[v] for x in r.get("per_step", {}).get(k, [r[k]]))
        for v in runs:
            if v != "bf16-grow" and v.startswith("bf16"):
                print(f"{v} vs bf16-grow: median step x{median_of(v, 'wall_s') / median_of('bf16-grow', 'wall_s'):.3f} "
                      f"by wall, x{median_of(v, 'cpu_s') / median_of('bf16-grow', 'cpu_s'):.3f} by CPU time "
                      f"(all timed steps of {len(runs[v])} and {len(runs['bf16-grow'])} runs)")
    base = rows.get("hf-bf16")
    for name, r in rows.items():
        variant = VARIANTS[name.split("#")[0]]
        if base is not None and variant[0] == "engine" and variant[1:3] == (1, 2):
            print(f"{name} vs hf-bf16: x{base['wall_s'] / r['wall_s']:.2f} tokens/s by wall, "
                  f"x{base['cpu_s'] / r['cpu_s']:.2f} by CPU time, x{r['peak_gib'] / base['peak_gib']:.2f} peak RSS")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = [args.profile] if args.profile else [n.strip() for n in args.variants.split(",") if n.strip()]
    names = names * max(1, args.repeats)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"error: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    header(args.model)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="train_cpu_") as tmp:
        data = ensure_data(args.data, Path(tmp))
        for i, name in enumerate(names):
            label = name if name not in names[:i] else f"{name}#{names[:i].count(name) + 1}"
            rows[label] = run_variant(name, args, data, Path(tmp))
            print(f"  {label}: {json.dumps({k: rounded(v) for k, v in rows[label].items() if k != 'per_step'})}",
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
