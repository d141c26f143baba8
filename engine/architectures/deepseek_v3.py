"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention in every layer, whose cache
keeps one compressed row per position (``engine.layers.latent_attention``); dense MLPs in the
first ``first_k_dense_replace`` layers and DeepSeek's mixtures of experts after them
(``engine.architectures.deepseek_moe``). RoPE covers only each head's ``qk_rope_head_dim`` part,
in DeepSeek's interleaved pairs unless ``rope_interleave`` is false. The multi-token-prediction
layers stored after the last one are read only by the MTP drafter (``--draft mtp``). Defaults are
those of transformers' config class."""

from __future__ import annotations

from engine.architectures.base import FULL, Architecture, TensorNames
from engine.architectures.deepseek_moe import DEEPSEEK_EXPERTS, deepseek_experts
from engine.architectures.expert_layers import with_experts
from engine.architectures.mtp_names import DEEPSEEK_MTP
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.latent_attention import LatentAttentionSpec
from engine.layers.spec import ModelSpec
from engine.modules.latent_attention import softmax_scale
from engine.modules.rope import RopeSpec


class DeepseekV3(Architecture):
    hf_names = ("DeepseekV3ForCausalLM",)
    names = TensorNames(parts=(DEEPSEEK_EXPERTS,))
    mtp = DEEPSEEK_MTP

    def mixer(self, cfg: ModelConfig, layer_type: str, rope: RopeSpec | None) -> LatentAttentionSpec:
        if layer_type != FULL or rope is None:
            raise ModelLoadError(f"{cfg.directory / 'config.json'}: unsupported layer type '{layer_type}'")
        nope, rotated = int(cfg.require("qk_nope_head_dim")), int(cfg.require("qk_rope_head_dim"))
        return LatentAttentionSpec(
            num_heads=int(cfg.require("num_attention_heads")),
            kv_lora_rank=int(cfg.require("kv_lora_rank")),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rotated,
            v_head_dim=int(cfg.require("v_head_dim")),
            scale=softmax_scale(nope + rotated, rope),
            rope=rope,
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            bias=bool(cfg.get("attention_bias", False)),
        )

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        dense = int(cfg.get("first_k_dense_replace", 3))
        moe = deepseek_experts(cfg, normalize=True, shared_experts=1)
        return with_experts(super().spec(cfg), cfg, moe, lambda i: i >= dense)
