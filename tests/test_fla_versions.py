"""flash-linear-attention's versions, on a CPU: choosing its kernel where one below the floor is installed is
refused with the installed version and what to do; from 0.5.0 q and k reach its kernel with their own heads
(grouped value heads), before that repeated per value head. Its kernel needs CUDA, so a stand-in takes its
place here (with its signature: the batch flattened into one row, ``cu_seqlens``), computing with our delta
rule; the real kernel's grouped and repeated calls are compared in tests/test_delta_rule_kernels.py on a device."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.ops import delta_rule
from qwen3_pretrain.models.ops.delta_rule import FlaDeltaRule, TorchDeltaRule, check_fla_version, delta_rule_kernel
from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule


class StandIn:
    """flash-linear-attention's ``chunk_gated_delta_rule`` as it is called: q, k [1, tokens, heads, dk] with
    heads those of v or (grouped) fewer, v [1, tokens, value heads, dv], g and beta [1, tokens, value heads],
    ``cu_seqlens`` the sequences' offsets; records what it was given."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, q, k, v, g, beta, cu_seqlens=None, use_qk_l2norm_in_kernel=False, **kwargs):
        assert q.shape[0] == 1 and use_qk_l2norm_in_kernel and not kwargs
        assert v.shape[2] % q.shape[2] == 0 and k.shape == q.shape
        self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape)})
        starts = torch.zeros(1, q.shape[1], dtype=torch.bool)
        starts[0, cu_seqlens[1:-1].long()] = True  # every sequence's first token, the first row's aside
        return chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, use_qk_l2norm=True)


def _fake_fla(monkeypatch, version: str, chunk=None) -> None:
    """flash-linear-attention ``version`` "installed": its metadata and its kernel's module."""
    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = chunk or StandIn()
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)
    monkeypatch.setattr(delta_rule, "installed_fla_version", lambda: version)
    real_find_spec = delta_rule.importlib.util.find_spec
    monkeypatch.setattr(delta_rule.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "fla" else real_find_spec(name, *a))


@pytest.mark.parametrize("version", ["0.1.0", "0.2.2", "0.3.2", "0.3.2.post1"])
def test_a_version_below_the_floor_is_refused_when_the_kernel_is_chosen(monkeypatch, version):
    _fake_fla(monkeypatch, version)
    with pytest.raises(UserError) as info:
        delta_rule_kernel("cuda")
    message = str(info.value)
    assert f"flash-linear-attention {version} is installed" in message and "0.4.0 or newer" in message
    assert "pip install 'flash-linear-attention>=0.4.0'" in message and "uninstall" in message
    assert delta_rule_kernel("cpu").name == "torch"  # a CPU never chooses it


@pytest.mark.parametrize("version, grouped", [("0.4.0", False), ("0.4.2", False), ("0.5.0", True),
                                              ("0.5.2", True), ("1.0.0rc1", True)])
def test_from_0_5_the_kernel_gets_grouped_heads(monkeypatch, version, grouped):
    _fake_fla(monkeypatch, version)
    kernel = delta_rule_kernel("cuda")
    assert kernel.name == "fla" and kernel.grouped is grouped
    assert check_fla_version() >= (0, 4, 0)


def test_pyproject_extra_floor_is_the_codes(repo_root):
    import tomllib

    extras = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["fla"] == [f"flash-linear-attention>={'.'.join(map(str, delta_rule.FLA_MIN_VERSION))}"]


def _inputs(seed=0, batch=2, seq=40, k_heads=2, v_heads=8, dim=8):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, seq, k_heads, dim, generator=gen) for _ in range(2))
    v = torch.randn(batch, seq, v_heads, dim, generator=gen)
    g = -torch.rand(batch, seq, v_heads, generator=gen)
    beta = torch.rand(batch, seq, v_heads, generator=gen)
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    starts[0, [9, 10, 30]] = True
    starts[1, 17] = True
    return [t.requires_grad_() for t in (q, k, v, g, beta)], starts


@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_and_repeated_heads_compute_ours(grouped):
    """What the kernel is handed: q and k with their 2 heads (grouped) or repeated to the 8 value heads, each
    key head serving 4 consecutive value heads; either way the output and every input's gradient are ours."""
    chunk = StandIn()
    kernel = FlaDeltaRule(chunk, grouped=grouped)
    tensors, starts = _inputs()
    out = kernel(*tensors, starts)
    heads = 2 if grouped else 8
    assert chunk.calls == [{"q": (1, 80, heads, 8), "k": (1, 80, heads, 8), "v": (1, 80, 8, 8)}]
    out.square().sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    want = TorchDeltaRule()(*tensors, starts)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, t in zip(grads, tensors):
        torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-6)
