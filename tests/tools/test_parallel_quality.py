"""tools/parallel_quality.py: quality jobs side by side, summarised per variant (a fake `engine`
package stands in for the real quality command, which converts for minutes on a GPU)."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "parallel_quality.py"

FAKE_QUALITY = textwrap.dedent(
    """
    import json, sys
    a = sys.argv
    seed = int(a[a.index("--seeds") + 1]) if "--seeds" in a else 0
    rows = [{"name": "unquantized", "kind": "unquantized", "bpw": None, "ppl": 20.0,
             "ppl_delta_pct": 0.0, "mean_kl": 0.0, "convert_s": None}]
    if "--no-exl3" not in a:
        bpw = float(a[a.index("--bpw") + 1])
        bonus = 1.0 if "--cal-text" in a else 0.0
        rows.append({"name": f"exl3 {bpw}", "kind": "exl3", "bpw": bpw, "ppl": 21.0,
                     "ppl_delta_pct": 6.0 + seed - bonus, "mean_kl": 0.1 + 0.01 * seed, "convert_s": 60.0})
    gguf = a[a.index("--gguf") + 1]
    for t in filter(None, gguf.split(",")):
        rows.append({"name": f"gguf {t}", "kind": "gguf", "bpw": 4.5, "ppl": 26.0,
                     "ppl_delta_pct": 30.0, "mean_kl": 0.4, "convert_s": 2.0})
    if seed == 9:
        sys.exit(1)  # a failing job: no JSON
    json.dump({"rows": rows}, open(a[a.index("--json") + 1], "w"))
    """
)


def _tool():
    spec = importlib.util.spec_from_file_location("parallel_quality", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_jobs_run_side_by_side_and_are_summarised_per_variant(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__main__.py").write_text(FAKE_QUALITY)
    monkeypatch.chdir(tmp_path)  # `python -m engine` finds the fake first
    out, summary = tmp_path / "out", tmp_path / "summary.json"
    jobs = [f"base|--bpw 4 --seeds {s}" for s in (0, 1)]
    jobs += [f"mine|--bpw 4 --seeds {s} --cal-text /x" for s in (0, 1, 9)]
    jobs += ["gguf|--no-exl3 --gguf q8_0,q4_0"]
    args = ["--model", "M", "--text", "T", "--out", str(out), "--summary", str(summary), "--parallel", "3"]
    _tool().main([*args, "--work", str(tmp_path / "work"), *jobs])
    got = json.loads(summary.read_text())
    assert got["base"]["means"]["4.0"] == {"ppl_delta_pct": 6.5, "mean_kl": pytest.approx(0.105), "n": 2}
    # The failed job (seed 9) counts for nothing; the others' rows keep their arguments.
    assert got["mine"]["means"]["4.0"]["n"] == 2 and got["mine"]["means"]["4.0"]["ppl_delta_pct"] == 5.5
    assert [r["name"] for r in got["gguf"]["rows"]] == ["gguf q8_0", "gguf q4_0"]
    assert got["gguf"]["means"] == {} and got["base"]["unquantized"] == 20.0
    printed = capsys.readouterr().out
    assert "rc=1" in printed and "| mine | mean of 2 at 4.0 bpw | - | +5.50% | 0.10500 | - |" in printed
    assert (out / "summary.json").is_file() and (out / "mine_4.log").is_file()
