"""Xiaomi MiMo (MiMoForCausalLM): Qwen2's decoder as it is, q/k/v biases included. Its checkpoints
also hold multi-token-prediction layers (``model.mtp_layers.{j}.*``, ``num_nextn_predict_layers``
of them), which predict a token further ahead: the main model never reads them; the MTP drafter
does (``--draft mtp``, ``engine.architectures.mtp_names``), and a conversion copies them
unquantized."""

from engine.architectures.mtp_names import MIMO_MTP
from engine.architectures.qwen2 import Qwen2


class MiMo(Qwen2):
    hf_names = ("MiMoForCausalLM",)
    mtp = MIMO_MTP
