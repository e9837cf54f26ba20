"""The gated-delta-rule kernel a device runs equals ours: the choice per device, the packed documents'
offsets flash-linear-attention takes, and (on a CUDA device with flash-linear-attention installed) its
outputs and gradients against our plain-torch kernel on packed documents, and (flash-linear-attention >= 0.5)
its grouped-heads call against the repeated one."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from qwen3_pretrain.models.ops.delta_rule import FlaDeltaRule, TorchDeltaRule, cu_seqlens, delta_rule_kernel


def test_the_cpu_runs_ours_and_devices_take_fla_only_where_installed():
    assert delta_rule_kernel("cpu").name == "torch"
    want = "fla" if importlib.util.find_spec("fla") is not None else "torch"
    assert delta_rule_kernel("cuda").name == want and delta_rule_kernel("npu").name == want


def test_cu_seqlens_cut_the_flattened_batch_at_rows_and_documents():
    starts = torch.tensor([[False, False, True, False, False], [True, False, False, False, True]])
    assert cu_seqlens(starts, 2, 5).tolist() == [0, 2, 5, 9, 10]
    assert cu_seqlens(None, 2, 5).tolist() == [0, 5, 10]


def _inputs(device, seed=0, batch=2, seq=200, k_heads=2, v_heads=4, dim=32):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, seq, k_heads, dim, generator=gen) for _ in range(2))
    v = torch.randn(batch, seq, v_heads, dim, generator=gen)
    g = -torch.rand(batch, seq, v_heads, generator=gen) * 0.5
    beta = torch.rand(batch, seq, v_heads, generator=gen)
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    starts[0, [70, 71, 150]] = True
    starts[1, 64] = True
    return [t.to(device).requires_grad_(t.is_floating_point()) for t in (q, k, v, g, beta)], starts.to(device)


def _outputs_and_grads(kernels, tensors, starts):
    """Each kernel's output (fp32) and the inputs' gradients of the sum of its squares."""
    outs, grads = [], []
    for kernel in kernels:
        out = kernel(*tensors, starts)
        out.float().square().sum().backward()
        outs.append(out.detach().float())
        grads.append([t.grad.clone() for t in tensors])
        for t in tensors:
            t.grad = None
    return outs, grads


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs a CUDA device and flash-linear-attention")
@pytest.mark.parametrize("packed", [True, False])
def test_fla_equals_ours_on_packed_documents(packed):
    tensors, starts = _inputs("cuda")
    starts = starts if packed else None  # without document masking each row is one sequence
    outs, grads = _outputs_and_grads((FlaDeltaRule(), TorchDeltaRule()), tensors, starts)
    scale = outs[1].abs().max()
    assert (outs[0] - outs[1]).abs().max() <= 2e-3 * scale
    for mine, theirs in zip(grads[0], grads[1]):
        assert (mine - theirs).abs().max() <= 5e-3 * theirs.abs().max()


def _fla_at_least(version: tuple[int, int, int]) -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        return False
    from qwen3_pretrain.models.ops.delta_rule import check_fla_version

    return check_fla_version() >= version


@pytest.mark.device
@pytest.mark.skipif(not _fla_at_least((0, 5, 0)), reason="needs a CUDA device and flash-linear-attention >= 0.5")
def test_fla_grouped_heads_equal_repeated_heads():
    """From flash-linear-attention 0.5 q and k reach its kernel with their own heads (2 here, for 4 value
    heads): the same outputs and gradients as q and k repeated per value head, as older versions get them."""
    tensors, starts = _inputs("cuda")
    grouped = FlaDeltaRule()
    assert grouped.grouped
    outs, grads = _outputs_and_grads((grouped, FlaDeltaRule(grouped.chunk, grouped=False)), tensors, starts)
    diff = (outs[0] - outs[1]).abs().max().item()
    print(f"\n[fla grouped vs repeated heads] max output diff {diff:.3g}")
    assert diff <= 1e-4 * outs[1].abs().max()
    for mine, theirs in zip(grads[0], grads[1]):
        assert (mine - theirs).abs().max() <= 1e-3 * theirs.abs().max()
