"""The roofline checked where it can be measured: real training on this CPU, its step priced from its own op
trace with this CPU's measured numbers, beside the measured step time and torch.profiler's per-category times.

    python bench/roofline_cpu.py                                  # every model x mode x layout
    python bench/roofline_cpu.py --models dense --modes eager --layouts 1p,dp2 --steps 3

Models: bench/train_cpu.py's tiny Qwen3 (hidden 256, 4 layers, the full 151,936 vocabulary, seq 512 x batch
4), its MoE (16 experts of 256, top-4) and its Qwen3.5 hybrid (3 Gated DeltaNet layers and 1 full-attention
layer), bf16 mixed precision. Modes: eager and compiled (``compile: true``, the decoder layers). Layouts:
``1p`` (one process, one thread), ``tp2`` and ``dp2`` (2 gloo processes, 1 thread each, the same global
batch). Each variant runs in fresh processes; per rank:

1. warm-up steps (compilation), then ``--steps`` timed steps: the measured step time is their median;
2. ``simulate.probe.measure_cpu`` at the rank's thread count (both ranks at once under tp2 / dp2, so each
   sees the memory bandwidth it shares): matmul TFLOP/s per dtype and shape class (square, skinny, the
   model's projections and its vocabulary head), streaming bandwidth, the host latency of one tiny op;
3. one step under ``torch.profiler``: self CPU time per op, summed by category (matmul, attention,
   elementwise, communication, other);
4. one step recorded by the roofline's op recorder (``StepRecorder``: ``simulate.roofline.RecordingMode``
   with the step's collectives counted per mesh axis; a compiled step recorded with dynamo off and priced
   with the roofline's fusion model) and priced on ``cpu_hardware``, the device table's "cpu" with the
   probe's figures: the predicted step time and its breakdown.

The table shows rank 0's figures: measured and predicted step seconds and their ratio (target: within 25%),
and per category the profiler's and the prediction's seconds (target: within 30%). On a CPU an op's host
cost and its computation run on the same thread one after the other, so the profiler's self time of an op
holds both; the prediction's host term is spread over the categories by the ops it counts in each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cpu import BATCH, HYBRID, MODEL, MOE, SEQ, free_port  # noqa: E402

from qwen3_pretrain.cli import PROCESS_ENV_DEFAULTS  # noqa: E402
from qwen3_pretrain.hardware import DEVICES, Hardware  # noqa: E402
from qwen3_pretrain.simulate.probe import CpuProbe, cpu_name, measure_cpu  # noqa: E402
from qwen3_pretrain.simulate.roofline import RecordingMode  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = {"dense": {}, "moe": MOE, "hybrid": HYBRID}
MODES = {"eager": {}, "compiled": {"compile": True}}
# name -> (processes, threads per process, config keys)
# One thread per process: on a machine whose load exceeds its cores, a 2-thread process waits at every parallel
# region for its descheduled second thread (measured at load 7 on 2 cores, dense eager: 9.5 s per step with 2
# threads, 1.1 s with 1), which no roofline describes; --threads sets the single process's.
LAYOUTS = {"1p": (1, 1, {}), "tp2": (2, 1, {"tp": 2}), "dp2": (2, 1, {})}
# The vocabulary cut from 151,936 so that the decoder layers, not the head and its loss, hold most of the step
# (at the full vocabulary the head's matmuls and the loss's vocabulary-wide elementwise work are ~80% of it)
VOCAB = 16384
CATEGORIES = ("matmul", "attention", "elementwise", "communication", "other")
# the profiler's "other" (the step outside every op: Python, autograd) is the roofline's host term on a CPU
PREDICTED = {"other": "host"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (compilation)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (151936: Qwen3's)")
    parser.add_argument("--json", help="also write every variant's per-rank results to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- the profiler's categories ---------------------------------------------------------------------------

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::matmul",
              "aten::linear", "aten::_weight_int8pack_mm")
ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention", "flex_attention")
COMM_MARKS = ("gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
              "broadcast", "record_param_comms", "wait_tensor", "nccl", "_functional_collectives")
# Inductor's compiled graphs: their self time is the fused kernels' (matmuls stay aten::mm extern calls).
COMPILED_MARKS = ("CompiledFxGraph", "CompiledFunction", "Torch-Compiled Region", "cpp_fused", "inductor")


def op_category(name: str) -> str:
    """The category of a profiler event by its name (an aten op, a record_function range, a Python frame)."""
    if name in MATMUL_OPS:
        return "matmul"
    lower = name.lower()
    if any(mark in lower for mark in ATTENTION_MARKS):
        return "attention"
    if any(mark in lower for mark in COMM_MARKS):
        return "communication"
    if name.startswith("aten::") or any(mark in name for mark in COMPILED_MARKS):
        return "elementwise"
    return "other"


def profiled_categories(step) -> dict[str, float]:
    """Seconds of self CPU time per category over one ``step()`` on this (the main) thread, and its wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.key_averages():
        seconds[op_category(event.key)] += event.self_cpu_time_total / 1e6
    # "other" is the step's time outside every op: Python, the autograd engine, hooks, the profiler's own
    # events (its self times do not count the Python between two ops)
    seconds["other"] = max(0.0, wall - sum(seconds[c] for c in CATEGORIES if c != "other"))
    seconds["wall"] = wall
    return seconds


