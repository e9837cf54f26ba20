"""Run the training engine as one rank of a world that does not exist, on fake tensors.

One process plays rank r of a W-rank world: torch's ``fake`` process-group
backend accepts every collective and moves nothing, and ``FakeTensorMode``
gives every tensor its shape and dtype but no storage, so Qwen3-32B on 64
ranks fits in a laptop's memory. The engine is the trainer's own
(``train/engine.py``): mesh, stage split, TP, activation checkpointing, FSDP,
the fused loss, AdamW and the pipeline schedule, on synthetic token batches.

Tensors live on the CPU device type (fake CUDA tensors need a CUDA build of
torch), but the engine is built as for the target device (``World.hardware``:
CUDA for an NVIDIA GPU, NPU for an Ascend 910B): its attention kernel, loss
chunk, elementwise kernels, native bf16 matmuls and FSDP's reduce-scatter are
those it uses there.

The same dispatch mode records the step's op trace (``simulate/roofline``),
priced on the target device eager and compiled: step time, tokens/s/device,
MFU and HFU, and the breakdown (``RankResult.roofline``).

A step of many micro-batches is simulated as two shorter steps whose figures
are extrapolated to the step's count (``simulate/microbatches.py``: exact where
each further micro-batch runs the same ops): Megatron-Bridge's 64 micro-batches
of Qwen3-8B cost 2 + 3.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.hardware import Hardware, default_chunk_tokens, get_device, matmul_precision
from qwen3_pretrain.models.qwen3.attention_calls import AttentionCall
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.parallel.dims import AXES, ParallelDims
from qwen3_pretrain.plan.flops import token_flops
from qwen3_pretrain.plan.layout import Cluster, Layout
from qwen3_pretrain.plan.memory import MemoryBreakdown, predict_memory
from qwen3_pretrain.simulate.attention import KernelRecord, simulated_kernels
from qwen3_pretrain.simulate.experts import play_experts
from qwen3_pretrain.simulate.microbatches import (config_with_microbatches, extrapolate_comm_bytes,
                                                extrapolate_comm_calls, extrapolate_trace, extrapolation_counts)
from qwen3_pretrain.simulate.optimizer import play_optimizer
from qwen3_pretrain.simulate.roofline import OpTrace, TraceRecorder, price, throughput
from qwen3_pretrain.simulate.track import CommCounter, ScalarReads, StepMemTracker
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.engine import Engine, Parallelism, engine_layout, resolve_parallelism
from qwen3_pretrain.train.model_source import ModelSource, resolve_model
from qwen3_pretrain.train.optim import lr_at

@dataclass
class World:
    """What every simulated rank shares: the model, the parallelism and the planner's layout."""

    cfg: TrainConfig
    source: ModelSource
    parallelism: Parallelism
    layout: Layout
    target: str  # torch's device type the engine is built for (the hardware's)
    hardware: Hardware = dataclasses.field(default_factory=lambda: get_device("h100"))
    devices_per_node: int | None = None  # None: min(world, 8)

    @property
    def dims(self) -> ParallelDims:
        return self.parallelism.dims


@dataclass
class RankResult:
    rank: int
    coords: dict[str, int]
    peak: dict[str, int]  # bytes by category, and "total"
    predicted: MemoryBreakdown
    comm: dict[str, dict[str, float]]  # axis -> kind -> bytes per step
    seconds: float
    attention: dict[str, int] = dataclasses.field(default_factory=dict)  # the target's kernel -> calls per step
    # the calls the target serves with an unfused kernel (SDPA's math: fp32 probabilities kept), and which
    unfused_attention: list[tuple[AttentionCall, str]] = dataclasses.field(default_factory=list)
    simulated_as: int | None = None  # the rank whose simulation stands for this one (same stage)
    # the priced op trace: {"eager": {...}, "compiled": {...}, "trace": {...}} (``roofline_report``)
    roofline: dict = dataclasses.field(default_factory=dict)
    trace: OpTrace | None = None  # the step's op trace itself (what ``roofline`` prices)
    comm_calls: dict = dataclasses.field(default_factory=dict)  # (axis, kind, group size) -> (bytes, calls)
    # the micro-batch counts simulated where the step's figures are extrapolated from two shorter steps
    # (``simulate/microbatches.py``); None: the whole step was simulated
    extrapolated_from: tuple[int, int] | None = None


