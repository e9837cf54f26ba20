"""The roofline checked where it can be measured: real training on this CPU, its step priced from its own op
trace with this CPU's measured numbers, beside the measured step time and torch.profiler's per-category times.

    python bench/roofline_cpu.py                                  # every model x mode x layout
    python bench/roofline_cpu.py --models dense --modes eager --layouts 1p,dp2 --steps 3
    python bench/roofline_cpu.py --repeats 3 --json runs.json     # each variant 3 times: per-cell medians
    python bench/roofline_cpu.py --summarize runs.json more.json  # the tables of earlier runs, together

Models: bench/train_cpu.py's tiny Qwen3 (hidden 256, 4 layers, the full 151,936 vocabulary, seq 512 x batch
4), its MoE (16 experts of 256, top-4) and its Qwen3.5 hybrid (3 Gated DeltaNet layers and 1 full-attention
layer), bf16 mixed precision. Modes: eager and compiled (``compile: true``, the decoder layers). Layouts:
``1p`` (one process, one thread), ``tp2`` and ``dp2`` (2 gloo processes, 1 thread each, the same global
batch). Each variant runs in fresh processes; per rank:

1. warm-up steps (compilation), then one step recorded by the roofline's op recorder (``StepRecorder``:
   ``simulate.roofline.RecordingMode`` with the step's collectives counted per mesh axis and the expert
   layers' group sizes as routing gave them; a compiled step recorded with dynamo off, its compiled modules
   marked as the compiled scope) and one untimed step;
2. ``--steps`` timed steps, the ranks lined up (a barrier) before each: the measured step time is their median;
   after each, ``simulate.probe.measure_cpu`` at the rank's thread count (both ranks at once under tp2 / dp2, so each
   sees the memory bandwidth it shares): matmul TFLOP/s per dtype and shape class (square, skinny, tiny, the
   model's projections and its vocabulary head, the expert layer's grouped products at the recorded group
   sizes), causal SDPA, the triangular solves at the trace's own shapes (the hybrid's chunk inverse),
   streaming bandwidth and the bandwidth by working-set size (0.5 to 128 MiB); on 2 processes, each collective
   kind's link on its own group at its own message (``measure_links``), the median fit over the steps
   (``median_links``); each timed step's minor page faults, and of them the transparent huge pages (the
   machine's count over the ranks), and the pages the trainer's ``malloc_trim`` hands back;
3. ``--profiled-steps`` steps under ``torch.profiler``: self CPU time per op, summed by category (matmul,
   attention, elementwise, communication, other), each category's median over the steps; torch.distributed's
   Python collectives timed whole (``CollectiveClock``: gloo's wait is no op, the profiler alone would put it
   under "other"), and the middle step's split across the ranks into waiting for the later rank and transfer
   (``collective_split``);
4. the recorded step priced on ``CpuProbe.hardware`` (the probes' medians; compiled with the roofline's
   fusion model): the predicted step time and its breakdown.

The host cost per op comes from a calibration run before the variant (``--tiny``): the same model, mode and
layout at tiny shapes (hidden 64, vocabulary 512, seq 64), where the arithmetic is negligible: its median step
time over the ops its trace counts is the host's cost per eager op (the engine's Python, autograd, hooks, the
optimizer's loop); compiled, what is left of its step time after the ops outside the compiled scope at that
eager cost, over the compiled scope's kernels. Its profiled steps' median share of the step outside every op
is the host term's share the table compares with the profiler's "other" (below).

The table shows rank 0's figures: measured and predicted step seconds and their ratio (target: within 25%),
and per category the profiler's and the prediction's seconds (target: within 30%, or both under 5 ms), then
the tally against the targets. With ``--repeats N`` every variant runs N times, round after round (so that a
slow window of a shared machine falls on different variants' runs), and a last table gives each figure's
median over the rounds with the spread of each cell's profiled seconds (max over min): the tally then also
counts, per category, the cells that reproduce within 30% and how many of those meet the target. On a CPU an op's host
cost and its computation run on the same thread one after the other, so the profiler's self time of an op
holds its dispatch as well as its work, while the prediction's host term holds each op's whole host cost.
The table splits the host term as the calibration run's profile splits its step: the share outside every op
is compared with the profiler's "other", the rest is added to the categories by their op counts
(``profiler_view``; the step total is unchanged).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cpu import BATCH, HYBRID, MODEL, MOE, SEQ, free_port  # noqa: E402

from qwen3_pretrain.cli import PROCESS_ENV_DEFAULTS  # noqa: E402
from qwen3_pretrain.simulate.probe import (  # noqa: E402
    CpuProbe, cpu_name, huge_page_faults, measure_cpu, minor_faults)
from qwen3_pretrain.simulate.roofline import RecordingMode  # noqa: E402
from qwen3_pretrain.simulate.roofline.pricing import fault_seconds, page_seconds  # noqa: E402
from qwen3_pretrain.simulate.track import _KINDS as _COMM_KINDS  # noqa: E402

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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (compilation)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (151936: Qwen3's)")
    parser.add_argument("--json", help="also write every round's per-variant, per-rank results to this file")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds: every variant run this many times in fresh processes, one round after "
                             "another (a variant's runs spread over the whole bench); the table of each "
                             "cell's median over the rounds and how far its profiled seconds moved")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="run nothing: the tables of these --json files' rounds, together")
    parser.add_argument("--denormals", choices=("flush", "keep"), default="flush",
                        help="denormal floats flushed to zero in every worker (the engine's default on a CPU, "
                             "cpu_flush_denormal) or computed as such (10-150x slower on x86)")
    parser.add_argument("--link-statistic", choices=("mean", "median"), default="mean",
                        help="2 processes: each collective kind's link fitted to its calls' mean time (what a "
                             "step of many calls pays, their slow tail included) or their median")
    parser.add_argument("--profiled-steps", type=int, default=3,
                        help="steps profiled per variant (each category's median) and per host calibration")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host-us", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- the profiler's categories ---------------------------------------------------------------------------

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::matmul",
              "aten::linear", "aten::_weight_int8pack_mm",
              "aten::linalg_solve_triangular")  # a BLAS-3 kernel: the roofline prices it with the matmuls
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


# torch.distributed's Python collectives: what FSDP2 (all-gathers) and the engine's CPU reduce-scatter (an
# all-reduce) call, each waiting for its gloo work before it returns
COLLECTIVE_CALLS = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                    "reduce_scatter_tensor", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single")


class CollectiveClock:
    """While active, each of torch.distributed's Python collectives (``COLLECTIVE_CALLS``) runs inside a
    ``record_function`` range named "c10d collective (call and wait)" and its wall seconds add to
    ``seconds``. A call without ``async_op`` on gloo waits in ``Work.wait``, which is no op: the profiler's
    self times saw 0.008 of the 0.058 s that 10 all-reduces of 4 MB took on 2 processes, and put the rest
    in the time outside every op. The range gives the wait to the communication category (its own self
    time: the call's wall less the ops inside it)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        # per call: (name, bytes of its first tensor, entry and exit on the wall clock, which every process of
        # the machine shares: the ranks' entries give the skew, the last entry to the exit the transfer)
        self.calls: list[tuple[str, int, float, float]] = []
        self._depth = 0
        self._saved: dict = {}

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            if self._depth:  # a collective built on another: timed once, outermost
                return fn(*args, **kwargs)
            self._depth += 1
            first = args[0] if args else None
            nbytes = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
            entry, start = time.time(), time.perf_counter()
            try:
                with torch.profiler.record_function("c10d collective (call and wait)"):
                    return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls.append((fn.__name__, nbytes, entry, time.time()))
                self._depth -= 1
        return timed

    def __enter__(self) -> "CollectiveClock":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            for name in COLLECTIVE_CALLS:
                fn = getattr(module, name, None)
                if fn is not None:
                    self._saved[(module, name)] = fn
                    setattr(module, name, self._wrap(fn))
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), fn in self._saved.items():
            setattr(module, name, fn)
        self._saved.clear()


