"""Qwen3 model configuration: dense, mixture-of-experts and the hybrids, with the field names of HF's ``config.json``.

``head_dim`` is a field of its own and is never derived from ``hidden_size /
num_attention_heads``: Qwen3-0.6B has 16 heads of 128 on a hidden size of 1024.

One class serves every family (``model_type``):

* ``qwen3``: the dense decoder;
* ``qwen3_moe``: a model with ``num_experts > 0`` replaces the MLP of its sparse
  layers (``is_sparse_layer``) by a mixture of ``num_experts`` experts of
  ``moe_intermediate_size``, each token routed to ``num_experts_per_tok`` of them;
* the hybrids, Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``; the multimodal
  checkpoints' ``qwen3_5`` and ``qwen3_5_moe`` hold these in ``text_config``) and
  Qwen3-Next (``qwen3_next``): ``layer_types`` makes most layers Gated DeltaNet
  (linear attention, ``linear_*`` sizes) and every ``full_attention_interval``-th
  a gated full attention (a sigmoid gate on its output, RoPE on the first
  ``partial_rotary_factor`` of each head); norms are zero-centred (``1 + weight``);
  a MoE hybrid adds a gated shared expert (``shared_expert_intermediate_size``).

Attention, norms, embedding and head are shared by all; only what a family changes is a field here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen3_pretrain.config.loader import lookup
from qwen3_pretrain.errors import MissingFileError, UserError

# The tokenizer has 151,669 ids; the embedding is padded to 151,936 = 128 * 1187.
QWEN3_VOCAB_SIZE = 151936
ENDOFTEXT_ID = 151643


# What backward recomputes instead of keeping, as the training config names it and the model reads it:
# nothing, the attention core ("selective", as Megatron's and MindSpeed's selective recompute), each MLP's
# intermediate activations, or every decoder layer ("full", keeping only each layer's input).
RECOMPUTE = ("none", "selective", "mlp", "full")

# The families this config reads (HF model_type); the hybrids' architectures name their text model.
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MODEL_TYPES = ("qwen3", "qwen3_moe", *HYBRID_TYPES)
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM"}
# A multimodal Qwen3.5 checkpoint's model_type -> its text model's.
MULTIMODAL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LAYER_TYPES = ("full_attention", "linear_attention")
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
             "norm_topk_prob", "router_aux_loss_coef", "shared_expert_intermediate_size")
_HYBRID_KEYS = ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "partial_rotary_factor", "mtp_num_hidden_layers")


@dataclass
class Qwen3Config:
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = QWEN3_VOCAB_SIZE
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    attention_bias: bool = False
    bos_token_id: int | None = ENDOFTEXT_ID  # None where the checkpoint names none (the hybrids may not)
    eos_token_id: int | None = 151645
    torch_dtype: str = "bfloat16"
    # --- mixture of experts (Qwen3-MoE; 0 experts: dense) ---
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1  # every this-many-th layer is sparse (1: all of them)
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)  # layers kept dense
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1 (transformers' default: no)
    router_aux_loss_coef: float = 0.001
    # --- hybrids (Qwen3.5, Qwen3-Next) ---
    model_type: str = ""  # "" -> "qwen3", or "qwen3_moe" with experts
    layer_types: list[str] = dataclasses.field(default_factory=list)  # per layer; [] -> all full attention
    linear_conv_kernel_dim: int = 4  # Gated DeltaNet's depthwise causal convolution over q, k, v
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32  # a multiple of the key heads: each key head serves consecutive value heads
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * this dims of each head
    shared_expert_intermediate_size: int = 0  # a MoE hybrid's gated shared expert (0: none)
    mtp_num_hidden_layers: int = 0  # multi-token-prediction layers (the releases ship 1; trained with mtp_loss_weight)

    def __post_init__(self) -> None:
        if self.model_type in ("", "qwen3", "qwen3_moe"):  # a preset given experts by overrides becomes MoE
            self.model_type = "qwen3_moe" if self.num_experts else "qwen3"
        if not self.layer_types or not self.is_hybrid:  # every layer attention (whatever a copied config held)
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    def validate(self) -> None:
        positive = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise UserError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise UserError(f"model config: hidden_act {self.hidden_act!r} is not supported (Qwen3 uses 'silu')")
        if self.attention_bias:
            raise UserError("model config: attention_bias=true is not supported (Qwen3 has no biases)")
        if self.num_experts:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise UserError(f"model config: {name} must be a positive integer, got {value!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise UserError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                                f"({self.num_experts})")
        self._validate_hybrid()

    def _validate_hybrid(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise UserError(f"model config: model_type {self.model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise UserError(f"model config: layer_types must name {self.num_hidden_layers} layers, each one of "
                            f"{', '.join(LAYER_TYPES)}; got {self.layer_types!r}")
        if not self.is_hybrid and "linear_attention" in self.layer_types:
            raise UserError(f"model config: model_type {self.model_type!r} has no linear-attention layers")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise UserError(f"model config: partial_rotary_factor {self.partial_rotary_factor} must give an even "
                            f"number of rotated dims of head_dim {self.head_dim}")
        if self.num_linear_layers:
            for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                         "linear_num_key_heads", "linear_num_value_heads"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise UserError(f"model config: {name} must be a positive integer, got {value!r}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise UserError(f"model config: linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                                f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")

    # --- the hybrids ------------------------------------------------------

    @property
    def is_hybrid(self) -> bool:
        """Qwen3.5 / Qwen3-Next: zero-centred norms, gated full attention, Gated DeltaNet layers."""
        return self.model_type in HYBRID_TYPES

    def is_linear_layer(self, index: int) -> bool:
        """Whether layer ``index`` is a Gated DeltaNet (linear attention) layer."""
        return self.layer_types[index] == "linear_attention"

    @property
    def num_linear_layers(self) -> int:
        return sum(map(self.is_linear_layer, range(self.num_hidden_layers)))

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def fused_linear_projections(self) -> bool:
        """Qwen3-Next fuses Gated DeltaNet's input projections, grouped per key head (``in_proj_qkvz``,
        ``in_proj_ba``); Qwen3.5 keeps four (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``)."""
        return self.model_type == "qwen3_next"

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer ``index`` holds experts (transformers' rule: not in ``mlp_only_layers`` and every
        ``decoder_sparse_step``-th layer, counting from 1)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    # --- HF config.json ---------------------------------------------------

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], source: str = "config.json") -> "Qwen3Config":
        model_type = data.get("model_type", "qwen3")
        if model_type in MULTIMODAL_TYPES:  # a multimodal checkpoint: its text model is what is trained
            if not isinstance(data.get("text_config"), dict):
                raise UserError(f"{source}: model_type {model_type!r} needs a 'text_config' object")
            data = {"tie_word_embeddings": data.get("tie_word_embeddings", False), **data["text_config"],
                    "model_type": MULTIMODAL_TYPES[model_type]}
            model_type = data["model_type"]
        if model_type not in MODEL_TYPES:
            raise UserError(f"{source}: model_type is {model_type!r}; this project trains "
                            f"{', '.join(map(repr, MODEL_TYPES + tuple(MULTIMODAL_TYPES)))} models")
        if data.get("rope_scaling"):
            raise UserError(f"{source}: rope_scaling {data['rope_scaling']!r} is not supported; remove it for pre-training")
        if data.get("use_sliding_window"):
            raise UserError(f"{source}: use_sliding_window=true is not supported")
        # transformers >= 5 writes rope_theta inside rope_parameters instead of at the top level.
        rope = data.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise UserError(f"{source}: rope_parameters {rope!r} is not supported; only rope_type 'default' is")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        # transformers >= 5 writes these inside rope_parameters; Qwen3.5's multimodal RoPE (mrope_section) is,
        # on text, the 1-D RoPE of the same positions
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope and key not in data:
                kwargs[key] = rope[key]
        if "dtype" in data and "torch_dtype" not in data:
            kwargs["torch_dtype"] = data["dtype"]
        required = ["hidden_size", "num_hidden_layers", "num_attention_heads"]
        if model_type != "qwen3_5_moe_text":  # its layers are all sparse: no dense MLP width
            required.insert(1, "intermediate_size")
        missing = [k for k in required if k not in data]
        if missing:
            raise UserError(f"{source}: missing key(s) {', '.join(missing)}")
        kwargs.setdefault("num_key_value_heads", data["num_attention_heads"])
        if "head_dim" not in data:
            kwargs["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        if model_type not in HYBRID_TYPES:  # Qwen3's files always name them; older ones may write null
            for key in ("bos_token_id", "eos_token_id"):
                if kwargs.get(key) is None:
                    kwargs.pop(key, None)
        kwargs.update(_family_defaults(model_type, data, kwargs))
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise UserError(f"{source}: {exc}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> "Qwen3Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise MissingFileError(f"{path}: no config.json; a HuggingFace model directory needs one")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path}: malformed JSON ({exc}); re-download or fix the file") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a JSON object")
        return cls.from_hf_dict(data, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if not self.is_moe:
            for key in _MOE_KEYS:
                out.pop(key)
        elif not self.is_hybrid:
            out.pop("shared_expert_intermediate_size")
        if self.is_hybrid:
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                      "partial_rotary_factor": self.partial_rotary_factor}
            if self.model_type == "qwen3_5_moe_text":  # every layer sparse, weights renormalised, by the class
                for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "intermediate_size"):
                    out.pop(key)
        else:
            for key in _HYBRID_KEYS:
                out.pop(key)
        out.update({
            "architectures": [ARCHITECTURES[self.model_type]],
            "attention_dropout": 0.0,
            "rope_scaling": None,
            "use_cache": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
        })
        return out

    # --- sizes ------------------------------------------------------------

    def mlp_params(self, index: int, active: bool = False) -> int:
        """Parameters of layer ``index``'s MLP: the dense one, or the experts, their router and a hybrid's gated
        shared expert (``active``: with the ``num_experts_per_tok`` experts one token uses in place of all)."""
        h = self.hidden_size
        if not self.is_sparse_layer(index):
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return experts * 3 * h * self.moe_intermediate_size + h * self.num_experts + shared

    def mixer_params(self, index: int, matmul_only: bool = False) -> int:
        """Parameters of layer ``index``'s token mixer: attention (q, k, v, o and the q/k norms; a hybrid's
        q_proj twice as wide for its output gate) or Gated DeltaNet (projections, convolution, decay
        parameters, output norm). ``matmul_only``: the weights of its matmuls (the convolution counted)."""
        h, hd = self.hidden_size, self.head_dim
        if not self.is_linear_layer(index):
            q_out, kv_out = self.num_attention_heads * hd, self.num_key_value_heads * hd
            matmul = h * q_out * (2 if self.is_hybrid else 1) + 2 * h * kv_out + q_out * h
            return matmul if matmul_only else matmul + 2 * hd
        conv = 2 * self.linear_key_dim + self.linear_value_dim
        heads = self.linear_num_value_heads
        # in_proj q k v, z, b, a (fused or not), the convolution, out_proj
        matmul = h * (conv + self.linear_value_dim + 2 * heads) + conv * self.linear_conv_kernel_dim \
            + self.linear_value_dim * h
        return matmul if matmul_only else matmul + 2 * heads + self.linear_value_head_dim  # dt_bias, A_log, norm

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Parameter count; with ``include_embedding=False`` the input embedding and an untied head are left out;
        ``active``: with the experts one token uses in place of all (a MoE model's "A3B"). Multi-token
        prediction layers are not counted (transformers' models leave them out too)."""
        h = self.hidden_size
        total = sum(self.mixer_params(i) + self.mlp_params(i, active) + 2 * h
                    for i in range(self.num_hidden_layers)) + h
        if include_embedding:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    def num_matmul_params(self) -> int:
        """Weights that take part in a token's matmuls: every linear layer including the LM head (of a MoE layer
        the router and the experts the token is routed to), not the embedding lookup."""
        h = self.hidden_size
        return sum(self.mixer_params(i, matmul_only=True) + self.mlp_params(i, active=True)
                   for i in range(self.num_hidden_layers)) + self.vocab_size * h

    def linear_attention_flops_per_token(self, chunk: int) -> float:
        """Training FLOPs of one token in one Gated DeltaNet layer's chunked delta rule (beyond its
        projections) over chunks of ``chunk`` tokens, the matmuls of models/ops/gated_delta.py: per value
        head, the chunk's unit-lower inverse applied to the values and the keys (``C (dv + dk)``), the chunk's
        attention times the writes (``C dv``), reading the [dk, dv] state for the writes and the output and
        updating it (``3 dk dv``); per key head, ``K K^T`` and ``Q K^T`` over the chunk (``2 C dk``); 2 FLOPs
        each, times 3 for forward and backward (plan/flops.py counts the model's FLOPs from this and the
        sizes above).

        This is the model's count, the torch kernel's: flash-linear-attention's kernel
        (models/ops/delta_rule.py ``FlaDeltaRule``; q and k repeated to the value heads before its 0.5, their own
        heads from 0.5, whose kernel reads each key head once per value head) computes ``K K^T`` and ``Q K^T``
        once per value head, ``(value heads - key heads) 2 C dk`` more multiply-adds
        per token forward, which MFU leaves out as redundant work (HFU too: it adds recompute, not kernels)."""
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        per_value_head = chunk * (2 * dv + dk) + 3 * dk * dv
        forward = 2 * (self.linear_num_value_heads * per_value_head + self.linear_num_key_heads * 2 * chunk * dk)
        return 3.0 * forward


