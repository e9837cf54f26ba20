"""Qwen3 decoder in plain PyTorch, dense and mixture-of-experts (Qwen3-MoE).

Reads top to bottom: RMSNorm, attention (RoPE in models/ops/rope.py), MLP, decoder layer,
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
afterwards (``ModelOptions``): the attention kernel, the elementwise kernels
(norms, RoPE, SwiGLU: models/ops/elementwise.py), the class of the
projections (numerics), which blocks are recomputed in backward, and whether
attention stays within each packed document. The ``forward`` below is the one
that runs.

Numerics follow HuggingFace's ``Qwen3ForCausalLM``: RMSNorm in fp32 then cast
back, q/k RMSNorm per head before RoPE, RoPE tables computed in fp32.

The hybrids (Qwen3.5, Qwen3-Next; ``Qwen3Config.is_hybrid``) are the same model
with three changes, each chosen when a module is built: a layer whose
``layer_types`` entry is ``linear_attention`` mixes tokens with Gated DeltaNet
(gated_deltanet.py) instead of attention; attention gates its output with
``sigmoid`` of a second half of ``q_proj`` and rotates only the first
``rotary_dim`` dims of each head; norms are zero-centred (``1 + weight``,
computed in fp32 as transformers' ``Qwen3_5RMSNorm``). Their MoE layers add a
shared expert whose output a sigmoid gate scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from qwen3_pretrain.models.ops.delta_rule import DeltaRuleKernel
from qwen3_pretrain.models.ops.elementwise import CPU_KERNELS, ElementwiseKernels
from qwen3_pretrain.models.ops.gated_delta import document_starts
from qwen3_pretrain.models.ops.loss import ChunkedLMHead, TiedLMHead
from qwen3_pretrain.models.ops.moe import Capacity, MoE, ExpertLoop, ExpertsKernel, RouterObserver, RouterStats
from qwen3_pretrain.models.ops.precision import LinearChoice, projection
from qwen3_pretrain.models.ops.rope import rope_cos_sin
from qwen3_pretrain.models.qwen3.attention import AttentionKernel, SdpaAttention
from qwen3_pretrain.models.qwen3.config import RECOMPUTE, Qwen3Config
from qwen3_pretrain.models.qwen3.gated_deltanet import GatedDeltaNet
from qwen3_pretrain.models.qwen3.init import init_param


# The parameters the vocabulary indexes (training pads them to a multiple of tp rows), and the tied head's
# alias: a model that ties them holds the weight once, as the embedding (checkpoints and HF files too).
EMBEDDING = "embed_tokens.weight"
HEAD = "lm_head.weight"
VOCAB_TENSORS = (EMBEDDING, HEAD)
TIED_ALIASES = {HEAD: EMBEDDING}
# The multi-token-prediction layer's parameters (``Qwen3Model.mtp``), named as in the HF files.
MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class LossHead:
    """The LM head as the fused head + cross-entropy (models/ops/loss.py): a model built with it returns its
    final hidden states, and the loss applies the head to them in chunks, never holding the full logits."""

    chunk_tokens: int = 4096  # tokens per chunk of the head's matmul and the loss
    valid_vocab: int | None = None  # the real vocabulary when the head is padded to a multiple of tp
    fp32_matmul: bool = False  # bf16 operands multiplied in fp32 (models/ops/precision.py)


class HeadSplit(Protocol):
    """A Gated DeltaNet layer's heads split over ranks, as the layer sees it: tensor parallelism (its
    column-parallel projections give a rank its heads already; parallel/tensor_parallel.py) or context
    parallelism, whose sequence is split too while the recurrence needs all of it, so a rank trades its
    tokens of all heads for all tokens of its share of the heads (parallel/context_parallel.py)."""

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, local seq, heads, d] -> [batch, seq, this rank's heads, d], in sequence order (under tp alone
        the input already is that)."""

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_heads``."""

    def rank_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a parameter laid out by heads (rows grouped per key head, or one per value
        head), as a plain tensor: the rows of ``to_heads``'s heads."""

    def gather_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The whole sequence's positions [batch, seq] (no autograd)."""


