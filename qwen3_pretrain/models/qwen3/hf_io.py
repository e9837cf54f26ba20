"""Reading the HuggingFace model directory format.

This module and its two siblings are the only ones that touch the bytes of a HF model directory:
``config.json``, ``generation_config.json`` and the safetensors weights, either
one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
``hf_layout`` holds the file names and the table that translates the model's
own parameter names (``layers.3.attn.q_proj.weight``) to HF's, with every
tensor's expected shape; ``hf_write`` writes a directory; this module reads one
(and re-exports the other two's public names, the format's one entry point).

A MoE layer's experts are read from one tensor per expert or from transformers'
packed ``gate_up_proj``; either way a slice of the stacked tensor reads only the
experts, and the rows, it covers. A Gated DeltaNet layer's [q | k | v] rows are
reordered to the model's grouping per key head, and a slice reads only its rows.

Loading never holds two copies of the model: the model is built on the
``meta`` device, materialized empty, and filled tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.hf_carried import CARRIED_PREFIXES, MULTIMODAL_TEXT_PREFIX
from qwen3_pretrain.models.qwen3.hf_layout import (CONFIG_FILE, EXPERT_PROJECTIONS, GENERATION_CONFIG_FILE,
                                                   INDEX_FILE, NAME_TABLE, SINGLE_FILE, _PACKED, _PER_EXPERT,
                                                   _internal_prefix, expected_shapes, expert_hf_name,
                                                   hf_to_internal, internal_to_hf, regrouped_rows)
from qwen3_pretrain.models.qwen3.hf_write import HFCheckpointWriter, parse_size, save_hf_model
from qwen3_pretrain.models.qwen3.model import EMBEDDING, HEAD, MTP_PREFIX, ModelOptions, Qwen3Model

# The format's public names, wherever they are defined (``from ...hf_io import save_hf_model`` keeps working).
__all__ = ["CONFIG_FILE", "EXPERT_PROJECTIONS", "GENERATION_CONFIG_FILE", "HFCheckpointReader", "HFCheckpointWriter",
           "INDEX_FILE", "NAME_TABLE", "SINGLE_FILE", "check_not_training_output", "expected_shapes",
           "expert_hf_name", "hf_to_internal", "internal_to_hf", "load_hf_model", "parse_size", "regrouped_rows",
           "save_hf_model"]

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """``rows`` as [start, stop) runs of consecutive integers, in their order."""
    runs: list[tuple[int, int]] = []
    for row in rows.tolist():
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


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
