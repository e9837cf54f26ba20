"""Build the local part of the model for this rank: the stage (with its numerics, recompute and fused-loss
head chosen at construction) -> TP -> FSDP.

The order follows the composition rules of torch.distributed: tensor
parallelism first (parameters become DTensors on the tp axis), then FSDP2 over
the data-parallel axes (parameters become 2-D DTensors). Activation
checkpointing is part of how the stage is built (``ModelOptions.recompute``):
the checkpoint sits inside each layer's forward, under FSDP's and TP's hooks.
Everything is built on the ``meta`` device and only this rank's slices are
materialized, so an 8B model never exists whole on one rank.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from qwen3_pretrain.models.ops.delta_rule import DeltaRuleKernel, delta_rule_kernel
from qwen3_pretrain.models.ops.fp8 import Fp8Projections
from qwen3_pretrain.models.ops.elementwise import ElementwiseKernels, elementwise_kernels
from qwen3_pretrain.models.ops.loss import TiedLMHead
from qwen3_pretrain.models.ops.moe import Capacity, MoE, ExpertLoop, ExpertsKernel, RouterObserver, experts_kernel
from qwen3_pretrain.models.ops.moe_fp8 import fp8_experts_kernel
from qwen3_pretrain.models.ops.precision import Fp32Linear, fp32_linear
from qwen3_pretrain.models.qwen3.attention import AttentionKernel, attention_kernel
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.init import INIT_TILE
from qwen3_pretrain.models.qwen3.model import LossHead, ModelOptions, ModelPart, Qwen3Model
from qwen3_pretrain.parallel.context_parallel import ContextParallelAttention, ContextParallelHeads
from qwen3_pretrain.parallel.expert_parallel import apply_expert_parallel
from qwen3_pretrain.parallel.tensor_parallel import apply_tensor_parallel

# (parameter name, global shape, slices of this rank) -> values for those slices
ParamSource = Callable[[str, tuple[int, ...], tuple[slice, ...]], torch.Tensor]


@dataclass
class PartSpec:
    stage_index: int
    num_stages: int
    layers: range


def local_stage_indices(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stages of this pipeline rank: ``pp_rank + k * pp`` (the looped assignment interleaved schedules use)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


# (device type, compute dtype or None) -> the device's attention kernel
KernelFactory = Callable[[str, "torch.dtype | None"], AttentionKernel]


def choose_attention(device_type: str, fp32_matmul: bool = False, cp_mesh: DeviceMesh | None = None,
                     make: KernelFactory = attention_kernel) -> AttentionKernel:
    """The one place the attention kernel is chosen: the device's kernel (``models/qwen3/attention.py``),
    on fp32 copies where bf16 matmuls run in fp32 (a CPU without native bf16), gathering keys and values
    over ``cp_mesh`` when the sequence is split (``context_parallel.py``). ``make`` builds the device's
    kernel (the scale simulation plays the target device's kernels on the CPU)."""
    kernel = make(device_type, torch.float32 if fp32_matmul else None)
    return ContextParallelAttention(kernel, cp_mesh) if cp_mesh is not None else kernel


def choose_experts(device_type: str, mixed_precision: str, fp32_matmul: bool = False,
                   fp8: Fp8Projections | None = None, compiled: bool = False) -> ExpertsKernel:
    """The one place a MoE layer's expert kernel is chosen (``models/ops/moe.py``: ``experts_kernel``): a
    grouped matmul where the device has one for the compute dtype, else one matmul per expert (in fp32 where
    bf16 matmuls run in fp32). Under ``fp8`` the FP8 grouped matmul (``models/ops/moe_fp8.py``) where the
    device has one or ``fp8_emulate`` emulates it, unless ``fp8_filter`` keeps ``mlp.experts`` out."""
    if fp8 is not None and fp8.filter.keeps("mlp.experts"):
        kernel = fp8_experts_kernel(fp8.recipe, device_type, fp8.emulate)
        if kernel is not None:
            return kernel
    dtype = torch.float32 if fp32_matmul or mixed_precision != "bf16" else torch.bfloat16
    return experts_kernel(device_type, dtype, fp32_linear if fp32_matmul else torch.nn.functional.linear,
                          compiled=compiled)


def kernel_table(cfg: Qwen3Config, device_type: str, elementwise: ElementwiseKernels, mixed_precision: str,
                 fp32_matmul: bool = False, cp: bool = False, optimizer: str | None = None,
                 make: KernelFactory = attention_kernel, fp8: Fp8Projections | None = None,
                 compiled: bool = False) -> dict[str, str]:
    """Which kernel each block of ``cfg``'s model runs on ``device_type``, for the start-up log: asked of
    the choosers the engine builds with (``choose_attention``, ``choose_experts``, ``delta_rule_kernel``),
    never restated; ``elementwise``: the kernels the engine built with (``Engine.elementwise``: its tensors'
    device's, which under tp take the norms' DTensors: models/ops/elementwise.py). ``cp``: the sequence is
    split over ranks; ``optimizer``: the optimizer's row (train/optim.py: ``describe_optimizer``, which reads
    the built optimizer); ``fp8``: the engine's FP8 choice (the experts' kernel follows it); ``compiled``: the
    layers run under ``torch.compile`` (the experts' kernel may follow it)."""
    attention = choose_attention(device_type, fp32_matmul, make=make)
    table = {"attention": f"{attention.name} ({type(attention).__name__}{', gathered over cp' if cp else ''})"}
    table.update(elementwise.describe(zero_centered=cfg.is_hybrid))
    if cfg.is_moe:
        table["experts"] = choose_experts(device_type, mixed_precision, fp32_matmul, fp8, compiled).name
    if cfg.num_linear_layers:
        table["delta rule"] = delta_rule_kernel(device_type).name
    if optimizer is not None:
        table["optimizer"] = optimizer
    return table


def describe_kernels(table: dict[str, str]) -> str:
    """``kernel_table`` as one log line."""
    return " | ".join(f"{block}: {kernel}" for block, kernel in table.items())


def build_stage(cfg: Qwen3Config, spec: PartSpec, valid_vocab: int, loss_chunk_tokens: int, *,
                attention: AttentionKernel | None = None, fp32_matmul: bool = False, ac_mode: str = "none",
                document_mask: bool = False, cp_mesh: DeviceMesh | None = None,
                experts: ExpertsKernel | None = None, router_observer: RouterObserver | None = None,
                moe_force_balance: bool = False, multi_token_prediction: bool = False,
                delta_rule: DeltaRuleKernel | None = None, elementwise: ElementwiseKernels | None = None,
                moe_router_fp32: bool = False, moe_expert_bias: bool = False,
                moe_capacity: Capacity | None = None, fp8: Fp8Projections | None = None) -> Qwen3Model:
    """The stage's part of the model on the meta device; the last stage's head is the fused-loss head
    (the loss applies it, in chunks, to the hidden states the stage returns).

    ``attention``: the kernel (``choose_attention``; by default the CPU's, for ``fp32_matmul`` and
    ``cp_mesh``); ``fp32_matmul``: its bf16 matmuls run in fp32 (CPUs without native bf16,
    ``models/ops/precision.py``); ``ac_mode``: what is recomputed in backward; ``document_mask``: attention
    within each document; ``cp_mesh``: the cp axis when it has more than one rank; ``experts``: a MoE layer's
    expert kernel (``choose_experts``), ``router_observer``: what watches its routing (the engine's balancing
    losses), ``moe_force_balance``: round-robin routing (a benchmark mode); ``multi_token_prediction``: the
    hybrids' MTP layer is trained (on the last stage; the next tokens' embeddings travel down the pipeline);
    ``delta_rule``: the Gated DeltaNet layers' kernel (``models/ops/delta_rule.py``: ``delta_rule_kernel``);
    ``elementwise``: the norms', RoPE's and SwiGLU's (``models/ops/elementwise.py``: ``elementwise_kernels``;
    by default the CPU's); ``moe_router_fp32``: the routers' logits in fp32, ``moe_expert_bias``: the MoE
    layers hold an aux-loss-free balancing bias (``ModelOptions``); ``moe_capacity``: the experts' capacity
    (``models/ops/moe.py``: ``Capacity``; None: dropless); ``fp8``: the decoder layers' projections
    multiply in FP8 (``models/ops/fp8.py``; its ``base`` becomes this stage's high-precision class)."""
    kernel = attention or choose_attention("cpu", fp32_matmul, cp_mesh)
    last = spec.stage_index == spec.num_stages - 1
    # Under pp > 1 a tied head has a parameter of its own on the last stage, kept equal to the embedding
    # by summing the two gradients (parallel/grads.py: TiedWeights).
    loss_head = LossHead(chunk_tokens=loss_chunk_tokens, valid_vocab=valid_vocab if valid_vocab < cfg.vocab_size
                         else None, fp32_matmul=fp32_matmul)
    linear = Fp32Linear if fp32_matmul else nn.Linear
    options = ModelOptions(attention=kernel, elementwise=elementwise or elementwise_kernels("cpu"),
                           linear=linear, projections=replace(fp8, base=linear) if fp8 is not None else None,
                           recompute=ac_mode, document_mask=document_mask, loss_head=loss_head,
                           experts=experts or ExpertLoop(fp32_linear if fp32_matmul else torch.nn.functional.linear),
                           router_observer=router_observer, moe_force_balance=moe_force_balance,
                           moe_router_fp32=moe_router_fp32, moe_expert_bias=moe_expert_bias,
                           moe_capacity=moe_capacity,
                           head_split=ContextParallelHeads(cp_mesh) if cp_mesh is not None else None,
                           multi_token_prediction=multi_token_prediction,
                           delta_rule=delta_rule)
    part = ModelPart(layers=spec.layers, embedding=spec.stage_index == 0, head=last)
    with torch.device("meta"):
        return Qwen3Model(cfg, options, part)


class AllReduceScatter:
    """FSDP's gradient reduce-scatter as an in-place all-reduce of the whole buffer, keeping this rank's slice
    (FSDP2's custom reduce-scatter interface: ``allocate`` and ``__call__``).

    gloo's ``reduce_scatter_tensor`` is slower than an all-reduce of its whole
    input (about twice, measured in bench/README.md), so on CPU the all-reduce is
    used: same sum, and no extra memory (the input is FSDP's full-size staging
    buffer, dropped after the call).
    """

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])


