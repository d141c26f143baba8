"""How the user asks for a model to be spread over several GPUs (the load options)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelChoice:
    """``gpus``: ranks of a tensor-parallel load, one GPU each (1: one device); ``split_layers``:
    consecutive layers per GPU, e.g. ``"20,12"`` (empty: no layer split). The engine checks the
    counts against the model when it loads."""

    gpus: int = 1
    split_layers: str = ""

    @property
    def is_single(self) -> bool:
        """Whether this is the plain one-device load."""
        return self.gpus <= 1 and not self.split_layers.strip()