def profiled_categories(step) -> dict[str, float]:
    """Seconds of self CPU time per category over one ``step()`` on this (the main) thread, and its wall time;
    the Python collectives' waits in the communication category (``CollectiveClock``), "collective_s" their
    whole wall time, "cpu_s" the process's CPU time over the step (every thread: gloo's, the data loader's)."""
    from torch.profiler import ProfilerActivity, profile

    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    with CollectiveClock() as clock, profile(activities=[ProfilerActivity.CPU]) as prof:
        start, cpu, faults, huge = time.perf_counter(), time.process_time(), minor_faults(), huge_page_faults()
        step()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        faults, huge = minor_faults() - faults, huge_page_faults() - huge
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    ops = {}
    for event in prof.key_averages():
        seconds[op_category(event.key)] += event.self_cpu_time_total / 1e6
        if event.self_cpu_time_total > 0:
            ops[event.key] = (event.self_cpu_time_total / 1e6, event.count)
    # "other" is the step's time outside every op: Python, the autograd engine, hooks, the profiler's own
    # events (its self times do not count the Python between two ops)
    seconds["other"] = max(0.0, wall - sum(seconds[c] for c in CATEGORIES if c != "other"))
    seconds["wall"] = wall
    seconds["collective_s"], seconds["cpu_s"], seconds["collectives"] = clock.seconds, cpu, clock.calls
    seconds["ops"] = ops  # self seconds and calls per event name
    # the step's minor page faults, and of them the huge pages (the machine's count over the ranks, which
    # profile at once): a profiled step's are not a timed step's (the profiler's own buffers, the probes'
    # allocations before it moving glibc's mmap threshold)
    seconds["faults"], seconds["huge_faults"] = faults, min(faults, round(huge / ranks))
    return seconds


def profiled_runs(step, repeats: int) -> list[dict]:
    """``profiled_categories`` of ``repeats`` steps (one at least), the ranks lined up before each."""
    runs = []
    for _ in range(max(repeats, 1)):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        runs.append(profiled_categories(step))
    return runs


