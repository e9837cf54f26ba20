"""What the fused LM head + cross-entropy keeps (models/ops/loss.py), measured by MemoryTracker.

In bf16 a chunk's matmul output and logits' gradient share the bytes of its
fp32 logits: the largest thing the loss holds is one chunk's fp32 logits, with
no second [chunk, vocab] buffer in bf16 beside it (it had one, half as large
again, before). The planner's logits term (plan/memory.py) is the measured peak.
"""

from __future__ import annotations

import pytest
import torch

from qwen3_pretrain.hardware import CHUNK_TOKENS_RULE, default_chunk_tokens
from qwen3_pretrain.models.ops import loss as loss_ops
from qwen3_pretrain.models.ops.loss import fused_linear_cross_entropy
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan.layout import Layout
from qwen3_pretrain.plan.memory import loss_working_bytes
from qwen3_pretrain.simulate.memtrack import MemoryTracker

# A head whose logits dwarf everything else: a chunk's fp32 logits are 8 MiB, the weight's gradient 0.75 MiB.
VOCAB, HIDDEN = 8192, 16


def _inputs(tokens: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, HIDDEN, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (1, tokens), generator=gen)
    return hidden, weight, labels


def _forward_peak(tokens: int, chunk: int, dtype: torch.dtype, fp32_matmul: bool = False) -> int:
    """Peak bytes of the storages the loss call creates (its gradients are computed in forward)."""
    hidden, weight, labels = _inputs(tokens, dtype)
    with MemoryTracker() as mem:
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk, fp32_matmul=fp32_matmul)
        peak = mem.peak_bytes
    loss.backward()
    return peak


@pytest.mark.parametrize("tokens, chunk", [(512, 256), (300, 256), (256, 256), (768, 256), (1000, 256)])
def test_bf16_chunk_keeps_its_fp32_logits_and_no_bf16_copy(tokens, chunk):
    """Beside the gradients it returns, the loss holds one chunk's fp32 logits (the in-place conversions' one
    bf16 row is freed before the weight's gradient, larger, exists): a separate bf16 logits buffer would add
    chunk x vocab x 2 bytes (4 MiB). The weight's gradient: over one or two chunks the bf16 gradient alone
    (the second chunk's product in the logits' spent bytes), over more the fp32 sum alone."""
    peak = _forward_peak(tokens, chunk, torch.bfloat16)
    logits = chunk * VOCAB * 4
    grad_hidden = tokens * HIDDEN * 2
    grad_weight = VOCAB * HIDDEN * (4 if -(-tokens // chunk) > 2 else 2)
    kept = logits + grad_hidden + grad_weight
    small = 64 * chunk * 8  # per-token vectors of the chunk (max, sums, ids, masks)
    assert kept <= peak <= kept + small, (peak, kept)
    assert peak < kept + chunk * VOCAB * 2 // 4


def test_bf16_peak_scales_with_the_chunk_not_the_tokens():
    """Twice the tokens in chunks of the same size cost the same logits bytes; twice the chunk costs
    twice the fp32 logits (4 bytes per entry, not 6; both in four chunks, so the weight's gradient is kept
    alike)."""
    base = _forward_peak(512, 128, torch.bfloat16)
    assert _forward_peak(1024, 128, torch.bfloat16) - base < 0.05 * 128 * VOCAB * 4
    assert _forward_peak(1024, 256, torch.bfloat16) - base == pytest.approx(128 * VOCAB * 4, rel=0.02)


@pytest.mark.parametrize("dtype, fp32_matmul, tokens, chunk", [
    (torch.bfloat16, False, 512, 256), (torch.bfloat16, False, 256, 256), (torch.float32, False, 512, 256),
    (torch.bfloat16, True, 512, 256), (torch.bfloat16, False, 768, 256), (torch.bfloat16, False, 96, 8),
    (torch.bfloat16, False, 16, 8)])
def test_planner_logits_term_is_the_measured_peak(dtype, fp32_matmul, tokens, chunk):
    """``loss_working_bytes`` counts the head's input (the final norm's output), made before the loss and
    not measured here, where the measurement has the hidden states' gradient of the same size, which the
    planner counts with the activations: the two sums agree."""
    cfg = Qwen3Config(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, intermediate_size=32, vocab_size=VOCAB)
    layout = Layout(mixed_precision="bf16" if dtype == torch.bfloat16 else "fp32", fp32_matmul=fp32_matmul,
                    seq_length=tokens, loss_chunk_tokens=chunk, device_type="cpu")
    measured = _forward_peak(tokens, chunk, dtype, fp32_matmul)
    if fp32_matmul:  # the fp32 copy of the input is made inside the call and measured; the planner has it too
        measured += tokens * HIDDEN * 2
    assert loss_working_bytes(cfg, layout) == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 33, 64, 127])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_place_conversions_equal_plain_copies(rows, dtype):
    """The upcast from the upper half of the fp32 rows' bytes and the downcast into their lower half give
    what a copy between separate tensors gives, for every row count (overlap at the ends included)."""
    vocab = 37
    source = torch.randn(rows, vocab).to(dtype)
    buffer = torch.empty(rows, vocab)
    flat = buffer.view(dtype).view(-1)
    upper, lower = flat[rows * vocab:].view(rows, vocab), flat[: rows * vocab].view(rows, vocab)
    upper.copy_(source)
    assert torch.equal(loss_ops._upcast_in_place(upper, buffer), source.float())
    values = torch.randn(rows, vocab) * 3
    buffer.copy_(values)
    assert torch.equal(loss_ops._downcast_in_place(buffer, lower), values.to(dtype))


