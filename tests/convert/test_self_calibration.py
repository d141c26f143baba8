"""Calibration rows the model writes itself (engine.convert.self_calibration) and their use in convert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quant_helpers import cheap_encoder

import engine.convert.quantize as quantize_mod
import engine.convert.self_calibration as selfcal
from engine.convert.errors import ConvertError
from engine.convert.options import ConvertOptions
from engine.convert.pipeline import convert_model


@pytest.fixture(scope="module")
def tiny(exl3_dir: Path):
    from engine.model import load_model

    return load_model(exl3_dir / "tiny-llama-hf", device="cpu", dtype=torch.float32)


def _text_ids(n: int = 400) -> torch.Tensor:
    return torch.arange(n) % 1000 + 7


def test_rows_are_snippets_of_the_text_continued_by_the_model(tiny, monkeypatch) -> None:
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens

    monkeypatch.setattr(selfcal, "TEMPERATURE", 0.0)  # greedy: the continuation is checkable
    text = _text_ids()
    rows = selfcal.generate_rows(tiny, text, rows=2, cols=48, seed=1, segment=24, log=lambda m: None)
    assert rows.shape == (2, 48) and rows.dtype == torch.long
    cache = PagedKVCache.for_model(tiny.spec, 64, page_size=16)
    snippet = selfcal.SNIPPET_TOKENS
    for segment in rows.reshape(4, 24):
        head = segment[:snippet].tolist()
        # The snippet is a run of the calibration text ...
        assert any(text[s : s + snippet].tolist() == head for s in range(len(text) - snippet + 1))
        # ... and every later token is the model's own choice after what precedes it.
        logits = score_tokens(tiny.module, cache, segment[:-1].tolist())
        assert torch.equal(logits[snippet - 1 :].argmax(-1), segment[snippet:])


def test_rows_depend_on_the_seed_only(tiny) -> None:
    text = _text_ids()
    a = selfcal.generate_rows(tiny, text, rows=2, cols=40, seed=3, segment=20, log=lambda m: None)
    b = selfcal.generate_rows(tiny, text, rows=2, cols=40, seed=3, segment=20, log=lambda m: None)
    c = selfcal.generate_rows(tiny, text, rows=2, cols=40, seed=4, segment=20, log=lambda m: None)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_resume_reads_the_saved_rows(tiny, tmp_path: Path, monkeypatch) -> None:
    text = _text_ids()
    first = selfcal.load_or_generate_rows(tmp_path, lambda: tiny, text, 2, 40, seed=5, log=lambda m: None)
    assert (tmp_path / selfcal.ROWS_FILE).is_file()

    def must_not_run(*args, **kwargs):
        raise AssertionError("a resume generated the rows again (or loaded the model for it)")

    monkeypatch.setattr(selfcal, "generate_rows", must_not_run)
    again = selfcal.load_or_generate_rows(tmp_path, must_not_run, text, 2, 40, 5, log=print)
    assert torch.equal(again, first)


def test_convert_calibrates_on_model_written_rows(exl3_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    seen: list[torch.Tensor] = []
    real = selfcal.generate_rows

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(selfcal, "generate_rows", spy)
    options = ConvertOptions(
        bits=2.5, head_bits=4, codebook="mcg", cal_rows=4, cal_cols=32, device="cpu", generated_rows=0.5
    )
    logs: list[str] = []
    report = convert_model(exl3_dir / "tiny-llama-hf", tmp_path / "out", options, log=logs.append)
    # 4 rows: 1 random, 3 text rows of which round(1.5) = 2 written by the model.
    assert len(seen) == 1 and seen[0].shape == (2, 32)
    assert any("4 rows x 32 tokens (2 model-written)" in line for line in logs)
    assert len(report.blocks) == 2 and not (tmp_path / "out" / ".exl3_work").exists()


def test_job_key_keeps_old_jobs_resumable() -> None:
    plain = ConvertOptions(bits=4.0).job_key()
    assert "cal_text" not in plain and "generated_rows" not in plain
    assert ConvertOptions(bits=4.0, generated_rows=0.5).job_key()["generated_rows"] == 0.5
    assert ConvertOptions(bits=4.0, cal_text="/data").job_key()["cal_text"] == "/data"


def test_a_share_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ConvertError, match="generated_rows: .*generated rows must be within 0..1, got 1.5"):
        ConvertOptions(bits=4.0, generated_rows=1.5, device="cpu")


def test_the_writing_reports_progress_to_the_end(tiny) -> None:
    seen: list[tuple[float, str]] = []
    report = lambda fraction, message: seen.append((fraction, message))  # noqa: E731
    selfcal.generate_rows(tiny, _text_ids(), 3, 40, seed=2, segment=20, log=lambda m: None, progress=report)
    fractions = [f for f, _ in seen]
    assert fractions[0] == 0.0 and fractions[-1] == 1.0 and fractions == sorted(fractions)
    assert seen[-1][1].startswith("calibration text 6/6 segments, ETA")


@pytest.mark.parametrize(("text_rows", "generated"), [(225, 202), (10, 5), (3, 2), (4, 4), (5, 0)])
def test_the_text_rows_kept_stay_spread_over_the_text(text_rows: int, generated: int) -> None:
    from engine.convert.calibration_rows import replaced_text_rows

    replaced = replaced_text_rows(text_rows, generated)
    assert len(replaced) == len(set(replaced)) == generated
    kept = sorted(set(range(text_rows)) - set(replaced))
    if len(kept) > 1:  # evenly spaced: the gaps differ by at most one row
        gaps = {b - a for a, b in zip(kept, kept[1:])}
        assert max(gaps) - min(gaps) <= 1 and kept[0] == 0 and kept[-1] >= text_rows - max(gaps)


@pytest.mark.slow
def test_convert_command_with_own_text_and_written_rows(
    exl3_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The CLI end to end: --cal-text and --generated-rows reach the conversion, and the writing
    shows on the progress bar before the blocks."""
    from engine.cli import main as cli_main

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    words = [f"w{i}" for i in range(1500)]
    (tmp_path / "mine.txt").write_text(" ".join(words), encoding="utf-8")
    src, dst = exl3_dir / "tiny-llama-hf", tmp_path / "out"
    argv = ["convert", "-i", str(src), "-o", str(dst), "-b", "2.5", "--codebook", "mcg", "--device", "cpu"]
    argv += ["--cal-rows", "4", "--cal-cols", "32", "--head-bits", "4"]
    argv += ["--cal-text", str(tmp_path / "mine.txt"), "--generated-rows", "0.5"]
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert "(2 model-written)" in out
    bars = [b for b in err.split("\r") if b.strip()]
    writing = [i for i, b in enumerate(bars) if "calibration text" in b]
    blocks = [i for i, b in enumerate(bars) if "block 1/2" in b]
    assert writing and blocks and max(writing) < min(blocks)
    assert (dst / "config.json").is_file()
