"""The converter's output: sharded like the reference layout (a module's tensors never straddle
two shards, an index names every tensor's shard), and written a shard at a time, reading the
finished blocks' tensors from the work folder only for the shard being written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from quant_helpers import cheap_encoder
from safetensors.torch import load_file

import engine.convert.quantize as quantize_mod
from engine.convert.checkpoints import WORK_DIR
from engine.convert.options import ConvertOptions
from engine.convert.pipeline import convert_model
from engine.loading.safetensors_store import WeightStore


def _convert(src: Path, dst: Path, **options) -> None:
    """A quick 4-bit CPU conversion; ``options`` are further ConvertOptions fields."""
    options = ConvertOptions(bits=4.0, cal_rows=2, cal_cols=32, device="cpu", allocation="uniform", **options)
    convert_model(src, dst, options, log=lambda m: None)


@pytest.mark.slow
def test_a_sharded_output_holds_the_same_tensors_written_a_shard_at_a_time(
    exl3_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    src = exl3_dir / "tiny-llama-hf"
    _convert(src, tmp_path / "one", shard_size_mb=8192)
    whole = load_file(str(tmp_path / "one" / "model.safetensors"))

    events: list[tuple[str, object]] = []
    real_get, real_save = WeightStore.get, st.save_file

    def get(self, key, *args, **kwargs):
        if self.directory.name == WORK_DIR:  # the finished blocks, not the source
            events.append(("load", key))
        return real_get(self, key, *args, **kwargs)

    def save(tensors, path, *args, **kwargs):
        events.append(("save", (set(tensors), Path(path).parent)))
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(WeightStore, "get", get)
    monkeypatch.setattr(st, "save_file", save)
    _convert(src, tmp_path / "sharded", shard_size_mb=1)  # 1 MiB shards: the ~2 MB output takes several

    out = tmp_path / "sharded"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and not (out / "model.safetensors").exists()
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = load_file(str(shard))
        assert {index["weight_map"][k] for k in tensors} == {shard.name}
        # A module's tensors are all in one shard (trellis, suh, svh, ... of one linear).
        merged |= tensors
    assert merged.keys() == whole.keys() == index["weight_map"].keys()
    for key, tensor in whole.items():
        assert torch.equal(merged[key], tensor), key
    for shard in shards:
        modules = {k.rsplit(".", 1)[0] for k in load_file(str(shard))}
        others = [s for s in shards if s != shard]
        assert not any(k.rsplit(".", 1)[0] in modules for s in others for k in load_file(str(s)))
    # Every block tensor is read from the work files just before the shard that holds it is saved.
    pending: set[str] = set()
    saves = 0
    for kind, what in events:
        if kind == "load":
            pending.add(what)
        elif what[1] == out:  # a shard of the output (not a finished block's work file)
            assert pending <= what[0], f"read before its shard: {sorted(pending - what[0])[:3]}"
            pending.clear()
            saves += 1
    assert saves == len(shards) and not pending
    loaded = [what for kind, what in events if kind == "load"]
    block_linears = {k for k in whole if ".layers." in k and "_proj." in k}
    assert len(loaded) == len(set(loaded)) and set(loaded) == block_linears  # each read once, late
    # And the sharded model loads and scores as the single-file one.
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens
    from engine.model import load_model

    logits = []
    for d in ("one", "sharded"):
        model = load_model(tmp_path / d, device="cpu", dtype=torch.float32)
        logits.append(
            score_tokens(model.module, PagedKVCache.for_model(model.spec, 16, page_size=16), [1, 5, 9])
        )
    assert torch.equal(*logits)


def test_a_store_of_given_files_holds_only_them_and_describes_each_tensor(
    exl3_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    src = load_file(str(exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1" / "model.safetensors"))
    layer0 = {k: v for k, v in src.items() if k.startswith("model.layers.0.")}
    save_file(layer0, str(tmp_path / "block_0000.safetensors"))
    save_file({"other": torch.zeros(3)}, str(tmp_path / "not_listed.safetensors"))
    store = WeightStore(tmp_path, [tmp_path / "block_0000.safetensors"])
    assert store.keys() == set(layer0)  # only the files given
    for key, tensor in layer0.items():
        meta = store.meta(key)
        assert meta.is_meta and meta.shape == tensor.shape and meta.dtype == tensor.dtype, key
        assert torch.equal(store.get(key), tensor)


def test_a_tied_half_precision_head_kept_at_16_bits_is_saved_as_its_own_copy(
    tmp_path: Path, monkeypatch
) -> None:
    """A tied bf16 model with ``head_bits=16``: the head is the embedding's own tensor, which
    safetensors would refuse to save under two names; it is written as an equal copy."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from tiny_models import build_tiny_model

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    hf = build_tiny_model("Gemma2ForCausalLM", tmp_path / "src", dtype=torch.bfloat16)
    assert hf.config.tie_word_embeddings
    # no tokenizer: random calibration rows
    _convert(tmp_path / "src", tmp_path / "out", head_bits=16, random_rows_fraction=1.0)
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    embed = out["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16 and torch.equal(out["lm_head.weight"], embed)
