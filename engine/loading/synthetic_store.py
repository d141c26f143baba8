"""Random weights of a given model shape, already in EXL3 form, made on the target device.

For benchmarks: :func:`synthetic_model` builds a model of any shape (a Hugging Face config
dict, e.g. from ``engine.shapes``) through the real :class:`ModelBuilder` and architecture code,
but its :class:`SyntheticWeightStore` answers each request with a random tensor instead of
reading a file. Speed does not depend on the values, only on shapes and dtypes, so no
calibration and no download are needed, and an 8B model at 4 bits builds in seconds on a GPU.

What the store holds, per docs/EXL3_FORMAT.md section 3 (tensors):

- every decoder linear: ``trellis`` int16 ``(in/16, out/16, 16*K)`` with uniformly random
  codes, ``suh``/``svh`` fp16 random signs (``suh`` also carries ``1/sqrt(in)`` so activations
  keep their size from layer to layer, like the folded channel scales of a real model), and the
  codebook flag tensor;
- the head: EXL3 at ``head_bits``, also where the config ties it to the embedding: the reference
  converter then quantizes a copy of the embedding as ``lm_head`` (section 3.4), which is what a
  user downloads; with ``head_bits = 16`` (or ``None``) an untied head is fp16 and a tied one is
  the embedding matrix itself;
- embedding, norms: random floating point.

``bits=None`` gives dense weights instead (``P.weight``), for the unquantized baseline.

:func:`write_synthetic_model` writes such a model as an EXL3 directory in the reference layout
(``python -m engine synthetic``), so that another engine (ExLlamaV3) can be measured on the very
bytes ours reads.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.architectures import architecture_for
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.exl3.trellis import MAX_BITS, TILE
from engine.loading.safetensors_store import TensorIndex

HADAMARD = 128  # stored EXL3 dims are padded to multiples of this (section 3.3)
_FLAG_VALUES = {"mcg": -877912083, "mul1": -2082680531}  # section 3.1
CODEBOOKS = ("3inst", "mcg", "mul1")


def _pad(n: int) -> int:
    return -(-n // HADAMARD) * HADAMARD


def check_bits(bits: Iterable[float]) -> list[int]:
    """Whole bits per weight 1..8; a fractional value is refused (a real converter mixes K per
    tensor to reach it, which a random model would only imitate)."""
    out = []
    for b in bits:
        if float(b) != int(b) or not 1 <= int(b) <= MAX_BITS:
            raise ValueError(
                f"bits per weight must be a whole number 1..{MAX_BITS} for a synthetic model, got {b} "
                "(fractional rates mix K per tensor in a real conversion; pick the neighbouring integers)"
            )
        out.append(int(b))
    return out


class SyntheticWeightStore(TensorIndex):
    """Answers :class:`WeightStore`'s ``has``/``get`` with random tensors of the right shape."""

    def __init__(
        self,
        config: ModelConfig,
        bits: int | None,
        head_bits: int | None = 6,
        codebook: str = "mul1",
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        if codebook not in CODEBOOKS:
            raise ValueError(f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
        if bits is not None:
            check_bits([bits])
        self.directory = config.directory
        self.device, self.dtype, self.codebook = torch.device(device), dtype, codebook
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        arch = architecture_for(config.architecture)
        spec, names = arch.spec(config), arch.names
        # key -> what to make: ("dense", shape) | ("trellis", in, out, K) | ("suh", in) |
        # ("svh", out) | ("flag",) | ("norm", dim) | ("embed", shape)
        self._plan: dict[str, tuple] = {}

        def linear(key: str, n_in: int, n_out: int, bias: bool, k: int | None) -> None:
            if bias:
                self._plan[f"{key}.bias"] = ("norm", n_out)
            if k is None:
                self._plan[f"{key}.weight"] = ("dense", (n_out, n_in))
                return
            self._plan[f"{key}.trellis"] = ("trellis", n_in, n_out, k)
            self._plan[f"{key}.suh"] = ("suh", n_in)
            self._plan[f"{key}.svh"] = ("svh", n_out)
            if codebook != "3inst":
                self._plan[f"{key}.{codebook}"] = ("flag",)

        s, n = spec, names
        h = s.hidden_size
        self._plan[n.prefix + n.embed + ".weight"] = ("embed", (s.vocab_size, h))
        for key, shape, quantizable in layer_tensors(spec, names, split_fused=bits is not None):
            if len(shape) == 1:  # a norm's weight or a linear's bias
                self._plan[key] = ("norm", shape[0])
            elif quantizable:
                linear(key.rpartition(".")[0], shape[1], shape[0], False, bits)
            else:  # routers stay dense, as a converter leaves them
                self._plan[key] = ("dense", shape)
        self._plan[n.prefix + n.final_norm + ".weight"] = ("norm", h)
        if s.per_layer_inputs is not None:  # Gemma 4's per-layer inputs: the model's own tensors
            from engine.layers.per_layer_input import NAMES

            ple, packed = s.per_layer_inputs, s.num_layers * s.per_layer_inputs.width
            self._plan[f"{n.prefix}{NAMES.table}.weight"] = ("embed", (ple.vocab_size, packed))
            self._plan[f"{n.prefix}{NAMES.projection}.weight"] = ("dense", (packed, h))
            self._plan[f"{n.prefix}{NAMES.projection_norm}.weight"] = ("norm", ple.width)
        head_k = head_bits if bits is not None and head_bits is not None and head_bits < 16 else None
        if head_k is not None or not s.tie_word_embeddings:
            linear(n.lm_head, h, s.vocab_size, False, head_k)

    def _index(self) -> dict[str, tuple]:
        return self._plan

    def total_bytes(self) -> int:
        return 0  # nothing on disk

    def _make(self, key: str) -> torch.Tensor:
        kind, *a = self._plan[key]
        dev, g = self.device, self._gen
        if kind == "trellis":
            n_in, n_out, k = a
            shape = (_pad(n_in) // TILE, _pad(n_out) // TILE, TILE * k)
            return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=dev, generator=g)
        if kind in ("suh", "svh"):
            size = _pad(a[0])
            signs = torch.randint(0, 2, (size,), device=dev, generator=g).to(torch.float16) * 2 - 1
            if kind == "suh":
                signs *= 1.0 / math.sqrt(a[0])
            signs[a[0] :] = 0  # padded channels carry no weight (section 3.3)
            return signs
        if kind == "flag":
            return torch.tensor(_FLAG_VALUES[self.codebook], dtype=torch.int32, device=dev)
        if kind == "norm":
            return 1 + 0.1 * torch.rand(a[0], device=dev, dtype=self.dtype, generator=g)
        if kind == "dense":
            t = torch.empty(a[0], device=dev, dtype=self.dtype)
            return t.normal_(0.0, 1.0 / math.sqrt(a[0][1]), generator=g)
        t = torch.empty(a[0], device=dev, dtype=self.dtype)  # embed
        return t.normal_(0.0, 1.0, generator=g)

    def get(
        self,
        key: str,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shape: Iterable[int] | None = None,
    ) -> torch.Tensor:
        if key not in self._plan:
            raise ModelLoadError(f"tensor '{key}' is not part of the synthetic model")
        tensor = self._make(key)
        if shape is not None and list(tensor.shape) != list(shape):
            raise ModelLoadError(
                f"synthetic tensor '{key}' has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor if device is None else tensor.to(device)


class _Planner:
    """A store that answers the builder while the layers' tensors are listed: every bias the
    spec asks for is there and no other optional tensor is (so fused or split projections follow
    the architecture's names); each tensor asked for is recorded with its shape."""

    def __init__(self) -> None:
        self.asked: dict[str, tuple[int, ...]] = {}

    def has(self, key: str) -> bool:
        return key.endswith(".bias")

    def get(self, key: str, dtype=None, device=None, shape: Iterable[int] | None = None) -> torch.Tensor:
        self.asked[key] = tuple(shape)
        return torch.empty(self.asked[key], dtype=dtype, device="meta")


def layer_tensors(spec, names, split_fused: bool = False) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """``(key, shape, quantizable)`` of every tensor the layers of ``spec`` read, as their kinds
    build them (on the ``meta`` device); ``quantizable``: it belongs to a linear the layer lists
    as quantizable. ``split_fused``: a fused projection's tensors (Phi-3's ``qkv_proj``, GLM-4's
    ``gate_up_proj``) are listed apart under its outputs' names, as a converter stores them."""
    from engine.loading.builder import ModelBuilder

    planner = _Planner()
    builder = ModelBuilder(spec, names, planner, torch.float16, "meta", spec.max_position_embeddings)
    rope = builder.rotary()
    for i in range(spec.num_layers):
        block = builder.block(i, rope)
        quantizable = {site.get().key for site in block.quantizable_linears()}
        outputs = _fused_outputs(block) if split_fused else {}
        for key, shape in planner.asked.items():
            module, _, leaf = key.rpartition(".")
            for name, rows in outputs.get(module, [(module, shape[0])]):
                yield f"{name}.{leaf}", (rows, *shape[1:]), module in quantizable
        planner.asked.clear()


def _fused_outputs(block) -> dict[str, list[tuple[str, int]]]:
    """Per fused projection of ``block`` (one linear split into outputs stored apart once
    quantized), its outputs' keys and widths."""
    from engine.modules.linear import ProjectionGroup

    return {
        group.linears[0].key: list(zip(group.output_keys, group.splits[0], strict=True))
        for group in block.modules()
        if isinstance(group, ProjectionGroup) and group.output_keys is not None and len(group.linears) == 1
    }


def synthetic_config(
    hf_config: dict[str, Any], name: str, bits: int | None, head_bits: int | None, codebook: str
) -> ModelConfig:
    """A :class:`ModelConfig` for ``hf_config`` with the ``quantization_config`` a converter would
    write (section 2); ``bits=None``: an unquantized model."""
    raw = dict(hf_config)
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"synthetic shape '{name}' names no architecture ('architectures')")
    quant = None
    if bits is not None:
        quant = {
            "quant_method": "exl3",
            "version": "1.0.0",
            "bits": float(bits),
            "head_bits": 16 if head_bits is None else head_bits,
            "codebook": codebook,
        }
        raw["quantization_config"] = quant
    return ModelConfig(Path(f"<synthetic {name}>"), archs[0], raw, dict(raw), {}, quant)


def synthetic_model(
    hf_config: dict[str, Any],
    bits: int | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    head_bits: int | None = 6,
    codebook: str = "mul1",
    context: int | None = None,
    exl3_mode: str | None = None,
    name: str = "custom",
    seed: int = 0,
    experts_on: str = "device",
):
    """A :class:`LoadedModel` of shape ``hf_config`` with random EXL3 weights at ``bits`` (dense
    weights of ``dtype`` when ``bits`` is None), built by the normal builder on ``device``
    (``experts_on``: as for ``engine.model.load_model``)."""
    from engine.model import build_model, default_dtype

    dev = torch.device(device)
    dtype = dtype or default_dtype(dev)
    config = synthetic_config(hf_config, name, bits, head_bits, codebook)
    store = SyntheticWeightStore(config, bits, head_bits, codebook, dtype, dev, seed)
    return build_model(config, store, dev, dtype, context, exl3_mode=exl3_mode, experts_on=experts_on)


def write_synthetic_model(
    hf_config: dict[str, Any],
    bits: int,
    out_dir: str | Path,
    head_bits: int | None = 6,
    codebook: str = "mul1",
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
    name: str = "custom",
    seed: int = 0,
    files_from: str | Path | None = None,
) -> Path:
    """Write a random-weight EXL3 model of shape ``hf_config`` at ``bits`` to ``out_dir`` in the
    layout our converter writes (safetensors shards, config.json with ``quantization_config``,
    quantization_config.json with ``tensor_storage``). ``files_from``: a model directory whose
    other files (tokenizer, chat template) are copied along; ExLlamaV3 needs a tokenizer to load.
    Tensors are made on ``device`` in the store's plan order, so a seed gives the same bytes."""
    from engine.convert.output import write_output  # deferred: the converter imports this package

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    config = synthetic_config(hf_config, name, bits, head_bits, codebook)
    store = SyntheticWeightStore(config, bits, head_bits, codebook, dtype, device, seed)
    # One module per linear (its trellis, scales, flag and bias) or per plain tensor, in plan order.
    modules: dict[str, dict[str, torch.Tensor]] = {}
    bits_of: dict[str, int] = {}  # the linears' K, from their trellis
    for key, (kind, *args) in store._plan.items():
        module = key.rsplit(".", 1)[0]
        modules.setdefault(module, {})[key] = store.get(key).cpu()
        if kind == "trellis":
            bits_of[module] = args[2]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        if files_from is not None:
            for path in Path(files_from).iterdir():
                if path.is_file() and not path.name.endswith(".safetensors"):
                    shutil.copyfile(path, src / path.name)
        (src / "config.json").write_text(json.dumps(hf_config, indent=1))
        write_output(
            src,
            out,
            [(module, tensors, bits_of.get(module)) for module, tensors in modules.items()],
            config.quantization,
            codebook,
            shard_size_mb=8192,
        )
    return out
