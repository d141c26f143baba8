"""Loading a model directory: config -> architecture -> spec -> modules with weights."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.architectures import ModelSpec, architecture_for
from engine.config import ModelConfig
from engine.errors import UsageError
from engine.loading import int8
from engine.loading.builder import ModelBuilder
from engine.loading.safetensors_store import WeightStore
from engine.modules import host_experts
from engine.modules.decoder import CausalLM
from engine.options import EngineOptions

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | None) -> torch.device:
    """``auto`` picks CUDA where present, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on the CPU (the reference path: exact, and CPU bf16 matmuls are slow), else bf16."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


@dataclass
class LoadedModel:
    config: ModelConfig
    spec: ModelSpec
    module: CausalLM
    device: torch.device
    dtype: torch.dtype
    vision: Any = None  # engine.vision.base.VisionModel of a vision-language model, else None
    # What each layer of this process's cache keeps (a tensor-parallel rank: its own KV heads,
    # engine.parallel); None: what the spec declares.
    cache_states: list | None = None
    # Each layer's device where the layers are split across devices (engine.parallel.placement);
    # None: all on ``device``.
    layer_devices: list[torch.device] | None = None
    # Where the routed experts are where not on ``device`` (host memory: --experts-on cpu,
    # engine.modules.host_experts); None: with the rest.
    experts_device: torch.device | None = None

    @property
    def directory(self) -> Path:
        return self.config.directory

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


def load_model(
    directory: str | Path,
    device: str | None = "auto",
    dtype: str | torch.dtype | None = None,
    context: int | None = None,
    progress: Callable[[float, str], None] | None = None,
    exl3_mode: str | None = None,
    options: EngineOptions | None = None,
    make_builder: Callable[..., ModelBuilder] = ModelBuilder,
    experts_on: str = "device",
    layer_devices: Sequence[torch.device | str] | None = None,
) -> LoadedModel:
    """Load a Hugging Face model directory onto ``device``.

    ``context`` is the longest sequence the caller will run (it only matters for RoPE schemes
    that depend on it); it defaults to the model's own maximum. ``options``: the process's
    kernels follow them from now on (:meth:`EngineOptions.configure_kernels`; None leaves them as
    they are). ``make_builder``: the :class:`ModelBuilder` (class, or a factory taking its
    arguments) that builds the modules, e.g. a tensor-parallel rank's, which reads only its shard.
    ``experts_on``: ``"device"`` (default) or ``"cpu"``: the routed experts of its mixture-of-experts
    layers in host memory, computed on the CPU, the rest on ``device``
    (``engine.modules.host_experts``). ``layer_devices``: each decoder layer's device, for a
    layer split (:func:`engine.parallel.placement.load_split`); None: all on ``device``.
    """
    config = ModelConfig.from_dir(directory)
    if int8.is_int8_config(config.quantization):
        int8.check_config(config.quantization, str(config.directory / "config.json"))
    store = WeightStore(config.directory)
    if progress:
        progress(0.0, f"loading {config.architecture} from {config.directory.name}")
    return build_model(
        config,
        store,
        device,
        dtype,
        context,
        progress,
        exl3_mode,
        options,
        make_builder,
        experts_on,
        layer_devices,
    )


def build_model(
    config: ModelConfig,
    store: Any,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = None,
    context: int | None = None,
    progress: Callable[[float, str], None] | None = None,
    exl3_mode: str | None = None,
    options: EngineOptions | None = None,
    make_builder: Callable[..., ModelBuilder] = ModelBuilder,
    experts_on: str = "device",
    layer_devices: Sequence[torch.device | str] | None = None,
) -> LoadedModel:
    """Build a model from its config and a weight store (a :class:`WeightStore`, or anything that
    answers ``has``/``get`` the same way, e.g. ``engine.loading.synthetic_store``). ``options``,
    ``make_builder``, ``experts_on`` and ``layer_devices``: as for :func:`load_model`."""
    if options is not None:
        options.configure_kernels()  # before the builder asks whether the kernels are there
    arch = architecture_for(config.architecture)
    spec = arch.spec(config)
    host = host_experts.experts_device(experts_on)
    if host is not None and not has_routed_experts(spec):
        raise UsageError(f"--experts-on {experts_on}: {config.architecture} has no mixture-of-experts layers")
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    if isinstance(dtype, str):
        dtype = _DTYPES[dtype]
    dtype = dtype or default_dtype(dev)
    with torch.inference_mode():
        names = arch.tensor_names(store.has)
        builder = make_builder(
            spec, names, store, dtype, dev, context or spec.max_position_embeddings, exl3_mode
        )
        builder.place_experts(host)
        builder.place_layers(layer_devices)
        module = builder.build(progress)
        if host is not None:
            host_experts.keep_experts_on_host(module, host, pin=dev.type == "cuda")
        vision = arch.vision_model(config, store, dtype, dev)
    return LoadedModel(config, spec, module, dev, dtype, vision, experts_device=host)


def has_routed_experts(spec: ModelSpec) -> bool:
    """Whether any layer of ``spec`` has a mixture of experts (alone or beside a dense MLP)."""
    kinds = {"sparse_moe", "parallel_experts"}
    return any(layer.feed_forward is not None and layer.feed_forward.kind in kinds for layer in spec.layers)
