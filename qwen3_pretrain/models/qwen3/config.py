"""Qwen3 model configuration, dense and mixture-of-experts, with the field names of HuggingFace's ``config.json``.

``head_dim`` is a field of its own and is never derived from ``hidden_size /
num_attention_heads``: Qwen3-0.6B has 16 heads of 128 on a hidden size of 1024.

One class serves both families (``model_type`` ``qwen3`` and ``qwen3_moe``): a
model with ``num_experts > 0`` replaces the MLP of its sparse layers
(``is_sparse_layer``) by a mixture of ``num_experts`` experts of
``moe_intermediate_size``, each token routed to ``num_experts_per_tok`` of them;
attention, norms, embedding and head are the dense family's.
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
    bos_token_id: int = ENDOFTEXT_ID
    eos_token_id: int = 151645
    torch_dtype: str = "bfloat16"
    # --- mixture of experts (Qwen3-MoE; 0 experts: dense) ---
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1  # every this-many-th layer is sparse (1: all of them)
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)  # layers kept dense
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1 (transformers' default: no)
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
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
        if model_type not in ("qwen3", "qwen3_moe"):
            raise UserError(f"{source}: model_type is {model_type!r}; this project trains 'qwen3' and 'qwen3_moe' "
                            "models")
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
        if "rope_theta" in rope and "rope_theta" not in data:
            kwargs["rope_theta"] = rope["rope_theta"]
        if "dtype" in data and "torch_dtype" not in data:
            kwargs["torch_dtype"] = data["dtype"]
        required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in data]
        if missing:
            raise UserError(f"{source}: missing key(s) {', '.join(missing)}")
        kwargs.setdefault("num_key_value_heads", data["num_attention_heads"])
        if "head_dim" not in data:
            kwargs["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        if model_type == "qwen3_moe":
            kwargs.setdefault("num_experts", data.get("num_local_experts", 128))  # transformers' class default
            kwargs["mlp_only_layers"] = list(kwargs.get("mlp_only_layers") or [])
        else:
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                        "mlp_only_layers", "norm_topk_prob", "router_aux_loss_coef"):
                kwargs.pop(key, None)
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
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                        "mlp_only_layers", "norm_topk_prob", "router_aux_loss_coef"):
                out.pop(key)
        out.update({
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
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
        """Parameters of layer ``index``'s MLP: the dense one, or the experts and their router (``active``: the
        router and the ``num_experts_per_tok`` experts one token uses)."""
        h = self.hidden_size
        if not self.is_sparse_layer(index):
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        return experts * 3 * h * self.moe_intermediate_size + h * self.num_experts

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Parameter count; with ``include_embedding=False`` the input embedding and an untied head are left out;
        ``active``: with the experts one token uses in place of all (a MoE model's "A3B")."""
        h, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * hd, self.num_key_value_heads * hd
        attn = h * q_out + 2 * h * kv_out + q_out * h + 2 * hd  # q, k, v, o, q_norm, k_norm
        total = sum(attn + self.mlp_params(i, active) + 2 * h for i in range(self.num_hidden_layers)) + h
        if include_embedding:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    def num_matmul_params(self) -> int:
        """Weights that take part in a token's matmuls: every linear layer including the LM head (of a MoE layer
        the router and the experts the token is routed to), not the embedding lookup."""
        h = self.hidden_size
        attn = h * self.num_attention_heads * self.head_dim * 2 + 2 * h * self.num_key_value_heads * self.head_dim
        return sum(attn + self.mlp_params(i, active=True) for i in range(self.num_hidden_layers)) + self.vocab_size * h

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: 6 * N_matmul (active parameters) + 12 * L * heads * head_dim * seq (PaLM
        convention)."""
        attn = 12 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_length
        return 6.0 * self.num_matmul_params() + attn


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


def get_preset(name: str) -> Qwen3Config:
    """A copy of the named preset; the name is case-insensitive (``Qwen3-8B`` works)."""
    return dataclasses.replace(lookup(PRESETS, name, "model preset"))


def is_preset_name(name: str | None) -> bool:
    return bool(name) and name.strip().lower() in PRESETS
