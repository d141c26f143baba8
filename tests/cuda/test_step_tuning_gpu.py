"""Split counts tuned on whole decode steps (engine.kernels.tuning.tune_step) on the GPU: the tuning
runs at the first capture of a step shape, only once per process, keeps counts the launches
accept, and the tuned graphs decode what the eager step decodes with the same counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.kernels import gemv, tuning
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_graphs import _assert_same_tokens, _generate  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.fixture
def fresh_tuning():
    tuning.forget()
    yield
    tuning.forget()


@pytest.mark.parametrize("batch", [1, 3])
def test_tuned_step_decodes_as_the_eager_step(exl3_dir, batch, fresh_tuning, monkeypatch):
    if not tuning.enabled():
        pytest.skip("GEMV split tuning is off (TRELLIS_GEMV_TUNE=0)")
    model = load_model(exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1", device="cuda", dtype="float16")
    seen: list[list[tuple]] = []
    real = tuning.tune_step

    def spy(keys, time_step):
        seen.append(list(keys))
        return real(keys, time_step)

    monkeypatch.setattr(tuning, "tune_step", spy)
    step_tuned = EngineOptions(step_tuning=True)
    graphed, gen = _generate(model, batch, graphs=True, options=step_tuned)
    assert gen._graphs.tune_splits and gen._graphs.failed is None, gen._graphs.failed
    assert len(seen) == 1 and seen[0], "one tuning, over the step's GEMV launch shapes"
    result = tuning.last_step_tuning()
    assert result is not None and result.timings >= 1 and result.after_ms <= result.before_ms
    for key in seen[0]:
        in_features = key[2]
        accepted = tuning.split_range(in_features, gemv._MAX_CHUNKS_PER_SPLIT, gemv._MAX_CLUSTER)
        assert tuning.choice(key) in accepted
    # A second Generator over the same model does not tune again.
    again, _ = _generate(model, batch, graphs=True, options=step_tuned)
    assert len(seen) == 1 and again == graphed
    eager, _ = _generate(model, batch, graphs=False)  # the same (tuned) counts, eagerly
    _assert_same_tokens(model, batch, eager, graphed)
