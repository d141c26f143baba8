"""SmolLM3: Llama in which some layers use no positional encoding at all (NoPE).

``no_rope_layers[i]`` is 1 where layer ``i`` *does* rotate; by default every
``no_rope_layer_interval``-th layer is a NoPE layer.
"""

from engine.architectures.base import Architecture
from engine.config import ModelConfig


class SmolLM3(Architecture):
    hf_names = ("SmolLM3ForCausalLM",)

    def rope_layers(self, cfg: ModelConfig) -> list[bool]:
        n = int(cfg.require("num_hidden_layers"))
        flags = cfg.get("no_rope_layers")
        if flags is None:
            interval = int(cfg.get("no_rope_layer_interval", 4))
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        return [bool(f) for f in flags]
