"""Tensor parallelism (Megatron-style, on DTensor) with sequence parallelism for the norms.

Between blocks the residual stream is a plain local tensor holding 1/tp of the
sequence ([batch, seq/tp, hidden]). Each attention/MLP block all-gathers its
input, runs column-parallel input projections (each rank owns whole heads) and
a row-parallel output projection that reduce-scatters back to the sequence
shard. The embedding is vocabulary-parallel. The LM head is not planned here:
its weight is sharded on the vocabulary and the fused loss handles it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _layer_plan() -> dict:
    gather = dict(desired_input_layouts=(Replicate(), None, None, None), input_layouts=(Shard(1), None, None, None))
    return {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(**gather),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        # q/k norms act per head on [batch, seq, local_heads, head_dim]: the heads axis is the sharded one.
        "attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard ``model`` (one pipeline stage of a Qwen3Model) over ``tp_mesh`` in place."""
    plan: dict = {}
    if model.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel(use_local_output=True)
    for name in model.layers:
        plan.update({f"layers.{name}.{k}": v for k, v in _layer_plan().items()})
    parallelize_module(model, tp_mesh, plan)
    if model.lm_head is not None:
        weight = model.lm_head.weight
        model.lm_head.weight = nn.Parameter(distribute_tensor(weight, tp_mesh, [Shard(0)]),
                                            requires_grad=weight.requires_grad)
    model.sequence_shards = tp_mesh.size()
