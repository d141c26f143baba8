"""A chat session over a model spread across devices: tensor parallel ranks, a layer split (also
the first N layers on the GPU and the rest on the CPU) or routed experts in host memory.

What a front end (the app's worker) loads when the user asks for more than one GPU; unloading
the session ends the tensor-parallel run's other ranks, and after a failed run (a rank that
died) the model can be loaded again in the same process.
"""

from __future__ import annotations

from pathlib import Path

from engine.options import EngineOptions
from engine.parallel.launch import TensorParallelRun
from engine.parallel.placement_choice import PlacementChoice, load_placed
from engine.session import ChatSession, Progress
from engine.tokenizer import Tokenizer


class ParallelChatSession(ChatSession):
    """A :class:`ChatSession` whose model is split across devices; ``run``: the tensor-parallel
    run it owns (None for a layer split)."""

    def __init__(self, *args, run: TensorParallelRun | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.run = run

    @classmethod
    def load_parallel(
        cls,
        model_dir: str | Path,
        tensor_parallel: int = 1,
        split: str | None = None,
        device: str = "auto",
        progress: Progress | None = None,
        cache_tokens: int | None = None,
        cache_bits: tuple[int, int] = (16, 16),
        options: EngineOptions | None = None,
        experts_on: str = "device",
        gpu_layers: int | None = None,
    ) -> ParallelChatSession:
        """Load ``model_dir`` over ``tensor_parallel`` ranks (one GPU each, or the CPU), with
        ``split`` layers per device (``"20,12"``; ``"auto"``: by each GPU's free memory,
        ``engine.parallel.auto_split``), with its first ``gpu_layers`` layers on the GPU and the
        rest on the CPU (``engine.parallel.gpu_layers``), or on one device with its routed experts
        in host memory (``experts_on="cpu"``); one of these at a time."""
        choice = PlacementChoice(  # refused here, before anything is read, where it cannot load
            tensor_parallel=tensor_parallel,
            split_layers=split or None,
            gpu_layers=gpu_layers,
            experts_on=experts_on,
            device=device,
        )
        tokenizer = Tokenizer.from_dir(model_dir)  # fail fast, before reading weights
        if progress:
            progress(0.0, "loading the model's parts")
        placed = load_placed(
            model_dir,
            choice,
            context=cache_tokens,
            cache_bits=cache_bits,
            options=options,
            progress=progress,
        )
        try:
            return cls(placed.model, tokenizer, cache_tokens, cache_bits, placed.options, run=placed.run)
        except BaseException:
            if placed.run is not None:
                placed.run.close(abort=True)
            raise

    def unload(self) -> None:
        """Drop the model; end the other ranks (at once where the run failed)."""
        broken = getattr(self.model.module, "broken", None) if self.model is not None else None
        super().unload()
        if self.run is not None:
            self.run.close(abort=broken is not None or self.run.failure is not None)
            self.run = None
