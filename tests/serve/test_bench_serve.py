"""``python -m engine bench-serve``: both paths run the same requests and report the same tokens."""

from __future__ import annotations

import json

import pytest

from engine.bench import serve as bench_serve


@pytest.mark.slow
def test_bench_serve_times_http_beside_the_engine(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["-m", str(smollm2_dir), "--device", "cpu", "--concurrency", "1,2", "--requests", "2"]
    assert bench_serve.main([*argv, "--max-tokens", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["path"]) for r in rows] == [
        (1, "engine"),
        (1, "http"),
        (2, "engine"),
        (2, "http"),
    ]
    for engine, http in zip(rows[::2], rows[1::2]):
        assert engine["tokens"] == http["tokens"] == 2 * 4  # greedy, same prompts: same replies
        assert engine["requests_per_s"] > 0 and http["tokens_per_s"] > 0
    assert "req/s" in capsys.readouterr().out


def test_bench_serve_refuses_bad_levels():
    assert bench_serve.main(["--concurrency", "0,2"]) == 2
