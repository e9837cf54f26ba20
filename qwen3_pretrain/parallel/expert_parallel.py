"""Expert parallelism: each rank of an ``ep`` group holds ``num_experts / ep`` of a MoE layer's experts, and
the (token, expert) pairs travel to the rank of their expert and back.

The experts' stacked parameters are DTensors sharded on their expert dimension over the ep mesh
(``Shard(0)``): a checkpoint holds them whole under their usual names, so a run resumes under another ep,
and ``merge`` writes one HF model from any layout. FSDP shards each rank's experts further over the
data-parallel ranks the ep group leaves (``ParallelDims.expert_meshes``).

Dispatch, per layer and micro-batch (``ExpertParallel``), dropless:

1. the pairs arrive sorted by expert, with ``counts`` [E] per expert; expert ``e`` lives on ep rank
   ``e // (E / ep)``, so the pairs for each rank are one contiguous run;
2. the counts travel first (an all-to-all of ``E`` integers), then the host reads how many rows go to
   and come from each rank (``2 x ep`` integers, which the all-to-all of the rows needs on the host): the
   one host synchronisation; the per-expert row indices are built on the device from the received counts;
3. the pairs (each token's hidden state with its routing weight as one more column) travel by an
   all-to-all with those splits; what arrives is grouped by source rank, then by local expert, and is
   regrouped by local expert (a stable sort: within an expert, source ranks in order);
4. the local experts compute (the build's expert kernel: grouped matmul or per-expert loop), the rows are
   put back in arrival order and travel back by the reverse all-to-all, in the order they left.

The groups are padded where the experts compute, on the expert's rank (what travels is unpadded): to the
kernel's alignment (``models/ops/moe.py``: ``pad_groups``), or with pad-to-capacity to the rows one copy of
an expert can receive at most. With a capacity the pairs a rank sends are the ones kept: dropping is
decided before dispatch, over the ranks that split the micro-batch (``gather_over`` collects the routing
weights there), so the rows an expert's rank receives are bounded by the capacity whatever the routing.

Autograd runs the same all-to-alls in reverse for the gradients (``all_to_all_single_autograd``). The
collectives are torch's functional ones, so a compiled layer traces the dispatch whole: the host-read split
sizes become symbolic sizes (``torch._dynamo.config.capture_scalar_outputs``, set by
``parallel/parallelize.py: compile_layer``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed._functional_collectives import (all_gather_tensor, all_to_all_single,
                                                       all_to_all_single_autograd)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from qwen3_pretrain.models.ops.moe import GroupedExperts
from qwen3_pretrain.parallel.tensor_parallel import local_tensor


class ExpertParallel:
    """A MoE layer's dispatch over ``ep_mesh`` (``models/ops/moe.py``: ``ExpertsDispatch``)."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()

    def exchange_counts(self, counts: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, list[int], list[int]]:
        """(the pairs this rank receives [ep, E / ep] from each ep rank per expert of its own, the rows it sends
        to each ep rank, the rows it receives from each): an all-to-all of the counts, of which the host
        reads only the row totals (the one synchronisation of the dispatch)."""
        send = counts.view(self.size, -1)
        recv = all_to_all_single(send.reshape(-1), None, None, self.group).view_as(send)
        splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()
        return recv, splits[0], splits[1]

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor,
                 experts: GroupedExperts, group_rows: int | None = None) -> torch.Tensor:
        ep, local = self.size, counts.numel() // self.size
        recv, send_splits, recv_splits = self.exchange_counts(counts, tokens.shape[0])
        payload = torch.cat([tokens, weights], dim=1)  # each pair's routing weight travels as one more column
        arrived = all_to_all_single_autograd(payload, recv_splits, send_splits, self.group)
        # rows grouped by source rank, then by local expert: regroup by local expert, sources in order
        device = counts.device
        expert_of_row = torch.arange(local, device=device).repeat(ep).repeat_interleave(
            recv.reshape(-1), output_size=sum(recv_splits))
        order = expert_of_row.argsort(stable=True)
        x, w = arrived[:, :-1].index_select(0, order), arrived[:, -1:].index_select(0, order)
        y = experts.kernel(x, recv.sum(0), w, local_tensor(experts.gate_proj), local_tensor(experts.up_proj),
                           local_tensor(experts.down_proj), group_rows)
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
        return all_to_all_single_autograd(y.index_select(0, back), send_splits, recv_splits, self.group)


def gather_over(group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    """Concatenates a tensor over ``group``'s ranks on its first dim, rank order (torch's functional
    all-gather, so a compiled layer traces it): how a MoE layer's capacity sees the whole micro-batch's
    routing (``models/ops/moe.py``: ``Capacity``)."""
    return lambda t: all_gather_tensor(t, 0, group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts of ``model`` (a pipeline stage, on the meta device) over ``ep_mesh``
    in place: each stacked parameter becomes a DTensor sharded on its expert dimension, under its own name,
    and the layer dispatches its pairs over the mesh."""
    dispatch, ep = ExpertParallel(ep_mesh), ep_mesh.size()
    for module in model.modules():
        if not isinstance(module, GroupedExperts):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            local = torch.empty((param.shape[0] // ep, *param.shape[1:]), dtype=param.dtype, device=param.device)
            module.register_parameter(name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)],
                                                                            run_check=False)))
        module.dispatch = dispatch
