"""A chat session over a model spread across devices: tensor parallel ranks, a layer split (also
the first N layers on the GPU and the rest on the CPU) or routed experts in host memory.

What a front end (the app's worker) loads when the user asks for more than one GPU; unloading
the session ends the tensor-parallel run's other ranks, and after a failed run (a rank that
died) the model can be loaded again in the same process.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from engine.cache.state import RecurrentState
from engine.errors import UsageError
from engine.model import LoadedModel, load_model, resolve_device
from engine.options import EngineOptions
from engine.parallel.auto_loading import load_auto_split, report_to_stderr
from engine.parallel.auto_split import is_auto
from engine.parallel.gpu_layers import load_gpu_layers
from engine.parallel.launch import TensorParallelRun, start_tensor_parallel
from engine.parallel.placement import default_devices, load_split, model_layer_count, parse_split
from engine.session import ChatSession, Progress
from engine.tokenizer import Tokenizer


def without_recurrent_draft(model: LoadedModel, options: EngineOptions | None) -> EngineOptions | None:
    """``options`` with speculative decoding off where a tensor-parallel model has recurrent
    layers: a verify step's rollback restores recurrent state on rank 0 only."""
    recurrent = any(isinstance(state, RecurrentState) for state in model.cache_states or [])
    if options is not None and options.draft != "off" and recurrent:
        return replace(options, draft="off")
    return options


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
        chosen = [tensor_parallel > 1, bool(split), gpu_layers is not None, experts_on != "device"]
        if sum(chosen) > 1:
            raise UsageError(
                "a model is split across ranks, by layers, by GPU layers or by experts: one at a time"
            )
        tokenizer = Tokenizer.from_dir(model_dir)  # fail fast, before reading weights
        if progress:
            progress(0.0, "loading the model's parts")
        if tensor_parallel > 1:
            kind = device if device in ("auto", "cpu", "cuda") else "cuda"
            model, run, report = start_tensor_parallel(
                model_dir, tensor_parallel, kind, context=cache_tokens, options=options
            )
            for line in report.lines():
                print(f"trellis: tp {tensor_parallel}: {line}", file=sys.stderr)
            try:
                options = without_recurrent_draft(model, options)
                return cls(model, tokenizer, cache_tokens, cache_bits, options, run=run)
            except BaseException:
                run.close(abort=True)
                raise
        if gpu_layers is not None:
            if device == "cpu":
                raise UsageError("the first layers on the GPU need a GPU, and the device is the CPU")
            gpu = resolve_device(device) if device.startswith("cuda") else None
            model = load_gpu_layers(
                model_dir, gpu_layers, gpu, context=cache_tokens, options=options, progress=progress
            )
            return cls(model, tokenizer, cache_tokens, cache_bits, options)
        if is_auto(split):
            if device == "cpu":
                raise UsageError("splitting across GPUs automatically needs a GPU, and the device is the CPU")

            def report(line: str) -> None:
                report_to_stderr(line)
                if progress:
                    progress(0.0, line)

            model = load_auto_split(
                model_dir,
                context=cache_tokens,
                cache_bits=cache_bits,
                options=options,
                progress=progress,
                report=report,
            )
            return cls(model, tokenizer, cache_tokens, cache_bits, options)
        if split:
            counts = parse_split(split, model_layer_count(model_dir))
            parts = len(counts)
            devices = default_devices(parts) if device == "auto" else [resolve_device(device)] * parts
            model = load_split(
                model_dir, counts, devices, context=cache_tokens, options=options, progress=progress
            )
        else:
            home = default_devices(1)[0] if device == "auto" else resolve_device(device)
            model = load_model(
                model_dir, device=str(home), context=cache_tokens, options=options, experts_on=experts_on
            )
        return cls(model, tokenizer, cache_tokens, cache_bits, options)

    def unload(self) -> None:
        """Drop the model; end the other ranks (at once where the run failed)."""
        broken = getattr(self.model.module, "broken", None) if self.model is not None else None
        super().unload()
        if self.run is not None:
            self.run.close(abort=broken is not None or self.run.failure is not None)
            self.run = None
