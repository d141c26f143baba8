"""Multimodal RoPE (Qwen2-VL, Wang et al., 2024): each token has three positions - temporal,
height, width - and each slice of the rotary frequencies turns with one of them.

Text tokens carry the same position three times, so for text this is ordinary RoPE; an image's
tokens share one temporal position and take their row and column as height and width.
``mrope_section`` says how many frequency pairs follow each axis: as contiguous blocks
(Qwen2/2.5-VL) or interleaved ``t h w t h w ...`` over the first ``3 * section`` pairs with the
rest temporal (Qwen3-VL).
"""

from __future__ import annotations

import torch

from engine.modules.rope import RopeSpec, RotaryEmbedding


class MultimodalRotaryEmbedding(RotaryEmbedding):
    multimodal = True  # BatchLayout hands it [3, tokens] positions when a step has them

    def __init__(self, spec: RopeSpec, head_dim: int, context: int) -> None:
        super().__init__(spec, head_dim, context)
        self.sections = [int(s) for s in spec.params["mrope_section"]]
        self.interleaved = bool(spec.params.get("mrope_interleaved", False))
        if sum(self.sections) != self.rotary_dim // 2:
            raise ValueError(
                f"mrope_section {self.sections} does not cover {self.rotary_dim // 2} frequency pairs"
            )

    def axis_of_pair(self) -> torch.Tensor:
        """For each frequency pair, the position axis (0 t, 1 h, 2 w) that turns it."""
        if self.interleaved:
            axis = torch.zeros(sum(self.sections), dtype=torch.long)
            for dim in (1, 2):
                axis[dim : self.sections[dim] * 3 : 3] = dim
            return axis
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(self.sections)])

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[tokens, 1, rotary_dim]`` for ``[3, tokens]`` (or plain ``[tokens]``) positions."""
        if positions.dim() == 1:
            return super().tables(positions, dtype)
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [3, tokens, pairs]
        axis = self.axis_of_pair().to(positions.device)
        freqs = freqs.gather(0, axis.expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_factor).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_factor).to(dtype)[:, None, :]
        return cos, sin
