"""Which layers of a mixture-of-experts family hold experts: each family says which by its own
fields (GLM-4.5's and dots.llm1's ``first_k_dense_replace``, Ernie 4.5's start, end and interval,
MiniMax-M2's every layer), and the others keep the dense MLP the common reading gave them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.sparse_moe import SparseMoESpec
from engine.layers.spec import ModelSpec


def with_experts(
    spec: ModelSpec, cfg: ModelConfig, moe: SparseMoESpec, sparse: Callable[[int], bool]
) -> ModelSpec:
    """``spec`` with ``moe`` as the feed-forward of every layer ``i`` where ``sparse(i)``. A
    routing the experts cannot do is refused here, naming the config, rather than when the first
    layer is built."""
    where = cfg.directory / "config.json"
    if not 1 <= moe.experts_per_token <= moe.num_experts:
        raise ModelLoadError(
            f"{where}: {moe.experts_per_token} experts per token, but the model has {moe.num_experts}"
        )
    groups, kept = moe.num_groups, moe.groups_per_token
    if moe.num_experts % groups or not 1 <= kept <= groups:
        raise ModelLoadError(f"{where}: {moe.num_experts} experts cannot form {groups} groups keeping {kept}")
    if moe.experts_per_token > kept * (moe.num_experts // groups):
        raise ModelLoadError(
            f"{where}: {moe.experts_per_token} experts per token exceed {kept} groups' experts"
        )
    layers = tuple(
        replace(layer, feed_forward=moe) if sparse(i) else layer for i, layer in enumerate(spec.layers)
    )
    return replace(spec, layers=layers)
