"""Strict YAML config loading: typo suggestions, coercion of YAML's odd scalars, overrides, required keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from qwen3_pretrain.config.loader import field_help, from_dict, load_config, save_config
from qwen3_pretrain.errors import ConfigError, UserError


@dataclass
class ToyConfig:
    data_path: Path = field_help(help="required: where the data lives")
    lr: float = field_help(3e-4, help="peak learning rate")
    train_steps: int = field_help(100, help="optimizer steps")
    use_bf16: bool = field_help(True, help="bf16 autocast")
    schedule: Literal["cosine", "linear"] = field_help("cosine", help="LR schedule")
    layers: list[int] = field_help([1, 2], help="layer ids")
    resume: str | None = field_help(None, help="checkpoint to resume from")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "toy.yaml"
    path.write_text(text)
    return path


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match="unknown key 'train_step'; did you mean 'train_steps'"):
        from_dict(ToyConfig, {"data_path": "d", "train_step": 5})


def test_unknown_key_without_near_match_lists_valid_keys():
    with pytest.raises(ConfigError, match="unknown key 'zzz'; valid keys: data_path, layers, lr"):
        from_dict(ToyConfig, {"data_path": "d", "zzz": 5})


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    # YAML 1.1 reads 1e-5 (no dot) as a string; the loader must still give a float.
    cfg = load_config(ToyConfig, write(tmp_path, "data_path: d\nlr: 1e-5\n"))
    assert cfg.lr == 1e-5 and isinstance(cfg.lr, float)
    assert from_dict(ToyConfig, {"data_path": "d", "lr": "2.5E-4"}).lr == 2.5e-4


@pytest.mark.parametrize("text, expected", [("True", True), ("False", False), ("true", True), ("no", False),
                                            ("ON", True), (0, False)])
def test_boolean_strings(text, expected):
    assert from_dict(ToyConfig, {"data_path": "d", "use_bf16": text}).use_bf16 is expected


def test_bad_boolean_names_the_key():
    with pytest.raises(ConfigError, match="use_bf16: expected true or false, got 'maybe'"):
        from_dict(ToyConfig, {"data_path": "d", "use_bf16": "maybe"})


@pytest.mark.parametrize("value", ["ten", 2.5, True, "1e-3"])
def test_int_coercion_errors_name_the_key(value):
    with pytest.raises(ConfigError, match="train_steps: expected an integer"):
        from_dict(ToyConfig, {"data_path": "d", "train_steps": value})


def test_int_accepts_integral_numbers_written_as_strings():
    assert from_dict(ToyConfig, {"data_path": "d", "train_steps": "1e3"}).train_steps == 1000


def test_literal_choices():
    assert from_dict(ToyConfig, {"data_path": "d", "schedule": "LINEAR"}).schedule == "linear"
    with pytest.raises(ConfigError, match="schedule: 'step' is not one of 'cosine', 'linear'"):
        from_dict(ToyConfig, {"data_path": "d", "schedule": "step"})


def test_lists_and_optionals():
    cfg = from_dict(ToyConfig, {"data_path": "d", "layers": ["3", 4], "resume": "null"})
    assert cfg.layers == [3, 4] and cfg.resume is None
    with pytest.raises(ConfigError, match=r"layers\[1\]: expected an integer"):
        from_dict(ToyConfig, {"data_path": "d", "layers": [1, "x"]})


def test_overrides_win_over_the_file(tmp_path):
    path = write(tmp_path, "data_path: d\ntrain_steps: 5\nlr: 0.1\n")
    cfg = load_config(ToyConfig, path, ["train_steps=7", "--use-bf16=false", "schedule=linear", "lr=1e-5"])
    assert (cfg.train_steps, cfg.use_bf16, cfg.schedule, cfg.lr) == (7, False, "linear", 1e-5)
    assert cfg.data_path == Path("d")
    with pytest.raises(ConfigError, match="'train_steps' is not of the form key=value"):
        load_config(ToyConfig, path, ["train_steps"])
    with pytest.raises(ConfigError, match="did you mean 'train_steps'"):
        load_config(ToyConfig, path, ["train_stepz=3"])


def test_required_keys_are_reported():
    with pytest.raises(ConfigError, match="missing required key.*data_path"):
        from_dict(ToyConfig, {"lr": 0.1})


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(ToyConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="toy.yaml.*mapping"):
        load_config(ToyConfig, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="toy.yaml: not valid YAML"):
        load_config(ToyConfig, write(tmp_path, "a: [1, 2\n"))


def test_config_errors_are_user_errors():
    # The CLI turns ValueError into a one-line message; ConfigError must be one.
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)


def test_save_then_load_gives_the_same_config(tmp_path):
    cfg = from_dict(ToyConfig, {"data_path": "d", "lr": "1e-5", "layers": [5], "schedule": "linear"})
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(ToyConfig, tmp_path / "saved.yaml") == cfg
