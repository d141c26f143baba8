"""A multi-token-prediction (MTP) layer: from the target's final hidden state at a position and
the embedding of the token after it, the hidden state that predicts the token after that
(``engine.architectures.mtp_names`` has the maths and each family's layout).

It runs over its own cache (the layer's attention sees the MTP inputs of earlier positions), in
steps laid out like any other (``BatchLayout``), so a drafter can feed many positions of many
sequences at once.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.modules.batch import BatchLayout
from engine.modules.decoder import DecoderBlock


class MtpHead(nn.Module):
    """``embed_norm`` / ``hidden_norm``: the two inputs' norms; ``projection``: ``2 * hidden ->
    hidden`` over their concatenation (embedding first, or the hidden state first where
    ``hidden_first``); ``block``: the decoder layer; ``final_norm`` before ``head`` (an LM head,
    the model's own where the layer stores none). ``hands_on_normed``: the hidden state a chained
    step reads is the normed one (else the block's output as it is)."""

    def __init__(
        self,
        embed_norm: nn.Module,
        hidden_norm: nn.Module,
        projection: nn.Module,
        block: DecoderBlock,
        final_norm: nn.Module,
        head: nn.Module,
        hidden_first: bool = False,
        hands_on_normed: bool = True,
    ) -> None:
        super().__init__()
        self.embed_norm, self.hidden_norm, self.projection = embed_norm, hidden_norm, projection
        self.block, self.final_norm, self.head = block, final_norm, head
        self.hidden_first, self.hands_on_normed = hidden_first, hands_on_normed

    @property
    def state(self):
        """What the layer keeps per sequence (its attention's pages)."""
        return self.block.state

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, batch: BatchLayout, cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, handed_on)`` for rows ``[tokens, hidden]`` of next-token ``embeds`` and the
        hidden states before them: ``normed`` is what :meth:`logits` reads, ``handed_on`` what
        a chained step takes as its hidden state."""
        e, h = self.embed_norm(embeds), self.hidden_norm(hidden)
        x = self.projection(torch.cat([h, e] if self.hidden_first else [e, h], dim=-1))
        out = self.block(x, batch, cache)
        normed = self.final_norm(out)
        return normed, normed if self.hands_on_normed else out

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head(normed).float()
