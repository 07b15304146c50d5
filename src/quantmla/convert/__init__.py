"""MLAfication: GQA/MHA models (Llama, Qwen2, Qwen3, Qwen3-MoE) converted into MLA and written in DeepSeek's format."""

from quantmla.convert.api import (
    Conversion,
    check_conversion,
    convert,
    distill_conversion,
    function_kl,
    save,
    to_deepseek,
)
from quantmla.convert.config import ConvertConfig
from quantmla.convert.distillation import DistillConfig, distill

__all__ = [
    "Conversion",
    "ConvertConfig",
    "DistillConfig",
    "check_conversion",
    "convert",
    "distill",
    "distill_conversion",
    "function_kl",
    "save",
    "to_deepseek",
]
