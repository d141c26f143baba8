"""The shipped calibration text: enough distinct, UTF-8 text, all of it reaching calibration_ids."""

from pathlib import Path

import pytest

from engine.quant.convert import CALIBRATION_DIR, calibration_ids

EVAL_TEXT = Path(__file__).resolve().parents[1] / "data" / "public_domain.txt"


def _files() -> list[Path]:
    return sorted(CALIBRATION_DIR.glob("*.txt"))


def _shingles(text: str, n: int = 8) -> set[str]:
    words = text.split()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_calibration_files_are_utf8_and_large_enough() -> None:
    files = _files()
    assert len(files) >= 6  # several kinds of text, not one short sampler tiled hundreds of times
    total = sum(len(p.read_bytes().decode("utf-8")) for p in files)  # raises on invalid UTF-8
    assert total >= 60_000


def test_calibration_readme_lists_every_file() -> None:
    readme = (CALIBRATION_DIR / "README.md").read_text(encoding="utf-8")
    for p in _files():
        assert f"`{p.name}`" in readme


def test_calibration_text_does_not_overlap_the_evaluation_text() -> None:
    # Calibrating on the perplexity text would flatter the quality numbers.
    if not EVAL_TEXT.is_file():
        pytest.skip("no evaluation text in this checkout")
    cal = _shingles("\n".join(p.read_text(encoding="utf-8") for p in _files()))
    assert not cal & _shingles(EVAL_TEXT.read_text(encoding="utf-8"))


def test_calibration_ids_use_every_file(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    texts = [p.read_text(encoding="utf-8") for p in _files()]
    words = sorted({w for t in texts for w in t.split()})
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    n_words = sum(len(t.split()) for t in texts)
    # One text row as long as the whole corpus: it must hold every word of every file.
    ids = calibration_ids(tmp_path, rows=1, cols=n_words, vocab=len(vocab), random_fraction=0.0, seed=0)
    assert set(ids[0].tolist()) == set(range(1, len(vocab)))
