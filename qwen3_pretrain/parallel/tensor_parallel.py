"""Tensor parallelism (Megatron-style, on DTensor) with sequence parallelism for the norms.

Between blocks the residual stream is a plain local tensor holding 1/tp of the
sequence ([batch, seq/tp, hidden]). Each attention (or a hybrid's Gated
DeltaNet) and MLP block all-gathers its input, runs column-parallel input
projections (each rank owns whole heads) and a row-parallel output projection
that reduce-scatters back to the sequence shard. The embedding is
vocabulary-parallel. The LM head is not planned here: its weight is sharded on
the vocabulary and the fused loss handles it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from qwen3_pretrain.models.ops.loss import TiedLMHead
from qwen3_pretrain.models.ops.moe import MoE
from qwen3_pretrain.parallel.fp8 import float8_tensor_parallel_plan


class VocabParallelEmbedding(nn.Module):
    """An embedding sharded on the vocabulary over a tp mesh whose backward stays on the local shard.

    Takes the token ids [batch, seq] (the same on every tp rank) and returns this
    rank's slice of the sequence [batch, seq / tp, hidden], as a plain tensor.
    DTensor's own row-wise embedding computes the forward on the shard, but has no
    sharded rule for the weight's gradient: each rank builds the full-vocabulary
    gradient (in the compute dtype, then in fp32 for the reduction) and slices it,
    which for Qwen3-8B at tp 4 is 3.7 GB of transient memory on the first pipeline
    stage. Here each rank looks up the ids that fall in its rows (the others give
    zeros, summed away by the reduce-scatter to the sequence shard) on its local
    weight, so autograd produces the gradient of the shard only. The parameter is
    ``weight``, as in ``nn.Embedding``: names and checkpoints do not change.
    """

    def __init__(self, embedding: nn.Embedding, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        options = {"padding_idx": embedding.padding_idx, "max_norm": embedding.max_norm,
                   "scale_grad_by_freq": embedding.scale_grad_by_freq or None, "sparse": embedding.sparse or None}
        if any(v is not None for v in options.values()):
            raise ValueError(f"VocabParallelEmbedding does not implement nn.Embedding options {options}")
        vocab = embedding.weight.shape[0]
        if vocab % tp_mesh.size():
            raise ValueError(f"vocabulary {vocab} is not divisible by tp={tp_mesh.size()}; pad it")
        self.weight = nn.Parameter(distribute_tensor(embedding.weight, tp_mesh, [Shard(0)]),
                                   requires_grad=embedding.weight.requires_grad)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight: DTensor = self.weight
        local, mesh = weight.to_local(), weight.device_mesh
        rows = local.shape[0]
        shifted = ids - mesh.get_local_rank() * rows
        outside = (shifted < 0) | (shifted >= rows)
        out = F.embedding(shifted.masked_fill(outside, 0), local)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return partial.redistribute(mesh, [Shard(1)]).to_local()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` when it is a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _replicated(num_inputs: int, sequence_dim: int = 1, num_outputs: int = 1) -> PrepareModuleInputOutput:
    """A module run whole on every tp rank: its first input's sequence gathered in, its first output cut out
    again, the others passed on (its weights replicated; each rank computes the same, with the same
    gradients)."""
    rest, more = (None,) * (num_inputs - 1), (None,) * (num_outputs - 1)
    return PrepareModuleInputOutput(
        input_layouts=(Shard(sequence_dim), *rest), desired_input_layouts=(Replicate(), *rest),
        use_local_input=True, output_layouts=(Replicate(), *more), desired_output_layouts=(Shard(sequence_dim), *more),
        use_local_output=True)


class TensorParallelHeads:
    """The tp split as a Gated DeltaNet layer sees it (``models/qwen3/model.py``: ``HeadSplit``): its
    column-parallel projections already give this rank its heads of the whole sequence, so nothing travels;
    its per-head parameters are DTensors sharded by heads, of which the layer takes this rank's rows."""

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def rank_rows(self, t: torch.Tensor) -> torch.Tensor:
        return local_tensor(t)

    def gather_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions


