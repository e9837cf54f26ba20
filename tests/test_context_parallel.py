"""Context parallelism: one attention layer split over cp ranks computes exactly the single-process
outputs and gradients, with and without document masking."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from qwen3_pretrain.errors import ConfigError, UserError
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from qwen3_pretrain.models.qwen3.attention import SdpaAttention
from qwen3_pretrain.models.qwen3.model import ModelOptions, rope_cos_sin
from qwen3_pretrain.parallel.context_parallel import ContextParallelAttention, shard_sequence, unshard_sequence
from qwen3_pretrain.plan.layout import Layout
from qwen3_pretrain.plan.layers import context_parallel_bytes_per_token
from qwen3_pretrain.simulate.memtrack import MemoryTracker
from qwen3_pretrain.train.config import TrainConfig
from test_loss import run_distributed

CFG = Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=128)
SEQ = 32


def _positions(documents: bool) -> torch.Tensor:
    """[2, SEQ]: plain 0..SEQ-1, or documents that straddle the chunk boundaries (8 tokens per chunk at cp 2)."""
    if not documents:
        return torch.arange(SEQ).repeat(2, 1)
    lengths = [[5, 14, 13], [20, 3, 9]]
    return torch.stack([torch.cat([torch.arange(n) for n in sample]) for sample in lengths])


def _attention(kernel, recompute: str = "none"):
    torch.manual_seed(0)
    return Qwen3Model(CFG, ModelOptions(attention=kernel, recompute=recompute, document_mask=True)).layers["0"].attn


def _run(attn, x, positions, documents: bool):
    cos, sin = rope_cos_sin(positions, CFG.head_dim, CFG.rope_theta, x.dtype)
    docs = attn.kernel.prepare(positions, x.dtype) if documents else None
    out = attn(x, cos, sin, docs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()  # a gradient that varies by token
    return out


def _check(rank: int, world_size: int, documents: bool, recompute: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    positions = _positions(documents)
    x = torch.randn(2, SEQ, CFG.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    reference = _attention(SdpaAttention())
    want = _run(reference, x, positions, documents)

    attn = _attention(ContextParallelAttention(SdpaAttention(), mesh["cp"]), recompute)
    x_local = shard_sequence(x.detach(), world_size, rank).requires_grad_()
    grad_scale = torch.linspace(-1, 1, want.numel()).view_as(want)
    cos, sin = rope_cos_sin(shard_sequence(positions, world_size, rank), CFG.head_dim, CFG.rope_theta, x.dtype)
    docs = attn.kernel.prepare(shard_sequence(positions, world_size, rank), x.dtype) if documents else None
    out = attn(x_local, cos, sin, docs)
    (out * shard_sequence(grad_scale, world_size, rank)).sum().backward()

    torch.testing.assert_close(out, shard_sequence(want.detach(), world_size, rank), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_local.grad, shard_sequence(x.grad, world_size, rank), rtol=1e-5, atol=1e-6)
    for (name, p), ref in zip(attn.named_parameters(), reference.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # every rank's tokens contribute, as FSDP sums them over cp
        torch.testing.assert_close(grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def _kept_per_token(kernel, x: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> float:
    """Bytes one decoder layer keeps for backward per token of ``x``, measured: the storages made in
    its forward that autograd saved (the masks built before). Counting every live storage instead read
    high about once in 150 under cp: gloo's worker thread had not yet let go of a finished all-gather's
    buffers."""
    layer = Qwen3Model(CFG, ModelOptions(attention=kernel)).to(dtype).layers["0"]
    cos, sin = rope_cos_sin(positions, CFG.head_dim, CFG.rope_theta, dtype)
    layer(x, cos, sin)  # builds the cached causal masks
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with MemoryTracker() as mem, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin)
        return mem.counted_bytes(saved) / x.shape[1]


def _check_memory(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, SEQ, CFG.hidden_size, dtype=dtype, requires_grad=True)
        positions = torch.arange(SEQ)[None]
        single = _kept_per_token(SdpaAttention(), x, positions, dtype)
        local = _kept_per_token(ContextParallelAttention(SdpaAttention(), mesh["cp"]),
                                shard_sequence(x.detach(), world_size, rank).requires_grad_(),
                                shard_sequence(positions, world_size, rank), dtype)
        layout = Layout(cp=world_size, seq_length=SEQ, mixed_precision="fp32" if dtype == torch.float32 else "bf16")
        want = context_parallel_bytes_per_token(CFG, layout)
        assert local - single == want, (dtype, rank, local, single, want)




def test_sharding_the_sequence_and_putting_it_back():
    t = torch.arange(2 * 16).view(2, 16)
    parts = [shard_sequence(t, 4, r) for r in range(4)]
    assert parts[1][0].tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    assert torch.equal(unshard_sequence(parts, dim=1), t)


def _check_all(rank: int, world_size: int) -> None:
    _check(rank, world_size, documents=False, recompute="none")
    _check(rank, world_size, documents=True, recompute="selective")  # the gather rerun in backward
    _check_memory(rank, world_size)


@pytest.mark.distributed
def test_one_attention_layer_under_cp2_equals_one_process_and_keeps_what_the_planner_says():
    """Outputs and gradients (input and parameters) of one attention layer under cp 2 equal one process's,
    plain causal and with documents that straddle the chunks (under selective recompute); and per local
    token a whole layer under cp 2 keeps the planner's context-parallel term more than one process (fp32,
    bf16). One set of processes for all three (process start-up dominates)."""
    run_distributed(2, _check_all)


def test_a_sequence_that_cp_cannot_split_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"seq_length 100 is not a multiple of 2 x cp = 16"):
        TrainConfig(data_path="/data/d", seq_length=100, cp=8)
    with pytest.raises(ConfigError, match="compile with cp > 1"):
        TrainConfig(data_path="/data/d", seq_length=128, cp=2, compile=True)


@pytest.mark.parametrize("seq,cp,tp,share", [(17, 1, 2, "seq_length 17"), (36, 2, 4, "seq_length / cp = 36 / 2 = 18")])
def test_a_share_of_the_sequence_that_tp_cannot_split_is_a_clear_error(seq, cp, tp, share):
    """Sequence parallelism splits each rank's seq_length / cp tokens over tp; before this check, seq 17 at
    tp 2 aborted inside gloo with a collective mismatch (NCCL would hang). The trainer's config and the
    planner's layout say so, naming the keys."""
    message = rf"{re.escape(share)} is not a multiple of tp = {tp}"
    with pytest.raises(ConfigError, match=message + ".*choose a seq_length, cp or tp"):
        TrainConfig(data_path="/data/d", seq_length=seq, cp=cp, tp=tp)
    with pytest.raises(UserError, match="layout: " + message):
        Layout(seq_length=seq, cp=cp, tp=tp)
    TrainConfig(data_path="/data/d", seq_length=seq + 1 if seq == 17 else 40, cp=cp, tp=tp)  # fits
