"""Side by side on the CPU: this engine at its defaults against torchtitan at its defaults, one process.

    python bench/torchtitan_cpu.py --titan-python /path/to/venv/bin/python               # dense, bf16
    python bench/torchtitan_cpu.py --titan-python ... --model moe --precision bf16,fp32 --repeats 2
    python bench/torchtitan_cpu.py --titan-python ... --busy 1     # one busy-loop process beside the runs

torchtitan runs from another interpreter (``--titan-python``: a virtual environment with torchtitan
and its torch), so this project's environment needs no torchtitan; this file is both the driver (in
the project's environment) and the two workers (each in a fresh process of its side's interpreter,
importing only the standard library and torch at the top).

The models are bench/train_cpu.py's (Qwen3 of hidden 256, 4 layers, the full 151,936 vocabulary, tied
embeddings, seq 512 x batch 4; ``--model moe``: 16 experts of 256, top-4), written once as a
HuggingFace directory (transformers, seed 0) that both sides load, and both train on the same
token windows (the engine's loader over the bundled Wikipedia sample, saved for torchtitan). So the
first step's loss is the same function of the same weights and tokens on both sides; later steps
differ by the optimizers' defaults (torchtitan: AdamW lr 8e-4, weight decay 0.1 on every parameter,
200 warm-up steps, and for MoE its expert-bias load balancing; the engine: bench/train_cpu.py's keys).

Each side at its own defaults, the shapes and precision aside:

* the engine: ``Trainer.train_step`` with ``mixed_precision`` set, everything else default (the fused
  chunked head + loss with its chunk chosen from memory, no recompute, fp32 master weights);
* torchtitan: what its ``Trainer`` builds for one process (its ``qwen3`` model spec with the same
  widths, fused QKV, ``parallelize_qwen3``: selective activation checkpointing, FSDP2 over a 1-rank
  mesh with ``mixed_precision_param`` bf16 (fp32 for ``--precision fp32``), gradients reduced in
  fp32; ``ChunkedLossWrapper`` of 8 sequence chunks; ``default_adamw``, gradient clipping at 1.0),
  driven by the same steps its trainer runs (forward without the head, chunked loss with per-chunk
  backward, backward, clip, optimizer step), without its data loader, checkpointer and metrics.
  Two departures, both forced by the CPU: its default attention, FlexAttention, has no backward on a
  CPU in torch 2.13 (and varlen is CUDA's), so its blocks get torchtitan's own causal SDPA module;
  and its MoE router's fp32 autocast region is ignored on a CPU (torch's CPU autocast takes no fp32),
  so its router runs in the bf16 of the gathered weights there. torchtitan 0.3.0's MoE code imports
  ``triton`` even on a CPU: install it beside torchtitan (``pip install triton``), unused.

The runs alternate (A B B A ...), ``--repeats`` each, every run a fresh process. Per run: peak resident
memory (``ru_maxrss`` of the worker, the whole process from start-up), median and best wall time of
the steps after ``--warmup``, tokens/s, the losses. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SIDES = ("ours", "titan")


# --- shared by both workers (standard library and torch only) -------------------------------------


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rss_now_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def _run_steps(step, steps: int, out: Path, extra: dict) -> None:
    """Time ``step()`` ``steps`` times; write wall/CPU seconds, losses, RSS after each step and the peak."""
    walls, cpus, losses, rss = [], [], [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), _cpu_seconds()
        losses.append(step())
        walls.append(time.perf_counter() - wall)
        cpus.append(_cpu_seconds() - cpu)
        rss.append(_rss_now_gib())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    out.write_text(json.dumps({"wall_s": walls, "cpu_s": cpus, "loss": losses, "rss_gib": rss,
                               "peak_gib": peak, **extra}))


# --- the engine's worker ---------------------------------------------------------------------------


def ours_worker(args: argparse.Namespace) -> None:
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig
    from qwen3_pretrain.train.trainer import Trainer

    sys.path.insert(0, str(HERE))
    import train_cpu

    keys = {"model_name": f"bench-{args.model}", "model_path": args.hf, "data_path": args.data,
            "output_path": str(Path(args.out).parent / "ours_run"), "seq_length": train_cpu.SEQ,
            "batch_size": train_cpu.BATCH, "total_steps": 1000, "log_steps": 1000, "save_steps": 0,
            "learning_rate": 3e-4, "mixed_precision": args.precision}
    if args.model == "moe":
        keys["moe_aux_loss"] = "none"
    trainer = Trainer(from_dict(TrainConfig, keys, source="torchtitan_cpu ours"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    _run_steps(lambda: float(trainer.train_step()["loss"]), args.steps, Path(args.out),
               {"before_gib": before, "threads": torch.get_num_threads()})
    trainer.close()


# --- torchtitan's worker ---------------------------------------------------------------------------


def _titan_model_config(model: str):
    """torchtitan's Qwen3 config of bench/train_cpu.py's widths, through its own builders."""
    from torchtitan.models import qwen3 as tq
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, head_dim, vocab, layers = 256, 64, 151936, 4
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=40960, theta=1e6)
    common = dict(n_layers=layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, rope=rope,
                  attn_backend="flex")
    if model == "moe":
        blocks = tq._build_qwen3_moe_layers(moe_hidden_dim=256, num_experts=16, top_k=4,
                                            moe_comm_backend="standard", **common)
    else:
        blocks = tq._build_qwen3_layers(hidden_dim=768, **common)
    # Its default attention (FlexAttention) has no backward on a CPU in torch 2.13 and varlen is CUDA's:
    # torch's SDPA, causal, through torchtitan's own maskless module.
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    return tq.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=tq._qwen3_norm(dim), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=tq._EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tq._LINEAR_INIT),
        layers=blocks)


def titan_worker(args: argparse.Namespace) -> None:
    # torchtitan picks its device type when imported ("cuda" where no accelerator is found): a CPU here.
    import torch._utils
    torch._utils._get_available_device_type = lambda: "cpu"
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter, parallelize_qwen3

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallelism = ParallelismConfig()
    dims = ParallelDims.from_config(parallelism, 1)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    training = TrainingConfig(local_batch_size=4, seq_len=512,
                              mixed_precision_param="bfloat16" if args.precision == "bf16" else "float32")
    config = _titan_model_config(args.model)
    with torch.device("meta"):
        model = config.build()
    model = parallelize_qwen3(model, parallel_dims=dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=SelectiveAC.Config(), dump_folder=args.out)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    # The HF weights, placed as the sharded model's parameters are (DTensors on the 1-rank mesh).
    state = Qwen3StateDictAdapter(config, None).from_hf(load_file(str(Path(args.hf) / "model.safetensors")))
    targets = model.state_dict()
    for name, target in targets.items():
        if name not in state:  # buffers HF has no weights for (MoE's expert bias and token counts): as built
            continue
        value = state[name].to(target.dtype)
        targets[name] = (distribute_tensor(value, target.device_mesh, target.placements)
                         if isinstance(target, DTensor) else value)
    model.load_state_dict(targets)
    model.train()
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=config.vocab_size)).build()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = default_adamw().build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=1000)
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    batches = iter(torch.load(args.batches))

    def step() -> float:
        inputs, labels = next(batches)
        valid = (labels != -100).sum()
        optimizers.zero_grad()
        with context():
            # One causal window per row as the engine's default (no per-document positions or mask): the
            # positions its data loader would restart at each document run on over the whole row here.
            positions = torch.arange(inputs.shape[1]).expand_as(inputs)
            pred = model(inputs, positions=positions)
            loss, _ = loss_fn(pred, labels, valid, positions=positions)
            del pred
            loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), training.max_norm, foreach=True)
        optimizers.step()
        schedulers.step()
        return loss.detach().item()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    _run_steps(step, args.steps, Path(args.out), {"before_gib": before, "threads": torch.get_num_threads()})
    dist.destroy_process_group()


# --- the driver (the project's environment) --------------------------------------------------------


def check_titan(python: str) -> str:
    """torchtitan's and torch's versions in ``python``; SystemExit with what to do where it cannot run."""
    probe = "import torch, torchtitan.models.qwen3 as q; from importlib.metadata import version; " \
            "print(version('torchtitan'), torch.__version__)"
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except OSError as err:
        raise SystemExit(f"error: --titan-python {python} cannot be run ({err}): give the python of an "
                         "environment with torchtitan installed (pip install torchtitan)") from None
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SystemExit(f"error: --titan-python {python} cannot import torchtitan's Qwen3 ({last}): install "
                         "torchtitan (and triton, which its MoE imports even on a CPU) into that environment")
    return proc.stdout.strip()


def write_hf_model(model: str, path: Path) -> None:
    """bench/train_cpu.py's model as a HuggingFace directory (transformers' initialization, seed 0, fp32)."""
    import transformers

    sys.path.insert(0, str(HERE))
    import train_cpu

    torch.manual_seed(0)
    family = "Qwen3Moe" if model == "moe" else "Qwen3"
    config = getattr(transformers, f"{family}Config")(**train_cpu.model_keys(model), rope_theta=1e6,
                                                      max_position_embeddings=40960)
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(path, safe_serialization=True)


def write_batches(data: str, count: int, path: Path) -> None:
    """The first ``count`` global batches the engine's loader yields (bench/train_cpu.py's plain loop reads the
    same), as (input_ids, labels) pairs for torchtitan's worker."""
    from qwen3_pretrain.data.reader import GlobalBatchLoader, PackedDataset

    sys.path.insert(0, str(HERE))
    import train_cpu

    loader = GlobalBatchLoader(PackedDataset(data, train_cpu.SEQ, seed=1234), train_cpu.BATCH, 0, 1,
                               train_cpu.BATCH)
    batches = []
    for _ in range(count):
        mb = next(loader)[0]
        batches.append((mb["input_ids"].clone(), mb["labels"].clone()))
    torch.save(batches, path)


