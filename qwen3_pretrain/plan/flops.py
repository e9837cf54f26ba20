"""FLOPs per trained token: the one owner of the counts behind MFU, HFU and the planner's compute time.

Three counts per token, forward and backward (backward twice the forward: 2 FLOPs per weight forward, 6 in
all), each used by the training log, ``metrics.jsonl``, parse-log and the planner:

* ``model`` (MFU): what the model needs as the kernels execute it. Every matmul weight (the LM head, a MoE
  layer's router and the experts a token is routed to; not the embedding lookup), attention's ``Q K^T`` and
  ``A V`` over the *causal half* of the square (flash, SDPA's causal kernels, FlexAttention and the NPU's
  fused kernel skip the blocks above the diagonal), a Gated DeltaNet's chunked delta rule, and the
  multi-token-prediction layer (its fc, one decoder layer and a second pass of the head) when it is trained.
* ``hardware`` (HFU): ``model`` plus what activation recompute runs again in backward: the whole forward of
  each layer (``full``), its MLP (``mlp``), or the attention core and the delta rule (``selective``); a dense
  MLP's down projection is not rerun (torch's checkpoint stops once backward has the tensors it needs, and
  nothing needs that product's output).
* ``full_square``: ``model`` with attention over the whole ``s x s`` square, the convention of PaLM
  (appendix B), torchtitan and Megatron-LM before its causal count; kept so that our figures compare with
  theirs (docs/monitoring.md says which peer figure uses which).

Document masks: a kernel that takes the document boundaries (FlexAttention's block mask, the NPU's
segments) skips other documents' blocks too, so it executes less than the causal half; the step does not
carry the documents' lengths to the host, so the count stays the causal half of the whole sequence, an
upper bound there (exact when one document fills the sequence). A math kernel with a dense mask computes
the whole square whatever the mask: that is wasted work, not model FLOPs, and counted nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen3_pretrain.models.qwen3.config import RECOMPUTE, Qwen3Config

# The gated delta rule's chunk (models/ops/gated_delta.py CHUNK_SIZE, which imports torch: the planner must
# not; tests/test_mfu.py holds the two equal)
DELTA_RULE_CHUNK = 64


@dataclass(frozen=True)
class LayerFlops:
    """One decoder layer's forward FLOPs per token, by part (training is 3 times the sum)."""

    mixer: float  # the token mixer's projections (attention's q, k, v, o; a Gated DeltaNet's and its convolution)
    mlp: float  # the dense MLP, or the router, the routed experts and a shared expert
    core: float  # attention's Q K^T and A V over the causal half of the square (0 for a Gated DeltaNet)
    core_square: float  # the same over the whole square
    rule: float  # the chunked delta rule (fp32; 0 for attention)
    # the MLP's last matmul where backward does not need its output (a dense MLP's down projection): a
    # checkpoint stops recomputing once backward has what it needs (torch.utils.checkpoint's early stop)
    mlp_tail: float = 0.0

    def training(self, full_square: bool = False) -> float:
        return 3.0 * (self.mixer + self.mlp + (self.core_square if full_square else self.core) + self.rule)

    def recomputed(self, activation_checkpointing: str) -> float:
        """The forward FLOPs recompute runs again in backward."""
        if activation_checkpointing not in RECOMPUTE:
            raise ValueError(f"unknown activation_checkpointing {activation_checkpointing!r}")
        if activation_checkpointing == "full":
            return self.mixer + self.mlp - self.mlp_tail + self.core + self.rule
        if activation_checkpointing == "mlp":
            return self.mlp - self.mlp_tail
        return self.core + self.rule if activation_checkpointing == "selective" else 0.0


@dataclass(frozen=True)
class TokenFlops:
    """FLOPs per trained token of the whole model (see the module docstring)."""

    model: float
    hardware: float
    full_square: float


def attention_core_forward(q_out: int, seq: int, causal: bool = True) -> float:
    """Forward FLOPs per token of ``Q K^T`` and ``A V`` (2 per multiply-add, both products): ``4 q_out`` per
    attended key, ``seq / 2`` keys on average under a causal mask (half the square), ``seq`` over the whole."""
    return 4.0 * q_out * (seq / 2 if causal else seq)


def layer_flops(cfg: Qwen3Config, mixer_index: int, mlp_index: int, seq: int) -> LayerFlops:
    """Forward FLOPs per token of a layer with layer ``mixer_index``'s token mixer and ``mlp_index``'s MLP."""
    mixer = 2.0 * cfg.mixer_params(mixer_index, matmul_only=True)
    mlp = 2.0 * cfg.mlp_params(mlp_index, active=True)
    # a MoE block's experts scale their down projections' outputs by the routing weights, whose gradient needs them
    tail = 0.0 if cfg.is_sparse_layer(mlp_index) else 2.0 * cfg.hidden_size * cfg.intermediate_size
    if cfg.is_linear_layer(mixer_index):
        rule = cfg.linear_attention_flops_per_token(DELTA_RULE_CHUNK) / 3
        return LayerFlops(mixer, mlp, 0.0, 0.0, rule, tail)
    q_out = cfg.num_attention_heads * cfg.head_dim
    return LayerFlops(mixer, mlp, attention_core_forward(q_out, seq), attention_core_forward(q_out, seq, False),
                      0.0, tail)


def model_layers(cfg: Qwen3Config, seq: int, mtp: bool = False) -> list[LayerFlops]:
    """Every decoder layer's ``LayerFlops``; with ``mtp``, the multi-token-prediction layer's too."""
    layers = [layer_flops(cfg, i, i, seq) for i in range(cfg.num_hidden_layers)]
    return layers + (mtp_layers(cfg, seq) if mtp else [])


def mtp_layers(cfg: Qwen3Config, seq: int) -> list[LayerFlops]:
    """The multi-token-prediction layer's decoder layers (full attention, the MLP of layer 0:
    models/qwen3/model.py ``MultiTokenPrediction``); none where the model has no MTP layer."""
    if not cfg.mtp_num_hidden_layers:
        return []
    attention = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_linear_layer(i))
    return [layer_flops(cfg, attention, 0, seq)] * cfg.mtp_num_hidden_layers


def head_flops(cfg: Qwen3Config, mtp: bool = False) -> float:
    """Training FLOPs per token outside the decoder layers: the LM head, and with ``mtp`` the
    multi-token-prediction layer's fc ([embedding | hidden] to hidden) and its second pass of the head."""
    h = cfg.hidden_size
    head = 6.0 * cfg.vocab_size * h
    if mtp and cfg.mtp_num_hidden_layers:
        head += 6.0 * 2 * h * h + 6.0 * cfg.vocab_size * h
    return head


def token_flops(cfg: Qwen3Config, seq: int, activation_checkpointing: str = "none", mtp: bool = False) -> TokenFlops:
    """Model, hardware (recompute included) and full-square FLOPs per trained token; ``mtp``: the
    multi-token-prediction layer is trained (``mtp_loss_weight`` > 0)."""
    layers = model_layers(cfg, seq, mtp)
    head = head_flops(cfg, mtp)
    model = head + sum(layer.training() for layer in layers)
    recomputed = sum(layer.recomputed(activation_checkpointing) for layer in layers)
    return TokenFlops(model=model, hardware=model + recomputed,
                      full_square=head + sum(layer.training(full_square=True) for layer in layers))
