"""FSDP's gradient reduce-scatter on CPU (an all-reduce keeping this rank's slice) gives gloo's reduce-scatter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qwen3_pretrain.parallel.parallelize import AllReduceScatter
from tests.test_loss import run_distributed


def _compare(rank: int, world_size: int) -> None:
    group = dist.new_group(list(range(world_size)))
    comm = AllReduceScatter()
    shard = 1001
    data = torch.randn(world_size * shard, generator=torch.Generator().manual_seed(rank))
    want = torch.empty(shard)
    dist.reduce_scatter_tensor(want, data.clone(), group=group)
    staging = comm.allocate((world_size * shard,), dtype=torch.float32, device=torch.device("cpu"))
    staging.copy_(data)
    got = comm.allocate((shard,), dtype=torch.float32, device=torch.device("cpu"))
    comm(got, staging, group, dist.ReduceOp.SUM)
    # the sum of every rank's slice `rank`, computed here from the seeds
    expected = sum(torch.randn(world_size * shard, generator=torch.Generator().manual_seed(r))
                   for r in range(world_size)).view(world_size, shard)[rank]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_scatter_matches_reduce_scatter(world_size):
    run_distributed(world_size, _compare)
