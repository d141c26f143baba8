"""MTP drafting on a CUDA GPU (tiny models with MTP layers, tests/engine/tiny_mtp.py): greedy
tokens equal plain decoding's, and a layer that reproduces its model gets its drafts kept."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_mtp import build_echo_mtp, build_with_mtp  # noqa: E402

pytestmark = pytest.mark.cuda


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("variant", ["Qwen3_5ForCausalLM", "DeepseekV3ForCausalLM"])
def test_greedy_with_mtp_drafts_equals_plain_decoding_on_the_gpu(variant, tmp_path):
    build_with_mtp(variant, tmp_path)
    # float32: plain steps replay CUDA graphs, MTP-fed steps run the general path; in half
    # precision a near-tie could flip on rounding alone.
    model = load_model(tmp_path, device="cuda", dtype="float32")
    prompts = _prompts([6, 37, 70])

    def run(draft: str):
        gen = Generator(model, cache_tokens=1024, page_size=16, options=EngineOptions(draft=draft))
        return gen.generate([Job(p, 40, stop_token_ids=()) for p in prompts]), gen

    plain, _ = run("off")
    got, gen = run("mtp")
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert gen.speculation.stats.drafted > 0


def test_an_mtp_layer_that_agrees_with_its_model_gets_its_drafts_kept_on_the_gpu(tmp_path):
    build_echo_mtp(tmp_path)
    model = load_model(tmp_path, device="cuda", dtype="float32")
    options = EngineOptions(draft="mtp", draft_tokens=4)
    gen = Generator(model, cache_tokens=1024, page_size=16, options=options)
    gen.generate([Job(p, 48, stop_token_ids=()) for p in _prompts([12, 30, 50], seed=2)])
    assert gen.speculation.stats.acceptance_rate > 0.8, gen.speculation.stats
