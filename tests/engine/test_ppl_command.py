"""``ppl`` with ``--reference``: KL divergence of a model from another on the same windows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.cli import main as cli_main

TEXT = Path(__file__).parents[1] / "data" / "public_domain.txt"


def _ppl(capsys, *argv: str) -> dict:
    assert cli_main(["ppl", *argv, "--device", "cpu", "--dtype", "float32", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT.read_text()[:3000])
    return path


def test_kl_against_the_source_model(exl3_dir: Path, text: Path, capsys) -> None:
    # The fixture's reference conversions of tiny-llama-hf, scored against it: fewer bits, further
    # from the source; the perplexity is the same figure ppl gives without a reference.
    src = exl3_dir / "tiny-llama-hf"
    common = ("--text-file", str(text), "--ctx", "128")
    q4 = _ppl(
        capsys, "-m", str(exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1"), "--reference", str(src), *common
    )
    q25 = _ppl(
        capsys, "-m", str(exl3_dir / "tiny-llama-exl3-2.5bpw-h4-mcg"), "--reference", str(src), *common
    )
    alone = _ppl(capsys, "-m", str(exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1"), *common)
    assert 0 < q4["mean_kl"] < q25["mean_kl"] < 0.05
    assert q25["top1_agree"] < q4["top1_agree"] <= 1.0
    assert q4["ppl"] == pytest.approx(alone["ppl"], rel=1e-6) and q4["tokens"] == alone["tokens"] > 500
    assert "mean_kl" not in alone
    # Against itself: no divergence at all.
    same = _ppl(capsys, "-m", str(src), "--reference", str(src), *common)
    assert abs(same["mean_kl"]) < 1e-7 and same["top1_agree"] == 1.0


def test_kl_of_a_quantized_cache(exl3_dir: Path, text: Path, capsys) -> None:
    # --cache-bits applies to the model, not the reference: the KL is the cache's own cost.
    src = str(exl3_dir / "tiny-llama-hf")
    common = ("-m", src, "--reference", src, "--text-file", str(text), "--ctx", "128")
    kl = {bits: _ppl(capsys, *common, "--cache-bits", bits)["mean_kl"] for bits in ("8", "3")}
    assert 0 < kl["8"] < kl["3"]


def test_reference_with_another_tokenizer_is_refused(exl3_dir: Path, text: Path, tmp_path: Path) -> None:
    # The same model with half its BPE merges dropped splits the text into other tokens.
    other = tmp_path / "other"
    shutil.copytree(exl3_dir / "tiny-llama-hf", other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["model"]["merges"] = tokenizer["model"]["merges"][: len(tokenizer["model"]["merges"]) // 2]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    argv = ["ppl", "-m", str(exl3_dir / "tiny-llama-hf"), "--reference", str(other), "--text-file", str(text)]
    with pytest.raises(SystemExit, match="tokenizes the text differently"):
        cli_main([*argv, "--device", "cpu"])


def test_reference_with_another_vocabulary_is_refused(exl3_dir: Path) -> None:
    import torch

    from engine.commands.ppl import score
    from engine.model import load_model

    model = load_model(exl3_dir / "tiny-llama-hf", device="cpu", dtype="float32")
    windows = [[1, 5, 9, 13]]
    wrong = [torch.zeros(3, 4096)]  # the model has 2048 tokens
    with pytest.raises(ValueError, match="same vocabulary"):
        score(model, windows, wrong)