# --- one variant's rank (a worker process) ---------------------------------------------------------------


def variant_config(model: str, mode: str, layout: str, data: str, out: str, vocab: int = VOCAB):
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig

    nproc, _, keys = LAYOUTS[layout]
    dp = nproc if "tp" not in keys else 1
    cfg = {"model_name": "qwen3.5-0.8b" if model == "hybrid" else "qwen3-0.6b",
           "model_overrides": dict(MODEL, vocab_size=vocab, **MODELS[model]), "data_path": data, "output_path": out,
           "seq_length": SEQ, "batch_size": BATCH // dp, "total_steps": 1000, "log_steps": 1000,
           "save_steps": 0, "learning_rate": 3e-4, "mixed_precision": "bf16",
           **({"moe_aux_loss": "none"} if model == "moe" else {}), **MODES[mode], **keys}
    return from_dict(TrainConfig, cfg, source=f"variant {model}-{mode}-{layout}")


def probe_shapes(model: str, layout: str, vocab: int = VOCAB) -> list[tuple[int, int, int]]:
    """(tokens, in, out) of the model's projections on one rank: attention's, the MLP's or an expert's, the
    vocabulary head's (one loss chunk of 1,024 tokens, the CPU default)."""
    nproc, _, keys = LAYOUTS[layout]
    tp = keys.get("tp", 1)
    tokens = SEQ * BATCH // (1 if tp > 1 else nproc)
    hidden = MODEL["hidden_size"]
    width = MOE["moe_intermediate_size"] if model == "moe" else MODEL["intermediate_size"]
    # an expert sees about tokens x top-k / experts rows
    rows = tokens * MOE["num_experts_per_tok"] // MOE["num_experts"] if model == "moe" else tokens
    return [(tokens, hidden, MODEL["num_attention_heads"] * MODEL["head_dim"] // tp),
            (rows, hidden, width // tp), (1024, hidden, vocab // tp)]


def probe_kernels(model: str, layout: str) -> dict:
    """The probe's expert-layer and attention sizes of one rank of this variant."""
    nproc, _, keys = LAYOUTS[layout]
    tp = keys.get("tp", 1)
    batch = BATCH // (1 if tp > 1 else nproc)
    heads, kv_heads = MODEL["num_attention_heads"] // tp, MODEL["num_key_value_heads"] // tp
    kernels = {"attention": (batch, heads, kv_heads, SEQ, MODEL["head_dim"])}
    if model == "moe":
        rows = batch * SEQ * MOE["num_experts_per_tok"]
        kernels["grouped"] = [(rows, MOE["num_experts"], MODEL["hidden_size"], MOE["moe_intermediate_size"] // tp)]
    return kernels


def worker(args: argparse.Namespace) -> None:
    from qwen3_pretrain.train.trainer import Trainer

    model, mode, layout = args.worker.split("-")
    nproc, threads, _ = LAYOUTS[layout]
    torch.set_num_threads(threads)
    rank = int(os.environ.get("RANK", 0))
    trainer = Trainer(variant_config(model, mode, layout, args.data, str(Path(args.out) / "run"), args.vocab))

    def step() -> float:
        return trainer.train_step()["loss"]

    for _ in range(args.warmup):
        step()
    # Steps and probes interleaved, so that both see the same spread of the machine's load; the medians of each.
    walls, probes = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
        probes.append(measure_cpu(probe_shapes(model, layout, args.vocab), min_seconds=0.01,
                                  **probe_kernels(model, layout)))
    probe = median_probe(probes)
    profiled = profiled_categories(step)
    predicted = predict_step(trainer, step, probe, mode == "compiled")
    trainer.close()
    result = {"wall_s": walls, "step_s": statistics.median(walls), "profiled": profiled,
              "probe": probe_json(probe), "predicted": predicted}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


def median_probe(probes: list[CpuProbe]) -> CpuProbe:
    """Each figure's median over ``probes``."""
    def med(get) -> float:
        return statistics.median(get(p) for p in probes)

    first = probes[0]
    return dataclasses.replace(
        first, matmul_tflops={k: med(lambda p: p.matmul_tflops[k]) for k in first.matmul_tflops},
        memory_gbps={k: med(lambda p: p.memory_gbps[k]) for k in first.memory_gbps},
        op_latency_us=med(lambda p: p.op_latency_us), autograd_op_latency_us=med(lambda p: p.autograd_op_latency_us),
        load_average=med(lambda p: p.load_average))


def probe_json(probe: CpuProbe) -> dict:
    return {"cpu": probe.cpu, "threads": probe.threads, "load": probe.load_average,
            "matmul_tflops": {f"{d} {s}": v for (d, s), v in probe.matmul_tflops.items()},
            "memory_gbps": probe.memory_gbps, "op_latency_us": probe.op_latency_us,
            "autograd_op_latency_us": probe.autograd_op_latency_us}


# --- the prediction: the roofline core's recorder and price, with this CPU's numbers ------------------------


aten = torch.ops.aten
SAME_MATMUL = {aten.mm.out: aten.mm.default, aten.addmm.out: aten.addmm.default,
               aten.addmm_.default: aten.addmm.default, aten.bmm.out: aten.bmm.default,
               aten.baddbmm_.default: aten.baddbmm.default}


class StepRecorder(RecordingMode):
    """The roofline's recorder of a real step, also counting the step's collectives by mesh axis (what the
    simulation's tracker does on fake tensors)."""

    def __init__(self, trainer) -> None:
        super().__init__()
        from qwen3_pretrain.parallel.dims import AXES
        from qwen3_pretrain.simulate.track import CommCounter

        mesh, engine = trainer.mesh, trainer.engine
        groups = {mesh[a].get_group().group_name: ("dp" if a.startswith("dp") else a) for a in AXES}
        for group in engine.dp_mesh.get_all_groups():
            groups.setdefault(group.group_name, "dp")
        if torch.distributed.is_initialized():
            groups.setdefault(torch.distributed.group.WORLD.group_name, "world")
        self.comm = CommCounter(groups)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented
        self.comm.count(func, args)
        out = func(*args, **(kwargs or {}))
        # The fused loss writes its matmuls into buffers (mm.out, addmm_), which the recorder would count as
        # memory-bound bytes: recorded as the functional matmul they compute.
        same = SAME_MATMUL.get(func)
        if same is not None:
            func, kwargs = same, {k: v for k, v in (kwargs or {}).items() if k != "out"}
        self.recorder.record(func, args, kwargs, out)
        return out


def measured_rate(probe: CpuProbe, trace, dtype: str) -> float:
    """TFLOP/s of the trace's ``dtype`` matmuls at the probe's rates for their shapes: each matmul at the
    rate of the probed linear layer with the same three sizes (or an expert layer's grouped rate), else at
    the skinny rate; the total FLOPs over the total time."""
    rates = {tuple(sorted(map(int, c.split("x")))): v for (d, c), v in probe.matmul_tflops.items()
             if d == dtype and c[0].isdigit()}
    grouped = [v for (_, c), v in probe.matmul_tflops.items() if c.startswith("grouped")]
    flops = seconds = 0.0
    for (_, dt, m, n, k, groups), calls in trace.matmuls.items():
        if dt.replace("bfloat16", "bf16").replace("float32", "fp32") != dtype:
            continue
        rate = grouped[0] if groups > 1 and grouped else rates.get(tuple(sorted((m, n, k))),
                                                                   probe.tflops(dtype, "skinny"))
        flops += 2.0 * m * n * k * calls
        seconds += 2.0 * m * n * k * calls / rate
    return flops / seconds if seconds else probe.tflops(dtype, "skinny")


def cpu_hardware(probe: CpuProbe, trace) -> Hardware:
    """The device table's "cpu" with this process's measured figures, the roofline's calibration:

    * matmul peaks: the probe's bf16 and fp32 rates at the trace's own matmul shapes (``measured_rate``),
      with ``matmul_efficiency`` undoing the roofline's shape share of the class they fall in (smallest side
      128-511: the shares model a GPU's tiles and waves; on these cores a 2048 x 256 x 256 product runs
      as fast as a square 1024^3);
    * ``memory_bandwidth_gbps``: the streaming fp32 add, at efficiency 1 (it is what a kernel achieves);
    * ``launch_latency_us``: one op of a training step under autograd (its forward, its backward node), the
      host cost of an eager op; ``compiled_launch_us``: one bare op's dispatch;
    * gloo between two processes of this machine: a ring step copies each byte out of and into a socket
      buffer, so the link is half the copy bandwidth (not measured: the probe has no second process).
    """
    from qwen3_pretrain.simulate.roofline.pricing import matmul_shape_share

    return dataclasses.replace(
        DEVICES["cpu"], name="cpu (measured)", peak_tflops=measured_rate(probe, trace, "bf16"),
        fp32_peak_tflops=measured_rate(probe, trace, "fp32"), tf32_peak_tflops=None,
        matmul_efficiency=1.0 / matmul_shape_share(2048, 256, 256),
        memory_bandwidth_gbps=probe.bandwidth_gbps, bandwidth_efficiency=1.0,
        launch_latency_us=probe.autograd_op_latency_us, compiled_launch_us=probe.op_latency_us,
        intra_node_gbps=probe.memory_gbps["copy"] / 2, source=f"measured by simulate.probe: {probe.cpu}")


def predict_step(trainer, step, probe: CpuProbe, compiled: bool) -> dict:
    """Record one real step with the roofline's recorder (eager ops: a compiled step's kernels are not aten
    ops, so the eager trace is priced as compiled, the roofline's fusion model) and price it on
    ``cpu_hardware``: {"step_s", seconds per category}."""
    from qwen3_pretrain.simulate.roofline import price
    from qwen3_pretrain.simulate.roofline.pricing import ATTENTION_SHARE

    recorder = StepRecorder(trainer)
    if compiled:
        torch._dynamo.config.disable = True  # record the ops the compiled graphs stand for
    try:
        with recorder:
            step()
    finally:
        torch._dynamo.config.disable = False
    hw = cpu_hardware(probe, recorder.trace)
    breakdown = price(recorder.trace, hw, compiled,
                      {key: tuple(value) for key, value in recorder.comm.calls_by_size.items()})
    result = {"step_s": breakdown.step, **breakdown.to_json(), "ops": sum(recorder.trace.host_ops.values())}
    # The roofline prices fused attention at a fixed share of the matmul peak (a GPU's FlashAttention); this
    # CPU's flash kernel reaches far less: the same seconds at the probe's measured attention rate.
    assumed = ATTENTION_SHARE * hw.peak_tflops
    result["attention_measured_rate"] = breakdown.attention * assumed / probe.tflops("bf16", "attention")
    result["step_s_attention_measured"] = breakdown.step - breakdown.attention + result["attention_measured_rate"]
    return result


# --- the driver ------------------------------------------------------------------------------------------


def synthetic_data(path: Path, vocab: int) -> str:
    """Random documents of ids below ``vocab`` (the step's cost does not depend on which tokens it reads)."""
    import numpy as np

    from qwen3_pretrain.data.synthetic import write_synthetic_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab - 1, rng.integers(100, 2000)) for _ in range(400)]
    write_synthetic_dataset(path, docs, eod_id=vocab - 1, vocab_size=vocab)
    return str(path)


def run_variant(name: str, args: argparse.Namespace, data: str, tmp: Path) -> list[dict]:
    nproc, threads, _ = LAYOUTS[name.split("-")[2]]
    out = tmp / name
    out.mkdir()
    script = [str(Path(__file__).resolve()), "--worker", name, "--data", data, "--out", str(out),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--vocab", str(args.vocab)]
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
        str(free_port())]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    for key, value in PROCESS_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    proc = subprocess.run(launcher + script, cwd=REPO, env=env, text=True, capture_output=True)
    if proc.returncode:
        raise RuntimeError(f"variant {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def print_table(rows: dict[str, list[dict]]) -> None:
    """Rank 0's row per variant: measured and predicted step, and the prediction with attention at the
    probe's measured rate (``att*``); per category the profiler's seconds / the prediction's."""
    head = f"{'variant':<20} {'meas s':>6} {'pred s':>6} {'ratio':>5} {'att* s':>6} {'ratio':>5}"
    for cat in CATEGORIES:
        head += f" {cat[:11]:>13}"
    print(head + "   (per category: profiler s / predicted s)")
    for name, ranks in rows.items():
        r = ranks[0]
        pred, meas = r["predicted"], r["step_s"]
        line = (f"{name:<20} {meas:>6.3f} {pred['step_s']:>6.3f} {pred['step_s'] / meas:>5.2f} "
                f"{pred['step_s_attention_measured']:>6.3f} {pred['step_s_attention_measured'] / meas:>5.2f}")
        for cat in CATEGORIES:
            line += f" {r['profiled'][cat]:>6.3f}/{pred.get(PREDICTED.get(cat, cat), 0.0):<6.3f}"
        print(line)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = [f"{m}-{mode}-{lay}" for m in args.models.split(",") for mode in args.modes.split(",")
             for lay in args.layouts.split(",")]
    print(f"cpu: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="roofline_cpu_") as tmp:
        data = synthetic_data(Path(tmp) / "data", args.vocab)
        for name in names:
            rows[name] = run_variant(name, args, data, Path(tmp))
            r = rows[name][0]
            print(f"  {name}: measured {r['step_s']:.3f} s, predicted {r['predicted']['step_s']:.3f} s; probe "
                  f"{json.dumps(r['probe'])}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