@dataclass(frozen=True)
class ModelOptions:
    """How the model's modules compute; the engine chooses them per device and config."""

    # The attention kernel every layer uses (attention.py: ``attention_kernel(device_type)``); SDPA when None.
    attention: AttentionKernel | None = None
    # The norms', RoPE's and SwiGLU's kernels (models/ops/elementwise.py: ``elementwise_kernels(device_type)``).
    elementwise: ElementwiseKernels = CPU_KERNELS
    # The class of every projection: ``nn.Linear``, or one with other numerics (models/ops/precision.py).
    linear: type[nn.Linear] = nn.Linear
    # A choice of class per decoder-layer projection, by module path (``layers.3.mlp.down_proj``): returns
    # what builds it (a class, or a factory called as one). FP8 (models/ops/fp8.py: ``Fp8Projections``).
    # None: ``linear`` everywhere. Never asked about the LM head, the embedding or a MoE router.
    projections: Callable[[str], Callable[..., nn.Linear]] | None = None
    # Recomputed in backward instead of kept (config.RECOMPUTE): "full" (each decoder layer keeps only its
    # input), "selective" (the attention core, the kernel call: what the kernel saves beyond its inputs, e.g.
    # scores or softmax statistics, as Megatron's selective recompute; a Gated DeltaNet layer's delta rule),
    # "mlp" (each MLP's intermediate
    # activations, 3 x intermediate_size per token), or "none".
    recompute: str = "none"
    # Attention stays within each packed document (the positions restart at 0 where one starts).
    document_mask: bool = False
    # The LM head a loss applies (returning hidden states), or None: a plain head returning logits.
    loss_head: LossHead | None = None
    # How a MoE layer's experts compute (models/ops/moe.py); one matmul per expert when None.
    experts: ExpertsKernel | None = None
    # Sees each MoE layer's routing in training (the load-balancing loss and the expert-load metrics): the
    # sparse layers return their ``RouterStats`` beside their output, and the model's layer loop hands them on.
    router_observer: RouterObserver | None = None
    # Benchmark mode: MoE layers route round-robin (perfectly balanced) instead of by the router's choice.
    moe_force_balance: bool = False
    # The MoE routers' logits computed in fp32 (models/ops/moe.py: ``Fp32Router``); False: in the model's
    # dtype, as transformers computes them.
    moe_router_fp32: bool = False
    # Each MoE layer holds a per-expert bias for its top-k choice (aux-loss-free balancing; a buffer the
    # training engine updates: train/balance.py).
    moe_expert_bias: bool = False
    # Each MoE layer's experts take at most this many pairs each (models/ops/moe.py ``Capacity``: token
    # dropping); None: dropless.
    moe_capacity: Capacity | None = None
    # Where the sequence is split over ranks (context parallelism), how a Gated DeltaNet layer, whose
    # recurrence needs the whole sequence, trades tokens for heads; None: each row is whole here.
    head_split: HeadSplit | None = None
    # The gated delta rule of Gated DeltaNet layers (models/ops/delta_rule.py); ours in plain torch when None.
    delta_rule: DeltaRuleKernel | None = None
    # The multi-token-prediction layer (``MultiTokenPrediction``) is trained: the part with the head holds it,
    # and ``forward`` carries its input (see there).
    multi_token_prediction: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, not {self.recompute!r}")

    def linear_for(self, name: str) -> Callable[..., nn.Linear]:
        """What builds the decoder-layer projection at module path ``name`` (``projections``' choice, else
        ``linear``)."""
        return self.linear if self.projections is None else self.projections(name)

    def linears(self, block: str) -> LinearChoice:
        """What the block at module path ``block`` (``layers.3.attn``) builds its projections with:
        ``linear`` itself when there is no per-projection choice (the model as it has always been built),
        else a function of the projection's name within the block (``models/ops/precision.py``:
        ``projection``)."""
        if self.projections is None:
            return self.linear
        return lambda name: self.linear_for(f"{block}.{name}")


