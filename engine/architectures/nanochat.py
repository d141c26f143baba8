"""Karpathy's nanochat (NanoChatForCausalLM, its checkpoints in the transformers layout).

What differs from the common reading:

- no norm has a learned scale (none is stored), and the embeddings are normalised before the
  first layer as well;
- queries and keys are RMS-normalised per head after RoPE (with no scale, the same as before it:
  a rotation keeps each head's norm), and RoPE turns the other way (its rotate-half has its signs
  flipped);
- the MLP is ungated, ``fc2(relu(fc1(x)) ** 2)``;
- the logits are soft-capped by ``final_logit_softcapping``.

Checkpoints in nanochat's own layout (``transformer.h.{i}.*``, with the value embeddings and
per-layer residual scalars of its later versions) are refused with a message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engine.architectures.base import Architecture, TensorNames
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.plain_mlp import PlainMLPNames, PlainMLPSpec
from engine.layers.spec import ModelSpec
from engine.modules.rope import RopeSpec

MLP = PlainMLPNames(up="mlp.fc1", down="mlp.fc2")


class NanoChat(Architecture):
    hf_names = ("NanoChatForCausalLM",)
    names = TensorNames(parts=(MLP,))
    qk_norm = True

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        softcap = cfg.get("final_logit_softcapping")
        return replace(
            super().spec(cfg),
            unweighted_norms=True,
            embed_norm=True,
            final_softcap=float(softcap) if softcap else None,
        )

    def mlp(self, cfg: ModelConfig) -> PlainMLPSpec:
        width, bias = int(cfg.require("intermediate_size")), bool(cfg.get("mlp_bias", False))
        return PlainMLPSpec(width, cfg.get("hidden_act") or "relu2", bias)

    def rope_specs(self, cfg: ModelConfig) -> dict[str, RopeSpec]:
        return {kind: replace(spec, reverse=True) for kind, spec in super().rope_specs(cfg).items()}

    def tensor_names(self, has: Callable[[str], bool]) -> TensorNames:
        if has("transformer.wte.weight"):
            raise ModelLoadError(
                "this nanochat checkpoint is in nanochat's own layout (transformer.h.*); only the "
                "transformers layout (model.layers.*) is supported: convert it with transformers' "
                "nanochat conversion script"
            )
        return self.names