def interval_layer_types(num_layers: int, interval: int) -> list[str]:
    """The hybrids' pattern: every ``interval``-th layer full attention, the others Gated DeltaNet."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def _family_defaults(model_type: str, data: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a family's ``config.json`` leaves to its transformers class's defaults (and drops what it does
    not use)."""
    out: dict[str, Any] = {"model_type": model_type}
    if model_type not in HYBRID_TYPES:
        for key in _HYBRID_KEYS:
            kwargs.pop(key, None)
    if model_type in ("qwen3", "qwen3_5_text"):
        for key in _MOE_KEYS:
            kwargs.pop(key, None)
    if model_type == "qwen3_moe":
        out["num_experts"] = data.get("num_experts", data.get("num_local_experts", 128))
        kwargs.pop("shared_expert_intermediate_size", None)
    if model_type in ("qwen3_moe", "qwen3_next"):
        out["mlp_only_layers"] = list(kwargs.get("mlp_only_layers") or [])
    if model_type in HYBRID_TYPES:
        if not kwargs.get("layer_types"):
            out["layer_types"] = interval_layer_types(data["num_hidden_layers"], data.get("full_attention_interval", 4))
        kwargs.setdefault("partial_rotary_factor", 0.25)  # the classes' default
        if data.get("attn_output_gate") is False or data.get("mtp_use_dedicated_embeddings"):
            raise UserError(f"{model_type}: attn_output_gate false and mtp_use_dedicated_embeddings true are not "
                            "supported (no released checkpoint has them)")
        if "rope_theta" not in kwargs:
            kwargs["rope_theta"] = 10_000.0  # transformers' default where the file names none
    if model_type == "qwen3_5_moe_text":  # transformers' class defaults; every layer sparse, top-k renormalised
        out.update(num_experts=data.get("num_experts", 256), num_experts_per_tok=data.get("num_experts_per_tok", 8),
                   moe_intermediate_size=data.get("moe_intermediate_size", 512),
                   shared_expert_intermediate_size=data.get("shared_expert_intermediate_size", 512),
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        out["intermediate_size"] = out["moe_intermediate_size"]  # unused: no dense layer
    if model_type == "qwen3_next":
        out.update(num_experts=data.get("num_experts", 512), num_experts_per_tok=data.get("num_experts_per_tok", 10),
                   moe_intermediate_size=data.get("moe_intermediate_size", 512),
                   shared_expert_intermediate_size=data.get("shared_expert_intermediate_size", 512),
                   norm_topk_prob=data.get("norm_topk_prob", True))
    return out


def _preset(hidden: int, layers: int, heads: int, ffn: int, tied: bool) -> Qwen3Config:
    return Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=8, head_dim=128, intermediate_size=ffn, tie_word_embeddings=tied)


