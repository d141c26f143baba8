"""The output directory, in the reference layout (docs/EXL3_FORMAT.md sections 1-2), so that
ExLlamaV3 and our loader read it alike: safetensors shard(s) with the modules in module order
(embedding; per layer its norms and linears; final norm; head), ``config.json`` with the
``quantization_config``, ``quantization_config.json`` with ``tensor_storage``, and the source's
other files (tokenizer, chat template, ...) copied."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import engine
from engine.convert.options import ConvertOptions
from engine.exl3.codebooks import FLAG_VALUES, MCG, MUL1

if TYPE_CHECKING:
    from engine.convert.source_model import SourceModel

# One module of the output: its key, its stored tensors by full name, and its bits (None: a
# module kept unquantized).
OutputModule = tuple[str, dict[str, torch.Tensor], int | None]

# Files never copied from the source directory (section 1).
_SKIP_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pth", ".pt")
_SKIP_NAMES = ("config.json", "model.safetensors.index.json", "quantization_config.json")


def fp16_copy(t: torch.Tensor) -> torch.Tensor:
    """Unquantized tensors keep bf16/fp16; fp32 becomes fp16 (section 3.4)."""
    return t.to(torch.float16) if t.dtype == torch.float32 else t


def output_modules(
    source: SourceModel,
    quantized: Mapping[str, torch.Tensor],
    head: dict[str, torch.Tensor],
    head_bits: int,
) -> list[OutputModule]:
    """Every module of the output in module order: embed, per layer (norms and linears), final
    norm, head, then anything else the source holds that belongs to no quantized linear (e.g.
    extra norms). ``quantized``: the blocks' stored tensors by name (placeholders allowed, see
    :func:`write_output`); ``head``: the head's. Unquantized tensors are read from the source
    and copied in fp16 (:func:`fp16_copy`)."""
    store, names = source.store, source.names
    all_slots = [s for slots in source.slots for s in slots]
    slot_of = {s.key: s for s in all_slots}
    outputs: list[OutputModule] = []
    copied: set[str] = set()

    def plain(key: str) -> None:
        if store.has(key) and key not in copied:
            copied.add(key)
            outputs.append((key.rsplit(".", 1)[0], {key: fp16_copy(store.get(key))}, None))

    def unquantized(name: str) -> None:
        """A module that stays unquantized (a norm, a router: its weight and bias), or a tensor a
        module keeps as stored (then in one entry with its module's other such tensors)."""
        stored = [name] if store.has(name) else [f"{name}.weight", f"{name}.bias"]
        keys = [k for k in stored if store.has(k) and k not in copied]
        if not keys:
            return
        copied.update(keys)
        module = name if keys[0] != name else name.rsplit(".", 1)[0]
        tensors = {k: fp16_copy(store.get(k)) for k in keys}
        if outputs and outputs[-1][0] == module and outputs[-1][2] is None:
            outputs[-1][1].update(tensors)
        else:
            outputs.append((module, tensors, None))

    plain(names.prefix + names.embed + ".weight")
    for keys in source.layouts:
        for key in keys:
            if key in slot_of:
                prefix = key + "."
                linear = {k: v for k, v in quantized.items() if k.startswith(prefix)}
                outputs.append((key, linear, slot_of[key].bits))
            else:
                unquantized(key)
    plain(names.prefix + names.final_norm + ".weight")
    outputs.append((names.lm_head, head, None if head_bits == 16 else head_bits))
    # What the blocks were built from is not copied again (fused source projections are stored
    # split, quantized), nor are the quantized linears' and the head's source tensors.
    claimed = {f"{s.key}.{suffix}" for s in all_slots for suffix in ("weight", "bias")}
    claimed |= {f"{names.lm_head}.{suffix}" for suffix in ("weight", "bias")}
    claimed |= source.block_keys
    for key in sorted(store.keys()):
        if key not in claimed and key not in copied and not key.endswith("rotary_emb.inv_freq"):
            plain(key)
    return outputs


def quantization_config(options: ConvertOptions, bits: float) -> dict:
    """The ``quantization_config`` of the output (section 2); ``bits``: the achieved bits per
    weight."""
    return {
        "quant_method": "exl3",
        "version": engine.__version__,
        "bits": bits,
        "head_bits": options.head_bits,
        "calibration": {"rows": options.cal_rows, "cols": options.cal_cols},
        "out_scales": "always" if options.out_scales else "never",
        "codebook": options.codebook,
        "converter": "trellis-chat",
    }


def _module_entry(tensors: dict[str, torch.Tensor], bits: int | None, codebook: str | None) -> dict:
    entry: dict = {
        "stored_tensors": {
            name: {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
            for name, t in tensors.items()
        }
    }
    if bits is not None:
        entry["quant_format"] = "exl3"
        entry["bits_per_weight"] = bits
        if codebook == MUL1:
            entry["mul1_multiplier"] = FLAG_VALUES[MUL1] + (1 << 32)
        elif codebook == MCG:
            entry["mcg_multiplier"] = FLAG_VALUES[MCG] + (1 << 32)
    return entry


def write_output(
    src: Path,
    dst: Path,
    modules: list[OutputModule],
    quant_config: dict,
    codebook: str,
    shard_size_mb: int,
    load: Callable[[str], torch.Tensor] | None = None,
) -> None:
    """Write safetensors shard(s), config.json, quantization_config.json and copied files.
    Tensors on the ``meta`` device are placeholders: ``load(key)`` reads each when its shard is
    written, so at most one shard's worth of them is in memory."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    limit = shard_size_mb * 1024 * 1024
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for _, tensors, _ in modules:  # a module's tensors never straddle shards (section 1)
        n = sum(t.numel() * t.element_size() for t in tensors.values())
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1].update(tensors)
        size += n

    def save(shard: dict[str, torch.Tensor], name: str) -> None:
        real = {k: (load(k) if v.is_meta else v).contiguous().cpu() for k, v in shard.items()}
        save_file(real, str(dst / name))

    if len(shards) == 1:
        save(shards[0], "model.safetensors")
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save(shard, name)
            for k, t in shard.items():
                weight_map[k] = name
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    original = config.get("quantization_config")
    qc = dict(quant_config)
    if original and original.get("quant_method") != "exl3":
        qc["original_quantization_config"] = original
    if "tied_word_embeddings" in config:
        config["tied_word_embeddings"] = True  # section 1, reproduced as the reference does
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=4))
    storage = {key: _module_entry(t, bits, codebook if bits else None) for key, t, bits in modules}
    (dst / "quantization_config.json").write_text(json.dumps({**qc, "tensor_storage": storage}, indent=4))
    for path in src.iterdir():
        if path.is_file() and path.name not in _SKIP_NAMES and not path.name.endswith(_SKIP_SUFFIXES):
            shutil.copyfile(path, dst / path.name)


__all__ = ["OutputModule", "fp16_copy", "output_modules", "quantization_config", "write_output"]
