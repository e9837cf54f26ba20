"""Which call each device's attention kernel makes, stated without torch.

The kernels of ``attention.py`` compute; this table says what they ask of the
device's libraries for each kind of attention (plain causal or within
documents; a whole sequence, or a context-parallel chunk whose queries are the
last ``q_len`` of ``kv_len`` keys), so that the planner and the scale
simulation can ask the device's kernel rules (``hardware.attention_backend``)
which fused kernel, or the math fallback, will run, without building a model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionCall:
    """One attention call, as a device's kernel rules see it."""

    api: str  # "sdpa", "flex" (FlexAttention) or "npu_fusion" (torch_npu.npu_fusion_attention)
    # "causal" (is_causal, q_len == kv_len), "lower_right" (causal with the queries the last q_len of the
    # keys), "dense" (an additive [.., q_len, kv_len] mask), "block" (FlexAttention's block mask),
    # "segments" (the NPU's variable-length documents)
    mask: str
    dtype: str  # "bfloat16", "float16", "float32": what attention computes in
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int


# kernel -> (documents, chunk) -> (api, mask). "sdpa" is the CPU's kernel (and any device's without one
# of its own); see attention.py for why each device calls what it calls.
CALLS: dict[str, dict[tuple[bool, bool], tuple[str, str]]] = {
    "sdpa": {(False, False): ("sdpa", "causal"), (False, True): ("sdpa", "dense"),
             (True, False): ("sdpa", "dense"), (True, True): ("sdpa", "dense")},
    "cuda": {(False, False): ("sdpa", "causal"), (False, True): ("sdpa", "lower_right"),
             (True, False): ("flex", "block"), (True, True): ("flex", "block")},
    "npu": {(False, False): ("sdpa", "causal"), (False, True): ("npu_fusion", "lower_right"),
            (True, False): ("npu_fusion", "segments"), (True, True): ("npu_fusion", "segments")},
}
_DEVICE_KERNELS = {"cuda": "cuda", "npu": "npu"}


def kernel_name(device_type: str, fp32_attention: bool = False) -> str:
    """The kernel a model on ``device_type`` uses; fp32 attention (a CPU without native bf16) is SDPA's."""
    return "sdpa" if fp32_attention else _DEVICE_KERNELS.get(device_type, "sdpa")


def describe_call(kernel: str, dtype: str, batch: int, q_heads: int, kv_heads: int, q_len: int, kv_len: int,
                  head_dim: int, documents: bool) -> AttentionCall:
    """The call ``kernel`` makes for queries [batch, q_heads, q_len, head_dim] against keys of ``kv_len``."""
    api, mask = CALLS[kernel][(documents, q_len != kv_len)]
    return AttentionCall(api, mask, dtype, batch, q_heads, kv_heads, q_len, kv_len, head_dim)


def dense_document_mask(kernel: str) -> bool:
    """Whether ``kernel`` materializes a [batch, 1, q_len, kv_len] document mask (built once per forward)."""
    return CALLS[kernel][(True, False)][1] == "dense"