@dataclass(frozen=True)
class ModelPart:
    """The part of the model one module holds: all of it, or one pipeline stage."""

    layers: range | None = None  # the decoder layers it holds; None: all
    embedding: bool = True  # holds the embedding and takes token ids (else the previous part's output)
    head: bool = True  # holds the final norm and the LM head (else hands on hidden states and positions)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool = False,
                 kernels: ElementwiseKernels = CPU_KERNELS) -> None:
        super().__init__()
        self.eps = eps
        # zero-centred (the hybrids): the scale is 1 + weight, applied in fp32 before the cast back
        self.zero_centered = zero_centered
        self.kernel = kernels.zero_centered_norm if zero_centered else kernels.norm
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        if self.zero_centered:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, kernel: AttentionKernel, linear: LinearChoice = nn.Linear,
                 recompute: bool = False, elementwise: ElementwiseKernels = CPU_KERNELS) -> None:
        super().__init__()
        self.recompute = recompute  # the kernel call keeps only q, k, v and runs again in backward
        self.head_dim = cfg.head_dim
        # The hybrids' output gate: q_proj's rows per head are [query | gate], so a shard of heads keeps its gates.
        self.output_gate = cfg.is_hybrid
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = projection(linear, "q_proj", h, cfg.num_attention_heads * hd * (2 if self.output_gate else 1))
        self.k_proj = projection(linear, "k_proj", h, cfg.num_key_value_heads * hd)
        self.v_proj = projection(linear, "v_proj", h, cfg.num_key_value_heads * hd)
        self.o_proj = projection(linear, "o_proj", cfg.num_attention_heads * hd, h)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.is_hybrid, elementwise)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.is_hybrid, elementwise)
        self.rope = elementwise.rope  # models/ops/rope.py, or the device's fused kernel
        self.kernel = kernel  # attention.py, chosen for the device the model runs on

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # Head counts come from the shapes, so a tensor-parallel shard runs unchanged.
        q = self.q_proj(x)
        if self.output_gate:
            q, gate = q.view(bsz, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.reshape(bsz, seq, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(bsz, seq, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)  # [batch, kv_heads, seq, head_dim]
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if self.recompute:
            out = checkpoint(self.kernel, q, k, v, mask, use_reentrant=False)
        else:
            out = self.kernel(q, k, v, mask)  # [batch, heads, seq, head_dim]
        out = out.transpose(1, 2).reshape(bsz, seq, -1)
        if self.output_gate:
            out = out * torch.sigmoid(gate.reshape(bsz, seq, -1))
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, linear: LinearChoice = nn.Linear, recompute: bool = False,
                 intermediate_size: int | None = None, elementwise: ElementwiseKernels = CPU_KERNELS) -> None:
        super().__init__()
        self.swiglu = elementwise.swiglu
        inter = intermediate_size or cfg.intermediate_size
        self.gate_proj = projection(linear, "gate_proj", cfg.hidden_size, inter)
        self.up_proj = projection(linear, "up_proj", cfg.hidden_size, inter)
        self.down_proj = projection(linear, "down_proj", inter, cfg.hidden_size)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:  # only the input is kept for backward
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMLP(MoE):
    """A Qwen3-MoE layer's mixture of experts, recomputed in backward like the MLP it replaces; a hybrid's
    adds a shared expert, an MLP every token takes, scaled by ``sigmoid(shared_expert_gate(x))``. With a
    router observer it returns (output, ``RouterStats``)."""

    def __init__(self, cfg: Qwen3Config, options: ModelOptions, path: str = "layers.0.mlp") -> None:
        observer = options.router_observer
        super().__init__(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                         cfg.norm_topk_prob, kernel=options.experts or ExpertLoop(), linear=options.linear,
                         report=observer is not None, z_loss=observer is not None and observer.z_loss,
                         balanced=options.moe_force_balance, router_fp32=options.moe_router_fp32,
                         expert_bias=options.moe_expert_bias, capacity=options.moe_capacity)
        self.recompute = options.recompute == "mlp"
        self.shared_expert: MLP | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, options.linears(f"{path}.shared_expert"), intermediate_size=cfg.shared_expert_intermediate_size,
                                     elementwise=options.elementwise)
            self.shared_expert_gate = options.linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        if self.recompute:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        out = super().forward(x)
        if self.shared_expert is None:
            return out
        out, stats = out if self.report else (out, None)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (out, stats) if self.report else out