def model_source(cfg: TrainConfig) -> ModelSource:
    """The architecture only: ``model_path``'s config.json when it exists, else the ``model_name`` preset.
    No weights, data or tokenizer are read."""
    config_json = Path(cfg.model_path) / "config.json" if cfg.model_path else None
    if config_json is not None and config_json.is_file():
        return ModelSource(Qwen3Config.from_json_file(config_json), None, f"{config_json}")
    preset = resolve_model(dataclasses.replace(cfg, model_path=None))
    return ModelSource(preset.config, None, f"{cfg.model_name} preset")


def make_world(cfg: TrainConfig, world_size: int, target: str | None = None, moe_imbalance: float = 1.0,
               hardware: Hardware | str = "h100", devices_per_node: int | None = None) -> World:
    """Check the layout against the world and the model, as the trainer does before it starts.
    ``moe_imbalance``: the routing skew the MoE layers are played with (``Layout.moe_imbalance``);
    ``hardware``: the target device (a ``hardware.DEVICES`` name or entry), whose device type the engine is
    built for (``target`` overrides it) and whose figures price the op trace."""
    hardware = get_device(hardware) if isinstance(hardware, str) else hardware
    target = target or hardware.device_type
    if cfg.fp8 is not None and not cfg.fp8_emulate:
        # the real run would be refused at start on this device: no FP8 peak to price it at either
        peak = hardware.mxfp8_tflops if cfg.fp8 == "mxfp8" else hardware.fp8_tflops
        if peak is None:
            raise UserError(f"fp8: {cfg.fp8} cannot be simulated on {hardware.name}, which has no "
                            f"{'MXFP8' if cfg.fp8 == 'mxfp8' else 'FP8'} tensor cores (training there is refused "
                            "too); choose an FP8 device with --device (h100, h200, b200) or leave fp8 empty")
    source = model_source(cfg)
    parallelism = resolve_parallelism(cfg, world_size, source.config)
    chunk = cfg.loss_chunk_tokens or default_chunk_tokens(target, source.config.vocab_size)
    layout = engine_layout(cfg, parallelism, chunk, target, fp32_matmul=False).replace(moe_imbalance=moe_imbalance)
    return World(cfg, source, parallelism, layout, target, hardware, devices_per_node)


