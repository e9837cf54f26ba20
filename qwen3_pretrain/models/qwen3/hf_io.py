"""Reading and writing the HuggingFace model directory format.

This module is the only one that touches the bytes of a HF model directory:
``config.json``, ``generation_config.json`` and the safetensors weights, either
one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
Everything else in the project speaks the model's own parameter names
(``layers.3.attn.q_proj.weight``); the table below translates.

A MoE layer's experts are stacked in the model (``layers.3.mlp.experts.gate_proj``
[E, I, H], ``up_proj`` [E, I, H], ``down_proj`` [E, H, I]). The files hold one
tensor per expert and projection (``model.layers.3.mlp.experts.7.gate_proj.weight``),
as the released Qwen3-MoE checkpoints and transformers' ``save_pretrained`` do;
this is what is written. Reading also takes transformers' packed form
(``mlp.experts.gate_up_proj`` [E, 2I, H], the gate's rows first, and
``mlp.experts.down_proj`` [E, H, I]). Either way a slice of the stacked tensor
reads only the experts, and the rows, it covers.

A Gated DeltaNet layer holds its [q | k | v] channels (the convolution's rows, Qwen3.5's
``in_proj_qkv``'s) grouped per key head, so that tensor parallelism splits them by heads with plain
row shards (models/qwen3/gated_deltanet.py); the files keep HF's order, q of all heads, then k, then v.
Reading and writing reorder those rows (``regrouped_rows``), and a slice reads only its rows.

Loading never holds two copies of the model: the model is built on the
``meta`` device, materialized empty, and filled tensor by tensor. Saving
holds one shard at a time and becomes visible only once complete (written
into a sibling temp directory, then renamed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.fsutil import write_json_atomic
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.hf_carried import CARRIED_PREFIXES, MULTIMODAL_TEXT_PREFIX, Carried
from qwen3_pretrain.models.qwen3.gated_deltanet import hf_row_order
from qwen3_pretrain.models.qwen3.model import EMBEDDING, HEAD, MTP_PREFIX, ModelOptions, Qwen3Model

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
_UMASK = os.umask(0o022)
os.umask(_UMASK)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_SAVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def _runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """``rows`` as [start, stop) runs of consecutive integers, in their order."""
    runs: list[tuple[int, int]] = []
    for row in rows.tolist():
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


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


def parse_size(size: int | str) -> int:
    """Bytes from ``5_000_000``, ``"5GB"`` (10^9), ``"500MB"``, ``"2GiB"`` (2^30) or ``"100KB"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if not match:
            raise UserError(f"max_shard_size {size!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a byte count")
        unit = match.group(2) or "B"
        base = 1024 if "I" in unit else 1000
        value = int(float(match.group(1)) * base ** "BKMGT".index(unit[0]))
    if value < 1:
        raise UserError(f"max_shard_size must be positive, got {size!r}")
    return value


# --- reading --------------------------------------------------------------


def check_not_training_output(path: Path) -> None:
    """A training output_path given where a HuggingFace model belongs: say to merge it first."""
    if not (path / CONFIG_FILE).is_file() and ((path / "latest").is_file() or any(path.glob("step_*/meta.json"))):
        raise UserError(f"{path} is a training output_path (sharded checkpoints step_N/), not a HuggingFace model; "
                        f"merge it into one first: qwen3-pretrain merge --input_path {path} --output_path "
                        f"{path}_merged, then use {path}_merged")


@dataclasses.dataclass
class _Stored:
    """Where the values of one internal tensor are: one tensor of a file, its rows in the file's order or
    (``order``: the file's row of each row) another; a range of a packed tensor's dim 1 (``rows``: a packed
    ``gate_up_proj``'s gate or up half); or, ``stacked``, one tensor per expert."""

    pieces: list[tuple[str, str]]  # (file name, HF name); per expert in expert order when stacked
    rows: tuple[int, int] | None = None
    stacked: bool = False
    order: torch.Tensor | None = None


