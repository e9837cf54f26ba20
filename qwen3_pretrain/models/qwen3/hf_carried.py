"""What a HF checkpoint holds beyond the text model, kept for the merged model to hold again.

The released Qwen3.5 checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``): the text model under
``model.language_model.``, a vision tower under ``model.visual.``, and a multi-token-prediction layer under
``mtp.``. Training trains the text model (and the MTP layer with ``mtp_loss_weight``); the rest is copied
once, as stored, into a ``carried`` directory of the run's output (``write_carried``), and the HF writer puts
it back (``Carried``): same names, dtypes and bytes, the text model nested again, and the source's
config.json with the trained text model's keys in its ``text_config``.

The directory holds one ``carried-NNNNN.safetensors`` per source file that had such tensors (so writing it
holds one source shard's share in memory, not all of them) and the source's ``config.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen3_pretrain.errors import MissingFileError
from qwen3_pretrain.fsutil import write_json_atomic
from qwen3_pretrain.models.qwen3.config import MULTIMODAL_TYPES
from qwen3_pretrain.models.qwen3.model import MTP_PREFIX

# The prefixes of tensors that are not the text model's, and where a multimodal checkpoint nests the text model.
CARRIED_PREFIXES = ("model.visual.", MTP_PREFIX)
MULTIMODAL_TEXT_PREFIX = "model.language_model."
CONFIG_FILE = "config.json"
_PATTERN = "carried-*.safetensors"


def write_carried(reader: Any, directory: str | os.PathLike, mtp_trained: bool = False) -> Path | None:
    """Keep what ``reader``'s checkpoint (an ``HFCheckpointReader``) holds beyond the text model (the MTP layer
    too unless ``mtp_trained``) in ``directory``, and its config.json; None when there is nothing to keep
    and the layout is the text model's own. The directory appears only once complete."""
    names = [n for n in reader.carried if not (mtp_trained and n.startswith(MTP_PREFIX))]
    if not names and not reader.multimodal:
        return None
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(reader.carried[name], []).append(name)
    directory = Path(directory)
    tmp = directory.parent / f"{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for k, group in enumerate(by_file.values()):
        save_file({name: reader.read_carried(name) for name in group}, str(tmp / f"carried-{k:05d}.safetensors"),
                  metadata={"format": "pt"})
    write_json_atomic(tmp / CONFIG_FILE, reader.hf_config)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


class Carried:
    """A ``write_carried`` directory, read back by the HF writer."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        if not (self.directory / CONFIG_FILE).is_file():
            raise MissingFileError(f"{self.directory}: no {CONFIG_FILE}; the tensors carried from the checkpoint "
                                   "training started from are missing (they are written at the run's start)")
        self.source_config = json.loads((self.directory / CONFIG_FILE).read_text(encoding="utf-8"))
        self.multimodal = self.source_config.get("model_type") in MULTIMODAL_TYPES

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor as stored), one file at a time."""
        for path in sorted(self.directory.glob(_PATTERN)):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def nested(self, hf_name: str) -> str:
        """A text model's HF name, nested under ``model.language_model.`` in a multimodal checkpoint."""
        if self.multimodal and hf_name.startswith("model."):
            return MULTIMODAL_TEXT_PREFIX + hf_name[len("model."):]
        return hf_name

    def config(self, text: dict[str, Any]) -> dict[str, Any]:
        """The config.json to write for the trained text model's ``text`` (its ``to_hf_dict``): that, or for a
        multimodal source the source's with ``text`` in its ``text_config``; what this project does not model
        (the vision config, the multimodal RoPE's sections) stays as it was."""
        if not self.multimodal:
            return text
        text = dict(text)
        rope = {**self.source_config["text_config"].get("rope_parameters", {}), **text.pop("rope_parameters", {})}
        for key in ("architectures", "model_type"):  # the source's text_config names its own
            text.pop(key)
        merged = {**self.source_config["text_config"], **text}
        if rope:
            merged["rope_parameters"] = rope
        return {**self.source_config, "text_config": merged, "dtype": text["dtype"]}
