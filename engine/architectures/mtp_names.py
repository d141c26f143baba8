"""Where a family keeps its multi-token-prediction (MTP) layers, and how they combine their inputs.

An MTP layer predicts the token after next: at position ``p`` it reads the target's final hidden
state there (``h_p``, after the final norm, as the target hands it to its LM head) and the
embedding of the token that follows (``e_{p+1}``), and computes

    h' = block(proj(cat(norm_e(e_{p+1}), norm_h(h_p))))      (MiMo: cat(norm_h(h), norm_e(e)))
    logits = head(final_norm(h'))                             -> the token at p + 2

with ``block`` a decoder layer of the family's own kinds (attention or latent attention, dense MLP
or mixture of experts) and ``head`` the model's LM head unless the layer stores its own. Drafting
``k`` tokens chains it: the hidden state it hands on (``final_norm(h')``, or ``h'`` itself where
``hands_on_normed`` is off, as inference engines run DeepSeek's) takes the place of ``h`` at the
next position, with the embedding of the token it just drafted.

Every key is a template formatted with ``j``: the MTP layer's index in the checkpoint (its number
among the MTP layers, or after the main layers where ``after_main_layers``). Keys the MTP layers
share (Qwen3.5's one ``mtp.fc`` for all of them) simply do not use ``{j}``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MtpNames:
    block: str  # the decoder layer's prefix (its norms, mixer and feed-forward by the family's names)
    embed_norm: str
    hidden_norm: str
    projection: str
    final_norm: str
    head: str | None = None  # the layer's own LM head, where stored; else the model's
    hidden_first: bool = False  # the projection reads cat(hidden, embedding) (MiMo)
    hands_on_normed: bool = True
    after_main_layers: bool = False  # j counts on from num_hidden_layers (DeepSeek's layer 61)
    # Which main layer's kinds the MTP layer has: "last" layer, or the "last_attention" one (in a
    # hybrid the MTP layer is a full-attention layer with the family's feed-forward).
    like: str = "last"


# Qwen3-Next and Qwen3.5 (dense and MoE): mtp.layers.{i} full-attention decoder layers behind
# one shared projection; config mtp_num_hidden_layers.
QWEN3_NEXT_MTP = MtpNames(
    block="mtp.layers.{j}.",
    embed_norm="mtp.pre_fc_norm_embedding",
    hidden_norm="mtp.pre_fc_norm_hidden",
    projection="mtp.fc",
    final_norm="mtp.norm",
    like="last_attention",
)

# DeepSeek-V3 and GLM-4.5: layer num_hidden_layers + j is a whole MTP module (config
# num_nextn_predict_layers); its decoder layer's tensors sit beside enorm/hnorm/eh_proj/shared_head.
DEEPSEEK_MTP = MtpNames(
    block="model.layers.{j}.",
    embed_norm="model.layers.{j}.enorm",
    hidden_norm="model.layers.{j}.hnorm",
    projection="model.layers.{j}.eh_proj",
    final_norm="model.layers.{j}.shared_head.norm",
    head="model.layers.{j}.shared_head.head",
    hands_on_normed=False,
    after_main_layers=True,
)

# Xiaomi MiMo: model.mtp_layers.{j}, a Qwen2 decoder layer with its own input norms, projection
# (hidden state first) and final norm; the model's LM head.
MIMO_MTP = MtpNames(
    block="model.mtp_layers.{j}.",
    embed_norm="model.mtp_layers.{j}.token_layernorm",
    hidden_norm="model.mtp_layers.{j}.hidden_layernorm",
    projection="model.mtp_layers.{j}.input_proj",
    final_norm="model.mtp_layers.{j}.final_layernorm",
    hidden_first=True,
)


def declared_mtp_layers(config: dict) -> int:
    """How many MTP layers a model's config.json (its dict, or its ``text_config``) declares."""
    text = config.get("text_config") or config
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers", "num_mtp_layers"):
        value = text.get(key) or config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0