class DecoderLayer(nn.Module):
    """Norm, token mixer (``attn``, or a hybrid's Gated DeltaNet ``linear_attn``), norm, MLP; residuals.
    ``full_attention``: attention whatever ``layer_types`` says (the multi-token-prediction layer's).
    ``reports_routing``: a sparse layer built with a router observer returns (output, ``RouterStats``), from
    outside its recompute, so the observer runs once per forward, outside the layer's (compiled) code."""

    def __init__(self, cfg: Qwen3Config, options: ModelOptions, attention: AttentionKernel, index: int,
                 full_attention: bool = False, path: str | None = None) -> None:
        super().__init__()
        path = path or f"layers.{index}"  # the module path, by which ModelOptions.projections chooses
        zero_centered = cfg.is_hybrid
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered, options.elementwise)
        self.linear = not full_attention and cfg.is_linear_layer(index)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, options.linears(f"{path}.linear_attn"), options.head_split, options.delta_rule,
                                             recompute=options.recompute == "selective")
        else:
            self.attn = Attention(cfg, attention, options.linears(f"{path}.attn"), recompute=options.recompute == "selective",
                                  elementwise=options.elementwise)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered, options.elementwise)
        self.mlp = SparseMLP(cfg, options, f"{path}.mlp") if cfg.is_sparse_layer(index) \
            else MLP(cfg, options.linears(f"{path}.mlp"), recompute=options.recompute == "mlp", elementwise=options.elementwise)
        self.reports_routing = isinstance(self.mlp, SparseMLP) and self.mlp.report
        self.recompute = options.recompute == "full"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None,
                starts: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        """``starts`` [batch, seq] (bool): where packed documents begin, for a Gated DeltaNet layer."""
        if self.recompute:  # only the input is kept for backward; the layer runs again there
            return checkpoint(self._forward, x, cos, sin, mask, starts, use_reentrant=False)
        return self._forward(x, cos, sin, mask, starts)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None,
                 starts: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        if self.linear:
            x = x + self.linear_attn(self.attn_norm(x), starts)
        else:
            x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        if self.reports_routing:
            out, stats = self.mlp(self.mlp_norm(x))
            return x + out, stats
        return x + self.mlp(self.mlp_norm(x))