class HFCheckpointReader:
    """Lazy access to the tensors of a HF Qwen3 directory, by internal name.

    Files are opened on first use and kept open; ``read_slice`` reads only the
    requested part of a tensor, so each rank of a sharded model reads only its
    shard.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingFileError(f"{self.path}: no such directory; expected a HuggingFace model directory "
                                   f"with {CONFIG_FILE} and {SINGLE_FILE} (or {INDEX_FILE})")
        check_not_training_output(self.path)
        self.config = Qwen3Config.from_json_file(self.path / CONFIG_FILE)
        self.hf_config = json.loads((self.path / CONFIG_FILE).read_text(encoding="utf-8"))
        self._handles: dict[str, safe_open] = {}
        self._handles_lock = threading.Lock()  # materialize reads on several threads
        self._stored: dict[str, _Stored] = {}
        self.carried: dict[str, str] = {}  # HF name -> file name of the tensors not of the text model
        self.multimodal = False  # the text model's names are nested under model.language_model.
        experts: dict[str, dict[int, tuple[str, str]]] = {}  # stacked name -> expert -> (file, HF name)
        for hf_name, file_name in self._weight_map().items():
            if hf_name.startswith(CARRIED_PREFIXES):
                self.carried[hf_name] = file_name
                if not hf_name.startswith(MTP_PREFIX):  # an MTP layer is read too, where training trains it
                    continue
            text_name = hf_name
            if hf_name.startswith(MULTIMODAL_TEXT_PREFIX):
                self.multimodal, text_name = True, "model." + hf_name[len(MULTIMODAL_TEXT_PREFIX):]
            if _PER_EXPERT.match(text_name):
                experts.setdefault(hf_to_internal(text_name), {})[int(_PER_EXPERT.match(text_name)["e"])] = \
                    (file_name, hf_name)
            elif (packed := _PACKED.match(text_name)) and packed["proj"] == "gate_up_proj":
                self._add_packed_gate_up(_internal_prefix(packed["pre"]) + f"layers.{packed['i']}", file_name,
                                         hf_name)
            else:
                try:
                    name = hf_to_internal(text_name)
                except UserError as exc:
                    raise UserError(f"{self.path / file_name}: {exc}") from None
                self._stored[name] = _Stored([(file_name, hf_name)], order=regrouped_rows(self.config, name))
        for name, by_expert in experts.items():
            gap = next(e for e in range(len(by_expert) + 1) if e not in by_expert)
            if gap < len(by_expert):
                raise UserError(f"{self.path}: tensor {expert_hf_name(name, gap)!r} is missing while experts up to "
                                f"{max(by_expert)} are present; the checkpoint is incomplete")
            self._stored[name] = _Stored([by_expert[e] for e in range(len(by_expert))], stacked=True)
        mtp_layers = {int(n.split(".")[2]) for n in self._stored if n.startswith("mtp.layers.")}
        if mtp_layers and not self.config.mtp_num_hidden_layers:  # a config.json that does not say
            self.config.mtp_num_hidden_layers = max(mtp_layers) + 1

    def _add_packed_gate_up(self, layer: str, file_name: str, hf_name: str) -> None:
        """``layer``: the internal prefix of the layer (``layers.3``)."""
        rows = self._handle(file_name).get_slice(hf_name).get_shape()[1]
        for k, proj in enumerate(("gate_proj", "up_proj")):  # gate rows first, as transformers chunks them
            half = (k * rows // 2, (k + 1) * rows // 2)
            self._stored[f"{layer}.mlp.experts.{proj}"] = _Stored([(file_name, hf_name)], rows=half)

    def _weight_map(self) -> dict[str, str]:
        """HF name -> file name, from the index or from the single file's header."""
        index = self.path / INDEX_FILE
        if index.is_file():
            return self._read_index(index)
        if (self.path / SINGLE_FILE).is_file():
            return {key: SINGLE_FILE for key in self._handle(SINGLE_FILE).keys()}
        raise MissingFileError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE}; this loader reads safetensors "
                               "weights only (re-save the model with save_pretrained(safe_serialization=True))")

    def _read_index(self, index: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{index}: malformed index ({exc!r}); it needs a 'weight_map' of name -> file") from None
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: 'weight_map' must map tensor names to file names")
        for file_name in sorted(set(weight_map.values())):
            if not (self.path / file_name).is_file():
                raise MissingFileError(f"{index} lists {file_name!r}, which is missing from {self.path}; "
                                       "the download is incomplete")
        return weight_map

    def _handle(self, file_name: str) -> safe_open:
        with self._handles_lock:  # two threads that miss at once would both open the file and keep one
            if file_name not in self._handles:
                try:
                    self._handles[file_name] = safe_open(str(self.path / file_name), framework="pt")
                except (SafetensorError, OSError) as exc:
                    raise UserError(f"{self.path / file_name}: not a readable safetensors file ({exc})") from None
            return self._handles[file_name]

    def _lookup(self, name: str) -> _Stored:
        if name not in self._stored:
            raise UserError(f"{self.path}: no tensor {name!r} ({internal_to_hf(name)}) in this checkpoint")
        return self._stored[name]

    def _slice(self, piece: tuple[str, str]):
        file_name, hf_name = piece
        return self._handle(file_name).get_slice(hf_name)

    @property
    def has_mtp(self) -> bool:
        """The files hold a multi-token-prediction layer (``mtp.*``)."""
        return any(name.startswith(MTP_PREFIX) for name in self.carried)

    def read_carried(self, hf_name: str) -> torch.Tensor:
        """A carried tensor (``carried``) as stored: same name, dtype and bytes."""
        return self._handle(self.carried[hf_name]).get_tensor(hf_name)

    def names(self) -> list[str]:
        """Internal names of the tensors present, in the checkpoint's order."""
        return list(self._stored)

    def hf_name(self, name: str) -> str:
        """The name tensor ``name`` has (or would have) in this checkpoint's files (of a stacked expert
        tensor: the pattern of its per-expert names)."""
        stored = self._stored.get(name)
        if stored is None or stored.stacked:
            return internal_to_hf(name)
        return stored.pieces[0][1]

    def file_of(self, name: str) -> Path:
        """The safetensors file that holds tensor ``name`` (of a stacked one: its first expert's)."""
        return self.path / self._lookup(name).pieces[0][0]

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self._lookup(name)
        shape = tuple(self._slice(stored.pieces[0]).get_shape())
        if stored.stacked:
            return (len(stored.pieces), *shape)
        if stored.rows is not None:
            return (shape[0], stored.rows[1] - stored.rows[0], *shape[2:])
        return shape

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(self._lookup(name).pieces[0]).get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise UserError(f"{self.file_of(name)}: tensor {self.hf_name(name)!r} is stored as {code}; expected a "
                            f"float type ({', '.join(_SAFETENSORS_DTYPES)})")
        return _SAFETENSORS_DTYPES[code]

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full tensor ``name`` on CPU, converted to ``dtype`` when given."""
        return self.read_slice(name, tuple(slice(None) for _ in self.shape(name)), dtype)

    def read_slice(self, name: str, slices: tuple[slice, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """``tensor[slices]`` reading only those bytes from disk (one slice per leading dim, no steps)."""
        stored = self._lookup(name)
        slices = tuple(slices) or (slice(None),)
        if stored.stacked:
            rest = slices[1:] or (slice(None),)
            experts = range(len(stored.pieces))[slices[0]]
            tensor = torch.stack([self._slice(stored.pieces[e])[rest] for e in experts]) if len(experts) else \
                torch.empty((0, *self.shape(name)[1:]))[(slice(None), *rest)]
        elif stored.rows is not None:
            first, last = stored.rows
            wanted = slices[1] if len(slices) > 1 else slice(None)
            start, stop, _ = wanted.indices(last - first)
            tensor = self._slice(stored.pieces[0])[(slices[0], slice(first + start, first + max(start, stop)),
                                                    *slices[2:])]
        elif stored.order is not None:
            piece, rest = self._slice(stored.pieces[0]), slices[1:]
            runs = _runs(stored.order[slices[0]])
            tensor = torch.cat([piece[(slice(start, stop), *rest)] for start, stop in runs]) if runs else \
                torch.empty((0, *self.shape(name)[1:]))[(slice(None), *rest)]
        else:
            tensor = self._slice(stored.pieces[0])[slices]
        return tensor if dtype is None else tensor.to(dtype)

    def validate(self) -> None:
        """Check the tensors against ``config.json``: none missing, none extra, every shape right.

        A tied model's checkpoint may also hold ``lm_head.weight`` (HF sometimes
        writes both); it is accepted only when equal to the embedding.
        """
        expected = expected_shapes(self.config)
        missing = [n for n in expected if n not in self._stored]
        if missing:
            listed = INDEX_FILE if (self.path / INDEX_FILE).is_file() else SINGLE_FILE
            raise UserError(f"{self.path / listed}: tensor {self.hf_name(missing[0])!r} is missing "
                            f"({len(missing)} missing in all); the checkpoint does not match its {CONFIG_FILE}")
        tied_head = HEAD if self.config.tie_word_embeddings else None
        if self.has_mtp:  # checked too, though read only where training trains it
            expected = expected_shapes(self.config, mtp=True)
        extra = [n for n in self._stored if n not in expected and n != tied_head]
        if extra:
            raise UserError(f"{self.file_of(extra[0])}: unexpected tensor {self.hf_name(extra[0])!r} for the model "
                            f"described by {CONFIG_FILE} ({self.config.num_hidden_layers} layers, "
                            f"{self.config.num_experts} experts, tie_word_embeddings={self.config.tie_word_embeddings})")
        for name, shape in expected.items():
            found = self.shape(name)
            if found != shape:
                raise UserError(f"{self.file_of(name)}: tensor {self.hf_name(name)!r} has shape {list(found)}, "
                                f"expected {list(shape)} from {CONFIG_FILE}")
        if tied_head in self._stored and not torch.equal(self.read(tied_head), self.read(EMBEDDING)):
            raise UserError(f"{self.file_of(tied_head)}: {self.hf_name(tied_head)!r} differs from the embedding but "
                            f"{CONFIG_FILE} says tie_word_embeddings=true; set it to false to keep a separate head")

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HFCheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", document_mask: bool = False, mtp: bool = False) -> Qwen3Model:
    """Build a ``Qwen3Model`` from a HF directory, holding the model plus at most one tensor in memory.
    ``document_mask``: each packed document of a row (positions restarting at 0) computed as if alone;
    ``mtp``: with the multi-token-prediction layer the files hold."""
    with HFCheckpointReader(path) as reader:
        reader.validate()
        if mtp and not reader.has_mtp:
            raise UserError(f"{reader.path}: no multi-token-prediction layer (mtp.*) to load")
        with torch.device("meta"):
            options = ModelOptions(document_mask=document_mask, multi_token_prediction=mtp)
            model = Qwen3Model(reader.config, options).to(dtype)
        model.to_empty(device=device)
        if reader.config.tie_word_embeddings:
            # to_empty gives each module its own new tensor, which unties the head; tie it again.
            model.lm_head.weight = model.embed_tokens.weight
        with torch.no_grad():
            for name in expected_shapes(reader.config, mtp):
                model.get_parameter(name).copy_(reader.read(name))
    return model


# --- writing --------------------------------------------------------------


class HFCheckpointWriter:
    """Streams tensors into a HF directory, one shard in memory at a time.

    ``add`` each tensor of the model by internal name (any order), then
    ``finalize``; the head of a tied model is skipped, as HF stores it once,
    and anything else that does not belong to ``config`` is an error. Until
    ``finalize`` everything lives in a sibling temp directory, so ``path``
    holds either the previous model or the complete new one. Used as a
    context manager, an exception before ``finalize`` removes the temp files.

    ``carried``: a directory ``hf_carried.write_carried`` made from the checkpoint training started from; its
    tensors (a vision tower, an MTP layer) are written back as they were, and a multimodal source's layout
    and config.json are kept (the text model nested under ``model.language_model.``, the vision config).
    """

    def __init__(self, path: str | os.PathLike, config: Qwen3Config, dtype: torch.dtype = torch.bfloat16,
                 max_shard_size: int | str = "5GB", carried: str | os.PathLike | None = None,
                 mtp: bool = False) -> None:
        if dtype not in _SAVE_DTYPES:
            raise UserError(f"cannot save weights as {dtype}; use one of {', '.join(map(str, _SAVE_DTYPES))}")
        self.path = Path(path)
        self.config = config
        self.carried = Carried(carried) if carried is not None else None
        self.dtype = dtype
        self.max_shard_bytes = parse_size(max_shard_size)
        self._expected = expected_shapes(config, mtp)  # mtp: the model holds a trained MTP layer
        self._added: set[str] = set()
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._shards: list[list[str]] = []  # HF names per flushed shard
        self._total_bytes = 0
        self._extra_files: list[Path] = []
        _check_replaceable(self.path)  # fail before hours of merging, not after
        self.tmp_dir = self.path.parent / f"{self.path.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue tensor ``name`` (internal name) for writing; a full shard goes to disk first."""
        if name == HEAD and self.config.tie_word_embeddings:
            return  # a tied head is the embedding; HF stores it once
        if name not in self._expected:
            raise UserError(f"{name!r} ({internal_to_hf(name)}) is not a tensor of this model "
                            f"({self.config.num_hidden_layers} layers, {self.config.num_experts} experts, "
                            f"tied={self.config.tie_word_embeddings})")
        if name in self._added:
            raise UserError(f"tensor {name!r} was added twice")
        if tuple(tensor.shape) != self._expected[name]:
            raise UserError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(self._expected[name])} "
                            "from the model config")
        self._added.add(name)
        tensor = tensor.detach()
        if _STACKED.match(name):  # one tensor per expert, as the released checkpoints hold them
            for expert in range(tensor.shape[0]):
                self._queue(self._nested(expert_hf_name(name, expert)), tensor[expert])
        else:
            order = regrouped_rows(self.config, name)
            if order is not None:  # back to the files' order
                tensor = tensor.index_select(0, order.argsort().to(tensor.device))
            self._queue(self._nested(internal_to_hf(name)), tensor)

    def _nested(self, hf_name: str) -> str:
        return self.carried.nested(hf_name) if self.carried is not None else hf_name

    def _queue(self, hf_name: str, tensor: torch.Tensor, keep_dtype: bool = False) -> None:
        tensor = tensor.to("cpu", None if keep_dtype else self.dtype).contiguous()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # safetensors refuses views that share a storage
        if self._shard and self._shard_bytes + tensor.nbytes > self.max_shard_bytes:
            self._flush()
        self._shard[hf_name] = tensor
        self._shard_bytes += tensor.nbytes

    def add_file(self, source: str | os.PathLike) -> None:
        """Copy a side file (``tokenizer.json``, a ``generation_config.json``) into the directory at ``finalize``."""
        source = Path(source)
        if not source.is_file():
            raise MissingFileError(f"{source}: no such file to copy into {self.path}")
        if source.name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE) or source.name.startswith("model-"):
            raise UserError(f"{source}: would overwrite the model's own {source.name}; copy it separately")
        self._extra_files.append(source)

    def _flush(self) -> None:
        save_file(self._shard, str(self.tmp_dir / f"shard-{len(self._shards)}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._shard))
        self._total_bytes += self._shard_bytes
        self._shard, self._shard_bytes = {}, 0

    def finalize(self) -> Path:
        """Write the last shard, the index and the configs, then move the directory onto ``path``."""
        missing = [n for n in self._expected if n not in self._added]
        if missing:
            raise UserError(f"{self.path}: cannot finalize, {len(missing)} tensor(s) never added, "
                            f"first {missing[0]!r}")
        if self.carried is not None:  # as they were: names, dtypes, values
            for hf_name, tensor in self.carried.tensors():
                self._queue(hf_name, tensor, keep_dtype=True)
        if self._shard or not self._shards:
            self._flush()
        weight_map = self._name_shards()
        if len(self._shards) > 1:
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
            write_json_atomic(self.tmp_dir / INDEX_FILE, index)
        write_json_atomic(self.tmp_dir / CONFIG_FILE, self._hf_config())
        write_json_atomic(self.tmp_dir / GENERATION_CONFIG_FILE, {
            "bos_token_id": self.config.bos_token_id, "eos_token_id": self.config.eos_token_id})
        for source in self._extra_files:
            shutil.copyfile(source, self.tmp_dir / source.name)
        _replace_dir(self.tmp_dir, self.path)
        return self.path

    def _name_shards(self) -> dict[str, str]:
        """Rename the temp shards to HF's names; returns HF name -> file name."""
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        for k, names in enumerate(self._shards):
            file_name = SINGLE_FILE if count == 1 else f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.tmp_dir / f"shard-{k}.safetensors", self.tmp_dir / file_name)
            # safetensors creates its files owner-only; a model directory is meant to be shared.
            os.chmod(self.tmp_dir / file_name, 0o666 & ~_UMASK)
            weight_map.update(dict.fromkeys(names, file_name))
        return weight_map

    def _hf_config(self) -> dict:
        out = dataclasses.replace(self.config, torch_dtype=str(self.dtype).removeprefix("torch.")).to_hf_dict()
        out["dtype"] = out["torch_dtype"]  # transformers >= 5 reads "dtype", older versions "torch_dtype"
        return self.carried.config(out) if self.carried is not None else out

    def abort(self) -> None:
        """Drop everything written so far; ``path`` is left untouched."""
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> "HFCheckpointWriter":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()


def _check_replaceable(target: Path) -> None:
    """Only an empty directory or a previous model may be replaced, never unrelated files."""
    if not target.exists():
        return
    names = {p.name for p in target.iterdir()} if target.is_dir() else None
    if names is None or (names and not names & {CONFIG_FILE, SINGLE_FILE, INDEX_FILE}):
        raise UserError(f"{target} exists and is not a HuggingFace model directory; refusing to replace it "
                        "(choose another output path or remove it)")


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` onto ``target``; an existing model there is kept until the new one is in place."""
    _check_replaceable(target)
    if not target.exists():
        os.replace(new, target)
        return
    old = target.parent / f"{target.name}.old-{os.getpid()}"
    os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old)


def save_hf_model(model: Qwen3Model, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                  max_shard_size: int | str = "5GB", extra_files: Iterable[str | os.PathLike] = ()) -> Path:
    """Write ``model`` as a HF directory loadable by ``transformers.AutoModelForCausalLM``.

    ``extra_files`` (e.g. the tokenizer's files) are copied alongside.
    """
    with HFCheckpointWriter(path, model.config, dtype, max_shard_size, mtp=model.mtp is not None) as writer:
        for name, param in model.named_parameters():
            writer.add(name, param)
        for source in extra_files:
            writer.add_file(source)
        return writer.finalize()
