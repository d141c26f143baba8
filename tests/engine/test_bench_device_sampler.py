"""``python -m engine bench-device-sampler``: it runs (on the CPU: host sampler and reference)."""

import json

from engine.bench import device_sampler as bench_device_sampler
from engine.bench.sampler import PRESETS


def test_bench_device_sampler_writes_a_row_per_case(tmp_path, capsys):
    out = tmp_path / "device_sampler.json"
    argv = ["--vocab", "3000", "--context", "50", "--repeats", "2", "--batch", "1,3", "--json", str(out)]
    assert bench_device_sampler.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(PRESETS) * 2
    assert all(r["host_ms"] > 0 and r["reference_ms"] > 0 for r in rows)
    assert "app balanced" in capsys.readouterr().out