def test_default_chunk_keeps_the_logits_within_the_budget():
    """``loss_chunk_tokens`` empty: Qwen3's vocab keeps the speed-best chunks (1024 on a CPU, 4096 elsewhere);
    a larger vocab gets the largest power of two whose fp32 logits fit the budget, never below the floor."""
    assert default_chunk_tokens("cpu", 151936) == 1024 and default_chunk_tokens("cuda", 151936) == 4096
    assert default_chunk_tokens("cpu") == 1024 and default_chunk_tokens("npu") == 4096
    for device in ("cpu", "cuda", "h100"):
        cap, budget, floor = CHUNK_TOKENS_RULE["cpu" if device == "cpu" else "accelerator"]
        for vocab in (1000, 151936, 248320, 262144, 10**6, 10**8):
            chunk = default_chunk_tokens(device, vocab)
            assert floor <= chunk <= cap and chunk & (chunk - 1) == 0
            assert chunk * vocab * 4 <= budget or chunk == floor
            assert chunk == cap or 2 * chunk * vocab * 4 > budget
    assert default_chunk_tokens("cpu", 248320) == 512


@pytest.mark.parametrize("tokens, chunk", [(512, 256), (700, 256), (1000, 200), (40, 8), (24, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_gradient_is_the_fp32_sum_of_the_chunks_products_rounded_once(tokens, chunk, dtype):
    """The head's weight gradient over several chunks equals, to the bit, each chunk's product (a call on that
    chunk alone, whose gradient is its one matmul's output) summed in fp32 in chunk order and rounded once:
    for two chunks (one addition in the inputs' dtype), for more (an fp32 running sum), and where a chunk has
    fewer tokens than the hidden size (8 < 16: each product in a buffer of its own)."""
    hidden, weight, labels = _inputs(tokens, dtype)
    fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk).backward()
    total = torch.zeros(VOCAB, HIDDEN)
    for start in range(0, tokens, chunk):
        part = weight.detach().clone().requires_grad_()
        piece = slice(start, start + chunk)
        fused_linear_cross_entropy(hidden.detach()[:, piece], part, labels[:, piece], chunk_tokens=chunk).backward()
        total += part.grad.float()
    assert torch.equal(weight.grad, total.to(dtype))
