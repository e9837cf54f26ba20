"""The planner's loss term and its single-process peak against MemoryTracker's measurement, on small CPU shapes.

The cases ``bench/plan_validate.py`` found the planner below the measurement in
(bf16, a vocabulary that dwarfs the layers, tied or not): the fused loss's
working set (``plan/memory.py:loss_working_bytes``) in one chunk (the chunk
larger than the micro-batch, as with the default 4096 tokens), two chunks,
three, tied and untied, bf16 and fp32, measured around the head's own call;
and the whole training step, whose peak in those cases is not the loss but
the embedding's gradient reduction at the end of backward (148 MiB = one
fp32 copy of the 151,936 x 256 embedding above the planner while FSDP divided
by a factor set on one rank, into a temporary: ``parallel/parallelize.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from qwen3_pretrain.models.ops.loss import ChunkedLMHead, TiedLMHead
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan.layout import Layout
from qwen3_pretrain.plan.memory import loss_working_bytes, predict_memory
from qwen3_pretrain.simulate.memtrack import MemoryTracker

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN = 8192, 32


def _cfg(tied: bool = False, vocab: int = VOCAB, hidden: int = HIDDEN) -> Qwen3Config:
    return Qwen3Config(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, intermediate_size=64, vocab_size=vocab, tie_word_embeddings=tied)


def _head_peak(tokens: int, chunk: int, dtype: torch.dtype, tied: bool) -> int:
    """Peak bytes of the head's loss call, its input made inside the measurement (the planner counts the
    final norm's output in this term), less the hidden states' gradient (counted with the activations)."""
    gen = torch.Generator().manual_seed(0)
    weight = nn.Parameter((torch.randn(VOCAB, HIDDEN, generator=gen) * 0.1).to(dtype))
    if tied:
        embedding = nn.Embedding(VOCAB, HIDDEN, dtype=dtype)
        embedding.weight = weight
        head: nn.Module = TiedLMHead(embedding, chunk_tokens=chunk)
    else:
        head = ChunkedLMHead(HIDDEN, VOCAB, chunk_tokens=chunk, dtype=dtype)
        head.weight = weight
    labels = torch.randint(0, VOCAB, (1, tokens), generator=gen)
    source = torch.randn(1, tokens, HIDDEN, generator=gen).to(dtype)
    with MemoryTracker() as mem:
        hidden = (source * 1).requires_grad_()  # a new storage, as the final norm's output
        loss = head(hidden, labels)
        peak = mem.peak_bytes
    loss.backward()  # the gradients computed in forward are the ones returned
    assert weight.grad is not None and hidden.grad is not None
    return peak - tokens * HIDDEN * dtype.itemsize


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype, tokens, chunk", [
    (torch.bfloat16, 256, 4096),  # one chunk larger than the micro-batch (the default chunk, h256 cases)
    (torch.bfloat16, 256, 256),  # one chunk, exactly
    (torch.bfloat16, 512, 256),  # two: the second product added to the first
    (torch.bfloat16, 768, 256),  # three: the fp32 running sum
    (torch.float32, 256, 4096), (torch.float32, 512, 256)])
def test_logits_term_is_the_heads_measured_peak(tied, dtype, tokens, chunk):
    cfg = _cfg(tied)
    layout = Layout(mixed_precision="bf16" if dtype == torch.bfloat16 else "fp32", seq_length=tokens,
                    loss_chunk_tokens=chunk, device_type="cpu")
    measured = _head_peak(tokens, chunk, dtype, tied)
    # the chunk's per-token vectors (max, sums, ids, masks) are the only thing the term leaves out
    assert loss_working_bytes(cfg, layout) == pytest.approx(measured, rel=0.01)


def _harness():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import plan_harness
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return plan_harness


@pytest.fixture
def one_rank():
    created = not dist.is_initialized()
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
def test_single_process_step_peak_is_predicted(one_rank, tied):
    """A bf16 step whose embedding dwarfs the layers (the h256 validation cases in small): the planner's
    allocated peak is MemoryTracker's, at the end of backward where the embedding's gradient is reduced
    (untied), within 2%; a temporary copy of the embedding's fp32 gradient would be 16% above it."""
    cfg = _cfg(tied, vocab=16384, hidden=64)
    layout = Layout(micro_batch_size=1, seq_length=64, activation_checkpointing="none")
    m = _harness().measure(cfg, layout)
    assert m.predicted.allocated == pytest.approx(m.measured_peak_bytes, rel=0.02)
    assert m.measured_peak_bytes - m.predicted.allocated < 0.5 * 4 * cfg.vocab_size * cfg.hidden_size