def apply_fsdp(model: Qwen3Model, dp_mesh: DeviceMesh, mixed_precision: str,
               reduce_scatter_device: str | None = None, experts_mesh: DeviceMesh | None = None,
               keep_params_gathered: bool = False, grad_reduce_dtype: str = "fp32",
               keep_last_gathered: bool = False) -> None:
    """FSDP2 units: the embedding, each decoder layer (the MTP layer's too), the LM head (its forward runs in the loss, outside
    the model's; a tied head on the embedding's stage has no weight of its own) and the final norm at the
    root. The embedding is a unit of its own so that it is gathered only around its own forward and
    backward, not for the whole backward pass as part of the root. Under expert parallelism a MoE layer's
    experts are a unit of their own, sharded over ``experts_mesh`` (the data-parallel ranks ep leaves).
    ``keep_params_gathered``: no unit frees its weights after forward (the engine keeps them gathered
    after backward too, until the step's last micro-batch: Megatron's accumulation). ``keep_last_gathered``:
    the last decoder layer to run forward (the multi-token-prediction layer's when there is one, and its
    experts' unit) keeps its weights from forward to backward: without pipelining its backward is the first,
    right after the loss, so freeing them would only gather them again (one all-gather of a layer per
    micro-batch); the loss's peak holds that layer gathered either way in ``plan``'s memory model. Under
    pipelining other micro-batches run between a stage's forward and its backward: not kept there. Under
    bf16 gradients accumulate and are reduced in ``grad_reduce_dtype``; the reduced shards are fp32 like
    the weights."""
    reduce_dtype = torch.bfloat16 if grad_reduce_dtype == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) \
        if mixed_precision == "bf16" else MixedPrecisionPolicy()
    tied_head = isinstance(model.lm_head, TiedLMHead)
    free = not keep_params_gathered
    if model.embed_tokens is not None:
        # A tied head applies the embedding's weight in the loss: it stays gathered from the
        # embedding's forward to its backward, the end of the step, and both gradients meet there.
        fully_shard(model.embed_tokens, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=free and not tied_head)
    mtp_layers = model.mtp.layers.values() if model.mtp is not None else ()
    experts_units = set()  # sharded over experts_mesh, not dp_mesh
    units = (*model.layers.values(), *mtp_layers)  # the multi-token-prediction layer's as the others
    for index, unit in enumerate(units):
        freed = free and not (keep_last_gathered and index == len(units) - 1)
        if experts_mesh is not None and isinstance(unit.mlp, MoE):
            fully_shard(unit.mlp.experts, mesh=experts_mesh, mp_policy=mp, reshard_after_forward=freed)
            experts_units.add(unit.mlp.experts)
        fully_shard(unit, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=freed)
    if model.lm_head is not None and not tied_head:
        # Its backward follows its forward at once: keeping the gathered weight saves a second gather.
        fully_shard(model.lm_head, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    # On one rank the sum is the rank's own gradient, and FSDP's default already copies it unscaled; a
    # divide factor set there makes it divide into a temporary the size of the unit's fp32 gradient
    # (torch 2.13's one-rank path), beside the reduce input and output: the embedding's at the end of
    # backward, the step's peak in single-process training (bench/plan_validate.py). Decided per unit: with
    # ep = dp x cp the experts' mesh has one rank while the rest's has several.
    for module in model.modules():
        mesh = experts_mesh if module in experts_units else dp_mesh
        if isinstance(module, FSDPModule) and mesh.size() > 1:
            # Gradients summed over the dp and cp ranks, not averaged: the loss carries the one scale,
            # 1 / the global batch's tokens (train/rank_model.py). Plain sums, which every library has.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    # Whose reduce-scatter the gradients take: the mesh's device by default; the scale simulation builds
    # on a CPU mesh what an accelerator would run, so it names the accelerator.
    if (reduce_scatter_device or dp_mesh.device_type) == "cpu":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(AllReduceScatter())


def parallelize_stage(model: Qwen3Model, mesh: DeviceMesh, dp_mesh: DeviceMesh, mixed_precision: str,
                      compile_layers: bool = False, reduce_scatter_device: str | None = None,
                      expert_meshes: tuple[DeviceMesh, DeviceMesh] | None = None,
                      keep_params_gathered: bool = False, grad_reduce_dtype: str = "fp32") -> None:
    """Tensor parallelism, expert parallelism (``expert_meshes``: ParallelDims.expert_meshes, for ep > 1),
    per-layer compilation and FSDP (``apply_fsdp``), in that order, on a stage built by ``build_stage``."""
    tensor_parallel = mesh["tp"].size() > 1
    if tensor_parallel:
        # with expert parallelism a MoE layer takes each tp rank's share of the sequence (ep borrows tp)
        apply_tensor_parallel(model, mesh["tp"], moe_local_tokens=expert_meshes is not None)
    if expert_meshes is not None:
        apply_expert_parallel(model, expert_meshes[0])
    if compile_layers:
        if tensor_parallel:
            # torch 2.13's AOTAutograd cache can hand a tensor-parallel graph compiled by another run (another
            # layout) to this one, with that run's process-group names: "Could not resolve the process group
            # registered under the name N" (seen with dp x tp after a tp-only run). Compiled here each time.
            torch._functorch.config.enable_autograd_cache = False
        compile_stage_layers(model, tensor_parallel, expert_parallel=expert_meshes is not None)
    apply_fsdp(model, dp_mesh, mixed_precision, reduce_scatter_device,
               expert_meshes[1] if expert_meshes is not None else None, keep_params_gathered, grad_reduce_dtype,
               keep_last_gathered=mesh["pp"].size() == 1)


def compile_stage_layers(model: Qwen3Model, tensor_parallel: bool, expert_parallel: bool = False) -> None:
    """``compile_layer`` on each decoder layer of ``model``, the multi-token-prediction layer's included."""
    # The per-expert loop's run lengths and expert parallelism's split sizes are read on the host
    # (``.tolist()``); traced as symbolic sizes, they stay inside the layer's graph instead of breaking it in
    # every MoE layer. A process-wide setting (dynamo traces at the first call, not here): a training
    # process builds one model, and the setting changes nothing for code without such reads.
    torch._dynamo.config.capture_scalar_outputs = True
    mtp_layers = model.mtp.layers.values() if model.mtp is not None else ()
    for layer in (*model.layers.values(), *mtp_layers):
        compile_layer(layer, tensor_parallel, expert_parallel)


def compile_layer(layer: nn.Module, tensor_parallel: bool, expert_parallel: bool = False) -> None:
    """``torch.compile`` a decoder layer in place (parameter names stay; the layers of a kind share one graph:
    no layer index or Python state enters it, and a MoE layer's routing statistics leave it as tensors for the
    balancing bookkeeping, which stays eager: ``models/qwen3/model.py``, ``tests/test_compile.py``).

    Two cases compile the layer's parts instead, what joins them (a recompute, the router) staying eager:
    a sparse layer under expert parallelism, whose experts are an FSDP unit of their own (``apply_fsdp``),
    whose hooks dynamo does not trace (a graph break inside the layer, and under full recompute the whole
    layer eager); and a layer recomputed whole under tensor parallelism: torch 2.13's AOTAutograd fails on
    a recompute region inside a compiled graph with tensor-parallel DTensors ("expected all
    tensors_saved_with_vc_check to be Tensors": a DeviceMesh among the saved values; docs/training.md)."""
    mixer = layer.linear_attn if layer.linear else layer.attn
    if expert_parallel and isinstance(layer.mlp, MoE):
        for part in (mixer, layer.attn_norm, layer.mlp_norm, layer.mlp.experts, layer.mlp.shared_expert):
            if part is not None:
                part.compile()
    elif tensor_parallel and layer.recompute:
        mixer.compile()
        layer.mlp.compile()
    else:
        layer.compile()


# Elements of a parameter one task of ``materialize`` fills: whole tiles of the init (INIT_TILE rows), few
# enough that a thread holds little on the host and the progress moves often.
_CHUNK_ELEMENTS = 1 << 22

# (elements filled so far, elements in all) of this rank's part, after each chunk
Progress = Callable[[int, int], None]


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, source: ParamSource, threads: int = 1,
                progress: Progress | None = None) -> None:
    """Allocate this rank's shards on ``device`` and fill each from ``source`` (only the owned slices).

    The shards are filled in chunks of rows on ``threads`` threads: the
    source draws or reads on the CPU, where a torch operation runs on the
    thread that calls it (one thread per rank under torchrun), and any chunk
    of a slice holds the same values as the slice (``init_param``)."""
    model.to_empty(device=device)
    chunks = [chunk for name, param in model.named_parameters() for chunk in _chunks(name, param)]
    total, done = sum(chunk[0].numel() for chunk in chunks), 0

    @torch.no_grad()  # in each thread: grad mode is per thread
    def fill(chunk: tuple[torch.Tensor, str, tuple[int, ...], tuple[slice, ...]]) -> int:
        local, name, shape, slices = chunk
        local.copy_(source(name, shape, slices).to(local.dtype))
        return local.numel()

    pool = (ThreadPoolExecutor(threads, initializer=_use_device, initargs=(device,)) if threads > 1
            else contextlib.nullcontext())
    with pool:
        for filled in (pool.map(fill, chunks) if threads > 1 else map(fill, chunks)):
            done += filled
            if progress is not None:
                progress(done, total)


