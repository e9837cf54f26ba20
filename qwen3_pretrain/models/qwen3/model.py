"""Qwen3 dense decoder in plain PyTorch.

Reads top to bottom: RMSNorm, rotary embedding, attention, MLP, decoder layer,
the model. Nothing here knows about ``torch.distributed``: tensor, pipeline and
data parallelism are applied from outside by module name. For that:

* layers live in a ``ModuleDict`` keyed by the layer index, so a pipeline stage
  deletes the layers it does not own and parameter names stay the same;
* ``embed_tokens``, ``norm`` and ``lm_head`` may be ``None`` on a stage;
* attention derives the number of local heads from the projected tensor's
  shape, so it runs unchanged on a tensor-parallel shard of the heads.

Numerics follow HuggingFace's ``Qwen3ForCausalLM``: RMSNorm in fp32 then cast
back, q/k RMSNorm per head before RoPE, RoPE tables computed in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qwen3_pretrain.models.qwen3.attention import AttentionKernel, SdpaAttention
from qwen3_pretrain.models.qwen3.config import Qwen3Config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for ``positions`` [batch, seq] -> two [batch, 1, seq, head_dim] tensors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [batch, seq, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, kernel: AttentionKernel) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        # The attention kernel (attention.py), chosen for the device; the engine may swap in one with
        # other numerics (models/ops/precision.py).
        self.kernel = kernel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs=None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # Head counts come from the shapes, so a tensor-parallel shard runs unchanged.
        q = self.q_norm(self.q_proj(x).view(bsz, seq, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(bsz, seq, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)  # [batch, kv_heads, seq, head_dim]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = self.kernel(q, k, v, docs)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, attention: AttentionKernel) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, attention)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, docs)
        return x + self.mlp(self.mlp_norm(x))


class Qwen3Model(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head.

    ``forward(input_ids)`` returns logits [batch, seq, vocab]. On a pipeline
    stage without ``embed_tokens`` the first argument is the previous stage's
    hidden states; without ``lm_head`` (or with ``return_hidden`` set, when the
    loss applies the head itself in chunks) it returns hidden states, and with
    ``pass_positions`` set (a stage before the last, with per-document
    positions) the pair (hidden states, positions) for the next stage.
    ``attention`` is the attention kernel every layer uses (``attention.py``:
    ``attention_kernel(device_type)``); torch's SDPA when not given.
    """

    def __init__(self, cfg: Qwen3Config, attention: AttentionKernel | None = None) -> None:
        super().__init__()
        self.config = cfg
        attention = attention if attention is not None else SdpaAttention()
        # Passing the weight skips nn.Embedding's random init, which on the meta device costs seconds
        # (it imports the compiler stack); init_weights below or a checkpoint sets the values.
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, attention) for i in range(cfg.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Set from outside: return hidden states instead of logits (the loss applies the head in chunks);
        # keep attention within each packed document (positions restart at 0 per document); and how
        # many shards of the sequence a hidden-state input holds (sequence parallelism hands a pipeline
        # stage 1/N of the sequence).
        self.return_hidden = False
        self.document_mask = False
        self.sequence_shards = 1
        # A pipeline stage before the last hands its positions on with its hidden states.
        self.pass_positions = False
        if self.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.embed_tokens is not None:
            bsz, seq = x.shape
            h = self.embed_tokens(x)
        else:
            h = x
            bsz, seq = x.shape[0], x.shape[1] * self.sequence_shards
        if positions is None:
            positions = torch.arange(seq, device=h.device).expand(bsz, seq)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        docs = None
        if self.document_mask:  # prepared once, by the kernel the layers use, and shared by them
            docs = next(iter(self.layers.values())).attn.kernel.prepare(positions, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, docs)
        if self.norm is not None:
            h = self.norm(h)
        if self.pass_positions and self.lm_head is None:
            return h, positions
        if self.lm_head is None or self.return_hidden:
            return h
        return self.lm_head(h)

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head's weight (the embedding's when tied), for a loss that applies the head itself."""
        assert self.lm_head is not None, "output_weight is only defined on the stage that holds the LM head"
        return self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter from ``seed``, independently of the others (see ``init_param``)."""
        for name, param in self.named_parameters():
            param.copy_(init_param(name, tuple(param.shape), self.config, seed).to(param.dtype))


def init_param(name: str, shape: tuple[int, ...], cfg: Qwen3Config, seed: int) -> torch.Tensor:
    """The initial value of parameter ``name``: a pure function of (name, shape, config, seed).

    Each parameter draws from its own generator seeded by its name, so a
    sharded or pipelined model initializes each rank's slice to exactly what
    the single-process model holds, whatever the parallel layout. Norms start
    at one; matrices are normal(0, initializer_range), with the projections
    that write into the residual stream (o_proj, down_proj) scaled down by
    sqrt(2 * num_layers) so the residual's variance does not grow with depth.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name)) % (2**63))
    std = cfg.initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's ``hash`` is salted per process)."""
    value = 1469598103934665603
    for byte in text.encode():
        value = ((value ^ byte) * 1099511628211) % (2**64)
    return value