# Published Qwen3 dense models (config.json of Qwen/Qwen3-*).
PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": _preset(1024, 28, 16, 3072, tied=True),
    "qwen3-1.7b": _preset(2048, 28, 16, 6144, tied=True),
    "qwen3-4b": _preset(2560, 36, 32, 9728, tied=True),
    "qwen3-8b": _preset(4096, 36, 32, 12288, tied=False),
    "qwen3-14b": _preset(5120, 40, 40, 17408, tied=False),
    "qwen3-32b": _preset(5120, 64, 64, 25600, tied=False),
}


def _moe_preset(hidden: int, layers: int, heads: int, expert_ffn: int) -> Qwen3Config:
    return Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=4,
                       head_dim=128, intermediate_size=6144 if hidden == 2048 else 12288, tie_word_embeddings=False,
                       num_experts=128, num_experts_per_tok=8, moe_intermediate_size=expert_ffn, norm_topk_prob=True)


# Published Qwen3 mixture-of-experts models (config.json of Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B):
# 30.5B parameters, 3.3B active; 235.1B, 22.2B active.
PRESETS.update({
    "qwen3-30b-a3b": _moe_preset(2048, 48, 32, 768),
    "qwen3-235b-a22b": _moe_preset(4096, 94, 64, 1536),
})


QWEN3_5_VOCAB_SIZE = 248320