def _use_device(device: torch.device) -> None:
    """Make ``device`` the current device of a thread of ``materialize``: a fresh thread's is device 0, and
    torch_npu keeps the current device per thread (data/prefetch.py sets it for its thread the same way)."""
    if device.type != "cpu" and device.index is not None:
        torch.accelerator.set_device_index(device.index)


def _chunks(name: str, param: torch.Tensor) -> list[tuple[torch.Tensor, str, tuple[int, ...], tuple[slice, ...]]]:
    """This rank's block of ``param`` cut along dim 0 at multiples of a fixed number of rows (so a chunk's
    bounds do not depend on the layout): (local view, name, global shape, global slices) per chunk."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return []
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        shape, offset = tuple(param.shape), (0,) * param.dim()
    slices = [slice(o, o + n) for o, n in zip(offset, shape)]
    if param.dim() < 2:
        return [(local, name, tuple(param.shape), tuple(slices))]
    step = max(1, _CHUNK_ELEMENTS // math.prod(shape[1:]))
    step = step - step % INIT_TILE[0] if step > INIT_TILE[0] else step
    first, stop = offset[0], offset[0] + shape[0]
    bounds = [first, *range((first // step + 1) * step, stop, step), stop]
    return [(local[a - first:b - first], name, tuple(param.shape), (slice(a, b), *slices[1:]))
            for a, b in zip(bounds, bounds[1:])]
