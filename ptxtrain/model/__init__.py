"""The DeepSeek-V3-style model: config and presets, the module, building and sampling.

See ``ptxtrain.model.config`` for the fields and presets and ``ptxtrain.model.deepseek`` for the
architecture (MLA + DeepSeekMoE + depth-1 MTP, DeepSeek-V3 report §2.1-2.2).
"""

from ptxtrain.model.config import PRESETS, DeepSeekV3Config, get_preset
from ptxtrain.model.deepseek import (
    DeepSeekV3,
    ModelOutput,
    build_model,
    fp8_module_filter,
    generate,
)

__all__ = [
    "PRESETS",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "ModelOutput",
    "build_model",
    "fp8_module_filter",
    "generate",
    "get_preset",
]
