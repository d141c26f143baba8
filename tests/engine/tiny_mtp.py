"""Tiny models with random multi-token-prediction (MTP) layers added in the Hub's layout, and an
independent reference of what such a layer computes.

The MTP decoder layer's tensors come from a one-layer transformers model of the family (random,
its norms and routers perturbed as the tiny models' are), saved with ``save_pretrained`` and
renamed to the MTP layer's keys; the projection, the two input norms (and DeepSeek's own head) are
random. That one-layer model, whose final norm is the MTP layer's final norm, is the reference's
decoder layer: :class:`MtpReference` adds the MTP maths around it as published (vLLM's
qwen3_next_mtp / deepseek_mtp): ``h' = layer(proj(cat(norm_e(embed(t_{p+1})), norm_h(h_p))))``,
``logits = head(norm(h'))``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from decisive_routers import build_routed_tiny_model
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model

# What each family's MTP layer needs: its keys, and how the reference combines them.
QWEN_MTP = dict(
    config_key="mtp_num_hidden_layers",
    block="mtp.layers.0.",
    embed_norm="mtp.pre_fc_norm_embedding.weight",
    hidden_norm="mtp.pre_fc_norm_hidden.weight",
    projection="mtp.fc.weight",
    final_norm="mtp.norm.weight",
    head=None,
    norm_offset=1.0,  # the Qwen3-Next family's norms scale by 1 + weight
    hands_on_normed=True,
)
LAYOUTS = {
    "Qwen3_5ForCausalLM": QWEN_MTP,
    "Qwen3NextForCausalLM": QWEN_MTP,  # its MTP layer has the family's experts
    "DeepseekV3ForCausalLM": dict(
        config_key="num_nextn_predict_layers",
        block="model.layers.4.",
        embed_norm="model.layers.4.enorm.weight",
        hidden_norm="model.layers.4.hnorm.weight",
        projection="model.layers.4.eh_proj.weight",
        final_norm="model.layers.4.shared_head.norm.weight",
        head="model.layers.4.shared_head.head.weight",
        norm_offset=0.0,
        hands_on_normed=False,
    ),
}


@dataclass
class MtpReference:
    """The published MTP maths over a transformers decoder layer (``layer_model``: a one-layer
    model whose final norm is the MTP layer's)."""

    layer_model: torch.nn.Module
    embed: torch.Tensor
    embed_norm: torch.Tensor
    hidden_norm: torch.Tensor
    projection: torch.Tensor
    head: torch.Tensor
    norm_offset: float
    eps: float
    hands_on_normed: bool
    hidden_first: bool = False  # MiMo: cat(hidden, embedding)

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (self.norm_offset + weight)

    @torch.no_grad()
    def run(self, next_tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, handed on)`` per position of a sequence whose MTP inputs are the embeddings
        of ``next_tokens`` and the hidden states ``hidden`` ``[n, width]``, positions 0 .. n - 1."""
        e = self.rms(self.embed[torch.tensor(next_tokens)], self.embed_norm)
        h = self.rms(hidden, self.hidden_norm)
        x = torch.cat([h, e] if self.hidden_first else [e, h], dim=-1) @ self.projection.T
        captured = {}
        hook = self.layer_model.layers[0].register_forward_hook(
            lambda m, a, out: captured.setdefault("out", out[0] if isinstance(out, tuple) else out)
        )
        try:
            normed = self.layer_model(inputs_embeds=x[None], use_cache=False).last_hidden_state[0]
        finally:
            hook.remove()
        return normed @ self.head.T, normed if self.hands_on_normed else captured["out"].reshape(normed.shape)


def build_with_mtp(variant: str, directory: Path, seed: int = 0) -> tuple[torch.nn.Module, MtpReference]:
    """The tiny model of ``variant`` saved to ``directory`` with one random MTP layer in the Hub's
    layout (and declared in config.json); returns the transformers model (without the MTP layer,
    which transformers does not read) and the layer's reference."""
    layout = LAYOUTS[variant]
    build = build_routed_tiny_model if variant.startswith("Deepseek") else build_tiny_model
    model = build(variant, directory, seed)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = ["full_attention"]
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = 0  # the MTP layer comes after the dense ones: experts
    import transformers as tf

    torch.manual_seed(seed + 7)
    bases = {
        "Qwen3_5ForCausalLM": tf.Qwen3_5TextModel,
        "Qwen3NextForCausalLM": tf.Qwen3NextModel,
        "DeepseekV3ForCausalLM": tf.DeepseekV3Model,
    }
    base = bases[variant]
    layer_model = base(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 8)
    with torch.no_grad():
        for name, p in [*layer_model.named_parameters(), *layer_model.named_buffers()]:
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # decisive routers (decisive_routers.py)
                p.mul_(10.0)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    saved = directory / "mtp-layer"
    layer_model.save_pretrained(saved, safe_serialization=True)
    layer_tensors = load_file(str(saved / "model.safetensors"))
    for path in saved.iterdir():
        path.unlink()
    saved.rmdir()

    h, vocab = config.hidden_size, config.vocab_size
    tensors = load_file(str(directory / "model.safetensors"))
    for key, value in layer_tensors.items():
        if key.startswith("layers.0."):
            tensors[layout["block"] + key[len("layers.0.") :]] = value
    tensors[layout["final_norm"]] = layer_tensors["norm.weight"]
    offset = layout["norm_offset"]
    tensors[layout["embed_norm"]] = (1.0 - offset) + 0.1 * torch.randn(h, generator=gen)
    tensors[layout["hidden_norm"]] = (1.0 - offset) + 0.1 * torch.randn(h, generator=gen)
    tensors[layout["projection"]] = torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5
    embed = tensors["model.embed_tokens.weight"]
    head = tensors["lm_head.weight"]
    if layout["head"] is not None:  # DeepSeek's MTP layer stores its own head
        head = tensors[layout["head"]] = torch.randn(vocab, h, generator=gen) * h**-0.5
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    raw = json.loads((directory / "config.json").read_text())
    raw[layout["config_key"]] = 1
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    reference = MtpReference(
        layer_model,
        embed.float(),
        tensors[layout["embed_norm"]].float(),
        tensors[layout["hidden_norm"]].float(),
        tensors[layout["projection"]].float(),
        head.float(),
        offset,
        float(config.rms_norm_eps),
        layout["hands_on_normed"],
    )
    return model, reference


def build_echo_mtp(directory: Path, seed: int = 0) -> None:
    """A one-layer (full attention) tiny Qwen3.5 whose MTP layer reproduces the model itself: the
    projection passes the normalised embedding through and drops the hidden state, the layer and
    final norm are copies of the model's, and every embedding row has unit RMS (so the input norm
    leaves it as it is). At position ``p`` the MTP layer then computes what the model computes at
    ``p + 1``, but for the first token, which its attention does not see: an MTP layer whose
    drafts are nearly always right."""
    import transformers as tf
    from tiny_models import _DELTA_NET, COMMON

    config = tf.Qwen3_5TextConfig(
        **{**COMMON, **_DELTA_NET, "num_hidden_layers": 1, "layer_types": ["full_attention"]}
    )
    build_tiny_model("Qwen3_5ForCausalLM", directory, seed, config=config)
    tensors = load_file(str(directory / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True))
    for key in [k for k in tensors if k.startswith("model.layers.0.")]:
        tensors["mtp.layers.0." + key[len("model.layers.0.") :]] = tensors[key].clone()
    h = embed.shape[1]
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)  # scale 1 + 0
    tensors["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(h)
    tensors["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)  # cat(e, h) -> e
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    raw = json.loads((directory / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(raw, indent=2))


def mimo_reference(directory: Path) -> MtpReference:
    """The reference of the MTP layer of tiny_more_families.build_mimo's checkpoint: its decoder
    layer as a one-layer transformers Qwen2 (MiMo's layer), the hidden state first in the
    projection's input."""
    import transformers as tf

    raw = json.loads((directory / "config.json").read_text())
    tensors = {k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}
    config = tf.Qwen2Config(**{**raw, "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    layer_model = tf.Qwen2Model(config).float().eval()
    prefix = "model.mtp_layers.0."
    state = {"norm.weight": tensors[prefix + "final_layernorm.weight"]}
    for key in layer_model.state_dict():
        if key.startswith("layers.0."):
            state[key] = tensors[prefix + key[len("layers.0.") :]]
    missing, _ = layer_model.load_state_dict(state, strict=False)
    assert missing == ["embed_tokens.weight"], missing
    return MtpReference(
        layer_model,
        tensors["model.embed_tokens.weight"],
        tensors[prefix + "token_layernorm.weight"],
        tensors[prefix + "hidden_layernorm.weight"],
        tensors[prefix + "input_proj.weight"],
        tensors["lm_head.weight"],
        0.0,
        float(raw.get("rms_norm_eps", 1e-6)),
        True,
        hidden_first=True,
    )
