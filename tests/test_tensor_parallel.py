"""The vocabulary-parallel embedding: same lookup and gradient as a plain embedding, gradient kept on the shard.
A hybrid's layers split by heads: the same output and every parameter's gradient as one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from qwen3_pretrain.models.qwen3.config import Qwen3Config, interval_layer_types
from qwen3_pretrain.models.qwen3.model import ModelOptions, ModelPart, Qwen3Model
from qwen3_pretrain.parallel.tensor_parallel import apply_tensor_parallel

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


def _hybrid(model_type: str) -> Qwen3Config:
    """A tiny hybrid: [Gated DeltaNet, full attention], 4 key heads of 8 with 2 value heads each."""
    return Qwen3Config(model_type=model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                       max_position_embeddings=256, partial_rotary_factor=0.25,
                       layer_types=interval_layer_types(2, 2), linear_num_key_heads=4, linear_num_value_heads=8,
                       linear_key_head_dim=8, linear_value_head_dim=8, bos_token_id=0, eos_token_id=1)


def _check_hybrid_heads(rank: int, world_size: int, model_type: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    cfg, part = _hybrid(model_type), ModelPart(head=False)  # the residual stream out, as a pipeline stage's
    torch.manual_seed(0)
    reference = Qwen3Model(cfg, ModelOptions(document_mask=True), part)
    with torch.no_grad():  # every parameter away from its init (norms at 0 or 1, dt_bias at 1)
        for param in reference.parameters():
            param.add_(0.1 * torch.randn_like(param))
    sharded = Qwen3Model(cfg, ModelOptions(document_mask=True), part)
    sharded.load_state_dict(reference.state_dict())
    apply_tensor_parallel(sharded, mesh)
    linear = sharded.layers["0"].linear_attn
    assert linear.conv1d.weight.placements == (Shard(0),) and linear.A_log.placements == (Shard(0),)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    positions = torch.cat([torch.arange(5), torch.arange(11)]).expand(2, 16)  # two packed documents
    seq = slice(16 // world_size * rank, 16 // world_size * (rank + 1))
    out, _ = sharded(ids, positions)
    want = reference(ids, positions)[0][:, seq]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    (out ** 2).sum().backward()
    (want ** 2).sum().backward()
    for name, param in reference.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)  # the sequence slices of all ranks
        got = sharded.get_parameter(name).grad
        got = got.full_tensor() if isinstance(got, DTensor) else got
        # summation orders differ (the sequence split): relative to the gradient's largest entry
        error = ((got - grad).abs().max() / grad.abs().max()).item()
        assert error < 1e-5, f"{name}: gradient differs by {error:.1e} of its largest entry"


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_gated_deltanet_heads_split_over_two_ranks(model_type):
    """Each rank runs its heads of the Gated DeltaNet layer (the projections, convolution rows, decay
    parameters sharded; the gated norm's shared weight summed over tp): output and every gradient as one
    process's, on packed documents."""
    run_distributed(2, _check_hybrid_heads, model_type)