def _hybrid_preset(model_type: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                   value_heads: int, tied: bool = False, experts: int = 0, top_k: int = 0,
                   dense_ffn: int | None = None) -> Qwen3Config:
    """A released hybrid: head_dim 256 with a quarter rotated, Gated DeltaNet with 16 key heads of 128, a
    full-attention layer every 4th; ``ffn`` is the MLP width, or with ``experts`` each expert's and the
    shared expert's (``dense_ffn``: the config's intermediate_size where it names one no layer uses)."""
    moe = dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=ffn,
               shared_expert_intermediate_size=ffn, norm_topk_prob=True) if experts else {}
    return Qwen3Config(
        model_type=model_type, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=256, intermediate_size=dense_ffn or ffn, tie_word_embeddings=tied,
        vocab_size=QWEN3_VOCAB_SIZE if model_type == "qwen3_next" else QWEN3_5_VOCAB_SIZE,
        max_position_embeddings=262144, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
        layer_types=interval_layer_types(layers, 4),
        linear_num_key_heads=16, linear_num_value_heads=value_heads, mtp_num_hidden_layers=1,
        bos_token_id=QWEN3_5_ENDOFTEXT_ID if model_type != "qwen3_next" else ENDOFTEXT_ID,
        eos_token_id=QWEN3_5_ENDOFTEXT_ID if model_type != "qwen3_next" else 151645, **moe)


