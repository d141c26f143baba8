"""Model folders whose safetensors file lists tensors of any size in its header but is sparse
on disk: memory estimates and placement choices for models of gigabytes, taking no disk."""

from __future__ import annotations

import json
import struct
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


def sparse_model(target: Path, tensors: dict[str, int], architecture: str, model_type: str) -> Path:
    """A model folder whose safetensors header lists ``tensors`` (name: bytes of BF16); the file
    is sparse, so its gigabytes take no disk."""
    target.mkdir(parents=True)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "max_position_embeddings": 2048,
    }
    (target / "config.json").write_text(json.dumps(config))
    (target / "tokenizer.json").write_text("{}")
    header, offset = {}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [size // 2], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(target / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    return target


def big_moe(models: Path) -> Path:
    """A Qwen3-MoE of 4 layers (100 MiB of attention, 1 GiB of experts each), in ``models``."""
    tensors = {"model.embed_tokens.weight": 200 * MIB}
    for i in range(4):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = 100 * MIB
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = GIB
    return sparse_model(models / "big-moe", tensors, "Qwen3MoeForCausalLM", "qwen3_moe")


def big_dense(models: Path) -> Path:
    """A Llama of 4 layers of 1 GiB (BF16), in ``models``."""
    tensors = {"model.embed_tokens.weight": 200 * MIB}
    tensors |= {f"model.layers.{i}.mlp.up_proj.weight": GIB for i in range(4)}
    return sparse_model(models / "big-dense", tensors, "LlamaForCausalLM", "llama")


def uneven_moe(models: Path) -> Path:
    """A Qwen3-MoE of 4 layers laid out as DeepSeek-V3 and GLM-4.5 are: a dense first layer
    (100 MiB of attention, a 300 MiB MLP), then three of 100 MiB of attention and 3 GiB of
    experts; beside them a vision tower's layer and an MTP layer kept after the main ones, which
    belong to no decoder layer."""
    tensors = {"model.embed_tokens.weight": 200 * MIB, "lm_head.weight": 200 * MIB}
    tensors["model.vision_tower.encoder.layers.0.mlp.fc1.weight"] = 50 * MIB
    tensors["model.layers.4.mlp.experts.gate_up_proj"] = GIB  # MTP: after num_hidden_layers
    for i in range(4):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = 100 * MIB
    tensors["model.layers.0.mlp.up_proj.weight"] = 300 * MIB
    for i in range(1, 4):
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = 3 * GIB
    return sparse_model(models / "uneven-moe", tensors, "Qwen3MoeForCausalLM", "qwen3_moe")
