"""How the user asks for a model to be spread over several GPUs, or over the GPU and system memory
(the load options)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelChoice:
    """``gpus``: ranks of a tensor-parallel load, one GPU each (1: one device); ``split_layers``:
    consecutive layers per GPU, e.g. ``"20,12"``, or ``"auto"`` by each GPU's free memory (empty:
    no layer split); ``experts_on``: ``"cpu"`` keeps a mixture of experts' routed experts in
    system memory, run by the CPU (``"device"``: with the rest); ``gpu_layers``: the first N
    layers on the GPU, the rest on the CPU (None: all on the device). The engine checks them
    against the model when it loads."""

    gpus: int = 1
    split_layers: str = ""
    experts_on: str = "device"
    gpu_layers: int | None = None

    @property
    def is_single(self) -> bool:
        """Whether this is the plain one-device load."""
        return (
            self.gpus <= 1
            and not self.split_layers.strip()
            and self.experts_on == "device"
            and self.gpu_layers is None
        )
