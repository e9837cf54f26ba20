"""Expert parallelism's dispatch against one process computing every expert: outputs and gradients equal,
including when one rank receives no pair at all (it must still take part in backward), in fp32 (the
per-expert loop) and bf16 (the grouped kernel)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._train_helpers import free_port

HIDDEN, EXPERTS, TOP_K, INTER, TOKENS = 32, 4, 2, 16, 24


def _inputs(rank: int, skewed: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    scores = torch.rand(TOKENS, EXPERTS, generator=g)
    if skewed:  # every pair goes to experts 0 and 1, rank 0's: rank 1 receives nothing
        scores[:, 2:] = -1.0
    chosen = scores.topk(TOP_K, dim=-1).indices
    weights = torch.rand(TOKENS, TOP_K, generator=g).softmax(-1).to(dtype)
    return x, chosen, weights


def _experts(dtype: torch.dtype):
    from qwen3_pretrain.models.ops.moe import GroupedExperts, experts_kernel

    experts = GroupedExperts(EXPERTS, HIDDEN, INTER, experts_kernel("cpu", dtype))
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return experts.to(dtype)


def _worker(rank: int, port: int, skewed: bool, dtype: torch.dtype, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from qwen3_pretrain.parallel.expert_parallel import apply_expert_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    reference = _experts(dtype)
    holder = torch.nn.Module()
    holder.experts = _experts(dtype)
    apply_expert_parallel(holder, mesh["ep"])
    rows = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(holder.experts, name).to_local().copy_(getattr(reference, name)[rows])
    x, chosen, weights = _inputs(rank, skewed, dtype)
    x.requires_grad_()
    weights.requires_grad_()
    out = holder.experts(x, chosen, weights)
    out.float().pow(2).sum().backward()
    grads = {n: getattr(holder.experts, n).grad.to_local().clone() for n in ("gate_proj", "up_proj", "down_proj")}
    torch.save((out.detach(), x.grad, weights.grad, grads), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # neither rank leaves while the other still talks to it (gloo aborts a rank whose peer left)
    dist.destroy_process_group()
    os._exit(0)  # no C++ static teardown: a communication thread destroyed at exit can abort the process


@pytest.mark.distributed
@pytest.mark.parametrize("skewed", [False, True], ids=["spread", "one-rank-idle"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-loop", "bf16-grouped"])
def test_dispatch_equals_one_process(skewed, dtype, tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, skewed, dtype, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)  # a rank left waiting in backward (the bug this guards against) would hang here
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(2)}
    # one process: every rank's tokens through all four experts
    reference = _experts(dtype)
    parts = [_inputs(r, skewed, dtype) for r in range(2)]
    x = torch.cat([p[0] for p in parts]).requires_grad_()
    weights = torch.cat([p[2] for p in parts]).requires_grad_()
    out = reference(x, torch.cat([p[1] for p in parts]), weights)
    out.float().pow(2).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for r in range(2):
        got_out, got_x, got_w, got_grads = results[r]
        rows = slice(r * TOKENS, (r + 1) * TOKENS)
        assert torch.allclose(got_out.float(), out[rows].detach().float(), atol=tol, rtol=tol)
        assert torch.allclose(got_x.float(), x.grad[rows].float(), atol=tol, rtol=tol)
        assert torch.allclose(got_w.float(), weights.grad[rows].float(), atol=tol, rtol=tol)
        experts = slice(r * EXPERTS // 2, (r + 1) * EXPERTS // 2)
        for name, grad in got_grads.items():
            want = getattr(reference, name).grad[experts].float()
            assert torch.allclose(grad.float(), want, atol=tol * max(1.0, want.abs().max().item()), rtol=tol), name
    if skewed:
        assert results[1][3]["gate_proj"].abs().max() == 0  # rank 1's experts received nothing