class _SharedWeightNorm(ParallelStyle):
    """A norm over each head's features whose one weight every head shares (the gated RMSNorm after Gated
    DeltaNet), run on this rank's heads: its inputs ([batch, seq, local heads, d], two of them) taken as
    sharded on the heads, its weight replicated, so autograd sums the weight's gradient over tp (what
    SequenceParallel does for the q/k norms, which take one input)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(_module, args, mesh):
            return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in args)

        return distribute_module(module, device_mesh, input_fn=inputs,
                                 output_fn=lambda _module, out, _mesh: out.to_local())


def _mixer_plan(linear: nn.Module | None) -> dict:
    """The token mixer's plan: attention split by heads; a hybrid's Gated DeltaNet (``linear``) too, its
    sequence gathered in, its input projections column-parallel (each rank's rows are whole heads: the layer
    holds its [q | k | v] rows grouped per key head), its gated norm on the rank's heads, ``out_proj``
    row-parallel; ``split_gated_deltanet`` shards its per-head parameters."""
    if linear is not None:
        projections = ("in_proj_qkvz", "in_proj_ba") if linear.fused else \
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        return {"linear_attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                  desired_input_layouts=(Replicate(), None)),
                **{f"linear_attn.{name}": ColwiseParallel() for name in projections},
                "linear_attn.norm": _SharedWeightNorm(),
                "linear_attn.out_proj": RowwiseParallel(output_layouts=Shard(1))}
    gather = dict(desired_input_layouts=(Replicate(), None, None, None), input_layouts=(Shard(1), None, None, None))
    return {
        "attn": PrepareModuleInput(**gather),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        # q/k norms act per head on [batch, seq, local_heads, head_dim]: the heads axis is the sharded one.
        "attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def _layer_plan(sparse: bool, moe_local_tokens: bool = False, linear: nn.Module | None = None,
                shared: bool = False, routed: bool = False) -> dict:
    """``sparse``: the MLP is a MoE (with a ``shared`` expert: a hybrid's; ``routed``: returning its routing
    statistics beside its output); ``linear``: the layer's Gated DeltaNet, None when its token mixer is
    attention."""
    common = {"attn_norm": SequenceParallel(), **_mixer_plan(linear), "mlp_norm": SequenceParallel()}
    if sparse and moe_local_tokens:
        # Under expert parallelism (which borrows the tp ranks) a MoE layer runs on this tp rank's share
        # of the sequence: no gather. Its router's weight is replicated over tp and sees different tokens
        # on each rank, so it is a DTensor whose gradient is summed over tp (as a norm's under sequence
        # parallelism); the experts are split by expert parallelism.
        plan = {**common, "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                                    use_local_output=True),
                "mlp.gate": SequenceParallel(sequence_dim=0, use_local_output=True)}
        if shared:  # so are the shared expert's and its gate's weights, on this rank's [batch, seq share, hidden]
            plan.update({f"mlp.{name}": SequenceParallel(sequence_dim=1, use_local_output=True) for name in
                         ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                          "shared_expert_gate")})
        return plan
    if sparse:
        # A MoE layer runs whole on every tp rank, on the whole sequence: its router and experts are
        # replicated (each rank computes the same), the sequence gathered in and cut out again. Expert
        # parallelism is what splits the experts.
        return {**common, "mlp": _replicated(num_inputs=1, num_outputs=2 if routed else 1)}
    return {
        **common,
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def _mtp_plan(mtp: nn.Module, moe_local_tokens: bool) -> dict:
    """The multi-token-prediction layer on the sequence-parallel residual stream: its norms per token, its
    projection of [embedding | hidden] gathering the sequence and cutting it again, its decoder layers as the
    model's."""
    plan = {"mtp.pre_fc_norm_embedding": SequenceParallel(use_local_output=True),
            "mtp.pre_fc_norm_hidden": SequenceParallel(use_local_output=True),
            "mtp.fc": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)),
            "mtp.norm": SequenceParallel(use_local_output=True)}
    for name, layer in mtp.layers.items():
        sparse, shared = isinstance(layer.mlp, MoE), getattr(layer.mlp, "shared_expert", None) is not None
        plan.update({f"mtp.layers.{name}.{k}": v
                     for k, v in _layer_plan(sparse, moe_local_tokens, shared=shared,
                                             routed=layer.reports_routing).items()})
    return plan


def split_gated_deltanet(layer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a Gated DeltaNet layer's per-head parameters (the convolution's rows, grouped per key head; the
    decay parameters, one per value head) by heads over ``tp_mesh``, as its projections are, and give it its
    view of the split (a cp split already there takes the tp rank's rows first: ``ContextParallelHeads``)."""
    for module, name in ((layer.conv1d, "weight"), (layer, "A_log"), (layer, "dt_bias")):
        param = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, tp_mesh, [Shard(0)]),
                                                     requires_grad=param.requires_grad))
    if layer.split is None:
        layer.split = TensorParallelHeads()


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, moe_local_tokens: bool = False) -> None:
    """Shard ``model`` (one pipeline stage of a Qwen3Model) over ``tp_mesh`` in place; ``moe_local_tokens``:
    MoE layers run on each tp rank's share of the sequence (expert parallelism borrows the tp ranks)."""
    plan: dict = {}
    if model.norm is not None:
        plan["norm"] = SequenceParallel(use_local_output=True)
    for name, layer in model.layers.items():
        sparse, shared = isinstance(layer.mlp, MoE), getattr(layer.mlp, "shared_expert", None) is not None
        linear = layer.linear_attn if layer.linear else None
        plan.update({f"layers.{name}.{k}": v for k, v in
                     _layer_plan(sparse, moe_local_tokens, linear, shared, layer.reports_routing).items()})
    if getattr(model, "mtp", None) is not None:
        plan.update(_mtp_plan(model.mtp, moe_local_tokens))
    # tensorwise FP8 projections take torchao's FP8 styles (parallel/fp8.py)
    parallelize_module(model, tp_mesh, float8_tensor_parallel_plan(model, plan, tp_mesh.device_type))
    for layer in model.layers.values():
        if layer.linear:
            split_gated_deltanet(layer.linear_attn, tp_mesh)
    if model.embed_tokens is not None:
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, tp_mesh)
    if isinstance(model.lm_head, TiedLMHead):  # no weight of its own: it applies the new embedding's
        model.lm_head.tie_to(model.embed_tokens)
    elif model.lm_head is not None:
        weight = model.lm_head.weight
        model.lm_head.weight = nn.Parameter(distribute_tensor(weight, tp_mesh, [Shard(0)]),
                                            requires_grad=weight.requires_grad)
