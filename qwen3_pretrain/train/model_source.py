"""Where the initial weights come from: a preset (random init) or a HuggingFace model directory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qwen3_pretrain.config.loader import nearest
from qwen3_pretrain.errors import ConfigError
from qwen3_pretrain.models.qwen3.config import Qwen3Config, get_preset, interval_layer_types, is_preset_name
from qwen3_pretrain.models.qwen3.init import init_param
from qwen3_pretrain.models.qwen3.model import MTP_PREFIX, TIED_ALIASES
from qwen3_pretrain.train.config import TrainConfig

# Keys a preset and a checkpoint's config.json must agree on for model_name to describe model_path.
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "layer_types",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim")


@dataclass
class ModelSource:
    config: Qwen3Config
    reader: object | None  # HFCheckpointReader when continuing from a HF directory
    description: str  # where the initial weights come from
    name: str = ""  # what the model is: the preset (and its overrides) or the HF directory

    def tensor_source(self, padded_vocab: int, seed: int):
        """A ``ParamSource`` for ``materialize``: values of any slice of any parameter.

        A tied head reads the embedding's values; rows past the real vocabulary (padding added to
        make it divisible by tp) are zero and never receive probability mass.
        """
        cfg = self.config
        # What the files hold; a multi-token-prediction layer they lack starts from random init
        stored = set(self.reader.names()) if self.reader is not None else set()

        def values(name: str, shape: tuple[int, ...], slices: tuple[slice, ...]) -> torch.Tensor:
            if self.reader is not None and (name in stored or not name.startswith(MTP_PREFIX)):
                return self.reader.read_slice(name, slices)
            return init_param(name, shape, cfg, seed, slices)  # only the slice is drawn

        def source(name: str, shape: tuple[int, ...], slices: tuple[slice, ...]) -> torch.Tensor:
            if cfg.tie_word_embeddings:
                name = TIED_ALIASES.get(name, name)
            real = (cfg.vocab_size,) + tuple(shape[1:]) if shape[0] == padded_vocab else tuple(shape)
            rows = slice(slices[0].start, min(slices[0].stop, real[0]))
            if rows.stop == slices[0].stop:  # no padding row in the slice
                return values(name, real, slices)
            out = torch.zeros(tuple(s.stop - s.start for s in slices))
            if rows.stop > rows.start:
                out[: rows.stop - rows.start] = values(name, real, (rows,) + tuple(slices[1:]))
            return out

        return source


def resolve_model(cfg: TrainConfig) -> ModelSource:
    if cfg.model_path:
        from qwen3_pretrain.models.qwen3.hf_io import HFCheckpointReader

        if cfg.model_overrides:
            raise ConfigError("model_overrides cannot be combined with model_path: the checkpoint's config.json "
                              "defines the model")
        reader = HFCheckpointReader(cfg.model_path)
        reader.validate()  # a broken checkpoint fails here, naming the tensor and file, not mid-load
        _check_name_matches(cfg.model_name, reader.config, cfg.model_path)
        return ModelSource(reader.config, reader, f"weights from {cfg.model_path} (continued pre-training)",
                           name=f"{cfg.model_name} ({cfg.model_path})")
    model_cfg = get_preset(cfg.model_name)
    if cfg.model_overrides:
        fields = {f.name for f in dataclasses.fields(Qwen3Config)}
        for key in cfg.model_overrides:
            if key not in fields:
                hint = nearest(key, fields)
                raise ConfigError(f"model_overrides: unknown key {key!r}" + (f"; did you mean {hint!r}?" if hint else ""))
        overrides = dict(cfg.model_overrides)
        if "num_hidden_layers" in overrides and "layer_types" not in overrides and model_cfg.is_hybrid:
            # the preset's pattern (3 Gated DeltaNet layers, then full attention) continues over the new depth
            interval = model_cfg.layer_types.index("full_attention") + 1
            overrides["layer_types"] = interval_layer_types(overrides["num_hidden_layers"], interval)
        model_cfg = dataclasses.replace(model_cfg, **overrides)
    overrides = f" with model_overrides {', '.join(f'{k}={v}' for k, v in cfg.model_overrides.items())}" \
        if cfg.model_overrides else ""
    return ModelSource(model_cfg, None, f"random init (seed {cfg.seed})", name=f"{cfg.model_name} preset{overrides}")


def _check_name_matches(model_name: str, config: Qwen3Config, path: str) -> None:
    if not is_preset_name(model_name):
        return  # a free-form label
    preset = get_preset(model_name)
    diffs = [f"{k}: preset {getattr(preset, k)} vs {getattr(config, k)}" for k in ARCHITECTURE_KEYS
             if getattr(preset, k) != getattr(config, k)]
    if diffs:
        raise ConfigError(f"model_name {model_name!r} names a preset that contradicts {path}/config.json "
                          f"({'; '.join(diffs)}); fix model_name or model_path")