def run_side(side: str, precision: str, args: argparse.Namespace, paths: dict, index: int) -> dict:
    from qwen3_pretrain.cli import PROCESS_ENV_DEFAULTS

    out = paths["tmp"] / f"{side}-{precision}-{index}.json"
    python = sys.executable if side == "ours" else args.titan_python
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--precision", precision, "--model",
           args.model, "--steps", str(args.warmup + args.steps), "--hf", str(paths["hf"]), "--data",
           paths["data"], "--batches", str(paths["batches"]), "--out", str(out), "--port", str(29600 + index)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "PYTHONPATH")}
    env["PYTHONUNBUFFERED"] = "1"
    # Each side as its users run it: the engine with the defaults its entry point sets, torchtitan without.
    for key, value in PROCESS_ENV_DEFAULTS.items():
        if side == "ours":
            env.setdefault(key, value)
        else:
            env.pop(key, None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"error: the {side} {precision} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    r = json.loads(out.read_text())
    timed = r["wall_s"][args.warmup:]
    r.update(median_s=statistics.median(timed), best_s=min(timed),
             median_cpu_s=statistics.median(r["cpu_s"][args.warmup:]))
    return r


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def print_table(rows: list[tuple[str, str, int, dict]], args: argparse.Namespace) -> None:
    tokens = 512 * 4
    print(f"{'side':<6} {'prec':<5} {'run':>3} {'peak GiB':>8} {'before':>6} {'step s':>7} {'best s':>7} "
          f"{'CPU s':>6} {'tokens/s':>8}  losses")
    for side, precision, i, r in rows:
        losses = " ".join(f"{x:.4f}" for x in r["loss"][:4])
        print(f"{side:<6} {precision:<5} {i:>3} {r['peak_gib']:>8.2f} {r['before_gib']:>6.2f} {r['median_s']:>7.2f} "
              f"{r['best_s']:>7.2f} {r['median_cpu_s']:>6.2f} {tokens / r['median_s']:>8.0f}  {losses}")
    for precision in args.precision.split(","):
        side_rows = {s: [r for s2, p, _, r in rows if s2 == s and p == precision] for s in SIDES}
        med = {s: {k: statistics.median(r[k] for r in side_rows[s]) for k in ("peak_gib", "median_s")}
               for s in SIDES}
        best = {s: min(r["best_s"] for r in side_rows[s]) for s in SIDES}
        first = [side_rows[s][0]["loss"][0] for s in SIDES]
        print(f"{precision}: ours / torchtitan peak RSS x{med['ours']['peak_gib'] / med['titan']['peak_gib']:.2f} "
              f"({med['ours']['peak_gib']:.2f} vs {med['titan']['peak_gib']:.2f} GiB, medians); tokens/s "
              f"x{med['titan']['median_s'] / med['ours']['median_s']:.2f} by median step, "
              f"x{best['titan'] / best['ours']:.2f} by best step; step-1 loss {first[0]:.6f} vs {first[1]:.6f} "
              f"(relative difference {abs(first[0] - first[1]) / abs(first[1]):.1e})")
    for side, precision, i, r in rows:
        print(f"RSS GiB after each step, {side} {precision} run {i}: " + " ".join(f"{m:.2f}" for m in r["rss_gib"]))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--titan-python", help="python of an environment with torchtitan (and its torch)")
    parser.add_argument("--model", choices=("dense", "moe"), default="dense")
    parser.add_argument("--precision", default="bf16", help="comma-separated, of: bf16, fp32")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, interleaved")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes running beside the bench")
    parser.add_argument("--data", default=str(REPO / "runs/data/d_convert"),
                        help="converted data folder; built from the bundled dump when absent")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    for hidden in ("--hf", "--batches", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29600, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker and not args.titan_python:
        parser.error("--titan-python is required: the python of an environment with torchtitan installed")
    bad = [p for p in args.precision.split(",") if p not in ("bf16", "fp32")]
    if bad:
        parser.error(f"--precision {args.precision}: {', '.join(bad)} is not bf16 or fp32")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        (ours_worker if args.worker == "ours" else titan_worker)(args)
        return 0
    versions = check_titan(args.titan_python)
    sys.path.insert(0, str(HERE))
    import train_cpu

    print(f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores; torch {torch.__version__} (ours), "
          f"torchtitan {versions} (torchtitan, torch); model {args.model}; {args.busy} busy process(es); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="torchtitan_cpu_") as tmp:
        paths = {"tmp": Path(tmp), "hf": Path(tmp) / "hf", "batches": Path(tmp) / "batches.pt"}
        paths["data"] = train_cpu.ensure_data(args.data, Path(tmp))
        write_hf_model(args.model, paths["hf"])
        write_batches(paths["data"], args.warmup + args.steps, paths["batches"])
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            index = 0
            for precision in args.precision.split(","):
                for i in range(args.repeats):
                    for side in SIDES if i % 2 == 0 else reversed(SIDES):
                        r = run_side(side, precision, args, paths, index)
                        index += 1
                        rows.append((side, precision, i, r))
                        print(f"  {side} {precision} run {i}: peak {r['peak_gib']:.2f} GiB, step {r['median_s']:.2f} s "
                              f"(best {r['best_s']:.2f}), losses {[round(x, 4) for x in r['loss']]}", flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
