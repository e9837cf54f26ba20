"""The vocabulary-parallel embedding: same lookup and gradient as a plain embedding, gradient kept on the shard."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from qwen3_pretrain.parallel.tensor_parallel import VocabParallelEmbedding
from test_loss import run_distributed

VOCAB, HIDDEN = 1000, 16


def _check(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    reference = nn.Embedding(VOCAB, HIDDEN)
    sharded = VocabParallelEmbedding(reference, mesh)
    assert [n for n, _ in sharded.named_parameters()] == ["weight"]  # the same name as nn.Embedding's
    ids = torch.randint(0, VOCAB, (2, 8 * world_size))
    ids[0, :4] = torch.tensor([0, VOCAB // world_size - 1, VOCAB // world_size, VOCAB - 1])  # shard edges
    out = sharded(ids)  # this rank's slice of the sequence
    seq = slice(8 * rank, 8 * (rank + 1))
    torch.testing.assert_close(out, reference(ids)[:, seq], rtol=0, atol=0)
    (out ** 2).sum().backward()
    (reference(ids)[:, seq] ** 2).sum().backward()
    want = reference.weight.grad.clone()
    dist.all_reduce(want)  # the sequence slices of all ranks
    grad = sharded.weight.grad
    assert grad.placements == (Shard(0),) and grad.to_local().shape == (VOCAB // world_size, HIDDEN)
    torch.testing.assert_close(grad.full_tensor(), want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="padding_idx"):
        VocabParallelEmbedding(nn.Embedding(VOCAB, HIDDEN, padding_idx=0), mesh)


@pytest.mark.distributed
def test_vocab_parallel_embedding_on_two_ranks():
    run_distributed(2, _check)
