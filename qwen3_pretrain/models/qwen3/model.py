"""Qwen3 decoder in plain PyTorch, dense and mixture-of-experts (Qwen3-MoE).

Reads top to bottom: RMSNorm, rotary embedding, attention, MLP, decoder layer,
the model. A Qwen3-MoE model is the same model whose sparse layers
(``Qwen3Config.is_sparse_layer``) hold a mixture of experts (models/ops/moe.py)
in place of the MLP. Nothing here knows about ``torch.distributed``: tensor, pipeline and
data parallelism are applied from outside by module name. For that:

* layers live in a ``ModuleDict`` keyed by the layer index, so a pipeline stage
  holds only its own layers and parameter names stay the same;
* a ``ModelPart`` says which part of the model is built: a stage without the
  embedding takes hidden states, a stage without the head returns them;
* attention derives the number of local heads from the projected tensor's
  shape, so it runs unchanged on a tensor-parallel shard of the heads.

How the modules compute is chosen when the model is built, never patched in
afterwards (``ModelOptions``): the attention kernel, the class of the
projections (numerics), which blocks are recomputed in backward, and whether
attention stays within each packed document. The ``forward`` below is the one
that runs.

Numerics follow HuggingFace's ``Qwen3ForCausalLM``: RMSNorm in fp32 then cast
back, q/k RMSNorm per head before RoPE, RoPE tables computed in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from qwen3_pretrain.models.ops.loss import ChunkedLMHead, TiedLMHead
from qwen3_pretrain.models.ops.moe import MoE, ExpertLoop, ExpertsKernel, RouterObserver
from qwen3_pretrain.models.ops.norm import rms_norm
from qwen3_pretrain.models.ops.swiglu import swiglu
from qwen3_pretrain.models.qwen3.attention import AttentionKernel, SdpaAttention
from qwen3_pretrain.models.qwen3.config import RECOMPUTE, Qwen3Config


# The parameters the vocabulary indexes (training pads them to a multiple of tp rows), and the tied head's
# alias: a model that ties them holds the weight once, as the embedding (checkpoints and HF files too).
EMBEDDING = "embed_tokens.weight"
HEAD = "lm_head.weight"
VOCAB_TENSORS = (EMBEDDING, HEAD)
TIED_ALIASES = {HEAD: EMBEDDING}


@dataclass(frozen=True)
class LossHead:
    """The LM head as the fused head + cross-entropy (models/ops/loss.py): a model built with it returns its
    final hidden states, and the loss applies the head to them in chunks, never holding the full logits."""

    chunk_tokens: int = 4096  # tokens per chunk of the head's matmul and the loss
    valid_vocab: int | None = None  # the real vocabulary when the head is padded to a multiple of tp
    fp32_matmul: bool = False  # bf16 operands multiplied in fp32 (models/ops/precision.py)


@dataclass(frozen=True)
class ModelOptions:
    """How the model's modules compute; the engine chooses them per device and config."""

    # The attention kernel every layer uses (attention.py: ``attention_kernel(device_type)``); SDPA when None.
    attention: AttentionKernel | None = None
    # The class of every projection: ``nn.Linear``, or one with other numerics (models/ops/precision.py).
    linear: type[nn.Linear] = nn.Linear
    # Recomputed in backward instead of kept (config.RECOMPUTE): "full" (each decoder layer keeps only its
    # input), "selective" (the attention core, the kernel call: what the kernel saves beyond its inputs, e.g.
    # scores or softmax statistics, as Megatron's selective recompute), "mlp" (each MLP's intermediate
    # activations, 3 x intermediate_size per token), or "none".
    recompute: str = "none"
    # Attention stays within each packed document (the positions restart at 0 where one starts).
    document_mask: bool = False
    # The LM head a loss applies (returning hidden states), or None: a plain head returning logits.
    loss_head: LossHead | None = None
    # How a MoE layer's experts compute (models/ops/moe.py); one matmul per expert when None.
    experts: ExpertsKernel | None = None
    # Sees each MoE layer's routing in training (the load-balancing loss and the expert-load metrics).
    router_observer: RouterObserver | None = None
    # Benchmark mode: MoE layers route round-robin (perfectly balanced) instead of by the router's choice.
    moe_force_balance: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, not {self.recompute!r}")


