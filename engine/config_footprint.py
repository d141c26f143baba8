"""A model's cache footprint (``engine.cache_footprint``) from its config.json alone, torch-free:
what the app's library estimates before a model is loaded (``engine.inspect``).

A family whose every layer attends needs nothing here: each of its layers keeps keys and values
of ``num_key_value_heads`` x ``head_dim``. A hybrid family lays its layers out in its own way
(``layer_types`` with names of its own, an interval, a pattern string, layers with no mixer), so
it lists a torch-free mirror of that layout in :data:`HYBRID_FOOTPRINTS`, as does a family whose
layers keep a compressed latent row instead of keys and values (DeepSeek-V3). The engine's truth is
``engine.cache.paged.cache_footprint(spec)``, from the kinds' declared states;
tests/engine/test_config_footprint.py holds every family's mirror equal to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.cache_footprint import KV, LATENT, NOTHING, STATE, CacheFootprint, StateSize

Config = Mapping[str, Any]


def _kv_shape(cfg: Config, head_dim_keys: Sequence[str] = ("head_dim",)) -> tuple[int, int]:
    """An attention layer's (kv_heads, head_dim), as ``Architecture.attention`` reads them."""
    heads = int(cfg["num_attention_heads"])
    head_dim = next((cfg[k] for k in head_dim_keys if cfg.get(k)), None)
    kv_heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_groups")  # the latter: Step 3.5
    return int(kv_heads or heads), int(head_dim or int(cfg["hidden_size"]) // heads)


def layer_type_footprint(
    types: Sequence[str], states: Mapping[str, StateSize], kv_shape: tuple[int, int]
) -> CacheFootprint:
    """Layers of ``types``: those of a type in ``states`` keep that state, the others attend."""
    kv = tuple(kv_shape for t in types if t not in states)
    layout = tuple(STATE if t in states else KV for t in types)
    return CacheFootprint(kv, tuple(states[t] for t in types if t in states), layout=layout)


def _delta_net_state(cfg: Config) -> StateSize:
    """A gated delta net's float32 state: its q/k/v convolution window and its state matrix."""
    k_heads, v_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    k_dim, v_dim = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    window = int(cfg.get("linear_conv_kernel_dim", 4)) - 1
    return (2 * k_heads * k_dim + v_heads * v_dim) * window + v_heads * k_dim * v_dim, 4


def _gated_delta_net_hybrid(cfg: Config) -> CacheFootprint:
    """Qwen3-Next and Qwen3.5: ``linear_attention`` layers are gated delta nets, every
    ``full_attention_interval``-th layer attends."""
    n, interval = int(cfg["num_hidden_layers"]), int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
    ]
    return layer_type_footprint(types, {"linear_attention": _delta_net_state(cfg)}, _kv_shape(cfg))


def _olmo_hybrid(cfg: Config) -> CacheFootprint:
    """OLMo-Hybrid: the delta nets of Qwen3-Next at the ``linear_attention`` entries of
    ``layer_types``; without the list every layer attends, as ``engine.architectures.olmo_hybrid``
    reads it."""
    types = cfg.get("layer_types") or ["full_attention"] * int(cfg["num_hidden_layers"])
    return layer_type_footprint(types, {"linear_attention": _delta_net_state(cfg)}, _kv_shape(cfg))


def _short_conv_hybrid(cfg: Config) -> CacheFootprint:
    """LFM2: ``conv`` layers keep their last ``conv_L_cache - 1`` inputs (in the cache's dtype);
    without ``layer_types``, the layers at ``full_attn_idxs`` attend."""
    n = int(cfg["num_hidden_layers"])
    attending = cfg.get("full_attn_idxs")
    attending = set(range(n)) if attending is None else {int(i) for i in attending}
    types = cfg.get("layer_types") or ["full_attention" if i in attending else "conv" for i in range(n)]
    numbers = int(cfg["hidden_size"]) * (int(cfg.get("conv_L_cache", 3)) - 1)
    return layer_type_footprint(types, {"conv": (numbers, None)}, _kv_shape(cfg))


# Nemotron-H's block names, as letters of its ``hybrid_override_pattern``.
_NEMOTRON_BLOCKS = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}


