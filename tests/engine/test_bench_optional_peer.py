"""``bench -m DIR`` (as the README shows it) where ``transformers`` is not installed: the peer is
skipped with a note before any work starts, our figures are measured and printed, and each run
says on stderr that it started. ``ppl`` reports its windows on stderr too (stdout stays JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench import speed as bench
from engine.cli import main as cli_main

SMALL_RUN = ["--prompt", "16", "--context", "16", "--decode-tokens", "3", "--repeats", "1"]
TEXT = Path(__file__).parents[1] / "data" / "public_domain.txt"


@pytest.fixture
def no_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine without transformers: finding it fails, importing it fails."""
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises


def test_bench_without_transformers_skips_the_peer_and_keeps_its_results(
    tiny_llama_hf: Path, tmp_path: Path, capsys, no_transformers
) -> None:
    out = tmp_path / "bench.json"
    argv = ["-m", str(tiny_llama_hf), "--device", "cpu", "--dtype", "float32", "--json", str(out)]
    assert bench.main([*argv, *SMALL_RUN]) == 0
    captured = capsys.readouterr()
    # Said before the work, not discovered after it.
    note = captured.err.index("transformers is not installed")
    assert note < captured.err.index("run 1/2")
    for figure in ("decode 3 tokens from an empty context", "at 16 tokens of context", "prefill 16 tokens"):
        assert f"{figure}: run 1/2 (warm-up)" in captured.err and f"{figure}: run 2/2" in captured.err
    results = json.loads(out.read_text())
    assert results["rows"][0]["decode_tokens_per_s"] > 0 and "transformers" not in results
    assert "transformers is not installed" in results["peer_note"]
    assert "model" in captured.out and "note: transformers is not installed" in captured.out


def test_a_failing_peer_costs_only_its_row(tiny_llama_hf: Path, capsys, monkeypatch) -> None:
    def broken_peer(*_args, **_kwargs):
        raise RuntimeError("the peer broke")

    monkeypatch.setattr(bench, "peer_row", broken_peer)
    monkeypatch.setattr(bench, "peer_missing", lambda: None)
    assert bench.main(["-m", str(tiny_llama_hf), "--device", "cpu", "--dtype", "float32", *SMALL_RUN]) == 0
    captured = capsys.readouterr()
    assert "our figures stand" in captured.err
    assert "note: the transformers peer failed: RuntimeError: the peer broke" in captured.out


def test_ppl_reports_progress_on_stderr(tiny_llama_hf: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:3000])
    argv = ["ppl", "-m", str(tiny_llama_hf), "--text-file", str(text), "--ctx", "128"]
    assert cli_main([*argv, "--device", "cpu", "--dtype", "float32", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    windows = -(-result["tokens"] // 127)
    assert f"scoring {windows} windows: {windows}/{windows} (100%)" in captured.err
