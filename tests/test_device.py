"""What the accelerator's own kernels compute: the model and the fused loss on the device, forward and
backward, against an independent float64 reference computed on the CPU.

Marked ``device``: skipped on a machine without a GPU or NPU; ``QWEN3_PRETRAIN_TEST_DEVICE=cpu`` runs
them on the CPU (``bench/device_check.sh --cpu`` does, so the device check's test stage is itself tested).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from qwen3_pretrain.models.ops.loss import fused_linear_cross_entropy
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from tests.test_model_parity import randomize

pytestmark = pytest.mark.device

# Relative error (norm of the difference / norm of the reference) allowed per compute dtype: fp32 kernels
# differ from float64 by rounding only; bf16 keeps 8 bits of mantissa (~0.4% per rounding), which a norm
# weight's gradient, summed over every token, shows as ~2%. A wrong kernel (positions ignored) gives ~30%.
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
# The gradients' bound in bf16: 2.4-2.7e-2 measured for the worst (a q/k or attention norm's weight) on an
# Intel Xeon with AMX, whatever oneDNN's ISA or ATen's vector width; how a CPU's bf16 kernels round differs
# by CPU (the suite runs on several kinds), so twice the output's bound, still a third of a wrong kernel's.
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-1}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm()).item()


def logits_and_grads(model: Qwen3Model, ids: torch.Tensor, probe: torch.Tensor,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and the gradients of <logits, probe> (a fixed random direction) for every parameter."""
    logits = model(ids, positions=positions)
    (logits.float() * probe).sum().backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "restarting-positions"])
def test_model_forward_and_backward_match_a_float64_cpu_reference(test_device, tiny_config, dtype, packed):
    cfg = tiny_config(num_hidden_layers=2, max_position_embeddings=512)  # GQA, head_dim != hidden / heads
    model = Qwen3Model(cfg)
    randomize(model, seed=3)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (2, 160), generator=gen)
    probe = torch.randn(2, 160, cfg.vocab_size, generator=gen)
    # RoPE positions restart at each packed document (reset_position_ids), as the trainer passes them.
    positions = torch.cat([torch.arange(60), torch.arange(100)]).expand(2, 160) if packed else None
    want, want_grads = logits_and_grads(copy.deepcopy(model).double(), ids, probe.double(), positions)
    on_device = model.to(device=test_device, dtype=dtype)
    got, got_grads = logits_and_grads(on_device, ids.to(test_device), probe.to(test_device),
                                      None if positions is None else positions.to(test_device))
    assert got.device.type == test_device.type and got.dtype == dtype
    assert rel_err(got, want) < REL_TOL[dtype], rel_err(got, want)
    worst = max(want_grads, key=lambda n: rel_err(got_grads[n], want_grads[n]))
    assert rel_err(got_grads[worst], want_grads[worst]) < GRAD_TOL[dtype], (worst, rel_err(got_grads[worst],
                                                                                         want_grads[worst]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_and_gradients_match_a_float64_cpu_reference(test_device, dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, vocab = 300, 64, 5000
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = 0.3 * torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = -100  # ignored positions (padding, document ends)
    # The reference rounds its inputs to the device's dtype first: only the computation is compared.
    h_ref = h.to(dtype).double().requires_grad_()
    w_ref = w.to(dtype).double().requires_grad_()
    want = F.cross_entropy(F.linear(h_ref, w_ref), labels, reduction="sum")
    want.backward()
    h_dev = h.to(device=test_device, dtype=dtype).requires_grad_()
    w_dev = w.to(device=test_device, dtype=dtype).requires_grad_()
    got = fused_linear_cross_entropy(h_dev, w_dev, labels.to(test_device), chunk_tokens=128)
    got.backward()
    assert got.dtype == torch.float32 and h_dev.grad.dtype == dtype
    assert abs(got.item() - want.item()) / want.item() < REL_TOL[dtype] / 10  # the loss is accumulated in fp32
    assert rel_err(h_dev.grad, h_ref.grad) < REL_TOL[dtype]
    assert rel_err(w_dev.grad, w_ref.grad) < REL_TOL[dtype]
