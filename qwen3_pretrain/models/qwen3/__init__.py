from qwen3_pretrain.models.qwen3.config import PRESETS, Qwen3Config, get_preset
from qwen3_pretrain.models.qwen3.model import ModelOptions, ModelPart, Qwen3Model, init_param

__all__ = ["PRESETS", "ModelOptions", "ModelPart", "Qwen3Config", "Qwen3Model", "get_preset", "init_param"]
