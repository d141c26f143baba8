"""Tiny random Gemma 4 models built with transformers, one per published size's layer kinds:

- ``e2b``: per-layer inputs; the last 3 of 6 layers reuse the keys and values of the last earlier
  sliding (layer 1) and full (layer 2) layer, with MLPs twice as wide (use_double_wide_mlp);
  4 sliding layers per full one, as E2B.
- ``e4b``: per-layer inputs; 5 sliding layers per full one over 12 layers, the last 4 sharing.
- ``26b-a4b``: a mixture of 8 experts (2 per token) beside every dense MLP; full layers' keys
  double as values with one global KV head; images' tokens see each other in sliding layers.
- ``31b``: dense, full layers' keys doubling as values, images bidirectional in sliding layers.

Sliding windows of 8 tokens, so a 64-token prompt leaves the window many times. Norms, layer
scalars and the routers' scales are perturbed (transformers initialises them to 1) and the routers
spread, so that no parity result hides their handling or rests on a near-tie between experts.
"""

from __future__ import annotations

from pathlib import Path

import torch

S, F = "sliding_attention", "full_attention"

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    max_position_embeddings=512,
    final_logit_softcapping=30.0,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 10_000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
)

LAYOUTS: dict[str, dict] = {
    "e2b": dict(
        layer_types=[S, S, F, S, S, F],
        num_kv_shared_layers=3,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=320,
    ),
    "e4b": dict(
        layer_types=[S] * 5 + [F] + [S] * 5 + [F],
        num_kv_shared_layers=4,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=320,
    ),
    "26b-a4b": dict(
        layer_types=[S, S, S, S, S, F],
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        use_bidirectional_attention="vision",
    ),
    "31b": dict(
        layer_types=[S, S, S, S, S, F],
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        use_bidirectional_attention="vision",
    ),
}


def text_config(layout: str, **changes):
    import transformers as tf

    fields = {**COMMON, **LAYOUTS[layout], **changes}
    return tf.Gemma4TextConfig(num_hidden_layers=len(fields["layer_types"]), **fields)


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Norms and scales away from 1, layer scalars spread over [0.5, 1.5], routers decisive."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not p.is_floating_point() or "inv_freq" in name or name.endswith("embed_scale"):
                continue
            if name.endswith("layer_scalar") or name.endswith("per_expert_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith("router.proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0)
            elif "norm" in name or name.endswith("router.scale"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def settle(model: torch.nn.Module) -> None:
    """Scale a random model as a trained one is: its stream (the embeddings, x12) outweighs each
    layer's addition (post-norms x0.15) and its attention is soft (q/k norms x0.3; the query
    scale is 1). Unsettled, every layer rewrites the stream and near-one-hot attention turns
    0.5% of noise on the weights into ~25% on the logits: a conversion's error would measure the
    model's chaos, not the converter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.mul_(12.0)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.3)
            elif ".post_" in name and name.endswith("norm.weight"):
                p.mul_(0.15)


def build_tiny_gemma4(layout: str, directory: Path, seed: int = 0, settled: bool = False):
    """A tiny Gemma4ForCausalLM of ``layout`` saved to ``directory`` (``settled``: see
    :func:`settle`); returns the model."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Gemma4ForCausalLM(text_config(layout)).float().eval()
    perturb(model)
    if settled:
        settle(model)
    model.save_pretrained(directory, safe_serialization=True)
    return model
