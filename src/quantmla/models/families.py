"""The MLA families transformers ships, registered by ``model_type``."""

from __future__ import annotations

from torch import nn

from quantmla.models.adapter import MLAAdapter, RopeLayout, register_adapter


class DeepseekV2Adapter(MLAAdapter):
    model_types = ("deepseek_v2",)
    attention_classes = ("DeepseekV2Attention",)
    description = "DeepSeek-V2, DeepSeek-V2-Lite"

    def rope_layout(self, config) -> RopeLayout:
        # complex-number RoPE on (2i, 2i+1) pairs; the cached key stays interleaved
        return RopeLayout(weight_interleaved=True, cache_interleaved=True)


class DeepseekV3Adapter(MLAAdapter):
    model_types = ("deepseek_v3", "kimi_k2")
    attention_classes = ("DeepseekV3Attention",)
    description = "DeepSeek-V3/R1, Moonlight, Kimi-K2 (load Kimi through DeepseekV3Config)"


class Glm4MoeLiteAdapter(MLAAdapter):
    model_types = ("glm4_moe_lite",)
    attention_classes = ("Glm4MoeLiteAttention",)
    description = "GLM-4.7-Flash"


class LongcatFlashAdapter(MLAAdapter):
    model_types = ("longcat_flash",)
    attention_classes = ("LongcatFlashMLA",)
    description = "LongCat-Flash (two MLAs per decoder layer, cache index 2*layer+i)"

    def num_cache_layers(self, config) -> int:
        return 2 * config.num_layers

    def rope_layout(self, config) -> RopeLayout:
        return RopeLayout(weight_interleaved=True, cache_interleaved=False)

    def latent_scale(self, attn: nn.Module) -> float:
        return float(attn.mla_scale_kv_lora)

    def query_scale(self, attn: nn.Module) -> float:
        return float(attn.mla_scale_q_lora)


for _adapter in (DeepseekV2Adapter(), DeepseekV3Adapter(), Glm4MoeLiteAdapter(), LongcatFlashAdapter()):
    register_adapter(_adapter)