QWEN3_5_ENDOFTEXT_ID = 248044

# Published hybrids (config.json of Qwen/Qwen3.5-* text_config, Qwen/Qwen3-Next-80B-A3B-*).
PRESETS.update({
    "qwen3.5-0.8b": _hybrid_preset("qwen3_5_text", 1024, 24, 8, 2, 3584, 16, tied=True),
    "qwen3.5-2b": _hybrid_preset("qwen3_5_text", 2048, 24, 8, 2, 6144, 16, tied=True),
    "qwen3.5-4b": _hybrid_preset("qwen3_5_text", 2560, 32, 16, 4, 9216, 32, tied=True),
    "qwen3.5-9b": _hybrid_preset("qwen3_5_text", 4096, 32, 16, 4, 12288, 32),
    "qwen3.5-27b": _hybrid_preset("qwen3_5_text", 5120, 64, 24, 4, 17408, 48),
    "qwen3.5-35b-a3b": _hybrid_preset("qwen3_5_moe_text", 2048, 40, 16, 2, 512, 32, experts=256, top_k=8),
    "qwen3.5-122b-a10b": _hybrid_preset("qwen3_5_moe_text", 3072, 48, 32, 2, 1024, 64, experts=256, top_k=8),
    "qwen3.5-397b-a17b": _hybrid_preset("qwen3_5_moe_text", 4096, 60, 32, 2, 1024, 64, experts=512, top_k=10),
    "qwen3-next-80b-a3b": _hybrid_preset("qwen3_next", 2048, 48, 16, 2, 512, 32, experts=512, top_k=10,
                                         dense_ffn=5120),
})


def get_preset(name: str) -> Qwen3Config:
    """A copy of the named preset; the name is case-insensitive (``Qwen3-8B`` works)."""
    return dataclasses.replace(lookup(PRESETS, name, "model preset"))


def is_preset_name(name: str | None) -> bool:
    return bool(name) and name.strip().lower() in PRESETS