class MultiTokenPrediction(nn.Module):
    """The hybrids' multi-token-prediction layer (the checkpoints' ``mtp.*``, as DeepSeek-V3's MTP module):
    from the model's final hidden state at ``t`` (after its norm) and the embedding of token ``t + 1``, each
    normalized, concatenated [embedding | hidden] and projected back to the hidden size, one more decoder
    layer (full attention, the MLP of the model's first layer) and a norm give the hidden state from which
    the model's own head predicts token ``t + 2``."""

    def __init__(self, cfg: Qwen3Config, options: ModelOptions, attention: AttentionKernel) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps, cfg.is_hybrid, options.elementwise)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, cfg.is_hybrid, options.elementwise)
        self.fc = options.linear(2 * h, h, bias=False)
        # Its MoE routing goes to the router observer as the decoder layers' does (the balancing losses count
        # it, as Megatron's do), under the indices after theirs (``routed_layers``).
        self.router_observer = options.router_observer
        self.first_index = cfg.num_hidden_layers
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, options, attention, 0, full_attention=True,
                                                      path=f"mtp.layers.{i}")
                                     for i in range(cfg.mtp_num_hidden_layers)})
        self.norm = RMSNorm(h, eps, cfg.is_hybrid, options.elementwise)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask=None, starts: torch.Tensor | None = None) -> torch.Tensor:
        """``starts``: what the model's layers were given (unused by this full-attention layer, passed so that
        a compiled layer's graph is the model's full-attention layers' one, not a recompile for a None)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for index, layer in self.layers.items():
            x = layer(x, cos, sin, mask, starts)
            if layer.reports_routing:
                x, stats = x
                if torch.is_grad_enabled():  # training: as in the model's layer loop
                    x = self.router_observer(self.first_index + int(index), x, stats)
        return self.norm(x)


def routed_layers(cfg: Qwen3Config, mtp: bool = False) -> list[int]:
    """The indices under which a router observer sees the sparse layers: the decoder layers' own, then, where
    the multi-token-prediction layer is trained (``mtp``) and its MLP is sparse (it takes layer 0's), its
    layers' as ``num_hidden_layers + i``."""
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)]
    if mtp and cfg.is_sparse_layer(0):
        layers += [cfg.num_hidden_layers + i for i in range(cfg.mtp_num_hidden_layers)]
    return layers


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
        self.head_split = options.head_split
        self.router_observer = options.router_observer
        # One kernel object for all layers: the model prepares the document mask once with it.
        self.attention = options.attention if options.attention is not None else SdpaAttention()
        # Passing the weight skips nn.Embedding's random init, which on the meta device costs seconds
        # (it imports the compiler stack); init_weights below or a checkpoint sets the values.
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)) \
            if part.embedding else None
        layers = part.layers if part.layers is not None else range(cfg.num_hidden_layers)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, options, self.attention, i) for i in layers})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.is_hybrid,
                                            options.elementwise) if part.head else None
        self.lm_head: nn.Module | None = self._head(cfg, options) if part.head else None
        if options.multi_token_prediction and not cfg.mtp_num_hidden_layers:
            raise ValueError("multi_token_prediction needs a config with mtp_num_hidden_layers >= 1")
        self.mtp: MultiTokenPrediction | None = None
        if part.head and options.multi_token_prediction:
            self.mtp = MultiTokenPrediction(cfg, options, self.attention)
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, mtp_input: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``mtp_input``, for the multi-token-prediction layer: on the part with the embedding each position's
        next token [batch, seq] (the labels), which it embeds; on a later part those embeddings, as the part
        before returned them. Given, a part before the last returns (hidden states, positions, embeddings),
        the part with the head the pair (main, MTP) of hidden states (or logits). The embeddings travel down
        the pipeline beside the hidden states so the last stage needs no copy of the embedding."""
        h, positions, context = self._run(x, positions)
        embeds = None
        if mtp_input is not None:
            embeds = self.embed_tokens(mtp_input) if self.embed_tokens is not None else mtp_input
        if self.lm_head is None:  # a pipeline stage before the last
            return (h, positions) if embeds is None else (h, positions, embeds)
        head = (lambda t: t) if self.returns_hidden else self.lm_head
        if embeds is None or self.mtp is None:
            return head(h)
        return head(h), head(self.mtp(embeds, h, *context))

    def hidden_states(self, x: torch.Tensor, positions: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after this part's layers (and the final norm, where the part has it), with
        the positions used."""
        h, positions, _ = self._run(x, positions)
        return h, positions

    def _run(self, x: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """``hidden_states``, and what the layers were given: (cos, sin, mask, starts)."""
        if self.embed_tokens is not None:
            h = self.embed_tokens(x)
            if positions is None:
                # contiguous: a pipeline stage sends them on to the next
                positions = torch.arange(x.shape[1], device=x.device).repeat(x.shape[0], 1)
        else:
            h = x
            if positions is None:  # the hidden states may hold a shard of the sequence: its length is unknown
                raise ValueError("a model part without the embedding needs the positions the part before returned")
        cos, sin = rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, h.dtype)
        mask = self.attention.prepare(positions, h.dtype) if self.document_mask else None  # shared by all layers
        # Gated DeltaNet layers restart their state and convolution where a document starts
        starts = None
        if self.document_mask and any(layer.linear for layer in self.layers.values()):
            split = self.head_split
            starts = document_starts(split.gather_positions(positions) if split is not None else positions)
        for index, layer in self.layers.items():
            h = layer(h, cos, sin, mask, starts)
            if layer.reports_routing:
                h, stats = h
                if torch.is_grad_enabled():  # training: the balancing losses' bookkeeping, eager, once
                    h = self.router_observer(int(index), h, stats)
        if self.norm is not None:
            h = self.norm(h)
        return h, positions, (cos, sin, mask, starts)

    def routed_mlps(self) -> dict[int, MoE]:
        """This part's sparse MLPs by the index its router observer sees them under (``routed_layers``)."""
        mlps = {int(i): layer.mlp for i, layer in self.layers.items() if isinstance(layer.mlp, MoE)}
        if self.mtp is not None:
            mlps.update({self.mtp.first_index + int(i): layer.mlp for i, layer in self.mtp.layers.items()
                         if isinstance(layer.mlp, MoE)})
        return mlps

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
