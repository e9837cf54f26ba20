"""What a HuggingFace model directory holds: its file names, and the name and shape of every tensor.

The project speaks the model's own parameter names (``layers.3.attn.q_proj.weight``); ``NAME_TABLE``
translates them to HF's and back. ``hf_io`` (reading) and ``hf_write`` (writing) are the only modules that
touch the directory's bytes; both take their names and shapes from here.

A MoE layer's experts are stacked in the model (``layers.3.mlp.experts.gate_proj``
[E, I, H], ``up_proj`` [E, I, H], ``down_proj`` [E, H, I]). The files hold one
tensor per expert and projection (``model.layers.3.mlp.experts.7.gate_proj.weight``),
as the released Qwen3-MoE checkpoints and transformers' ``save_pretrained`` do;
this is what is written. Reading also takes transformers' packed form
(``mlp.experts.gate_up_proj`` [E, 2I, H], the gate's rows first, and
``mlp.experts.down_proj`` [E, H, I]).

A Gated DeltaNet layer holds its [q | k | v] channels (the convolution's rows, Qwen3.5's
``in_proj_qkv``'s) grouped per key head, so that tensor parallelism splits them by heads with plain
row shards (models/qwen3/gated_deltanet.py); the files keep HF's order, q of all heads, then k, then v.
Reading and writing reorder those rows (``regrouped_rows``).
"""

from __future__ import annotations

import re

import torch

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.gated_deltanet import hf_row_order
from qwen3_pretrain.models.qwen3.model import EMBEDDING, HEAD, MTP_PREFIX

# (internal name, HF name); "{i}" is the layer index.
NAME_TABLE: list[tuple[str, str]] = [
    (EMBEDDING, f"model.{EMBEDDING}"),  # the vocabulary tensors (model.py names them): HF nests the embedding
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate.weight"),  # a MoE layer's router
    ("layers.{i}.mlp.experts.down_proj", "model.layers.{i}.mlp.experts.down_proj"),  # packed (read only)
    ("layers.{i}.mlp.shared_expert_gate.weight", "model.layers.{i}.mlp.shared_expert_gate.weight"),
    *[(f"layers.{{i}}.mlp.shared_expert.{p}.weight", f"model.layers.{{i}}.mlp.shared_expert.{p}.weight")
      for p in ("gate_proj", "up_proj", "down_proj")],
    # a hybrid's Gated DeltaNet layers (Qwen3.5's four input projections or Qwen3-Next's two fused ones)
    *[(f"layers.{{i}}.linear_attn.{p}", f"model.layers.{{i}}.linear_attn.{p}")
      for p in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                "in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
                "out_proj.weight")],
    ("norm.weight", "model.norm.weight"),
    (HEAD, HEAD),  # ... under "model.", not the head
]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _compile(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


# The hybrids' multi-token-prediction layer (``mtp.*`` in both worlds): its own norms and projection, then
# decoder layers named as the model's, under ``mtp.layers.{i}``.
NAME_TABLE += [(f"mtp.{n}", f"mtp.{n}") for n in ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                                                   "fc.weight", "norm.weight")]
NAME_TABLE += [(f"mtp.{internal}", "mtp." + hf.removeprefix("model."))
               for internal, hf in NAME_TABLE if internal.startswith("layers.{i}.")]

