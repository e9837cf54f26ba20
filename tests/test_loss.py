"""The chunked, vocab-parallel LM-head loss equals the naive full-logits cross-entropy.

The reference is always ``F.cross_entropy(F.linear(h, W).float(), labels,
reduction="sum")`` run by autograd on the full weight in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.ops.loss import ChunkedLMHead, fused_linear_cross_entropy
from tests._host_syncs import HostSyncCounter
from tests._train_helpers import free_port

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def make_inputs(shape=(2, 9), hidden=16, vocab=50, dtype=torch.float64, seed=0, num_ignored=3):
    """Random (h [*shape, hidden], W [vocab, hidden], labels [*shape]) with a few ignored labels."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels.view(-1)[torch.randperm(labels.numel(), generator=gen)[:num_ignored]] = -100
    return h, w, labels


def naive(h, w, labels, scale=1.0):
    """(loss, grad h, grad W) of the full-logits cross-entropy sum, by autograd."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    logits = F.linear(h, w).to(torch.promote_types(h.dtype, torch.float32))
    loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def fused(h, w, labels, scale=1.0, **kwargs):
    """(loss, grad h, grad W) of fused_linear_cross_entropy."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels, **kwargs)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 7, 18, 4096])
def test_matches_naive(dtype, chunk_tokens):
    h, w, labels = make_inputs(dtype=dtype)
    got = fused(h, w, labels, scale=0.37, chunk_tokens=chunk_tokens)
    want = naive(h, w, labels, scale=0.37)
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, **TOL[dtype])


@pytest.mark.parametrize("shape", [(18,), (3, 4, 5)])
def test_any_leading_dims(shape):
    h, w, labels = make_inputs(shape=shape, dtype=torch.float64)
    got = fused(h, w, labels, chunk_tokens=7)
    want = naive(h, w, labels)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, **TOL[torch.float64])


def test_repeated_runs_are_bit_identical():
    h, w, labels = make_inputs(shape=(4, 16), hidden=32, vocab=500, dtype=torch.float32)
    first, second = fused(h, w, labels, chunk_tokens=9), fused(h, w, labels, chunk_tokens=9)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_bf16_close_to_naive_bf16():
    h, w, labels = make_inputs(shape=(4, 16), hidden=64, vocab=1000, dtype=torch.bfloat16)
    loss, gh, gw = fused(h, w, labels, chunk_tokens=24)
    want_loss, want_gh, want_gw = naive(h, w, labels)
    assert loss.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0)
    torch.testing.assert_close(gh, want_gh, rtol=2e-2, atol=2e-2 * want_gh.abs().max().item())
    torch.testing.assert_close(gw, want_gw, rtol=2e-2, atol=2e-2 * want_gw.abs().max().item())


def test_valid_vocab_masks_padding_rows():
    h, w, labels = make_inputs(vocab=40)
    padding = 100.0 * torch.ones(8, w.shape[1], dtype=w.dtype)  # would dominate the softmax if not masked
    loss, gh, gw = fused(h, torch.cat([w, padding]), labels, chunk_tokens=5, valid_vocab=40)
    want_loss, want_gh, want_gw = naive(h, w, labels)
    torch.testing.assert_close(loss, want_loss, **TOL[torch.float64])
    torch.testing.assert_close(gh, want_gh, **TOL[torch.float64])
    torch.testing.assert_close(gw[:40], want_gw, **TOL[torch.float64])
    assert torch.all(gw[40:] == 0)


def test_all_ignored_gives_zero_loss_and_gradients():
    h, w, labels = make_inputs()
    loss, gh, gw = fused(h, w, torch.full_like(labels, -100), chunk_tokens=4)
    assert loss.item() == 0 and torch.all(gh == 0) and torch.all(gw == 0)


def test_custom_ignore_index():
    h, w, labels = make_inputs(num_ignored=0)
    labels[0, :4] = 7
    got = fused(h, w, labels, ignore_index=7)
    want = naive(h, w, torch.where(labels == 7, -100, labels))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, **TOL[torch.float64])


def test_no_grad_evaluation():
    h, w, labels = make_inputs()
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h.requires_grad_(), w, labels, chunk_tokens=4)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, naive(h, w, labels)[0], **TOL[torch.float64])


