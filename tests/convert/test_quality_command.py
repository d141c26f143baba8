"""``quality``: GGUF round-trip rows and an EXL3 row, scored against the unquantized model, on a tiny
random Llama with a byte tokenizer (the SmolLM2 table itself is a command run, not a test)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from quant_helpers import cheap_encoder

import engine.convert.block_quantizer as block_quantizer
import engine.convert.pipeline as pipeline
import engine.convert.quantize as quantize_mod
from engine.bench import quality
from engine.cli import main as cli_main

TEXT = Path(__file__).parents[1] / "data" / "public_domain.txt"
pytest.importorskip("gguf")


def _byte_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    # One token per byte (ids in ByteLevel alphabet order), then BOS and EOS.
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _tiny_llama(directory: Path, tied: bool) -> Path:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the init's: a peaked, quantization-sensitive model
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    model.save_pretrained(directory, safe_serialization=True)
    _byte_tokenizer(directory)
    return directory


def test_quantized_tensor_names_follow_the_converter(tmp_path: Path) -> None:
    untied = _tiny_llama(tmp_path / "untied", tied=False)
    linears, head, tied = quality.quantized_tensor_names(untied)
    assert len(linears) == 14 and "model.layers.1.mlp.down_proj.weight" in linears
    assert (head, tied) == ("lm_head.weight", False)
    tied_dir = _tiny_llama(tmp_path / "tied", tied=True)
    _, head, tied = quality.quantized_tensor_names(tied_dir)
    assert (head, tied) == ("model.embed_tokens.weight", True)
    # With a tied head the embedding is the head, so a GGUF row quantizes it (untied: left alone).
    from engine.loading.safetensors_store import WeightStore

    info = quality.write_gguf_model(tied_dir, tmp_path / "q", "q4_0", "q4_0", lambda m: None)
    assert info["quantized"] == 15 and not info["skipped"]
    src, dst = WeightStore(tied_dir), WeightStore(tmp_path / "q")
    assert not torch.equal(src.get(head), dst.get(head))
    assert torch.equal(src.get("model.norm.weight"), dst.get("model.norm.weight"))
    assert dst.get(head).dtype == torch.float32
    assert (tmp_path / "q" / "tokenizer.json").is_file()


def test_gguf_bits_per_weight_include_block_scales() -> None:
    assert quality.gguf_bpw("q8_0") == 8.5
    assert quality.gguf_bpw("q4_0") == 4.5
    assert quality.gguf_bpw("q5_1") == 6.0


def test_gguf_round_trip_error_shrinks_with_bits() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    err = {t: float((quality.gguf_round_trip(w, t) - w).norm() / w.norm()) for t in ("q8_0", "q4_0")}
    assert 0 < err["q8_0"] < 0.01 < err["q4_0"] < 0.15
    assert quality.gguf_round_trip(torch.randn(4, 48), "q4_0") is None  # not whole blocks


def test_quality_table(tmp_path: Path, monkeypatch, capsys) -> None:
    # The EXL3 row's structure, fast: a greedy encoder and no scale search.
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    fast = partial(quantize_mod.quantize_weights, search_scale=False)
    monkeypatch.setattr(block_quantizer, "quantize_weights", fast)
    src = _tiny_llama(tmp_path / "tiny", tied=False)
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:400])
    out_json, out_md = tmp_path / "q.json", tmp_path / "q.md"
    argv = [
        "quality", "-m", str(src), "--text-file", str(text), "--ctx", "128", "--device", "cpu",
        "--dtype", "float32", "--bpw", "4", "--head-bits", "8", "--cal-rows", "2", "--cal-cols", "32",
        "--gguf", "q8_0,q4_0,q4_0:q4_0", "--gguf-head", "", "--work", str(tmp_path / "work"),
        "--json", str(out_json), "--markdown", str(out_md),
    ]  # fmt: skip
    assert cli_main(argv) == 0
    rows = {r["name"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert list(rows) == ["unquantized", "exl3 4.0", "gguf q8_0", "gguf q4_0", "gguf q4_0:q4_0"]
    base, q8, q4 = rows["unquantized"], rows["gguf q8_0"], rows["gguf q4_0"]
    # No BOS (the byte tokenizer adds none): 400 tokens = windows of 128, 128, 128, 16, each
    # scoring all but its first token.
    assert base["mean_kl"] < 1e-9 and base["top1_agree"] == 1.0 and base["tokens"] == 396
    assert 0 < q8["mean_kl"] < 1e-3 and abs(q8["ppl_delta_pct"]) < 1.0
    assert q4["mean_kl"] > 3 * q8["mean_kl"]
    # '' for --gguf-head: each row's own type; a T:H row sets it, so the last two are the same model.
    assert q4["head"] == "Q4_0" and q4["mean_kl"] == rows["gguf q4_0:q4_0"]["mean_kl"]
    assert q8["bpw"] == 8.5 and q4["bpw"] == 4.5
    exl3 = rows["exl3 4.0"]
    assert exl3["bpw"] == 4.0 and exl3["convert_s"] > 0 and exl3["head"] == "EXL3 8 bit"
    assert exl3["tokens"] == 396 and 0 < exl3["mean_kl"] < 5 and exl3["ppl"] > 1
    table = out_md.read_text()
    assert "| exl3 4.0 | 4.00 |" in table and "| gguf q8_0 | 8.50 |" in table
    assert "| unquantized |" in capsys.readouterr().out
    # A rerun takes every quantized row from rows.json: nothing is converted or quantized again.
    monkeypatch.setattr(quality, "convert_exl3", lambda *a: pytest.fail("converted again"))
    monkeypatch.setattr(quality, "write_gguf_model", lambda *a: pytest.fail("quantized again"))
    assert cli_main(argv) == 0
    assert json.loads(out_json.read_text())["rows"][3] == q4


def test_runs_without_the_gguf_package(tmp_path: Path, monkeypatch) -> None:
    import sys

    for name in ["gguf", *(m for m in sys.modules if m.startswith("gguf."))]:
        monkeypatch.setitem(sys.modules, name, None)  # import gguf(.x) -> ImportError
    src = _tiny_llama(tmp_path / "tiny", tied=True)
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:200])
    argv = ["--model", str(src), "--text-file", str(text), "--ctx", "64", "--device", "cpu", "--no-exl3"]
    argv += ["--work", str(tmp_path / "work"), "--json", str(tmp_path / "q.json")]
    with pytest.raises(SystemExit, match="gguf package"):
        quality.main(argv)  # the default GGUF rows
    assert quality.main([*argv, "--gguf", ""]) == 0
    (row,) = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert row["name"] == "unquantized"


def test_compare_scores_a_model_quantized_elsewhere(exl3_dir: Path, tmp_path: Path) -> None:
    # The fixture's ExLlamaV3 conversions of tiny-llama-hf, scored against it as found.
    src = exl3_dir / "tiny-llama-hf"
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:1500])
    out_json = tmp_path / "q.json"
    argv = ["-m", str(src), "--text-file", str(text), "--ctx", "128", "--device", "cpu", "--dtype", "float32"]
    argv += ["--no-exl3", "--gguf", "", "--work", str(tmp_path / "work"), "--json", str(out_json)]
    argv += ["--compare", f"{exl3_dir / 'tiny-llama-exl3-2.5bpw-h4-mcg'}=ref 2.5"]
    argv += ["--compare", str(exl3_dir / "tiny-llama-exl3-5.5bpw-h8-3inst")]
    assert quality.main(argv) == 0
    rows = {r["name"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert list(rows) == ["unquantized", "ref 2.5", "tiny-llama-exl3-5.5bpw-h8-3inst"]
    low, high = rows["ref 2.5"], rows["tiny-llama-exl3-5.5bpw-h8-3inst"]
    assert (low["bpw"], low["head"], low["kind"]) == (2.5, "EXL3 4 bit", "compare")
    assert (high["bpw"], high["head"]) == (5.5, "EXL3 8 bit")
    # More bits, closer to the source model (the fixture's 2.5 bpw: KL ~1e-3; 5.5 bpw: ~4e-5).
    assert 0 < high["mean_kl"] < low["mean_kl"] < 0.01
    assert low["tokens"] == rows["unquantized"]["tokens"] > 200
    with pytest.raises(SystemExit, match="no config.json"):
        quality.main([*argv, "--compare", str(tmp_path)])


def test_converter_options_reach_the_converter(tmp_path: Path, monkeypatch) -> None:
    # --seed, --damping and --no-refit are the converter's; the EXL3 row is converted with them.
    seen = {}

    def fake_convert(src, dst, options, resume, log):
        seen.update(seed=options.seed, damping=options.damping, refit=options.refit)
        seen.update(tune=(options.tune_steps, options.tune_target))
        raise SystemExit("stop after the options")

    monkeypatch.setattr(pipeline, "convert_model", fake_convert)
    src = _tiny_llama(tmp_path / "tiny", tied=True)
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:200])
    argv = ["-m", str(src), "--text-file", str(text), "--ctx", "64", "--device", "cpu", "--gguf", ""]
    argv += [
        "--bpw",
        "4",
        "--work",
        str(tmp_path / "work"),
        "--seeds",
        "3",
        "--damping",
        "0.02",
        "--no-refit",
    ]
    with pytest.raises(SystemExit, match="stop after the options"):
        quality.main([*argv, "--tune-steps", "7", "--tune-target", "model"])
    assert seen == {"seed": 3, "damping": 0.02, "refit": False, "tune": (7, "model")}
    with pytest.raises(SystemExit, match="--seeds takes whole numbers"):
        quality.main([*argv, "--seeds", "1,x"])


def test_several_seeds_give_a_mean_row(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    monkeypatch.setattr(
        block_quantizer, "quantize_weights", partial(quantize_mod.quantize_weights, search_scale=False)
    )
    src = _tiny_llama(tmp_path / "tiny", tied=True)
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:300])
    out_json = tmp_path / "q.json"
    argv = ["-m", str(src), "--text-file", str(text), "--ctx", "128", "--device", "cpu", "--dtype", "float32"]
    argv += ["--bpw", "3", "--head-bits", "16", "--cal-rows", "2", "--cal-cols", "32", "--gguf", ""]
    argv += ["--seeds", "2,0", "--work", str(tmp_path / "work"), "--json", str(out_json)]
    assert quality.main(argv) == 0
    rows = {r["name"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert list(rows) == ["unquantized", "exl3 3.0", "exl3 3.0 seed 2", "exl3 3.0 mean"]
    a, b, mean = rows["exl3 3.0"], rows["exl3 3.0 seed 2"], rows["exl3 3.0 mean"]
    assert a["mean_kl"] != b["mean_kl"]  # another seed, another conversion
    assert mean["kind"] == "exl3-mean" and mean["mean_kl"] == pytest.approx((a["mean_kl"] + b["mean_kl"]) / 2)
    assert mean["ppl"] == pytest.approx((a["ppl"] + b["ppl"]) / 2)
    assert "mean of 2 seeds" in mean["note"]