_TO_HF = [(_compile(internal), hf) for internal, hf in NAME_TABLE]
_TO_INTERNAL = [(_compile(hf), internal) for internal, hf in NAME_TABLE]

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# (an MTP layer's experts are named the same under mtp.)
_STACKED = re.compile(r"(?P<mtp>mtp\.)?layers\.(?P<i>\d+)\.mlp\.experts\.(?P<proj>gate_proj|up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"(?P<pre>model\.|mtp\.)layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PACKED = re.compile(r"(?P<pre>model\.|mtp\.)layers\.(?P<i>\d+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def expert_hf_name(name: str, expert: int) -> str:
    """The HF name of expert ``expert``'s slice of stacked tensor ``name``:
    ``layers.3.mlp.experts.gate_proj``, 7 -> ``model.layers.3.mlp.experts.7.gate_proj.weight``."""
    match = _STACKED.match(name)
    assert match, f"{name!r} is not a stacked expert tensor"
    return f"{match['mtp'] or 'model.'}layers.{match['i']}.mlp.experts.{expert}.{match['proj']}.weight"


_REGROUPED = ("linear_attn.conv1d.weight", "linear_attn.in_proj_qkv.weight")


def regrouped_rows(config: Qwen3Config, name: str) -> torch.Tensor | None:
    """For a tensor whose rows the model holds in another order than the files (a Gated DeltaNet layer's
    [q | k | v] channels, grouped per key head), the file's row of each of its rows; None for the others."""
    return hf_row_order(config) if name.endswith(_REGROUPED) else None


def _internal_prefix(hf_prefix: str) -> str:
    """The internal names' prefix of a layer under HF's ``model.`` (none) or ``mtp.`` (the same)."""
    return MTP_PREFIX if hf_prefix == MTP_PREFIX else ""


def _translate(name: str, rules: list[tuple[re.Pattern[str], str]], kind: str) -> str:
    for pattern, template in rules:
        match = pattern.match(name)
        if match:
            return template.replace("{i}", match.groupdict().get("i") or "")
    raise UserError(f"{name!r} is not a Qwen3 {kind} parameter name (see NAME_TABLE in {__name__})")


def hf_to_internal(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.attn.q_proj.weight``; one expert's tensor
    (``model.layers.0.mlp.experts.5.up_proj.weight``) -> the stacked tensor it is part of
    (``layers.0.mlp.experts.up_proj``)."""
    match = _PER_EXPERT.match(name)
    if match:
        return f"{_internal_prefix(match['pre'])}layers.{match['i']}.mlp.experts.{match['proj']}"
    return _translate(name, _TO_INTERNAL, "HF")


def internal_to_hf(name: str) -> str:
    """``layers.0.attn.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj.weight``; a stacked expert tensor
    -> the pattern of its per-expert names (``model.layers.0.mlp.experts.*.up_proj.weight``)."""
    if _STACKED.match(name):
        return expert_hf_name(name, 0).replace(".experts.0.", ".experts.*.")
    return _translate(name, _TO_HF, "internal")


def expected_shapes(config: Qwen3Config, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Internal name -> shape of every tensor a HF checkpoint of ``config`` holds (no head when tied); with
    ``mtp``, its multi-token-prediction layers' too (``mtp_num_hidden_layers``).

    Written out rather than read off a meta-device model: the first random
    init on ``meta`` imports torch._dynamo, seconds a writer need not pay.
    """
    h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
    attn = {  # nn.Linear weights are [out_features, in_features]
        "attn.q_proj.weight": (q_out * (2 if config.is_hybrid else 1), h),  # a hybrid's [query | gate] per head
        "attn.k_proj.weight": (kv_out, h),
        "attn.v_proj.weight": (kv_out, h),
        "attn.o_proj.weight": (h, q_out),
        "attn.q_norm.weight": (hd,),
        "attn.k_norm.weight": (hd,),
    }
    norms = {"attn_norm.weight": (h,), "mlp_norm.weight": (h,)}
    dense = {"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    e, moe_inter, shared = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    sparse = {"mlp.gate.weight": (e, h), "mlp.experts.gate_proj": (e, moe_inter, h),
              "mlp.experts.up_proj": (e, moe_inter, h), "mlp.experts.down_proj": (e, h, moe_inter)}
    if shared:
        sparse.update({"mlp.shared_expert.gate_proj.weight": (shared, h), "mlp.shared_expert.up_proj.weight":
                       (shared, h), "mlp.shared_expert.down_proj.weight": (h, shared),
                       "mlp.shared_expert_gate.weight": (1, h)})
    shapes = {EMBEDDING: (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        mixer = _linear_attention_shapes(config) if config.is_linear_layer(i) else attn
        mlp = sparse if config.is_sparse_layer(i) else dense
        shapes.update({f"layers.{i}.{name}": shape for name, shape in {**norms, **mixer, **mlp}.items()})
    shapes["norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes[HEAD] = (config.vocab_size, h)
    if mtp:  # full-attention decoder layers, their MLP as the first layer's
        mlp = sparse if config.is_sparse_layer(0) else dense
        for i in range(config.mtp_num_hidden_layers):
            shapes.update({f"mtp.layers.{i}.{name}": shape for name, shape in {**norms, **attn, **mlp}.items()})
        shapes.update({"mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
                       "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,)})
    return shapes


def _linear_attention_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (gated_deltanet.py), in the layout of the config's family."""
    h, heads = config.hidden_size, config.linear_num_value_heads
    key_dim, value_dim = config.linear_key_dim, config.linear_value_dim
    conv = 2 * key_dim + value_dim
    if config.fused_linear_projections:
        projections = {"in_proj_qkvz.weight": (conv + value_dim, h), "in_proj_ba.weight": (2 * heads, h)}
    else:
        projections = {"in_proj_qkv.weight": (conv, h), "in_proj_z.weight": (value_dim, h),
                       "in_proj_b.weight": (heads, h), "in_proj_a.weight": (heads, h)}
    shapes = {**projections, "conv1d.weight": (conv, 1, config.linear_conv_kernel_dim), "dt_bias": (heads,),
              "A_log": (heads,), "norm.weight": (config.linear_value_head_dim,), "out_proj.weight": (h, value_dim)}
    return {f"linear_attn.{name}": shape for name, shape in shapes.items()}
