"""engine.inspect: describing model folders from config.json and safetensors headers only."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from engine.inspect import (
    MemoryVerdict,
    inspect_model,
    likely_device,
    memory_verdict,
    read_safetensors_header,
    system_memory,
)

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 2048,
}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], truncate: int = 0) -> None:
    """A valid safetensors file with zero-filled data (the inspector never reads the data)."""
    sizes = {"F16": 2, "BF16": 2, "F32": 4, "I16": 2, "I32": 4}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    data = struct.pack("<Q", len(blob)) + blob + b"\0" * offset
    path.write_bytes(data[: len(data) - truncate] if truncate else data)


def make_model(root: Path, config: dict | None = LLAMA_CONFIG, shards: int = 1) -> Path:
    root.mkdir(parents=True)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text("{}")
    tensors = {
        "model.embed_tokens.weight": ("BF16", [100, 64]),
        "model.layers.0.mlp.up_proj.weight": ("BF16", [128, 64]),
        "model.norm.weight": ("F32", [64]),
    }
    if shards == 1:
        write_safetensors(root / "model.safetensors", tensors)
    else:
        names = list(tensors)
        weight_map = {}
        for i, name in enumerate(names):
            shard = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
            write_safetensors(root / shard, {name: tensors[name]})
            weight_map[name] = shard
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def test_good_model_is_described(tmp_path: Path) -> None:
    info = inspect_model(make_model(tmp_path / "good"))
    assert info.ok, info.problems
    assert info.architecture == "LlamaForCausalLM"
    assert info.parameter_count == 100 * 64 + 128 * 64 + 64
    assert info.quantization == "BF16" and info.bits_per_weight == 16
    assert info.context_length == 2048
    assert info.head_dim == 16 and info.num_kv_heads == 2
    assert info.size_bytes == sum(p.stat().st_size for p in (tmp_path / "good").iterdir())
    # KV cache: 2 (k, v) x layers x kv heads x head dim x tokens x 2 bytes.
    assert info.kv_cache_bytes(1000) == 2 * 2 * 2 * 16 * 1000 * 2
    assert info.memory_needed(8192) > info.memory_needed(1024) > info.weight_bytes
    # The CPU path computes in fp32: 4 bytes per parameter and per cached value (bf16 file: 2).
    extra = (info.parameter_count * 4 - info.weight_bytes) + info.kv_cache_bytes(1000)
    assert abs(info.memory_needed(1000, "cpu") - info.memory_needed(1000, "cuda") - extra * 1.1) <= 1


def test_sharded_model_with_missing_shard_says_which(tmp_path: Path) -> None:
    root = make_model(tmp_path / "sharded", shards=3)
    assert inspect_model(root).ok
    (root / "model-00002-of-00003.safetensors").unlink()
    info = inspect_model(root)
    assert not info.ok
    assert any("missing shard model-00002-of-00003.safetensors" in p for p in info.problems)


@pytest.mark.parametrize(
    "breakage, expected",
    [
        ("no_config", "config.json is missing"),
        ("bad_json", "config.json is unreadable"),
        ("unknown_arch", "architecture MambaForCausalLM is not supported"),
        ("truncated", "model.safetensors is corrupt"),
        ("garbage_header", "model.safetensors is corrupt"),
        ("gguf_only", "GGUF file: import it first"),
        ("other_quant", "quantization method 'gptq' is not supported"),
    ],
)
def test_bad_models_say_why(tmp_path: Path, breakage: str, expected: str) -> None:
    root = tmp_path / breakage
    if breakage == "gguf_only":
        root.mkdir()
        (root / "model.gguf").write_bytes(b"GGUF\0\0\0\0")
    elif breakage == "no_config":
        make_model(root, config=None)
    elif breakage == "unknown_arch":
        make_model(root, config=dict(LLAMA_CONFIG, architectures=["MambaForCausalLM"]))
    elif breakage == "other_quant":
        make_model(root, config=dict(LLAMA_CONFIG, quantization_config={"quant_method": "gptq"}))
    else:
        make_model(root)
        if breakage == "bad_json":
            (root / "config.json").write_text("{not json")
        elif breakage == "truncated":
            data = (root / "model.safetensors").read_bytes()
            (root / "model.safetensors").write_bytes(data[:-100])
        elif breakage == "garbage_header":
            (root / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"{broken!!}" + b"\0" * 64)
    info = inspect_model(root)
    assert not info.ok
    assert any(expected in p for p in info.problems), info.problems


def test_not_a_folder(tmp_path: Path) -> None:
    assert "is not a folder" in inspect_model(tmp_path / "nope").problems[0]


def test_header_length_beyond_file_is_rejected_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ValueError, match="does not fit"):
        read_safetensors_header(path)


def test_inspect_never_imports_torch(tmp_path: Path) -> None:
    import subprocess

    code = (
        "import sys; from engine.inspect import inspect_model; "
        f"inspect_model({str(make_model(tmp_path / 'm'))!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_exl3_fixture_reports_bpw_and_logical_parameter_count(exl3_dir: Path) -> None:
    dense = inspect_model(exl3_dir / "tiny-llama-hf")
    quant = inspect_model(exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1")
    assert quant.ok and dense.ok
    assert quant.quantization == "EXL3 4.0 bpw" and quant.bits_per_weight == 4.0
    # Trellis shapes decode to the same logical weight matrices as the dense model.
    assert quant.parameter_count == dense.parameter_count
    assert quant.weight_bytes < dense.weight_bytes
    assert quant.memory_needed(512, "cpu") < dense.memory_needed(512, "cpu")  # EXL3 stays packed


def test_memory_verdicts() -> None:
    available, total = system_memory()
    assert total > 0 and 0 < available <= total
    assert MemoryVerdict(10, 100, 200).verdict == "fits"
    assert MemoryVerdict(150, 100, 200).verdict == "tight"
    assert MemoryVerdict(250, 100, 200).verdict == "too big"


def test_memory_verdict_for_a_model(tmp_path: Path) -> None:
    info = inspect_model(make_model(tmp_path / "m"))
    v = memory_verdict(info, 1024)
    assert v.needed_bytes == info.memory_needed(1024)
    assert v.verdict in {"fits", "tight", "too big"}


def test_likely_device_honours_an_explicit_setting() -> None:
    assert likely_device("cpu") == "cpu" and likely_device("cuda") == "cuda"
    assert likely_device("auto") in ("cpu", "cuda")