def simulate_rank(world: World, rank: int, steps: int = 1) -> RankResult:
    """``steps`` training steps of ``rank``: its peak memory by category and the bytes it sends."""
    start = time.perf_counter()
    _quiet_known_notices()
    cfg, dims = world.cfg, world.dims
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    # DTensor caches sharding decisions under keys that compare meshes by shape and names, not by their
    # process groups: a decision made for a mesh of an earlier world in this process (or in the parent
    # that forked it) would hand back that mesh, whose groups no longer exist.
    _clear_sharding_prop_cache()
    try:
        mesh = dims.build_mesh("cpu")
        groups = {mesh[a].get_group().group_name: ("dp" if a.startswith("dp") else a) for a in AXES}
        groups.setdefault(dist.group.WORLD.group_name, "world")  # an axis spanning the world keeps its name
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        device = torch.device("cpu")

        def allocate(part: nn.Module) -> None:
            with fake:
                part.to_empty(device=device)

        kernels = KernelRecord()
        engine = Engine(cfg, world.source, world.parallelism, mesh, device, False,
                        world.layout.loss_chunk_tokens, allocate=allocate,
                        stage_io=lambda e: _stage_io(e, fake), target_device_type=world.target,
                        make_attention=simulated_kernels(kernels),
                        play_experts=functools.partial(play_experts, load=world.layout.moe_rank_load))
        for group in engine.dp_mesh.get_all_groups():  # under cp, FSDP's flattened dp_shard x cp group
            groups.setdefault(group.group_name, "dp")
        if engine.expert_meshes is not None:  # FSDP of each rank's experts (all-to-alls count as ep by kind)
            for group in engine.expert_meshes[1].get_all_groups():
                groups.setdefault(group.group_name, "dp")
        if engine.tied is not None and engine.tied.group is not None:
            groups[engine.tied.group.group_name] = "pp"  # the tied embedding and head, first and last stage
        comm = CommCounter(groups)
        recorder = TraceRecorder()
        tracker = StepMemTracker(comm, recorder)
        with fake:
            batches = _synthetic_batches(cfg, engine.uses_positions)
        play_optimizer(engine, world.layout.optimizer_impl)  # the target's AdamW kernel, not the CPU's
        _create_optimizer_state(engine, fake)
        tracker.track_external(*engine.parts, *engine.optimizers)
        recorder.install()
        try:
            with fake, tracker:
                for step in range(steps):
                    if step == steps - 1:  # the figures are the last step's
                        comm.reset()
                        kernels.reset()
                        recorder.reset()
                        tracker.reset_peak()
                    _train_step(engine, batches, step)
        finally:
            recorder.remove()
        coords = dims.coords(rank)
        predicted = predict_memory(world.source.config, world.layout, stage=coords["pp"])
        per_step = {axis: dict(kinds) for axis, kinds in comm.bytes.items()}
        calls = {key: tuple(value) for key, value in comm.calls_by_size.items()}
        return RankResult(rank, coords, tracker.peak_by_category(), predicted, per_step,
                          time.perf_counter() - start, attention=dict(kernels.counts),
                          unfused_attention=[(call, backend) for call, backend in kernels.unfused.items()],
                          roofline=roofline_report(world, recorder.trace, calls), trace=recorder.trace,
                          comm_calls=calls)
    finally:
        dist.destroy_process_group()


