"""``synthetic SHAPE -o DIR``: a random-weight EXL3 model written in the converter's layout."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.cli import main as cli_main
from engine.exl3 import EXL3Linear, load_quantization_config


def _tensors(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                out[key] = (tuple(t.shape), t.dtype)
    return out


def test_same_layout_as_the_reference_conversion(exl3_dir: Path, tmp_path: Path) -> None:
    """Written from the fixture model's own config at 4 bpw, MUL1, 6-bit head, the directory holds
    exactly the tensors (keys, shapes, dtypes) of ExLlamaV3's conversion of that model, and its
    quantization config agrees on what a loader reads."""
    out = tmp_path / "synth"
    assert cli_main(["synthetic", str(exl3_dir / "tiny-llama-hf" / "config.json"), "-o", str(out)]) == 0
    ref = exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1"
    assert _tensors(out) == _tensors(ref)
    ours, theirs = load_quantization_config(out), load_quantization_config(ref)
    assert (ours.bits, ours.head_bits, ours.codebook) == (theirs.bits, theirs.head_bits, theirs.codebook)
    assert set(ours.tensor_storage) == set(theirs.tensor_storage)
    for key, entry in theirs.tensor_storage.items():
        assert ours.tensor_storage[key].bits_per_weight == entry.bits_per_weight, key


def test_loads_runs_and_is_reproducible(exl3_dir: Path, tmp_path: Path, capsys) -> None:
    cfg = json.loads((exl3_dir / "tiny-llama-hf" / "config.json").read_text())
    cfg.update(tie_word_embeddings=True)
    shape = tmp_path / "tied.json"
    shape.write_text(json.dumps(cfg))
    args = ["synthetic", str(shape), "--bpw", "3", "--files-from", str(exl3_dir / "tiny-llama-hf")]
    assert cli_main([*args, "-o", str(tmp_path / "a")]) == 0
    assert "at 3 bpw" in capsys.readouterr().out
    assert cli_main([*args, "-o", str(tmp_path / "b")]) == 0
    digest = {d: hashlib.sha256((tmp_path / d / "model.safetensors").read_bytes()).hexdigest() for d in "ab"}
    assert digest["a"] == digest["b"]  # one seed, the same bytes
    assert (tmp_path / "a" / "tokenizer.json").is_file()  # --files-from

    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    model = load_model(tmp_path / "a", device="cpu", dtype=torch.float32)
    linears = [m for m in model.module.modules() if isinstance(m, EXL3Linear)]
    # the tied head: a 6-bit copy of the embedding, as the reference converter writes it
    assert len(linears) == 2 * 7 + 1 and sorted({m.bits for m in linears}) == [3, 6]
    assert model.module.lm_head.bits == 6  # the embedding is a separate (float) matrix
    assert model.module.lm_head.in_features == cfg["hidden_size"]
    logits = score_tokens(model.module, PagedKVCache.for_model(model.spec, 16, page_size=16), [1, 5, 9])
    assert logits.shape == (3, cfg["vocab_size"]) and torch.isfinite(logits).all()

    with pytest.raises(SystemExit, match="not empty"):
        cli_main([*args, "-o", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="whole number"):
        cli_main(["synthetic", str(shape), "--bpw", "2.5", "-o", str(tmp_path / "c")])