def test_autocast_matches_linear_under_autocast():
    h, w, labels = make_inputs(shape=(2, 32), hidden=32, vocab=300, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, gh, gw = fused(h, w, labels, chunk_tokens=24)
        want_loss, want_gh, want_gw = naive(h, w, labels)
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0)
    torch.testing.assert_close(gw, want_gw, rtol=2e-2, atol=2e-2 * want_gw.abs().max().item())


@pytest.mark.parametrize("bad_label, valid_vocab", [(50, None), (-5, None), (45, 45)])
def test_label_outside_vocab_is_a_user_error(bad_label, valid_vocab):
    h, w, labels = make_inputs(vocab=50)
    labels[1, 2] = bad_label
    with pytest.raises(UserError, match=f"first: {bad_label}"):
        fused_linear_cross_entropy(h, w, labels, valid_vocab=valid_vocab)


def test_a_models_head_reads_nothing_and_a_direct_call_checks_its_labels_with_one_read():
    """A model's head leaves token ids to the check where the batch is made (data/reader.py): its loss call
    never waits for the device, and equals the full-logits reference; a direct call checks, reading once."""
    h, w, labels = make_inputs(shape=(2, 9), vocab=50)
    head = ChunkedLMHead(16, 50, chunk_tokens=4, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(w)
    with HostSyncCounter() as syncs:
        loss = head(h, labels)
    assert syncs.events == []
    torch.testing.assert_close(loss.detach(), naive(h, w, labels)[0], **TOL[torch.float64])
    with HostSyncCounter() as syncs:
        fused_linear_cross_entropy(h, w, labels, chunk_tokens=4)
    assert len(syncs.events) == 1
    bad = labels.clone()
    bad[0, 5], bad[1, 7] = 61, -7
    with pytest.raises(UserError, match=r"2 label\(s\) are not token ids in the LM head's vocab .*\(first: 61\)"):
        fused_linear_cross_entropy(h, w, bad, chunk_tokens=4)
    assert torch.isfinite(head(h, bad))  # unchecked: no target logit for them, no error


def test_shape_and_dtype_errors_name_the_problem():
    h, w, labels = make_inputs()
    with pytest.raises(UserError, match="labels must be"):
        fused_linear_cross_entropy(h, w, labels[:, :-1])
    with pytest.raises(UserError, match="expected \\[vocab, 16\\]"):
        fused_linear_cross_entropy(h, w.T, labels)
    with pytest.raises(UserError, match="float32"):
        fused_linear_cross_entropy(h.float(), w, labels)
    with pytest.raises(UserError, match="chunk_tokens"):
        fused_linear_cross_entropy(h, w, labels, chunk_tokens=0)


def test_chunked_lm_head_logits_loss_and_from_linear():
    h, w, labels = make_inputs(dtype=torch.float32)
    model = nn.Sequential()
    model.lm_head = nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(w)
    param = model.lm_head.weight
    model.lm_head = ChunkedLMHead.from_linear(model.lm_head, chunk_tokens=5)
    assert model.lm_head.weight is param and [n for n, _ in model.named_parameters()] == ["lm_head.weight"]
    torch.testing.assert_close(model.lm_head(h), F.linear(h, w))
    loss = model.lm_head(h, labels)
    loss.backward()
    want_loss, _, want_gw = naive(h, w, labels)
    torch.testing.assert_close(loss, want_loss, **TOL[torch.float32])
    torch.testing.assert_close(param.grad, want_gw, **TOL[torch.float32])
    with pytest.raises(UserError, match="bias"):
        ChunkedLMHead.from_linear(nn.Linear(16, 50))


# --- vocab-parallel: 4 gloo processes, tp 4 and tp 2 ------------------------------------------

def run_distributed(world_size: int, fn, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; a failure in any fails the test."""
    mp.spawn(_init_and_run, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)


def _init_and_run(rank: int, world_size: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # No rank closes its connections while another may still be reading its last collective's data
        # (gloo aborts the reader: "terminate called without an active exception", seen once in CI).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _vocab_shards(vocab: int, tp: int) -> list[tuple[int, int]]:
    """(start, stop) rows per rank, the torch.chunk split that DTensor's Shard(0) also uses."""
    rows = -(-vocab // tp)
    return [(min(r * rows, vocab), min((r + 1) * rows, vocab)) for r in range(tp)]


def _check_plain_tensor_shards(mesh) -> None:
    """Each rank holds a slice of W and passes the tp group; uneven shards, padded vocab and bf16."""
    tp, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    h, w, labels = make_inputs(shape=(2, 11), vocab=37)
    start, stop = _vocab_shards(37, tp)[rank]
    loss, gh, gw = fused(h, w[start:stop], labels, scale=0.5, chunk_tokens=5, tp_group=group, vocab_start=start)
    want_loss, want_gh, want_gw = naive(h, w, labels, scale=0.5)
    torch.testing.assert_close(loss, want_loss, **TOL[torch.float64])
    torch.testing.assert_close(gh, want_gh, **TOL[torch.float64])
    torch.testing.assert_close(gw, want_gw[start:stop], **TOL[torch.float64])

    padded = torch.cat([w, 50.0 * torch.ones(40 - 37, w.shape[1], dtype=w.dtype)])  # 40 = a multiple of tp
    start, stop = _vocab_shards(40, tp)[rank]
    loss, gh, gw = fused(h, padded[start:stop], labels, chunk_tokens=4, tp_group=group,
                         vocab_start=start, valid_vocab=37)
    want_loss, want_gh, want_gw = naive(h, w, labels)
    torch.testing.assert_close(loss, want_loss, **TOL[torch.float64])
    torch.testing.assert_close(gh, want_gh, **TOL[torch.float64])
    torch.testing.assert_close(gw, F.pad(want_gw, (0, 0, 0, 3))[start:stop], **TOL[torch.float64])

    hb, wb = h.bfloat16(), w.bfloat16()
    start, stop = _vocab_shards(37, tp)[rank]
    loss, gh, gw = fused(hb, wb[start:stop], labels, chunk_tokens=8, tp_group=group, vocab_start=start)
    want_loss, want_gh, want_gw = naive(hb, wb, labels)
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0)
    torch.testing.assert_close(gh, want_gh, rtol=2e-2, atol=3e-2 * want_gh.abs().max().item())
    torch.testing.assert_close(gw, want_gw[start:stop], rtol=2e-2, atol=3e-2 * want_gw.abs().max().item())


def _check_dtensor_head(mesh, padded_vocab: int | None = None) -> None:
    """ChunkedLMHead with W sharded Shard(0) and h sequence-parallel Shard(1): same loss and full grads.

    Without ``padded_vocab`` the 37 vocab rows shard unevenly; with it, W gets padding rows up to
    ``padded_vocab`` and the head ``valid_vocab=37``.
    """
    h, w, labels = make_inputs(shape=(2, 8), vocab=37)
    rows = padded_vocab or 37
    full_w = torch.cat([w, 50.0 * torch.ones(rows - 37, w.shape[1], dtype=w.dtype)])
    linear = nn.Linear(16, rows, bias=False, dtype=torch.float64)
    linear.weight = nn.Parameter(distribute_tensor(full_w, mesh, [Shard(0)]))
    head = ChunkedLMHead.from_linear(linear, chunk_tokens=5, valid_vocab=37 if padded_vocab else None)
    h_dt = distribute_tensor(h, mesh, [Shard(1)]).requires_grad_()
    loss = head(h_dt, labels)
    (loss * 0.5).backward()
    want_loss, want_gh, want_gw = naive(h, w, labels, scale=0.5)
    torch.testing.assert_close(loss, want_loss, **TOL[torch.float64])
    torch.testing.assert_close(h_dt.grad.full_tensor(), want_gh, **TOL[torch.float64])
    torch.testing.assert_close(head.weight.grad.full_tensor(), F.pad(want_gw, (0, 0, 0, rows - 37)),
                               **TOL[torch.float64])
    with torch.no_grad():
        torch.testing.assert_close(head(h_dt).full_tensor(), F.linear(h, full_w), **TOL[torch.float64])


def _check_tp4_and_tp2(rank: int, world_size: int) -> None:
    # tp=2 runs as two replicas on the inner axis of a (dp, tp) mesh, so its group is not the world's.
    tp4 = init_device_mesh("cpu", (world_size,))
    tp2 = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    for mesh in (tp4, tp2):
        _check_plain_tensor_shards(mesh)
        _check_dtensor_head(mesh)
        _check_dtensor_head(mesh, padded_vocab=40)


@pytest.mark.distributed
def test_vocab_parallel_matches_single_process():
    run_distributed(4, _check_tp4_and_tp2)
