from qwen3_pretrain.models.qwen3.config import PRESETS, Qwen3Config, get_preset
from qwen3_pretrain.models.qwen3.model import Qwen3Model, init_param

__all__ = ["PRESETS", "Qwen3Config", "Qwen3Model", "get_preset", "init_param"]
