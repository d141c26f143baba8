"""``bench --synthetic``: random-weight EXL3 models of a shape, their roofline, the peer (CPU)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from synthetic_shapes import tiny_llama_shape, tiny_moe_shape

from engine.bench import speed as bench
from engine.bench.roofline import DecodeBytes, kv_bytes_per_token, module_decode_bytes
from engine.exl3 import EXL3Linear
from engine.loading.synthetic_store import SyntheticWeightStore, check_bits, synthetic_config, synthetic_model

# Tiny Llama: intermediate 200 and 2 KV heads of 32 make padded EXL3 dims (256, 128).
TINY = tiny_llama_shape(intermediate_size=200)
TINY_QWEN3_TIED = {
    **TINY,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "tie_word_embeddings": True,
}
FIGURES = ("decode_tokens_per_s", "decode_ctx_tokens_per_s", "prefill_tokens_per_s")
ROOFLINE = (
    "weight_bytes",
    "kv_bytes_per_token",
    "decode_bytes_per_step",
    "decode_roofline_tokens_per_s",
    "decode_roofline_pct",
    "decode_ctx_bytes_per_step",
    "decode_ctx_roofline_tokens_per_s",
    "decode_ctx_roofline_pct",
)
SMALL_RUN = ["--prompt", "24", "--context", "24", "--decode-tokens", "3", "--repeats", "1"]


@pytest.fixture
def tiny_json(tmp_path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def test_store_writes_exl3_tensors_of_the_format(tmp_path):
    """Shapes/dtypes as a converter writes them (docs/EXL3_FORMAT.md 3.1): padded trellis, fp16 scales."""
    store = SyntheticWeightStore(synthetic_config(TINY, "tiny", 3, 6, "mul1"), 3, head_bits=6)
    key = "model.layers.0.mlp.gate_proj"
    trellis = store.get(f"{key}.trellis")
    assert trellis.dtype == torch.int16 and tuple(trellis.shape) == (128 // 16, 256 // 16, 16 * 3)
    suh, svh = store.get(f"{key}.suh"), store.get(f"{key}.svh")
    assert suh.dtype == svh.dtype == torch.float16 and suh.shape == (128,) and svh.shape == (256,)
    assert set(svh[:200].abs().tolist()) == {1.0} and not svh[200:].any()  # signs; padding zero
    assert torch.allclose(suh.abs().float(), torch.full((128,), 128**-0.5), rtol=1e-3)
    assert store.get(f"{key}.mul1").item() == -2082680531 and not store.has(f"{key}.mcg")
    head = store.get("lm_head.trellis")
    assert tuple(head.shape) == (8, 384 // 16, 16 * 6)  # vocab 320 padded to 384, head_bits 6
    assert not store.has("lm_head.weight") and not store.has(f"{key}.weight")
    # Tied embeddings: the head is an EXL3 copy of the embedding, as the reference converter
    # writes it (section 3.4); at head_bits 16 there are no head tensors (the model reuses the
    # embedding matrix).
    tied = SyntheticWeightStore(synthetic_config(TINY_QWEN3_TIED, "t", 4, 6, "3inst"), 4)
    assert tuple(tied.get("lm_head.trellis").shape) == (8, 384 // 16, 16 * 6)
    assert not tied.has("lm_head.weight") and tied.has("model.layers.1.self_attn.q_norm.weight")
    config16 = synthetic_config(TINY_QWEN3_TIED, "t", 4, 16, "3inst")
    assert config16.quantization["head_bits"] == 16
    assert not SyntheticWeightStore(config16, 4, head_bits=16).has_prefix("lm_head")
    assert not tied.has("model.layers.0.mlp.up_proj.mcg")  # 3INST has no flag tensor
    dense = SyntheticWeightStore(synthetic_config(TINY, "tiny", None, 6, "mul1"), None)
    assert dense.get("lm_head.weight", shape=[320, 128]).dtype == torch.float16


def test_fractional_or_out_of_range_bits_are_refused():
    assert check_bits([1, 4.0, 8]) == [1, 4, 8]
    for bad in (2.5, 0, 9):
        with pytest.raises(ValueError, match="whole number 1..8"):
            check_bits([bad])
    with pytest.raises(SystemExit, match="--bpw"):
        bench.parse_bpw("2,2.5")


def test_roofline_matches_a_hand_count():
    model = synthetic_model(TINY, 3, "cpu", torch.float32, head_bits=6, exl3_mode="streaming")
    linears = [m for m in model.module.modules() if isinstance(m, EXL3Linear)]
    assert len(linears) == 2 * 7 + 1 and {m.bits for m in linears} == {3, 6}

    def exl3(p_in: int, p_out: int, k: int) -> int:  # trellis + suh + svh (fp16); the flag is not kept
        return p_in * p_out * k // 8 + 2 * (p_in + p_out)

    # padded (in, out): q 128x128, k/v 128x128 (64 padded), o 128x128, gate/up 128x256, down 256x128
    layer = 4 * exl3(128, 128, 3) + 2 * exl3(128, 256, 3) + exl3(256, 128, 3) + 2 * 128 * 4
    hand_weights = 2 * layer + 128 * 4 + exl3(128, 384, 6) + 16 * 4  # + final norm, head, inv_freq
    kvb = kv_bytes_per_token(2, 2, 32)  # fp16 cache: 2 layers * (K + V) * 2 heads * 32 * 2 bytes
    assert kvb == 2 * 2 * 2 * 32 * 2
    db = module_decode_bytes(model.module, model.module.embedding.weight, kvb)
    assert db == DecodeBytes(hand_weights, 128 * 4, kvb)
    # batch 2 at context 100: weights once, per sequence one embedding row and 100 positions of KV
    step = hand_weights + 2 * (128 * 4 + 100 * kvb)
    assert db.per_step(100, 2) == step
    assert db.roofline_tokens_per_s(1e9, 100, 2) == pytest.approx(2 * 1e9 / step)


def test_roofline_counts_a_mixtures_routed_experts_at_one_tokens_share():
    model = synthetic_model(tiny_moe_shape(), 3, "cpu", torch.float32, head_bits=6, exl3_mode="streaming")
    everything = sum(
        t.numel() * t.element_size() for t in (*model.module.parameters(), *model.module.buffers())
    )
    moes = [block.feed_forward for block in model.module.blocks]
    routed = sum(
        t.numel() * t.element_size()
        for moe in moes
        for e in moe.experts
        for t in (*e.parameters(), *e.buffers())
    )
    db = module_decode_bytes(model.module, model.module.embedding.weight, 0)
    emb = model.module.embedding.weight
    # 2 of 8 experts per token; the embedding table contributes rows only
    assert db.weight_bytes == everything - emb.numel() * 4 - routed + routed * 2 // 8


def test_tied_head_counts_the_embedding_once_in_full():
    model = synthetic_model(TINY_QWEN3_TIED, None, "cpu", torch.float32)
    emb = model.module.embedding.weight
    assert model.module.lm_head.weight.data_ptr() == emb.data_ptr()
    db = module_decode_bytes(model.module, emb, 0)
    params = sum(t.numel() * 4 for t in {p.data_ptr(): p for p in model.module.parameters()}.values())
    buffers = sum(b.numel() * b.element_size() for b in model.module.buffers())
    assert db.weight_bytes == params + buffers and db.weight_bytes > 320 * 128 * 4


def test_synthetic_bench_end_to_end_without_peer(tiny_json, tmp_path, capsys):
    out = tmp_path / "b.json"
    args = ["--synthetic", str(tiny_json), "--bpw", "2,4", "--fp16", "--no-peer", "--json", str(out)]
    assert bench.main([*args, "--device", "cpu", *SMALL_RUN]) == 0
    r = json.loads(out.read_text())
    assert [row["label"] for row in r["rows"]] == ["2 bpw", "4 bpw", "float32"]
    assert [row["bits"] for row in r["rows"]] == [2, 4, None]
    assert r["rows"][0]["exl3_mode"] == "dense" and r["rows"][2]["exl3_mode"] is None
    assert r["copy_bandwidth_GBps"] > 0 and r["batch"] == 1 and r["context"] == 24
    for row in r["rows"]:
        for key in FIGURES + ROOFLINE:
            assert row[key] > 0, key
        # the roofline figures are the stored bytes over the stored bandwidth
        roof = r["copy_bandwidth_GBps"] * 1e9 / row["decode_ctx_bytes_per_step"]
        assert row["decode_ctx_roofline_tokens_per_s"] == pytest.approx(roof)
        assert row["decode_ctx_roofline_pct"] == pytest.approx(100 * row["decode_ctx_tokens_per_s"] / roof)
        assert row["decode_ctx_bytes_per_step"] == pytest.approx(
            row["weight_bytes"] + row["embed_row_bytes"] + (24 + 1.5) * row["kv_bytes_per_token"]
        )
    assert "transformers" not in r
    assert r["chained_launches"] is False  # a CPU run: no extension, nothing chained
    assert r["int8_gemv"] is False
    printed = capsys.readouterr().out
    assert "2 bpw" in printed and "chained launches off" in printed and "int8 GEMV off" in printed


def test_bench_needs_exactly_one_model_source(tiny_json):
    with pytest.raises(SystemExit):
        bench.main(["--no-peer", "--device", "cpu"])
    with pytest.raises(SystemExit, match="unknown model shape"):
        bench.main(["--synthetic", "no-such-shape", "--no-peer", "--device", "cpu"])


def _layer_index(key: str) -> int:
    return int(key.split(".layers.")[1].split(".")[0])


def test_named_shapes_build_their_stores():
    from engine.shapes import SHAPES

    for name, cfg in SHAPES.items():
        store = SyntheticWeightStore(synthetic_config(cfg, name, 4, 6, "mul1"), 4)
        k = cfg["num_key_value_heads"] * (
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        )
        # The first attention layer's keys (a hybrid's layer 0 may be recurrent).
        first = min((key for key in store.keys() if key.endswith(".k_proj.trellis")), key=_layer_index)
        trellis = store.get(first)
        padded = -(-cfg["hidden_size"] // 128) * 128  # gpt-oss's 2880 is stored as 2944
        assert tuple(trellis.shape) == (padded // 16, k // 16, 64)
        assert store.has("lm_head.trellis")  # tied or not (a tied head is a quantized copy)


def test_peer_on_a_tiny_shape(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "qwen3.json"
    path.write_text(json.dumps(TINY_QWEN3_TIED))
    out = tmp_path / "p.json"
    assert (
        bench.main(
            ["--synthetic", str(path), "--bpw", "3", "--json", str(out), "--device", "cpu", *SMALL_RUN]
        )
        == 0
    )
    r = json.loads(out.read_text())
    peer = r["transformers"]
    for key in FIGURES + ROOFLINE:
        assert peer[key] > 0, key
    assert peer["compiled"] is False  # transformers compiles only on accelerators
    vs = r["rows"][0]["vs_transformers"]
    assert vs["decode_tokens_per_s"] == pytest.approx(
        r["rows"][0]["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
    )
    # the peer's tied bf16/fp32 weights: same parameter count as our dense model of the shape
    assert peer["weight_bytes"] > 0 and peer["kv_bytes_per_token"] == kv_bytes_per_token(2, 2, 32, (32, 32))


def test_bench_imports_without_the_app_dependencies(monkeypatch):
    """The GPU machine lacks gguf/platformdirs/httpx: the modules must import without them.

    Our modules are imported afresh with those three names blocked (torch and transformers stay
    loaded, so this is quick); afterwards ``sys.modules`` is exactly as before.
    """
    ours = {m: mod for m, mod in sys.modules.items() if m == "engine" or m.startswith("engine.")}
    for name in ("gguf", "platformdirs", "httpx"):
        monkeypatch.setitem(sys.modules, name, None)  # importing a None entry raises ImportError
    try:
        for name in ours:
            del sys.modules[name]
        for name in (
            "engine.bench.speed",
            "engine.bench.peer",
            "engine.generation.generator",
            "engine.loading.synthetic_store",
        ):
            importlib.import_module(name)
    finally:
        for name in [m for m in sys.modules if m == "engine" or m.startswith("engine.")]:
            del sys.modules[name]
        sys.modules.update(ours)


def test_checkpoint_bench_reports_the_same_fields(tiny_model_factory, tmp_path):
    """``-m DIR`` (a real checkpoint) goes through the same measurement and roofline code."""
    directory, _ = tiny_model_factory("LlamaForCausalLM")
    out = tmp_path / "m.json"
    assert (
        bench.main(["-m", str(directory), "--no-peer", "--json", str(out), "--device", "cpu", *SMALL_RUN])
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["label"] == "model"
    for key in FIGURES + ROOFLINE:
        assert row[key] > 0, key


def test_sampled_decode_figure(tiny_json, tmp_path, capsys):
    out = tmp_path / "b.json"
    args = ["--synthetic", str(tiny_json), "--bpw", "4", "--no-peer", "--sampled", "--json", str(out)]
    assert bench.main([*args, "--device", "cpu", *SMALL_RUN]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["decode_sampled_tokens_per_s"] > 0
    assert "'balanced' sampling" in capsys.readouterr().out
