"""EXAONE 4.0 (Exaone4ForCausalLM): post-norm layers (``h += norm(attention(h))``,
``h += norm(mlp(h))``, as OLMo 2), q/k RMSNorm per head, and in the hybrid sizes sliding layers
with RoPE beside global layers without any (NoPE). Without a ``sliding_window`` every layer is
global and rotated. Where config.json lists no ``layer_types``, ``sliding_window_pattern`` says
which layers slide: a string of L (local) and G (global) repeated from layer 0, or every n-th
layer global; the last layer is always global."""

from __future__ import annotations

from engine.architectures.base import FULL, POST_NORMS, SLIDING, Architecture, post_norms
from engine.config import ModelConfig
from engine.layers.spec import ModelSpec


class Exaone4(Architecture):
    hf_names = ("Exaone4ForCausalLM",)
    names = POST_NORMS
    qk_norm = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        return post_norms(super().spec(cfg))

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        n = int(cfg.require("num_hidden_layers"))
        pattern = cfg.get("sliding_window_pattern")
        if not cfg.get("sliding_window") or not pattern:
            return [FULL] * n
        if isinstance(pattern, str):
            types = [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(n)]
        else:
            types = [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(n)]
        return types[:-1] + [FULL]

    def rope_layers(self, cfg: ModelConfig) -> list[bool]:
        """Global layers of a hybrid model are NoPE; a model with no sliding window rotates all."""
        if not cfg.get("sliding_window"):
            return [True] * int(cfg.require("num_hidden_layers"))
        return [kind == SLIDING for kind in cfg.get("layer_types") or self.layer_types(cfg)]
