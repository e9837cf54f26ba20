"""bf16 matmuls computed in fp32 (CPUs without native bf16): the same products as a bf16 matmul, gradients
in the inputs' dtypes, chosen from the CPU's features, and training that matches native bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qwen3_pretrain.models.ops import precision
from qwen3_pretrain.models.ops.loss import fused_linear_cross_entropy
from qwen3_pretrain.models.ops.precision import Fp32Linear, fp32_linear, use_fp32_matmul
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model
from tests._train_helpers import TINY_MODEL, check_ok, losses, make_corpus, run_train, write_config


def _bf16(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).bfloat16()


def test_fp32_linear_is_an_fp32_matmul_of_the_bf16_operands_with_bf16_gradients():
    x, w, g = _bf16(3, 5, 32), _bf16(48, 32, seed=1), _bf16(3, 5, 48, seed=2)
    x.requires_grad_(), w.requires_grad_()
    out = fp32_linear(x, w)
    out.backward(g)
    # reference: autograd through an fp32 linear of upcast leaves, rounded to bf16 at the end
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.linear(x32, w32)
    ref.backward(g.float())
    assert out.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x32.grad.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w32.grad.bfloat16(), rtol=1e-2, atol=1e-2)
    # and a native bf16 linear (fp32 accumulation too) gives the same up to bf16 rounding
    native = F.linear(x.detach(), w.detach())
    torch.testing.assert_close(out, native, rtol=2e-2, atol=2e-2)


def test_fp32_linear_leaves_fp32_alone_and_adds_a_bias():
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    torch.testing.assert_close(fp32_linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    torch.testing.assert_close(fp32_linear(xb, wb, bb).float(), F.linear(x, w, b), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("chunk_tokens", [64, 16])
def test_fused_loss_in_fp32_matches_fp32_cross_entropy_of_the_bf16_inputs(chunk_tokens):
    vocab, hidden_size, n = 300, 32, 40
    hidden, weight = _bf16(n, hidden_size), _bf16(vocab, hidden_size, seed=1) * 0.2
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3))
    labels[::7] = -100
    hidden.requires_grad_(), weight.requires_grad_()
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens, fp32_matmul=True)
    loss.backward()
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = F.cross_entropy(h32 @ w32.T, labels, reduction="sum")
    ref.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(hidden.grad, h32.grad.bfloat16(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(weight.grad, w32.grad.bfloat16(), rtol=1e-2, atol=1e-3)
    # The native bf16 path rounds the logits to bf16: further from the fp32 reference than this one.
    native = fused_linear_cross_entropy(hidden.detach(), weight.detach(), labels, chunk_tokens=chunk_tokens)
    assert abs(loss - ref) <= abs(native - ref)


def test_a_model_built_with_fp32_linears_keeps_its_names_and_computes_the_same():
    cfg = Qwen3Config(**TINY_MODEL)
    native = Qwen3Model(cfg).bfloat16()
    fp32 = Qwen3Model(cfg, ModelOptions(linear=Fp32Linear, attention=precision.fp32_attention())).bfloat16()
    fp32.load_state_dict(native.state_dict())
    assert [n for n, _ in fp32.named_parameters()] == [n for n, _ in native.named_parameters()]
    linears = [m for m in fp32.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 7 * cfg.num_hidden_layers + 1 and all(type(m) is Fp32Linear for m in linears)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    out = fp32(ids)
    assert "Fp32Linear" in out.grad_fn.name()  # the forward that ran is the fp32 one, down to the head
    torch.testing.assert_close(out, native(ids), rtol=5e-2, atol=5e-2)


def test_the_choice_follows_device_precision_setting_and_cpu_features(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not use_fp32_matmul(cuda, "bf16", "fp32")
    assert not use_fp32_matmul(cpu, "fp32", "fp32")
    assert use_fp32_matmul(cpu, "bf16", "fp32")
    assert not use_fp32_matmul(cpu, "bf16", "bf16")
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    for avx512_bf16, amx, want in [(False, False, True), (True, False, False), (False, True, False)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert use_fp32_matmul(cpu, "bf16", "auto") is want
    monkeypatch.setattr(precision.platform, "machine", lambda: "aarch64")
    assert not use_fp32_matmul(cpu, "bf16", "auto")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _bf16_run(corpus, path, nproc, *overrides):
    path.mkdir()
    cfg = write_config(path / "c.yaml", corpus, path / "out", mixed_precision="bf16")
    proc = run_train(cfg, nproc, *overrides)
    check_ok(proc)
    return losses(path / "out"), proc.stdout + proc.stderr


@pytest.mark.distributed
def test_training_with_fp32_matmuls_matches_native_bf16_and_works_under_tp(corpus, tmp_path):
    native, _ = _bf16_run(corpus, tmp_path / "native", 1, "cpu_bf16_matmul=bf16", "gradient_accumulation_steps=2")
    fp32, log = _bf16_run(corpus, tmp_path / "fp32", 1, "cpu_bf16_matmul=fp32", "gradient_accumulation_steps=2")
    assert "bf16 matmuls are computed in fp32" in log
    tp2, _ = _bf16_run(corpus, tmp_path / "tp2", 2, "cpu_bf16_matmul=fp32", "tp=2", "gradient_accumulation_steps=2")
    for got in (fp32, tp2):
        worst = max(abs(a - b) / b for a, b in zip(got, native, strict=True))
        print(f"max relative loss diff vs native bf16: {worst:.2e}")
        assert len(got) == len(native) and worst < 2e-2, (got, native)
    assert fp32[-1] < fp32[0]


def test_fp32_attention_matches_fp32_attention_of_the_bf16_inputs():
    q, k, v = _bf16(2, 4, 9, 16), _bf16(2, 2, 9, 16, seed=1), _bf16(2, 2, 9, 16, seed=2)
    for t in (q, k, v):
        t.requires_grad_()
    out = precision.fp32_attention()(q, k, v, None)  # causal, no document mask
    out.backward(_bf16(2, 4, 9, 16, seed=3))
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    ref.backward(_bf16(2, 4, 9, 16, seed=3).float())
    assert out.dtype == q.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.bfloat16(), rtol=0, atol=0)
    for got, want in zip((q.grad, k.grad, v.grad), leaves, strict=True):
        torch.testing.assert_close(got, want.grad.bfloat16(), rtol=1e-2, atol=1e-3)
