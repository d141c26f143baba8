"""How each GGUF architecture maps onto a Hugging Face one: config fields, tensor names and the
few tensor fix-ups llama.cpp's converter applied that must be undone.

The facts, per family (from llama.cpp's converter and runtime):

* Llama: llama.cpp's RoPE rotates interleaved pairs (x0,x1),(x2,x3)... while HF's rotates the
  two halves of each head, so the converter permuted the rows of ``q_proj``/``k_proj`` (weights
  and biases) within every head. We apply the inverse permutation.
* Qwen2/Qwen3 and Gemma use the "NEOX" (halves) RoPE in llama.cpp too: no permutation.
* Gemma: HF's RMSNorm computes ``x * (1 + w)`` and stores ``w``; llama.cpp computes ``x * w``, so
  the converter stored ``w + 1`` for every ``*norm.weight``. We subtract 1.
* Mixtures of experts: llama.cpp stacks a layer's experts into one 3-D tensor per projection
  (``ffn_{gate,up,down}_exps``, expert-major); older Mixtral files have one 2-D tensor per expert
  (``ffn_gate.E``). The router is ``ffn_gate_inp``. Mixtral is converted with the *llama*
  architecture (and its q/k permutation) plus ``llama.expert_count``. GGUF has no
  ``mlp_only_layers`` / ``decoder_sparse_step``: which layers are sparse is read off the tensors
  (a layer with a router is sparse). We write the Hub's layout: one 2-D tensor per expert.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from engine.errors import GGUFImportError

Meta = Mapping[str, Any]


def shortest_float(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.999999747378752e-06. Take the shortest
    decimal that is the same float32, which is the value the original config.json had."""
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class ArchSpec:
    gguf_name: str
    hf_architecture: str
    model_type: str
    block_tensors: Mapping[str, str]  # GGUF per-block name -> HF name under model.layers.N.
    build_config: Callable[[Meta, ArchContext], dict[str, Any]]
    unpermute_qk: bool = False
    norm_offset: float = 0.0  # subtracted from every *norm.weight
    optional_tensors: frozenset[str] = field(default_factory=frozenset)
    # Mixture of experts: GGUF stem of a stacked expert tensor (``ffn_gate_exps``) -> HF name
    # under model.layers.N. with ``{e}`` for the expert. Empty for dense families.
    expert_tensors: Mapping[str, str] = field(default_factory=dict)
    # Block tensors HF keeps as a [1, n] matrix that llama.cpp may store as a vector.
    row_vectors: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class ArchContext:
    """Facts about the file that the config needs beyond metadata."""

    path: str
    tensor_names: frozenset[str]
    vocab_rows: int  # rows of token_embd.weight


GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

