"""The transformers peer's bytes per decode step: configs whose per-layer attributes refuse a
model-wide read (Gemma 4's in some transformers releases) still give an estimate."""

import torch
from torch import nn

from engine.bench.peer import peer_decode_bytes


class AmbiguousError(Exception):
    """Stands in for transformers' AmbiguousGlobalPerLayerAttributeError (not an AttributeError)."""


class _Config:
    hidden_size, num_attention_heads, num_hidden_layers = 64, 4, 2

    def __init__(self, refuse: bool):
        self.refuse = refuse

    def get_text_config(self):
        return self

    @property
    def head_dim(self):
        if self.refuse:
            raise AmbiguousError("'head_dim' is a per-layer attribute")
        return 32

    @property
    def num_key_value_heads(self):
        if self.refuse:
            raise AmbiguousError("'num_key_value_heads' is a per-layer attribute")
        return 2


class _Model(nn.Module):
    def __init__(self, refuse: bool):
        super().__init__()
        self.config = _Config(refuse)
        self.embed = nn.Embedding(10, 64, dtype=torch.bfloat16)
        self.proj = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)

    def get_input_embeddings(self):
        return self.embed


def test_per_layer_attributes_that_refuse_a_global_read_fall_back_to_the_model_wide_shape():
    plain = peer_decode_bytes(_Model(refuse=False), torch.bfloat16)
    refused = peer_decode_bytes(_Model(refuse=True), torch.bfloat16)
    # Fallbacks: head_dim = 64 // 4 = 16 (not 32), kv heads = 4 (not 2): the same KV bytes.
    assert refused == plain
    assert refused.kv_bytes_per_token == 2 * 4 * 16 * 2 * 2  # layers x kv heads x dim x (K, V) x bf16
