"""A tiny random gpt-oss (transformers' GptOssForCausalLM), saved as transformers saves it or in
the MXFP4 layout of the Hub's checkpoints, with weights chosen so that every feature matters:

- sliding-window layers (a window of 8) beside full ones, over prompts of up to 64 tokens;
- attention sinks of a few units (transformers initialises them at std 0.02: nearly no effect);
- experts wide enough that the clamped SwiGLU clips (gate and up beyond ``swiglu_limit``), with
  biases, and a YaRN RoPE with ``truncate`` false as the released models have;
- routers whose logits are spread wide, so no top-k choice is a coin flip: :func:`routing_margin`
  measures, in transformers' own forward pass, how far every choice is from a tie.

The MXFP4 encoder here is test-side only (the engine reads MXFP4, it never writes it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    swiglu_limit=7.0,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
    },
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
ROUTER = "GptOssTopKRouter"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# The spread of the weights that transformers initialises at std 0.02 (or at 0, 1): strong enough
# that the clamps clip and the sinks matter.
STRONG = {"sinks": 2.0, "router": 0.4, "router_bias": 0.5, "gate_up": 0.6, "down": 0.1}


def _perturb(model, seed: int, spread: dict[str, float]) -> None:
    gen = torch.Generator().manual_seed(seed + 100)

    def randn(t: torch.Tensor, std: float) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(randn(p, 0.1))
            if name.endswith("sinks"):
                p.copy_(randn(p, spread["sinks"]))
            elif name.endswith("router.weight"):
                p.copy_(randn(p, spread["router"]))
            elif name.endswith("router.bias") or name.endswith("proj_bias"):
                p.copy_(randn(p, spread["router_bias"]))
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(randn(p, spread["gate_up"]))
            elif name.endswith("experts.down_proj"):
                p.copy_(randn(p, spread["down"]))


def build_tiny_gpt_oss(
    directory: Path, seed: int = 0, mxfp4: bool = False, spread: dict[str, float] = STRONG, **changes
):
    """Save the tiny model to ``directory`` (with ``mxfp4``: its experts' projections as MXFP4
    blocks and scales, and ``quantization_config`` saying so); returns the transformers model,
    whose experts then hold the MXFP4 values (the dequantized checkpoint is its reference).
    ``spread``: the weights' standard deviations (:data:`STRONG`); ``changes``: config fields."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**{**CONFIG, **changes})).float().eval()
    _perturb(model, seed, spread)
    model.save_pretrained(directory, safe_serialization=True)
    if not mxfp4:
        return model
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantize_mxfp4(param.detach())
                del tensors[name]
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
                param.copy_(dequantize_reference(blocks, scales))
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return model


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks ``[*lead, out, in / 32, 16]`` and scales ``[*lead, out, in / 32]`` of ``w`` in
    transformers' layout ``[*lead, in, out]``: per 32 inputs, the power of two that brings the
    largest magnitude within 6, and each value rounded to the nearest E2M1 value."""
    rows = w.transpose(-1, -2).float()  # [*lead, out, in]
    *lead, out, n = rows.shape
    groups = rows.reshape(*lead, out, n // 32, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # E8M0's range
    scaled = groups / torch.exp2(exponent)[..., None]
    index = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = (index | ((scaled < 0).long() << 3)).to(torch.uint8)
    pairs = codes.reshape(*lead, out, n // 32, 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def dequantize_reference(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """transformers' own MXFP4 dequantization (its gpt-oss loading path), ``[*lead, in, out]``."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def _margin(router, hidden: torch.Tensor) -> float:
    """The smallest gap, over the tokens of ``hidden``, between the last chosen and the best
    unchosen expert's router logit."""
    logits = torch.nn.functional.linear(
        hidden.reshape(-1, router.hidden_dim).float(), router.weight, router.bias
    )
    ranked = logits.sort(dim=-1, descending=True).values
    return float((ranked[:, router.top_k - 1] - ranked[:, router.top_k]).min())


def routing_margin(model, ids: list[int]) -> tuple[float, int]:
    """The smallest routing margin (:func:`_margin`) over every token of ``ids`` and every layer
    in transformers' forward pass; and how many different sets of experts the tokens chose."""
    margins: list[float] = []
    choices: set[tuple[int, ...]] = set()

    def record(module, args, out) -> None:
        margins.append(_margin(module, args[0]))
        choices.update(tuple(sorted(row)) for row in out[2].tolist())

    routers = [m for m in model.modules() if type(m).__name__ == ROUTER]
    hooks = [r.register_forward_hook(record) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(margins) == len(routers) > 0
    return min(margins), len(choices)