@dataclass(frozen=True)
class ModelPart:
    """The part of the model one module holds: all of it, or one pipeline stage."""

    layers: range | None = None  # the decoder layers it holds; None: all
    embedding: bool = True  # holds the embedding and takes token ids (else the previous part's output)
    head: bool = True  # holds the final norm and the LM head (else hands on hidden states and positions)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

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
    def __init__(self, cfg: Qwen3Config, kernel: AttentionKernel, linear: type[nn.Linear] = nn.Linear,
                 recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute  # the kernel call keeps only q, k, v and runs again in backward
        self.head_dim = cfg.head_dim
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = linear(h, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = linear(cfg.num_attention_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.kernel = kernel  # attention.py, chosen for the device the model runs on

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # Head counts come from the shapes, so a tensor-parallel shard runs unchanged.
        q = self.q_norm(self.q_proj(x).view(bsz, seq, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(bsz, seq, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)  # [batch, kv_heads, seq, head_dim]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.recompute:
            out = checkpoint(self.kernel, q, k, v, mask, use_reentrant=False)
        else:
            out = self.kernel(q, k, v, mask)  # [batch, heads, seq, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, linear: type[nn.Linear] = nn.Linear, recompute: bool = False) -> None:
        super().__init__()
        self.gate_proj = linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:  # only the input is kept for backward
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMLP(MoE):
    """A Qwen3-MoE layer's mixture of experts, recomputed in backward like the MLP it replaces."""

    def __init__(self, cfg: Qwen3Config, index: int, options: ModelOptions) -> None:
        super().__init__(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                         cfg.norm_topk_prob, layer=index, kernel=options.experts or ExpertLoop(),
                         linear=options.linear, observer=options.router_observer,
                         balanced=options.moe_force_balance)
        self.recompute = options.recompute == "mlp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return checkpoint(super().forward, x, use_reentrant=False)
        return super().forward(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, options: ModelOptions, attention: AttentionKernel, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, attention, options.linear, recompute=options.recompute == "selective")
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMLP(cfg, index, options) if cfg.is_sparse_layer(index) \
            else MLP(cfg, options.linear, recompute=options.recompute == "mlp")
        self.recompute = options.recompute == "full"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        if self.recompute:  # only the input is kept for backward; the layer runs again there
            return checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False)
        return self._forward(x, cos, sin, mask)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Qwen3Model(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head, or the ``part`` of it a pipeline stage holds.

    ``forward(x, positions=None)``: ``x`` is token ids [batch, seq] on a part
    with the embedding, else the previous part's hidden states, and
    ``positions`` [batch, seq] the RoPE positions (0..seq-1 in every sample
    when not given; they restart at 0 per packed document when the data says
    so). A part with the head returns logits [batch, seq, vocab] (or, built with
    a ``LossHead``, the final hidden states, to which the loss applies the
    head); a part without it returns the pair (hidden states, positions) for
    the next part.
    """

    def __init__(self, cfg: Qwen3Config, options: ModelOptions | None = None, part: ModelPart | None = None) -> None:
        super().__init__()
        options, part = options or ModelOptions(), part or ModelPart()
        self.config = cfg
        self.document_mask = options.document_mask
        # One kernel object for all layers: the model prepares the document mask once with it.
        self.attention = options.attention if options.attention is not None else SdpaAttention()
        # Passing the weight skips nn.Embedding's random init, which on the meta device costs seconds
        # (it imports the compiler stack); init_weights below or a checkpoint sets the values.
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)) \
            if part.embedding else None
        layers = part.layers if part.layers is not None else range(cfg.num_hidden_layers)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, options, self.attention, i) for i in layers})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if part.head else None
        self.lm_head: nn.Module | None = self._head(cfg, options) if part.head else None
        # A loss head is applied by the loss (to the final hidden states, which the model returns).
        self.returns_hidden = options.loss_head is not None
        if next(self.parameters()).device.type != "meta":
            self.init_weights()

    def _head(self, cfg: Qwen3Config, options: ModelOptions) -> nn.Module:
        """The LM head: a plain projection to logits, or the fused-loss head; tied to the embedding's weight
        (``TIED_ALIASES``) where the config ties them and this part holds the embedding. A tied head on a
        pipeline stage without the embedding has a weight of its own, kept equal to it from outside."""
        tied = cfg.tie_word_embeddings and self.embed_tokens is not None
        loss = options.loss_head
        if loss is None:
            head = options.linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if tied:
                head.weight = self.embed_tokens.weight
            return head
        if tied:  # one parameter, as in HF: the head applies the embedding's weight itself
            return TiedLMHead(self.embed_tokens, chunk_tokens=loss.chunk_tokens, valid_vocab=loss.valid_vocab,
                              fp32_matmul=loss.fp32_matmul)
        return ChunkedLMHead(cfg.hidden_size, cfg.vocab_size, chunk_tokens=loss.chunk_tokens,
                             valid_vocab=loss.valid_vocab, fp32_matmul=loss.fp32_matmul)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h, positions = self.hidden_states(x, positions)
        if self.lm_head is None:  # a pipeline stage before the last
            return h, positions
        return h if self.returns_hidden else self.lm_head(h)

    def hidden_states(self, x: torch.Tensor, positions: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after this part's layers (and the final norm, where the part has it), with
        the positions used."""
        if self.embed_tokens is not None:
            h = self.embed_tokens(x)
            if positions is None:
                # contiguous: a pipeline stage sends them on to the next
                positions = torch.arange(x.shape[1], device=x.device).repeat(x.shape[0], 1)
        else:
            h = x
            if positions is None:  # the hidden states may hold a shard of the sequence: its length is unknown
                raise ValueError("a model part without the embedding needs the positions the part before returned")
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        mask = self.attention.prepare(positions, h.dtype) if self.document_mask else None  # shared by all layers
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        return h, positions

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
    that write into the residual stream (o_proj, down_proj, the experts'
    down_proj) scaled down by
    sqrt(2 * num_layers) so the residual's variance does not grow with depth.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name)) % (2**63))
    std = cfg.initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's ``hash`` is salted per process)."""
    value = 1469598103934665603
    for byte in text.encode():
        value = ((value ^ byte) * 1099511628211) % (2**64)
    return value