_GEMMA3_BLOCK = {
    **_LLAMA_BLOCK,
    **_QK_NORM,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


_QWEN_MOE_BLOCK = {"ffn_gate_inp": "mlp.gate"}
_QWEN_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_QWEN2_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_MIXTRAL_MOE_BLOCK = {"ffn_gate_inp": "block_sparse_moe.gate"}
_MIXTRAL_EXPERTS = {  # Mixtral's w1/w3/w2 are gate/up/down
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}


class _Reader:
    """``meta["<arch>.<key>"]`` with a clear error when a required key is absent."""

    def __init__(self, meta: Meta, arch: str, path: str) -> None:
        self.meta, self.arch, self.path = meta, arch, path

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value


def _common_config(meta: Meta, ctx: ArchContext, arch: str) -> dict[str, Any]:
    r = _Reader(meta, arch, ctx.path)
    heads = int(r.require("attention.head_count"))
    hidden = int(r.require("embedding_length"))
    kv_heads = r.get("attention.head_count_kv", heads)
    if not isinstance(kv_heads, (int, np.integer)):
        raise GGUFImportError(
            f"{ctx.path}: per-layer head counts ({arch}.attention.head_count_kv) are not supported"
        )
    head_dim = int(r.get("attention.key_length") or hidden // heads)
    cfg: dict[str, Any] = {
        "hidden_size": hidden,
        # An all-MoE file may carry only the experts' width.
        "intermediate_size": int(r.get("feed_forward_length") or r.require("expert_feed_forward_length")),
        "num_hidden_layers": int(r.require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": shortest_float(r.require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(r.get("context_length", 4096)),
        "vocab_size": ctx.vocab_rows,
        "tie_word_embeddings": "output.weight" not in ctx.tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in ctx.tensor_names,
    }
    theta = shortest_float(r.get("rope.freq_base", 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = _rope_scaling(r)
    if scaling:
        rope.update(scaling)
    # Both spellings: transformers 5 reads rope_parameters, transformers 4 rope_theta/rope_scaling.
    cfg["rope_theta"] = theta
    cfg["rope_scaling"] = scaling or None
    cfg["rope_parameters"] = rope
    return cfg


def _rope_scaling(r: _Reader) -> dict[str, Any]:
    kind = r.get("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind not in ("linear", "yarn"):
        raise GGUFImportError(f"{r.path}: RoPE scaling {kind!r} is not supported")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": shortest_float(r.require("rope.scaling.factor"))}
    original = r.get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _llama_config(meta: Meta, ctx: ArchContext) -> dict[str, Any]:
    cfg = _common_config(meta, ctx, "llama")
    cfg.update(hidden_act="silu", mlp_bias=False)
    return cfg


def _qwen2_config(meta: Meta, ctx: ArchContext) -> dict[str, Any]:
    cfg = _common_config(meta, ctx, "qwen2")
    cfg.pop("attention_bias")  # Qwen2 always has q/k/v biases; its config has no such field
    cfg.update(hidden_act="silu", use_sliding_window=False)
    return cfg


def _qwen3_config(meta: Meta, ctx: ArchContext) -> dict[str, Any]:
    cfg = _common_config(meta, ctx, "qwen3")
    cfg.update(hidden_act="silu", use_sliding_window=False)
    return cfg


def _sparse_layers(ctx: ArchContext) -> set[int]:
    """Layers with a router: the sparse ones (GGUF does not say which layers are sparse)."""
    return {
        int(n.split(".")[1]) for n in ctx.tensor_names if n.startswith("blk.") and ".ffn_gate_inp.weight" in n
    }


def _moe_config(meta: Meta, ctx: ArchContext, arch: str, layers: int, normalize: bool) -> dict[str, Any]:
    """Expert counts, widths and which layers stay dense, in Qwen-MoE's field names."""
    r = _Reader(meta, arch, ctx.path)
    experts = int(r.require("expert_count"))
    used = int(r.require("expert_used_count"))
    if not 1 <= used <= experts:
        raise GGUFImportError(
            f"{ctx.path}: {arch}.expert_used_count is {used}, but there are {experts} experts"
        )
    sparse = _sparse_layers(ctx)
    cfg: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(r.get("expert_feed_forward_length") or r.require("feed_forward_length")),
        # llama.cpp hard-codes the renormalisation per family unless the file says otherwise.
        "norm_topk_prob": bool(r.get("expert_weights_norm", normalize)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": sorted(set(range(layers)) - sparse),
    }
    if any(".ffn_up_shexp." in n for n in ctx.tensor_names):
        cfg["shared_expert_intermediate_size"] = int(r.require("expert_shared_feed_forward_length"))
    return cfg


def _qwen3moe_config(meta: Meta, ctx: ArchContext) -> dict[str, Any]:
    cfg = _common_config(meta, ctx, "qwen3moe")
    cfg.update(hidden_act="silu", use_sliding_window=False)
    cfg.update(_moe_config(meta, ctx, "qwen3moe", cfg["num_hidden_layers"], normalize=True))
    return cfg


def _qwen2moe_config(meta: Meta, ctx: ArchContext) -> dict[str, Any]:
    cfg = _common_config(meta, ctx, "qwen2moe")
    cfg["qkv_bias"] = cfg.pop("attention_bias")  # Qwen2-MoE's name for the q/k/v biases
    cfg.update(hidden_act="silu", use_sliding_window=False)
    cfg.update(_moe_config(meta, ctx, "qwen2moe", cfg["num_hidden_layers"], normalize=False))
    return cfg


def _mixtral_config(meta: Meta, ctx: ArchContext) -> dict[str, Any]:
    cfg = _common_config(meta, ctx, "llama")
    layers = cfg["num_hidden_layers"]
    moe = _moe_config(meta, ctx, "llama", layers, normalize=True)
    if moe["mlp_only_layers"]:
        raise GGUFImportError(
            f"{ctx.path}: Mixtral layers {moe['mlp_only_layers']} have no experts (no ffn_gate_inp router); "
            "Mixtral has no dense layers"
        )
    cfg.pop("attention_bias")  # Mixtral's config has no such field (and no biases)
    cfg.update(
        hidden_act="silu",
        num_local_experts=moe["num_experts"],
        num_experts_per_tok=moe["num_experts_per_tok"],
        intermediate_size=moe["moe_intermediate_size"],  # Mixtral's experts are its only MLPs
        sliding_window=None,  # llama.cpp keeps no sliding window for Mixtral
    )
    return cfg


GEMMA3_SLIDING_PATTERN = 6  # five sliding-window layers, then one global (llama.cpp hard-codes it)
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # base of the sliding layers' RoPE, not stored in GGUF


def _gemma3_config(meta: Meta, ctx: ArchContext) -> dict[str, Any]:
    cfg = _common_config(meta, ctx, "gemma3")
    r = _Reader(meta, "gemma3", ctx.path)
    layers = cfg["num_hidden_layers"]
    pattern = GEMMA3_SLIDING_PATTERN
    layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    # Queries are scaled by query_pre_attn_scalar**-0.5: head_dim for every Gemma 3 but the 27B
    # (62 layers), which uses hidden_size / heads -- the same rule llama.cpp applies.
    scalar = cfg["head_dim"] if layers != 62 else cfg["hidden_size"] // cfg["num_attention_heads"]
    full = dict(cfg["rope_parameters"])
    local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}
    cfg.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=scalar,
        sliding_window=int(r.get("attention.sliding_window", 4096)),
        sliding_window_pattern=pattern,
        layer_types=layer_types,
        rope_local_base_freq=GEMMA3_LOCAL_ROPE_THETA,
        rope_parameters={"full_attention": full, "sliding_attention": local},
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )
    cfg.pop("attention_bias")
    return cfg


_LLAMA = ArchSpec("llama", "LlamaForCausalLM", "llama", _LLAMA_BLOCK, _llama_config, unpermute_qk=True)

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.gguf_name: spec
    for spec in (
        _LLAMA,
        ArchSpec("qwen2", "Qwen2ForCausalLM", "qwen2", _LLAMA_BLOCK, _qwen2_config),
        ArchSpec("qwen3", "Qwen3ForCausalLM", "qwen3", {**_LLAMA_BLOCK, **_QK_NORM}, _qwen3_config),
        ArchSpec(
            "gemma3", "Gemma3ForCausalLM", "gemma3_text", _GEMMA3_BLOCK, _gemma3_config, norm_offset=1.0
        ),
        ArchSpec(
            "qwen3moe",
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            {**_LLAMA_BLOCK, **_QK_NORM, **_QWEN_MOE_BLOCK},
            _qwen3moe_config,
            expert_tensors=_QWEN_EXPERTS,
        ),
        ArchSpec(
            "qwen2moe",
            "Qwen2MoeForCausalLM",
            "qwen2_moe",
            {**_LLAMA_BLOCK, **_QWEN_MOE_BLOCK, **_QWEN2_SHARED_EXPERT},
            _qwen2moe_config,
            expert_tensors=_QWEN_EXPERTS,
            row_vectors=frozenset({"ffn_gate_inp_shexp"}),
        ),
    )
}

# A GGUF architecture whose files with ``<arch>.expert_count`` > 0 are another HF architecture:
# llama.cpp writes Mixtral as "llama".
MOE_VARIANTS: dict[str, ArchSpec] = {
    "llama": replace(
        _LLAMA,
        hf_architecture="MixtralForCausalLM",
        model_type="mixtral",
        block_tensors={**_LLAMA_BLOCK, **_MIXTRAL_MOE_BLOCK},
        build_config=_mixtral_config,
        expert_tensors=_MIXTRAL_EXPERTS,
    ),
}


def arch_spec(meta: Meta, path: str) -> ArchSpec:
    arch = meta.get("general.architecture")
    if arch is None:
        raise GGUFImportError(f"{path}: metadata general.architecture is missing")
    spec = ARCHITECTURES.get(str(arch))
    if str(arch) in MOE_VARIANTS and int(meta.get(f"{arch}.expert_count") or 0) > 0:
        spec = MOE_VARIANTS[str(arch)]
    if spec is None:
        raise GGUFImportError(
            f"{path}: architecture {arch!r} is not supported by the GGUF importer "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return spec


_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)")


_EXPERT_NAME = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down))(_exps|\.\d+)\.weight")


def expert_tensor(spec: ArchSpec, gguf_name: str) -> tuple[str, int | None] | None:
    """For an expert tensor, its HF name template (``{e}`` left to fill) and, for a per-expert
    2-D tensor of an old file, its expert index (None for a stacked 3-D one); None otherwise."""
    match = _EXPERT_NAME.fullmatch(gguf_name)
    if not match or f"{match.group(2)}_exps" not in spec.expert_tensors:
        return None
    layer, stem, suffix = match.groups()
    template = f"model.layers.{layer}.{spec.expert_tensors[stem + '_exps']}.weight"
    return template, (None if suffix == "_exps" else int(suffix[1:]))


def hf_tensor_name(spec: ArchSpec, gguf_name: str, path: str) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match and match.group(2) in spec.block_tensors:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{spec.block_tensors[part]}.{kind}"
    if gguf_name == "rope_freqs.weight":
        raise GGUFImportError(
            f"{path}: the file uses per-frequency RoPE factors (rope_freqs, Llama 3.1 style), "
            "which the importer cannot express as a Hugging Face config yet"
        )
    raise GGUFImportError(f"{path}: tensor {gguf_name!r} has no Hugging Face equivalent for {spec.gguf_name}")


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, GGUF rows alternate between the
    two halves HF keeps apart (GGUF row 2j is HF row j, row 2j+1 is HF row j + head_dim/2)."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFImportError(f"cannot unpermute {rows} rows into {n_heads} heads")
    half = rows // n_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def fix_tensor(spec: ArchSpec, gguf_name: str, weight: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
    """Apply the per-family fix-ups to one dequantized tensor (float32)."""
    if spec.unpermute_qk:
        if ".attn_q." in gguf_name:
            weight = unpermute_rows(weight, int(config["num_attention_heads"]))
        elif ".attn_k." in gguf_name:
            weight = unpermute_rows(weight, int(config["num_key_value_heads"]))
    if spec.norm_offset and gguf_name.endswith("norm.weight"):
        weight = weight - np.float32(spec.norm_offset)
    return weight


def needs_whole_tensor(spec: ArchSpec, gguf_name: str) -> bool:
    """Fix-ups that mix rows need the whole tensor; everything else can stream in row chunks."""
    return spec.unpermute_qk and (".attn_q." in gguf_name or ".attn_k." in gguf_name)
