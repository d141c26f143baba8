"""What a prompt's images add to its token sequence, in the form forward steps consume.

:class:`PromptMedia` travels with a generation job. Each forward step covers positions
``start .. end - 1`` of a sequence and asks for its slice: which of those rows take image
embeddings instead of token embeddings, the multimodal RoPE positions of those rows, and which
spans attend bidirectionally. It also names the image rows for prefix caching, so cached pages
only match where the same images sit at the same places.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.modules.splice import InputSplice


@dataclass
class ImageFeatures:
    """One image after its vision tower and projector: ``embeddings`` ``[tokens, hidden]`` of the
    language model, plus ``deepstack`` rows added after the first decoder layers (Qwen3-VL)."""

    embeddings: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ImagePlacement:
    """Where one image's features go: the sequence positions of its placeholder tokens (in
    order; not always contiguous, Pixtral puts row-break tokens between rows)."""

    positions: torch.Tensor  # [tokens] long
    features: ImageFeatures
    key: str  # content hash: names these rows in page keys


@dataclass
class PromptMedia:
    """The images of one prompt of ``length`` tokens.

    ``rope_positions`` ``[3, length]`` are multimodal RoPE positions (temporal, height, width) for
    families that use them; positions after the prompt are ``index + rope_delta`` on all three.
    ``bidirectional``: tokens of one image attend to each other regardless of order (Gemma 3).
    """

    length: int
    images: list[ImagePlacement]
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    bidirectional: bool = False

    def splice(self, start: int, end: int, row: int) -> InputSplice:
        """The image rows among positions ``start .. end - 1``, as rows of a flat batch in which
        position ``start`` is row ``row``."""
        rows, values, deep = [], [], []
        for image in self.images:
            inside = (image.positions >= start) & (image.positions < end)
            if not bool(inside.any()):
                continue
            rows.append(image.positions[inside] - start + row)
            values.append(image.features.embeddings[inside])
            deep.append([d[inside] for d in image.features.deepstack])
        if not rows:
            empty = torch.empty(0, dtype=torch.long)
            return InputSplice(empty, torch.empty(0))
        depth = len(deep[0])
        return InputSplice(
            torch.cat(rows), torch.cat(values), [torch.cat([d[i] for d in deep]) for i in range(depth)]
        )

    def positions(self, start: int, end: int) -> torch.Tensor | None:
        """M-RoPE positions ``[3, end - start]`` of positions ``start .. end - 1`` (None when the
        family uses plain positions)."""
        if self.rope_positions is None:
            return None
        inside = self.rope_positions[:, start : min(end, self.length)]
        beyond = torch.arange(max(start, self.length), max(end, self.length)) + self.rope_delta
        return torch.cat([inside, beyond.expand(3, -1)], dim=1)

    def bidirectional_spans(self) -> list[tuple[int, int]]:
        """Position ranges ``[start, end)`` whose tokens see each other (runs of one image's rows)."""
        if not self.bidirectional:
            return []
        spans = []
        for image in self.images:
            pos = image.positions.tolist()
            run_start = prev = pos[0]
            for p in pos[1:]:
                if p != prev + 1:
                    spans.append((run_start, prev + 1))
                    run_start = p
                prev = p
            spans.append((run_start, prev + 1))
        return spans

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk from ``start`` wanting to stop at ``end`` may stop: never inside a
        bidirectional span (its first tokens must see its last ones). Moves back to the span's
        start when that leaves a non-empty chunk, else forward to its end."""
        for lo, hi in self.bidirectional_spans():
            if lo < end < hi:
                return lo if lo > start else hi
        return end

    def key_tokens(self, tokens: Sequence[int]) -> list[int | str]:
        """``tokens`` with every image row replaced by its image's content hash, for page keys."""
        keyed: list[int | str] = list(tokens)
        for image in self.images:
            for p in image.positions.tolist():
                if p < len(keyed):
                    keyed[p] = f"image:{image.key}"
        return keyed