def _mamba2_hybrid(cfg: Config) -> CacheFootprint:
    """Nemotron-H: ``M`` layers are Mamba-2 (a float32 convolution window and state), ``*``
    layers attend, ``-`` and ``E`` layers have no mixer (a feed-forward alone)."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    pattern = "".join(_NEMOTRON_BLOCKS[t] for t in types) if types else str(cfg["hybrid_override_pattern"])
    heads, head_dim = int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"])
    groups = int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 1)
    state_size = int(cfg["ssm_state_size"])
    window = int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4) - 1
    numbers = (heads * head_dim + 2 * groups * state_size) * window + heads * head_dim * state_size
    kv = _kv_shape(cfg, ("head_dim", "attention_head_dim"))
    layout = tuple({"M": STATE, "*": KV}.get(letter, NOTHING) for letter in pattern)
    return CacheFootprint((kv,) * pattern.count("*"), ((numbers, 4),) * pattern.count("M"), layout=layout)


def _latent_attention(cfg: Config) -> CacheFootprint:
    """DeepSeek-V3: every layer's multi-head latent attention keeps one row per position, its
    latent (``kv_lora_rank``) and the rotated key part its heads share (``qk_rope_head_dim``)."""
    width = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
    layers = int(cfg["num_hidden_layers"])
    return CacheFootprint(latent_layers=(width,) * layers, layout=(LATENT,) * layers)


def _gemma4(cfg: Config) -> CacheFootprint:
    """Gemma 4: sliding and full layers keep keys and values of their own shapes (a layer's
    ``per_layer_config`` entry where config.json has them, else full layers take
    ``global_head_dim`` and, where their keys double as values, ``num_global_key_value_heads``);
    the last ``num_kv_shared_layers`` keep none (they read an earlier layer's). A torch-free
    mirror of ``engine.architectures.gemma4``."""
    n, full = int(cfg["num_hidden_layers"]), "full_attention"
    types = list(
        cfg.get("layer_types") or [full if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    )
    types[-1] = full
    base = {"num_key_value_heads": _kv_shape(cfg)[0], "head_dim": int(cfg.get("head_dim") or 256)}
    wide = dict(base, head_dim=int(cfg.get("global_head_dim") or 512))
    if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
        wide["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
    per_layer = cfg.get("per_layer_config")

    def shape(i: int) -> Mapping[str, Any]:
        if isinstance(per_layer, dict):  # keyed by zero-padded layer index
            return {**base, **{int(k): v for k, v in per_layer.items()}.get(i, {})}
        return wide if types[i] == full else base

    kept = n - int(cfg.get("num_kv_shared_layers") or 0)
    return CacheFootprint(
        tuple((int(s["num_key_value_heads"]), int(s["head_dim"])) for s in map(shape, range(kept))),
        layout=(KV,) * kept + (NOTHING,) * (n - kept),
    )


def _deci(cfg: Config) -> CacheFootprint:
    """DeciLM (Nemotron-NAS): each layer's ``block_configs`` entry gives its KV heads
    (``num_attention_heads / n_heads_in_group``); a ``no_op`` attention keeps none. A torch-free
    mirror of ``engine.architectures.deci``."""
    heads, head_dim = int(cfg["num_attention_heads"]), _kv_shape(cfg)[1]
    kv, layout = [], []
    for block in cfg["block_configs"]:
        attention = block.get("attention") or {}
        if attention.get("no_op"):
            layout.append(NOTHING)
        else:
            kv.append((heads // int(attention.get("n_heads_in_group") or 1), head_dim))
            layout.append(KV)
    return CacheFootprint(tuple(kv), layout=tuple(layout))


# Families whose layers do not all keep keys and values of one shape (hybrids, latent attention),
# by config.json's architecture name: their layers' footprint from the config.
HYBRID_FOOTPRINTS: dict[str, Callable[[Config], CacheFootprint]] = {
    "Qwen3NextForCausalLM": _gated_delta_net_hybrid,
    "Qwen3_5ForCausalLM": _gated_delta_net_hybrid,
    "Qwen3_5ForConditionalGeneration": _gated_delta_net_hybrid,
    "Qwen3_5MoeForCausalLM": _gated_delta_net_hybrid,
    "Qwen3_5MoeForConditionalGeneration": _gated_delta_net_hybrid,
    "OlmoHybridForCausalLM": _olmo_hybrid,
    "Lfm2ForCausalLM": _short_conv_hybrid,
    "Lfm2MoeForCausalLM": _short_conv_hybrid,
    "NemotronHForCausalLM": _mamba2_hybrid,
    "DeepseekV3ForCausalLM": _latent_attention,
    "Gemma4ForCausalLM": _gemma4,
    "Gemma4ForConditionalGeneration": _gemma4,
    "DeciLMForCausalLM": _deci,
}


def config_footprint(config: Config) -> CacheFootprint | None:
    """The footprint of the model config.json ``config`` describes (its ``text_config`` where it
    nests one); None when the config lacks the shapes (or a hybrid's config is malformed: loading
    will say why)."""
    inner = config.get("text_config")
    cfg = {**config, **inner} if isinstance(inner, dict) else config
    archs = config.get("architectures") or [None]
    hybrid = HYBRID_FOOTPRINTS.get(archs[0]) if isinstance(archs, list) else None
    try:
        if hybrid is not None:
            return hybrid(cfg)
        return CacheFootprint.uniform(int(cfg["num_hidden_layers"]), *_kv_shape(cfg))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
