"""``python -m engine bench-sampler``: it runs, times both sides and writes its rows."""

import json

import torch

from engine.bench import sampler as bench_sampler
from engine.generation.sampling import SamplingSettings


def test_bench_sampler_writes_a_row_per_preset_and_logits_kind(tmp_path, capsys):
    out = tmp_path / "sampler.json"
    argv = ["--vocab", "3000", "--context", "50", "--repeats", "2", "--json", str(out)]
    assert bench_sampler.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(bench_sampler.PRESETS)
    assert all(r["definition_ms"] > 0 and r["sampler_ms"] > 0 for r in rows)
    assert "app balanced" in capsys.readouterr().out


def test_reference_draw_stays_within_what_truncation_keeps():
    logits = bench_sampler.example_logits(5000)["peaked"]
    settings = SamplingSettings(temperature=0.7, top_p=0.5, min_p=0.2)
    gen = torch.Generator().manual_seed(0)
    draws = {bench_sampler.reference_sample(logits, settings, [], [], gen) for _ in range(50)}
    assert draws <= set(range(50))  # only the strong candidates survive these cuts