def profiled_steps(step, repeats: int) -> dict:
    """``profiled_categories`` over ``repeats`` steps, the ranks lined up before each: each category's, the wall's
    and the CPU time's median (one profiled step's categories moved by 10-40% between runs at a load of 2 on 2
    cores: a descheduled rank's gap lands in "other" or in its collectives' waits); the per-op times and the
    collectives of the middle step, the same step on every rank (``collective_split`` matches them)."""
    runs = profiled_runs(step, repeats)
    out = dict(runs[len(runs) // 2])
    for key in (*CATEGORIES, "wall", "collective_s", "cpu_s", "faults", "huge_faults"):
        out[key] = statistics.median(r[key] for r in runs)
    out["repeats"] = len(runs)
    return out


# --- one variant's rank (a worker process) ---------------------------------------------------------------


# The host calibration's model (``--tiny``): the same layers at negligible arithmetic
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "moe_intermediate_size": 32, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16}
TINY_VOCAB, TINY_SEQ = 512, 64


def variant_config(model: str, mode: str, layout: str, data: str, out: str, vocab: int = VOCAB, tiny: bool = False):
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig

    nproc, _, keys = LAYOUTS[layout]
    dp = nproc if "tp" not in keys else 1
    overrides = dict(MODEL, vocab_size=vocab, **MODELS[model])
    if tiny:
        overrides.update({k: v for k, v in TINY.items() if k in overrides}, vocab_size=TINY_VOCAB)
    cfg = {"model_name": "qwen3.5-0.8b" if model == "hybrid" else "qwen3-0.6b",
           "model_overrides": overrides, "data_path": data, "output_path": out,
           "seq_length": TINY_SEQ if tiny else SEQ, "batch_size": BATCH // dp, "total_steps": 1000, "log_steps": 1000,
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
    # the engine sets it at start-up from cpu_flush_denormal; set here too, before any kernel, so that the
    # bench's choice holds whatever the config's default
    torch.set_flush_denormal(args.denormals == "flush")
    rank = int(os.environ.get("RANK", 0))
    cfg = variant_config(model, mode, layout, args.data, str(Path(args.out) / "run"), args.vocab, args.tiny)
    if hasattr(cfg, "cpu_flush_denormal"):
        cfg = dataclasses.replace(cfg, cpu_flush_denormal=args.denormals == "flush")
    trainer = Trainer(cfg)

    def step() -> float:
        return trainer.train_step()["loss"]

    for _ in range(args.warmup):
        step()
    if args.tiny:
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(host_calibration(trainer, step, mode, args)))
        trainer.close()
        return
    # The step's trace first: the probe times the expert kernel at the group sizes its routing gave; then one
    # untimed step (what recording with dynamo off might have invalidated recompiles there).
    recorder = record_step(trainer, step, mode == "compiled")
    step()
    # Steps and probes interleaved, so that both see the same spread of the machine's load; the medians of each.
    walls, probes, faults, huge, link_runs = [], [], [], [], []
    released = ReleaseCounter(trainer)
    for _ in range(args.steps):
        # the ranks lined up before each timed step: the probe after a step takes each rank its own time, and a
        # rank that started its next step sooner waited at its first collective for the other's probe (the
        # step timed 1.1-1.5 s on one rank against 0.5 on the other, both dp2 ranks' profiled walls 0.65)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        start, taken, huge_taken = time.perf_counter(), minor_faults(), huge_page_faults()
        step()
        walls.append(time.perf_counter() - start)
        faults.append(minor_faults() - taken)
        # the machine's count, over the ranks that stepped at once (each rank's own is not counted)
        huge.append(min(faults[-1], round((huge_page_faults() - huge_taken) / nproc)))
        probes.append(measure_cpu(probe_shapes(model, layout, args.vocab), min_seconds=0.01,
                                  group_counts=recorder.group_counts, **probe_kernels(model, layout),
                                  solves=[key[1:] for key in recorder.trace.solves]))
        link_runs.append(measure_links(recorder, args.link_statistic))
    released.close()  # the timed steps' releases only
    probe = median_probe(probes)
    links = median_links(link_runs)
    if links:
        main = links[0]  # the kind that moved the most bytes: the link of kinds not measured
        probe = dataclasses.replace(probe, link_gbps=main["gbps"], link_latency_us=main["latency_us"],
                                    links={k["kind"]: (k["gbps"], k["latency_us"]) for k in links},
                                    straggler_share=measure_stragglers(recorder, statistics.median(walls)))
    host = json.loads(args.host_us)
    probe = dataclasses.replace(probe, engine_op_us=host["eager_us"], engine_compiled_us=host.get("compiled_us"))
    # The profiler's first start in a process takes a while, and not alike on every rank: a rank that starts
    # sooner waits at its first collective for the other (0.4-1.5 s of "communication" on one rank of the
    # dp2 rows, 0.03-0.07 on the other). One start before, and the ranks lined up after it.
    profiled_categories(lambda: None)
    profiled = profiled_steps(step, args.profiled_steps)
    # the timed steps' (compiled: not the recording's)
    recorder.trace.page_faults = int(statistics.median(faults))
    recorder.trace.huge_page_faults = int(statistics.median(huge))
    recorder.trace.pages_released = int(statistics.median(released.pages)) if released.pages else 0
    predicted = predict_step(recorder, probe, mode == "compiled")
    # the profiled steps' own faults at the same costs: what the profiler's categories hold
    predicted["profiled_page_faults"] = fault_seconds(profiled["faults"], profiled["huge_faults"], probe.page_fault_us,
                                                      probe.huge_page_fault_us)
    predicted["per_op"] = per_op_view(recorder, probe.hardware(recorder.trace), profiled["ops"])
    trainer.close()
    result = {"wall_s": walls, "step_s": statistics.median(walls), "profiled": profiled,
              "probe": probe_json(probe), "predicted": predicted, "links": links, "page_faults": faults,
              "huge_page_faults": huge, "pages_released": released.pages,
              "fault_split": recorder.fault_seconds(probe, nproc),
              "comm_calls": [[*key, *value] for key, value in recorder.comm_calls().items()]}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


class ReleaseCounter:
    """The pages (of the OS's page size, the probe's release unit) the trainer's per-step ``malloc_trim`` hands
    back (``HostMemory.after_step``), per step (``pages``): its drop of the resident memory (a huge page's
    4 KiB pages: the trim releases it split, the roofline prices it so). Appends one entry per step; ``close``
    restores the trainer."""

    def __init__(self, trainer) -> None:
        from qwen3_pretrain.train.host_memory import resident_bytes

        self.pages: list[int] = []
        self._memory = trainer.host_memory
        self._after_step = self._memory.after_step

        def counted() -> None:
            before = resident_bytes()
            self._after_step()
            after = resident_bytes()
            if before is not None and after is not None:
                self.pages.append(max(0, before - after) // mmap.PAGESIZE)

        self._memory.after_step = counted

    def close(self) -> None:
        del self._memory.after_step  # the instance's wrapper: the class's method again


def measure_stragglers(recorder: StepRecorder, step_s: float) -> float:
    """The stragglers' share of a multi-process variant (``probe.straggler_share``) on the group of all its
    ranks, at the step's own mean time between two of its collectives (the step over their number)."""
    from qwen3_pretrain.simulate.probe import straggler_share

    calls = sum(c for (_, _, n), (_, c) in recorder.comm_calls().items() if n > 1)
    return straggler_share(None, step_s / max(calls, 1))


def measure_links(recorder: StepRecorder, statistic: str = "mean") -> list[dict]:
    """The links of a multi-process variant, one per collective kind the step ran over more than one rank
    (all-reduce, all-gather, reduce-scatter: gloo reduces on the CPU, so they differ per byte), each measured
    on the group that carried most of the kind's bytes at the kind's average message there, in the dtype it
    moved (``probe.link_figures`` with ``statistic``; every rank calls this at once): [{"axis", "kind",
    "bytes", "dtype", "gbps", "latency_us"}], the kind that moved the most bytes first; empty for one
    process."""
    from qwen3_pretrain.simulate.probe import link_figures

    if not torch.distributed.is_initialized():
        return []
    largest: dict[str, tuple] = {}  # kind -> ((axis, kind, size), (bytes, calls)) of its largest group
    for key, value in sorted(recorder.comm_calls().items()):
        if key[1] in ("all_reduce", "all_gather", "reduce_scatter") and value[1] and key[2] > 1:
            if key[1] not in largest or value[0] > largest[key[1]][1][0]:
                largest[key[1]] = (key, value)
    out = []
    for (axis, kind, size), (nbytes, count) in sorted(largest.values(), key=lambda kv: (-kv[1][0], kv[0])):
        message = int(nbytes / count)
        dtype = recorder.comm_dtypes.get(kind, torch.bfloat16)
        gbps, latency = link_figures(recorder.group_of(axis, size), kind, message, dtype, iters=30,
                                     statistic=statistic)
        out.append({"axis": axis, "kind": kind, "ranks": size, "bytes": message, "dtype": str(dtype), "gbps": gbps,
                    "latency_us": latency, "statistic": statistic})
    return out


def median_links(runs: list[list[dict]]) -> list[dict]:
    """``measure_links``'s fits of several runs (one after each timed step) made one: per collective kind, the
    run whose fit prices the kind's own message at the median of the runs' prices, that run's bandwidth and
    latency together (one fit after the timed steps moved a row's priced communication by up to 40% between two
    runs of the bench: a 4 KiB all-gather's latency measured 0.4-3.3 ms)."""
    from qwen3_pretrain.plan.formulas import collective_seconds

    def priced(fit: dict) -> float:
        return collective_seconds(fit["kind"], fit["bytes"], fit["ranks"], fit["gbps"] * 1e9, fit["latency_us"] * 1e-6)

    runs = [run for run in runs if run]
    if not runs:
        return []
    return [sorted((run[i] for run in runs), key=priced)[len(runs) // 2] for i in range(len(runs[0]))]


def host_calibration(trainer, step, mode: str, args: argparse.Namespace) -> dict:
    """The tiny run's host cost per op (module docstring): eager, its median step time less its collectives
    over its ops; compiled (``args.host_us`` holding the eager figure), over its compiled scope's kernels what
    the ops outside the scope at the eager cost leave. The collectives come off at their price on the links
    measured here, per kind at the tiny step's own messages (``tiny_collectives``), as the timed step's are
    priced: the roofline prices them on the link, and a tiny tp2 step's 59 calls (DTensor's functional
    collectives, waited on inside ops) had counted as host (0.053 s of a 0.219 s tiny step). The tiny step's
    own page faults stay in the host figure (under 1% of it)."""
    from qwen3_pretrain.simulate.probe import host_us_per_op
    from qwen3_pretrain.simulate.roofline.pricing import compiled_kernels

    recorder = record_step(trainer, step, mode == "compiled")
    trace = recorder.trace
    ops = sum(trace.host_ops.values())
    comm_s, links = tiny_collectives(recorder, args.link_statistic)
    wall = host_us_per_op(step, ops, repeats=max(args.steps, 3)) * ops * 1e-6
    out = {"ops": ops, "eager_us": max(wall - comm_s, 0.0) / max(ops, 1) * 1e6, "wall_s": wall,
           "collectives_s": comm_s, "links": links}
    # the share of the host cost the profiler sees outside every op (the rest is inside the ops' self times), the
    # median over the profiled steps
    out["outside_share"] = statistics.median(min(1.0, run["other"] / max(run["wall"] - run["communication"], 1e-9))
                                             for run in profiled_runs(step, args.profiled_steps))
    if mode == "compiled":
        eager_us = json.loads(args.host_us)["eager_us"]
        outside = sum(trace.outside_ops.values())
        kernels = compiled_kernels(trace, recorder.comm_calls())
        host_s = out.pop("eager_us") * ops * 1e-6
        out.update(eager_us=eager_us, compiled_us=max(host_s - outside * eager_us * 1e-6, 0.0) / max(kernels, 1) * 1e6,
                   outside_ops=outside, kernels=kernels)
    return out


def tiny_collectives(recorder: StepRecorder, statistic: str) -> tuple[float, list[dict]]:
    """(seconds, links) of a recorded step's collectives, every one whole (a CPU overlaps none of them), priced
    on the links measured now on its own groups (``measure_links``); (0, []) for one process."""
    from qwen3_pretrain.hardware import measured_cpu
    from qwen3_pretrain.simulate.roofline.pricing import comm_seconds

    links = measure_links(recorder, statistic)
    if not links:
        return 0.0, []
    hw = measured_cpu(1.0, 1.0, 1.0, 1.0, intra_node_gbps=links[0]["gbps"],
                      intra_node_latency_us=links[0]["latency_us"],
                      collective_links=tuple((k["kind"], k["gbps"], k["latency_us"]) for k in links))
    return sum(total for total, _ in comm_seconds(recorder.comm_calls(), hw).values()), links


def median_probe(probes: list[CpuProbe]) -> CpuProbe:
    """Each figure's median over ``probes``."""
    def med(get) -> float:
        return statistics.median(get(p) for p in probes)

    first = probes[0]
    return dataclasses.replace(
        first, matmul_tflops={k: med(lambda p: p.matmul_tflops[k]) for k in first.matmul_tflops},
        memory_gbps={k: med(lambda p: p.memory_gbps[k]) for k in first.memory_gbps},
        bandwidth_by_size={k: [med(lambda p: p.bandwidth_by_size[k][i]) for i in range(len(v))]
                           for k, v in first.bandwidth_by_size.items()},
        op_latency_us=med(lambda p: p.op_latency_us), autograd_op_latency_us=med(lambda p: p.autograd_op_latency_us),
        load_average=med(lambda p: p.load_average), page_fault_us=med(lambda p: p.page_fault_us),
        page_release_us=med(lambda p: p.page_release_us),
        # the probes that got huge pages (one whose mapping got none measured 0: unmeasured, not free)
        huge_page_fault_us=statistics.median([p.huge_page_fault_us for p in probes if p.huge_page_fault_us] or [0.0]),
        solve_tflops=med(lambda p: p.solve_tflops) if first.solve_tflops else None)


def probe_json(probe: CpuProbe) -> dict:
    return {"cpu": probe.cpu, "threads": probe.threads, "load": probe.load_average,
            "matmul_tflops": {f"{d} {s}": v for (d, s), v in probe.matmul_tflops.items()},
            "memory_gbps": probe.memory_gbps, "bandwidth_by_size": probe.bandwidth_by_size,
            "curve_mib": probe.curve_mib, "op_latency_us": probe.op_latency_us,
            "autograd_op_latency_us": probe.autograd_op_latency_us, "engine_op_us": probe.engine_op_us,
            "engine_compiled_us": probe.engine_compiled_us, "link_gbps": probe.link_gbps,
            "link_latency_us": probe.link_latency_us, "links": probe.links,
            "straggler_share": probe.straggler_share, "page_fault_us": probe.page_fault_us,
            "page_release_us": probe.page_release_us, "huge_page_fault_us": probe.huge_page_fault_us,
            "solve_tflops": probe.solve_tflops}


# --- the prediction: the roofline core's recorder and price, with this CPU's numbers ------------------------


class StepRecorder(RecordingMode):
    """The roofline's recorder of a real step, also counting the step's collectives by mesh axis (what the
    simulation's tracker does on fake tensors). The compiled scope: the modules ``compile: true`` compiled
    (``module.compile()``); where none is (eager), the decoder layers, as simulate prices it."""

    def __init__(self, trainer=None) -> None:
        from qwen3_pretrain.parallel.dims import AXES
        from qwen3_pretrain.simulate.track import CommCounter

        compiled = [m for part in (trainer.engine.parts if trainer is not None else ())
                    for m in part.modules() if getattr(m, "_compiled_call_impl", None) is not None]
        super().__init__(scope="layers")
        if compiled:
            self.recorder.mark_compiled(compiled)
        groups: dict = {}
        if trainer is not None:
            mesh, engine = trainer.mesh, trainer.engine
            groups = {mesh[a].get_group().group_name: ("dp" if a.startswith("dp") else a) for a in AXES}
            for group in engine.dp_mesh.get_all_groups():
                groups.setdefault(group.group_name, "dp")
            if torch.distributed.is_initialized():
                groups.setdefault(torch.distributed.group.WORLD.group_name, "world")
        self.comm = CommCounter(groups)
        self.group_counts: list[list[int]] = []  # each grouped matmul's rows per group, as routing gave them
        # the memory-bound bytes by op name (the trace's size keys of each op's bytes), for the per-op view
        self.by_op: dict[str, Counter] = {}
        self._op = ""
        for mem in self.trace.memory.values():
            mem.sizes = _TeeCounter(self)
        self.op_calls: Counter = Counter()
        self.comm_dtypes: dict[str, torch.dtype] = {}  # collective kind -> the dtype it moved
        # the recorded step's minor page faults by the profiler category of the op that took them ("other":
        # outside every op), to spread the priced faults over the profiler's categories (``profiler_view``);
        # the machine's huge pages faulted in meanwhile, the same way (``fault_seconds``)
        self.faults: Counter = Counter()
        self.huge_faults: Counter = Counter()

    def __enter__(self):
        self._faults_at_entry = minor_faults() - sum(self.faults.values())  # a recorder entered again adds up
        self._huge_at_entry = huge_page_faults() - sum(self.huge_faults.values())
        return super().__enter__()

    def __exit__(self, *exc):
        self.faults["other"] += minor_faults() - self._faults_at_entry - sum(self.faults.values())
        self.huge_faults["other"] += huge_page_faults() - self._huge_at_entry - sum(self.huge_faults.values())
        return super().__exit__(*exc)

    def fault_seconds(self, probe: CpuProbe, ranks: int = 1) -> dict[str, float]:
        """The recorded step's page faults' seconds per profiler category at ``probe``'s costs: a category's
        huge pages (the machine's count over the ``ranks`` that recorded at once, at most its faults) at the
        huge page's cost, the rest at the small page's (what ``profiler_view`` spreads the priced faults by)."""
        return {cat: fault_seconds(count, round(self.huge_faults.get(cat, 0) / ranks), probe.page_fault_us,
                                   probe.huge_page_fault_us) for cat, count in self.faults.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented
        self.comm.count(func, args)
        kind = _COMM_KINDS.get(func)
        moved = args[kind[1] or 0] if kind is not None else None
        if isinstance(moved, (list, tuple)) and moved:  # c10d's allreduce_ / allgather_ take tensor lists
            moved = moved[0][0] if isinstance(moved[0], (list, tuple)) and moved[0] else moved[0]
        if isinstance(moved, torch.Tensor):
            self.comm_dtypes[kind[0]] = moved.dtype
        self._op = func.__name__.split(".")[0]
        self.op_calls[self._op] += 1
        if func is torch.ops.aten._grouped_mm.default:
            offs = (kwargs or {}).get("offs", args[2] if len(args) > 2 else None)
            a = args[0]
            if offs is not None and a.dim() == 2 and args[1].dim() == 3 and len(self.group_counts) < 8:
                ends = [0] + offs.tolist()  # rows split into groups (forward, input gradient): the first 8 distinct
                counts = [e - s for s, e in zip(ends, ends[1:])]
                if counts not in self.group_counts:
                    self.group_counts.append(counts)
        huge = huge_page_faults()  # read before the process's own count (a read's faults are not the op's)
        faults = minor_faults()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        faults = minor_faults() - faults
        category = op_category(f"aten::{self._op}")
        self.faults[category] += faults
        self.huge_faults[category] += huge_page_faults() - huge
        return out

    def group_of(self, axis: str, size: int):
        """The process group of ``size`` ranks the step's collectives on ``axis`` ran over (several mesh axes
        count as dp: the one-rank ones are not it)."""
        resolve = torch.distributed.distributed_c10d._resolve_process_group
        return next(group for group in (resolve(g) for g, a in self.comm.axis_of_group.items() if a == axis)
                    if group.size() == size)

    def comm_calls(self) -> dict:
        """{(axis, kind, group size): (whole-buffer bytes, calls)}: what ``price`` takes."""
        return {key: tuple(value) for key, value in self.comm.calls_by_size.items()}


class _TeeCounter(Counter):
    """A trace's ``MemoryOps.sizes`` that also adds each op's bytes to its recorder's ``by_op`` (the op being
    recorded: ``StepRecorder._op``)."""

    def __init__(self, recorder: StepRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __setitem__(self, key, value) -> None:
        delta = value - self.get(key, 0)
        self.recorder.by_op.setdefault(self.recorder._op, Counter())[key] += delta
        super().__setitem__(key, value)


def per_op_view(recorder: StepRecorder, hw, profiled_ops: dict) -> dict:
    """Per memory-bound op name (eager): its calls, bytes and priced seconds on ``hw``, beside the profiler's
    self seconds and calls of ``aten::<name>`` (what the elementwise category sums)."""
    from qwen3_pretrain.simulate.roofline.pricing import sizes_seconds

    out = {}
    for name, sizes in recorder.by_op.items():
        seconds, nbytes = sizes_seconds(sizes, hw, ("eager",)) if hw.bandwidth_curve else (0.0, 0.0)
        classes = sorted({k[3] for k in sizes if len(k) > 3 and k[0] == "eager"})
        prof = profiled_ops.get(f"aten::{name}", (0.0, 0))
        out[name] = {"calls": recorder.op_calls[name], "bytes": nbytes, "priced_s": seconds, "classes": classes,
                     "profiled_s": prof[0], "profiled_calls": prof[1]}
    return out


def record_step(trainer, step, compiled: bool) -> StepRecorder:
    """One real step recorded (eager ops: a compiled step's kernels are not aten ops, so dynamo is off while
    recording and the compiled modules are marked as the compiled scope)."""
    recorder = StepRecorder(trainer)
    # record the ops the compiled graphs stand for. The compiler's stance, not ``torch._dynamo.config.disable``:
    # a step with that flag set and cleared again left the compiled modules eager for good (torch 2.13: every
    # later step dispatched the layers' aten ops, no compiled region)
    with torch.compiler.set_stance("force_eager" if compiled else "default"), recorder:
        step()
    return recorder


def predict_step(recorder: StepRecorder, probe: CpuProbe, compiled: bool) -> dict:
    """A recorded real step (``record_step``) priced on ``probe.hardware``: {"step_s", seconds per category,
    the trace's op counts, the device's figures}."""
    from qwen3_pretrain.simulate.roofline import price

    hw = probe.hardware(recorder.trace)
    breakdown = price(recorder.trace, hw, compiled, recorder.comm_calls())
    trace = recorder.trace
    counts = {"matmul": sum(trace.matmuls.values()) + sum(trace.solves.values()),
              "attention": sum(trace.attention.values()),
              "elementwise": sum(m.ops for m in trace.memory.values()),
              "communication": sum(c for _, c in recorder.comm_calls().values())}
    return {"step_s": breakdown.step, **breakdown.to_json(), "ops": sum(trace.host_ops.values()),
            "outside_ops": sum(trace.outside_ops.values()), "op_counts": counts,
            "device": {"bf16_tflops": hw.peak_tflops, "fp32_tflops": hw.fp32_peak_tflops,
                       "attention_efficiency": hw.attention_efficiency,
                       "classes": [hw.matmul_shape_classes, hw.fp32_shape_classes],
                       "grouped_share": hw.grouped_matmul_share, "bandwidth_curve": hw.bandwidth_curve,
                       "cache_bytes": hw.cache_bytes,
                       "launch_us": hw.launch_latency_us,
                       "compiled_launch_us": hw.compiled_launch_us, "straggler_share": hw.straggler_share,
                       "page_fault_us": hw.page_fault_us, "page_release_us": hw.page_release_us,
                       "huge_page_fault_us": hw.huge_page_fault_us,
                       "page_faults": trace.page_faults, "pages_released": trace.pages_released,
                       "huge_page_faults": trace.huge_page_faults},
            "page_release": page_seconds(trace, hw)[1]}


# --- the driver ------------------------------------------------------------------------------------------


def synthetic_data(path: Path, vocab: int) -> str:
    """Random documents of ids below ``vocab`` (the step's cost does not depend on which tokens it reads)."""
    import numpy as np

    from qwen3_pretrain.data.synthetic import write_synthetic_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab - 1, rng.integers(100, 2000)) for _ in range(400)]
    write_synthetic_dataset(path, docs, eod_id=vocab - 1, vocab_size=vocab)
    return str(path)


def run_variant(name: str, args: argparse.Namespace, data: str, tmp: Path, host: dict | None = None,
                tiny: bool = False) -> list[dict]:
    """One variant's ranks in fresh processes: the timed run (``host``: the calibration's figures), or the
    host calibration at tiny shapes (``tiny``; ``host``: the eager calibration, for a compiled one)."""
    nproc, threads, _ = LAYOUTS[name.split("-")[2]]
    out = tmp / (name + ("-tiny" if tiny else ""))
    out.mkdir()
    script = [str(Path(__file__).resolve()), "--worker", name, "--data", data, "--out", str(out),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--vocab", str(args.vocab),
              "--host-us", json.dumps(host or {}), "--denormals", args.denormals,
              "--link-statistic", args.link_statistic, "--profiled-steps", str(args.profiled_steps)] + (
                  ["--tiny"] if tiny else [])
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


def collective_split(ranks: list[dict]) -> list[dict[str, float]]:
    """Per rank, its profiled step's Python collectives (``CollectiveClock.calls``, matched by order across the
    ranks) split into "skew_s": waiting for the last rank to arrive (the last entry less its own) and
    "transfer_s": from the last rank's arrival to its own return (what the link model prices)."""
    calls = [r["profiled"].get("collectives") or [] for r in ranks]
    n = min(map(len, calls)) if calls else 0
    out = []
    for own in calls:
        skew = transfer = 0.0
        for i in range(n):
            last = max(c[i][2] for c in calls)
            skew += last - own[i][2]
            transfer += max(0.0, own[i][3] - last)
        out.append({"skew_s": skew, "transfer_s": transfer, "calls": n})
    return out


def profiler_view(result: dict) -> dict[str, float]:
    """The prediction's seconds per profiler category: the host term split as the calibration's profile
    split it (``outside_share`` of it outside every op: "other"; the rest inside the ops' self times, spread
    over the categories by the ops the trace counts in each)."""
    pred = result["predicted"]
    share = result.get("host_calibration", {}).get("outside_share", 1.0)
    # a file from before the op counts: the host term all outside the ops
    counts = pred.get("op_counts") or dict.fromkeys(("matmul", "attention", "elementwise", "communication"), 0)
    total = sum(counts.values()) or 1
    view = {cat: pred.get(cat, 0.0) + pred["host"] * (1 - share) * counts[cat] / total for cat in counts}
    if not sum(counts.values()):
        share = 1.0
    view["other"] = pred["host"] * share
    view["communication"] += pred.get("waiting", 0.0)  # the profiler sees a rank's waiting in its collectives
    # a page's fault is in the self time of the op that touched it first: the profiled steps' own faults
    # ("profiled_page_faults"; a profiled step takes more than a timed one), spread as the recorded step's
    # faults' seconds fell per category; its release outside every op (``malloc_trim`` after the step)
    released = pred.get("page_release", 0.0)
    faults = pred.get("profiled_page_faults", pred.get("page_faults", 0.0) - released)
    view["other"] += released
    split = {cat: n for cat, n in (result.get("fault_split") or {}).items() if n > 0} or {"elementwise": 1}
    for cat, count in split.items():
        view[cat] = view.get(cat, 0.0) + faults * count / sum(split.values())
    return view


# The targets: a predicted step within 25% of the measured one; a category within 30% of the profiler's, or both
# under 5 ms (a category of a few ops, where a millisecond is 30%)
STEP_TARGET, CELL_TARGET, CELL_FLOOR_S = 0.25, 0.30, 0.005


def cell_agrees(profiled: float, predicted: float) -> bool:
    """A category's prediction within ``CELL_TARGET`` of the profiler's seconds, or both under ``CELL_FLOOR_S``."""
    if profiled < CELL_FLOOR_S and predicted < CELL_FLOOR_S:
        return True
    return profiled > 0 and abs(predicted - profiled) <= CELL_TARGET * profiled


def variant_cells(ranks: list[dict]) -> dict:
    """Rank 0's figures of one run of a variant: measured and predicted step seconds, and per category the
    profiler's seconds and the prediction's (``profiler_view``)."""
    r = ranks[0]
    view = profiler_view(r)
    return {"step_s": r["step_s"], "predicted_s": r["predicted"]["step_s"],
            "cells": {cat: (r["profiled"][cat], view[cat]) for cat in CATEGORIES}}


def median_cells(runs: list[dict]) -> dict:
    """A variant's ``variant_cells`` over its runs (rounds): each figure's median on its own, and per category
    "spread", the profiled seconds' max over min across the runs (1 where every run's is under
    ``CELL_FLOOR_S``: a millisecond's move there is no signal; inf where one run measured 0; None with one
    run: nothing to compare)."""
    def spread(values):
        if len(values) < 2:
            return None
        if max(values) < CELL_FLOOR_S:
            return 1.0
        return max(values) / min(values) if min(values) > 0 else float("inf")

    out = {"runs": len(runs), "step_s": statistics.median(r["step_s"] for r in runs),
           "predicted_s": statistics.median(r["predicted_s"] for r in runs), "cells": {}, "spread": {}}
    for cat in CATEGORIES:
        profiled = [r["cells"][cat][0] for r in runs]
        out["cells"][cat] = (statistics.median(profiled), statistics.median(r["cells"][cat][1] for r in runs))
        out["spread"][cat] = spread(profiled)
    return out


def tally(summary: dict[str, dict]) -> dict:
    """Against the targets, over variants' ``median_cells`` (or one run's ``variant_cells``): the step ratios,
    and per category the cells that agree (``cell_agrees``) of those counted, a 1-process communication cell
    not counted; "reproducible": per category the cells of variants run more than once whose profiled
    seconds moved by at most ``CELL_TARGET`` over the runs, and of those the ones that agree."""
    ratios = [v["predicted_s"] / v["step_s"] for v in summary.values()]
    out = {"steps": [sum(abs(x - 1) <= STEP_TARGET for x in ratios), len(ratios)], "ratios": ratios,
           "cells": {}, "reproducible": {}}
    for cat in CATEGORIES:
        agree = total = rep = rep_agree = 0
        for name, v in summary.items():
            if cat == "communication" and name.endswith("-1p"):
                continue
            ok = cell_agrees(*v["cells"][cat])
            agree, total = agree + ok, total + 1
            moved = v.get("spread", {}).get(cat)
            if moved is not None and moved <= 1 + CELL_TARGET:
                rep, rep_agree = rep + 1, rep_agree + ok
        out["cells"][cat] = [agree, total]
        out["reproducible"][cat] = [rep_agree, rep]
    return out


def print_tally(summary: dict[str, dict]) -> None:
    t = tally(summary)
    ratios = t["ratios"]
    print(f"steps within {STEP_TARGET:.0%}: {t['steps'][0]}/{t['steps'][1]} (ratios {min(ratios):.2f}-"
          f"{max(ratios):.2f}, median {statistics.median(ratios):.2f}); per category within {CELL_TARGET:.0%} "
          "(or both under 5 ms): " + ", ".join(f"{c} {a}/{n}" for c, (a, n) in t["cells"].items()))
    if any(x is not None for v in summary.values() for x in v.get("spread", {}).values()):
        print(f"cells whose profiled seconds moved by at most {CELL_TARGET:.0%} over the rounds, and of those "
              "within the target: " + ", ".join(f"{c} {a}/{n}" for c, (a, n) in t["reproducible"].items()))


def print_median_table(summary: dict[str, dict]) -> None:
    """Per variant over its rounds: the medians of ``print_table``'s figures, and per category the profiled
    seconds' spread (max / min over the rounds)."""
    head = f"{'variant':<20} {'runs':>4} {'meas s':>6} {'pred s':>6} {'ratio':>5}"
    for cat in CATEGORIES:
        head += f" {cat[:11]:>19}"
    print(head + "   (per category: profiler s / predicted s, x the profiled seconds' max/min)")
    for name, v in summary.items():
        line = (f"{name:<20} {v['runs']:>4} {v['step_s']:>6.3f} {v['predicted_s']:>6.3f} "
                f"{v['predicted_s'] / v['step_s']:>5.2f}")
        for cat in CATEGORIES:
            (prof, pred), spread = v["cells"][cat], v["spread"][cat]
            line += f" {prof:>6.3f}/{pred:<6.3f}" + (f"x{spread:<5.2f}" if spread is not None else " " * 6)
        print(line)


def load_rounds(paths: list[str]) -> list[dict[str, list[dict]]]:
    """The rounds of ``--json`` files, in order (a file of one round written before rounds: that round)."""
    rounds = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rounds.extend(data["rounds"] if "rounds" in data else [data])
    return rounds


def summarize(rounds: list[dict[str, list[dict]]]) -> dict[str, dict]:
    """Each variant's ``median_cells`` over the rounds that ran it, in the order first run."""
    names = list(dict.fromkeys(name for rows in rounds for name in rows))
    return {name: median_cells([variant_cells(rows[name]) for rows in rounds if name in rows]) for name in names}


def print_table(rows: dict[str, list[dict]]) -> None:
    """Rank 0's row per variant: the load average before and after it, measured and predicted step; per
    category the profiler's seconds / the prediction's (``profiler_view``)."""
    head = f"{'variant':<20} {'load':>9} {'meas s':>6} {'pred s':>6} {'ratio':>5}"
    for cat in CATEGORIES:
        head += f" {cat[:11]:>13}"
    print(head + "   (per category: profiler s / predicted s)")
    for name, ranks in rows.items():
        r = ranks[0]
        pred, meas = r["predicted"], r["step_s"]
        load = r.get("load", [0.0, 0.0])
        line = (f"{name:<20} {load[0]:>4.1f}-{load[1]:<4.1f} {meas:>6.3f} {pred['step_s']:>6.3f} "
                f"{pred['step_s'] / meas:>5.2f}")
        view = profiler_view(r)
        for cat in CATEGORIES:
            line += f" {r['profiled'][cat]:>6.3f}/{view[cat]:<6.3f}"
        print(line)


def print_results(rounds: list[dict[str, list[dict]]]) -> None:
    """Each round's table, then (several rounds) the medians' table; the tally against the targets."""
    for i, rows in enumerate(rounds):
        if len(rounds) > 1:
            print(f"round {i + 1}:")
        print_table(rows)
        if len(rounds) > 1:
            print_tally(summarize([rows]))
    summary = summarize(rounds)
    if len(rounds) > 1:
        print(f"median over the {len(rounds)} rounds:")
        print_median_table(summary)
    print_tally(summary)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.summarize:
        print_results(load_rounds(args.summarize))
        return 0
    names = [f"{m}-{mode}-{lay}" for m in args.models.split(",") for mode in args.modes.split(",")
             for lay in args.layouts.split(",")]
    print(f"cpu: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rounds: list[dict[str, list[dict]]] = []
    with tempfile.TemporaryDirectory(prefix="roofline_cpu_") as tmp:
        data = synthetic_data(Path(tmp) / "data", args.vocab)
        tiny_data = synthetic_data(Path(tmp) / "tiny_data", TINY_VOCAB)
        for i in range(max(args.repeats, 1)):
            if args.repeats > 1:
                print(f"round {i + 1} of {args.repeats}", flush=True)
            rounds.append({})
            run_round(names, args, data, tiny_data, Path(tmp) / f"round{i}", rounds)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print_results(rounds)
    return 0


def run_round(names: list[str], args: argparse.Namespace, data: str, tiny_data: str, tmp: Path,
              rounds: list[dict]) -> None:
    """Every variant once, each with host calibrations of its own, into ``rounds[-1]``; the JSON rewritten
    after each variant (a later variant's failure keeps the earlier ones)."""
    tmp.mkdir()
    rows = rounds[-1]
    hosts: dict[str, dict] = {}  # variant -> its rank 0's host calibration
    for name in names:
        model, mode, layout = name.split("-")
        eager = f"{model}-eager-{layout}"
        if eager not in hosts:
            hosts[eager] = run_variant(eager, args, tiny_data, tmp, tiny=True)[0]
        if mode == "compiled":
            hosts[name] = run_variant(name, args, tiny_data, tmp, hosts[eager], tiny=True)[0]
        load = os.getloadavg()[0]
        rows[name] = run_variant(name, args, data, tmp, hosts[name])
        for r, split in zip(rows[name], collective_split(rows[name])):
            r["load"] = [load, os.getloadavg()[0]]
            r["host_calibration"] = hosts[name]
            r["collective_split"] = split
        r = rows[name][0]
        if any(x["calls"] for x in (q["collective_split"] for q in rows[name])):
            print(f"  {name}: the profiled step's collectives per rank (waiting for the other / transfer, s): "
                  + ", ".join(f"{q['collective_split']['skew_s']:.3f} / {q['collective_split']['transfer_s']:.3f}"
                              for q in rows[name]) + f"; priced {r['predicted']['communication_total']:.3f}",
                  flush=True)
        print(f"  {name}: measured {r['step_s']:.3f} s, predicted {r['predicted']['step_s']:.3f} s, load "
              f"{r['load'][0]:.1f}-{r['load'][1]:.1f}; host {json.dumps(hosts[name])}; device "
              f"{json.dumps(r['predicted']['device'])}; probe {json.dumps(r['probe'])}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"rounds": rounds}, indent=1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