def roofline_report(world: World, trace: OpTrace, comm: dict) -> dict:
    """The rank's step priced on ``world.hardware`` eager and compiled (``simulate/roofline/pricing.py``):
    seconds by category, step time, tokens/s/device, MFU and HFU (plan/flops.py's counts over the dense peak
    of what the matmuls run in)."""
    cfg, layout, hw = world.cfg, world.layout, world.hardware
    dims = world.dims
    per_node = world.devices_per_node or min(dims.world_size, 8)
    cluster = Cluster(max(1, dims.world_size // per_node), per_node)
    intra = {axis: cluster.axis_is_intra_node(layout, axis) for axis in ("tp", "cp", "ep", "dp", "pp")}
    intra["world"] = intra["other"] = cluster.nodes == 1
    flops = token_flops(world.source.config, cfg.seq_length, cfg.ac_mode, mtp=layout.mtp)
    peak = hw.compute_flops(matmul_precision(cfg.mixed_precision, device_type=hw.device_type))
    tokens_per_device = layout.tokens_per_step / dims.world_size
    out: dict = {"device": hw.name, "trace": trace.to_json()}
    for name, compiled in (("eager", False), ("compiled", True)):
        b = price(trace, hw, compiled, comm, intra, layout.pp, layout.num_microbatches, layout.stages_per_rank)
        out[name] = {**throughput(b, tokens_per_device, flops.model, flops.hardware, peak),
                     "breakdown_s": b.to_json()}
    return out


def _create_optimizer_state(engine: Engine, fake: FakeTensorMode) -> None:
    """An update with zero gradients, before anything is tracked: AdamW creates its state, so the first
    tracked step is already the steady state (the optimizer state held through forward and backward)."""
    with fake, ScalarReads():
        for p in engine.params:
            p.grad = torch.zeros_like(p)
        engine.optimizer_step(0.0, 1.0)


def _train_step(engine: Engine, batches: list[dict[str, torch.Tensor]], step: int) -> None:
    engine.step(batches, lr_at(step, engine.cfg))


def _synthetic_batches(cfg: TrainConfig, positions: bool) -> list[dict[str, torch.Tensor]]:
    """One step's micro-batches of token id 0 (the values are never read)."""
    shape = (cfg.batch_size, cfg.seq_length)
    mb = {"input_ids": torch.zeros(shape, dtype=torch.long), "labels": torch.zeros(shape, dtype=torch.long)}
    if positions:
        mb["positions"] = torch.arange(cfg.seq_length).expand(shape)
    return [dict(mb) for _ in range(cfg.gradient_accumulation_steps)]


def _stage_io(engine: Engine, fake: FakeTensorMode):
    """The engine's own pipeline messages (``Engine.pipeline_messages``), as fake tensors."""
    with fake:
        return engine.pipeline_messages()


def simulate_ranks(world: World, ranks: list[int], steps: int = 1, jobs: int = 1,
                   each: bool = False, extrapolate: bool = True) -> list[RankResult]:
    """``simulate_rank`` for ``ranks``, each in a fresh child process (torch.distributed keeps per-process
    state, group names and mesh caches, that one world would leave to the next).

    Ranks of one pipeline stage hold equal-sized slices of the same tensors and run the same operators
    on the same shapes, so unless ``each`` is set one rank per stage is simulated and its figures stand
    for the others of its stage (``simulated_as``). With ``extrapolate``, a step of many micro-batches is
    simulated as two shorter steps and extrapolated (``simulate/microbatches.py``: exact where each further
    micro-batch runs the same ops).
    """
    chosen: dict[int, int] = {}
    for rank in ranks:
        chosen.setdefault(rank if each else world.dims.coords(rank)["pp"], rank)
    layout = world.layout
    counts = extrapolation_counts(layout.num_microbatches, layout.pp, world.cfg.pp_schedule) if extrapolate else None
    worlds = [world] if counts is None else [_shorter_world(world, n) for n in counts]
    tasks = [(w, rank, steps) for rank in chosen.values() for w in worlds]
    context = multiprocessing.get_context("fork")
    with context.Pool(processes=max(1, min(jobs, len(tasks))), maxtasksperchild=1) as pool:
        done = pool.starmap(simulate_rank, tasks, chunksize=1)
    if counts is not None:
        done = [_extrapolated(world, done[i], done[i + 1], counts) for i in range(0, len(done), 2)]
    by_rank = {r.rank: r for r in done}
    out = []
    for rank in ranks:
        rep = by_rank[chosen[rank if each else world.dims.coords(rank)["pp"]]]
        out.append(rep if rep.rank == rank else
                   dataclasses.replace(rep, rank=rank, coords=world.dims.coords(rank), simulated_as=rep.rank))
    return out


def _shorter_world(world: World, microbatches: int) -> World:
    """``world`` with ``microbatches`` micro-batches per step (the same shapes, layout and device)."""
    cfg = config_with_microbatches(world.cfg, world.layout.pp, microbatches)
    return make_world(cfg, world.dims.world_size, world.target, world.layout.moe_imbalance, world.hardware,
                      world.devices_per_node)


def _extrapolated(world: World, a: RankResult, b: RankResult, counts: tuple[int, int]) -> RankResult:
    """The rank's figures for ``world``'s micro-batch count from its simulations at ``counts`` (``a`` < ``b``
    micro-batches): sums extrapolated, and the peak by category too (equal at ``a`` and ``b`` but for what a
    step keeps per micro-batch: MoE routing statistics, a few bytes each)."""
    f = (world.layout.num_microbatches - counts[1]) / (counts[1] - counts[0])
    trace = extrapolate_trace(a.trace, b.trace, f)
    calls = extrapolate_comm_calls(a.comm_calls, b.comm_calls, f)
    attention = {k: round(b.attention.get(k, 0) + f * (b.attention.get(k, 0) - a.attention.get(k, 0)))
                 for k in set(a.attention) | set(b.attention)}
    predicted = predict_memory(world.source.config, world.layout, stage=b.coords["pp"])
    peak = {k: round(b.peak[k] + f * (b.peak[k] - a.peak.get(k, 0))) for k in b.peak}
    return dataclasses.replace(b, peak=peak, predicted=predicted, comm=extrapolate_comm_bytes(a.comm, b.comm, f),
                               seconds=a.seconds + b.seconds, attention=attention,
                               roofline=roofline_report(world, trace, calls), trace=trace, comm_calls=calls,
                               extrapolated_from=counts)


def _quiet_known_notices() -> None:
    # The trainer's own filter (train/trainer.py).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
