"""The shipped calibration text: enough distinct, UTF-8 text, all of it reaching calibration_ids."""

from pathlib import Path

import pytest

from engine.convert.calibration_rows import CALIBRATION_DIR, calibration_ids

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
    assert total >= 1_500_000  # ~590k SmolLM2 tokens: 225 rows of 2,048 never repeat it


def test_calibration_readme_lists_every_file() -> None:
    for p in _files():
        readme = (p.parent / "README.md").read_text(encoding="utf-8")
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


def _word_tokenizer(directory: Path, words: list[str]) -> dict[str, int]:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(sorted(set(words)))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    return vocab


def test_own_calibration_text_replaces_the_shipped_one(tmp_path) -> None:
    words = [f"w{i}" for i in range(40)]
    vocab = _word_tokenizer(tmp_path, words)
    folder = tmp_path / "cal"
    folder.mkdir()
    (folder / "b.utf8").write_text(" ".join(words[20:]), encoding="utf-8")
    (folder / "a.txt").write_text(" ".join(words[:20]), encoding="utf-8")
    (folder / ".hidden").write_text("[UNK] [UNK]", encoding="utf-8")
    ids = calibration_ids(tmp_path, 1, 40, len(vocab), 0.0, 0, text_source=folder)
    # Every file of the folder, in name order (a.txt before b.utf8), hidden files skipped.
    assert ids[0].tolist() == [vocab[w] for w in words]
    one = calibration_ids(tmp_path, 1, 20, len(vocab), 0.0, 0, text_source=folder / "b.utf8")
    assert one[0].tolist() == [vocab[w] for w in words[20:]]


def test_long_calibration_text_is_sampled_over_its_whole_length(tmp_path) -> None:
    words = [f"w{i:05d}" for i in range(20_000)]
    vocab = _word_tokenizer(tmp_path, words)
    (tmp_path / "long.txt").write_text(" ".join(words), encoding="utf-8")
    ids = calibration_ids(tmp_path, 10, 16, len(vocab), 0.0, 0, text_source=tmp_path / "long.txt")
    starts = ids[:, 0].tolist()
    assert starts == sorted(starts) and len(set(starts)) == 10
    assert max(starts) > vocab["w16000"]  # the rows reach the end of the text, not only its start


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "does not exist"), (b"\xff\xfe bad", "is not UTF-8"), (b"  \n ", "is empty")],
)
def test_bad_calibration_text_is_named(tmp_path, content, message) -> None:
    from engine.convert.errors import ConvertError

    _word_tokenizer(tmp_path, ["a"])
    path = tmp_path / "cal.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConvertError, match=message) as err:
        calibration_ids(tmp_path, 1, 4, 2, 0.0, 0, text_source=path)
    assert "cal.txt" in str(err.value)


def test_cal_text_reaches_the_converter_options() -> None:
    import argparse

    from engine.commands.convert import add_quantizer_args, quantizer_options

    p = argparse.ArgumentParser()
    add_quantizer_args(p)
    assert quantizer_options(p.parse_args(["--cal-text", "/data/cal"]))["cal_text"] == "/data/cal"
    assert quantizer_options(p.parse_args([]))["cal_text"] == ""


def test_the_default_text_is_cal_text_on_a_folder_of_the_same_files(tmp_path) -> None:
    # The thirteenth session measured the current default through --cal-text on a folder of these
    # files (docs/PERFORMANCE.md); those figures are the default's only while both read the same text.
    import shutil

    from engine.convert.calibration_rows import calibration_text

    for p in _files():
        shutil.copy(p, tmp_path / p.name)
    assert calibration_text(tmp_path) == calibration_text()
    (tmp_path / "zz_extra.txt").write_text("one more file", encoding="utf-8")
    assert calibration_text(tmp_path) == calibration_text() + "\n\none more file"
