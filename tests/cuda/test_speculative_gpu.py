"""Speculative decoding on a CUDA GPU: greedy tokens with every drafter equal plain decoding's
(the starter model's real weights, 10 prompts x 128 tokens), verify steps and a draft model's
steps replayed from CUDA graphs, and a verify step's logits equal to the eager step's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.generation.decode_inputs import run_decode_step
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import StepItem, run_step
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_speculative_greedy import _random_draft_model, starter_prompt_texts  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda


def _prompts(tok) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": text}]) for text in starter_prompt_texts()]


@pytest.mark.slow
def test_greedy_tokens_with_every_drafter_equal_plain_decoding_on_the_gpu(smollm2_dir, tmp_path):
    from engine.tokenizer import Tokenizer

    # float32: plain and verify steps run different row counts through cuBLAS; in half precision a
    # near-tie could flip on rounding alone, which is not what this test is about.
    model = load_model(smollm2_dir, device="cuda", dtype="float32")
    tok = Tokenizer.from_dir(smollm2_dir)
    prompts = _prompts(tok)

    def run(draft: str):
        gen = Generator(model, tok, cache_tokens=4096, max_batch_size=4, options=EngineOptions(draft=draft))
        return gen.generate([Job(p, 128) for p in prompts]), gen

    plain, _ = run("off")
    random_dir = _random_draft_model(smollm2_dir, tmp_path / "draft")
    for draft in ("ngram", f"model:{random_dir}", f"model:{smollm2_dir}"):
        got, gen = run(draft)
        assert [r.token_ids for r in got] == [r.token_ids for r in plain], draft
        assert gen.speculation.stats.drafted > 0, draft
        assert gen._use_graphs and gen._graphs is not None and gen._graphs.failed is None
        # Verify steps replayed from graphs of more rows than jobs (1 + k rows per job).
        assert any(rows > 4 for rows, _ in gen._graphs.captured), (draft, gen._graphs.captured)
        drafter = gen.speculation.drafter
        if draft.startswith("model:"):  # the draft model's own steps replay from its own graphs
            assert drafter.graphs is not None and drafter.graphs.failed is None
            assert drafter.graphs.replays > 0 and drafter.graphs.captured, draft


def test_verify_rows_on_the_gpu_give_the_eager_verify_logits(tmp_path):
    # tests/engine's tiny_model_factory fixture is not visible from tests/cuda: build directly.
    directory = tmp_path / "llama"
    build_tiny_model("LlamaForCausalLM", directory)
    model = load_model(directory, device="cuda", dtype="float32")
    from engine.cache.paged import PagedKVCache

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 300, (50,), generator=g).tolist()
    for k in (1, 4, 8):
        results = []
        for step in (run_step, run_decode_step):
            cache = PagedKVCache.for_model(model.spec, 256, 16, model.dtype, model.device)
            pages = cache.pages.allocate(8)
            run_step(model.module, cache, [StepItem(prompt[:40], 0, pages, None)])
            results.append(step(model.module, cache, [StepItem(prompt[40 : 41 + k], 40, pages, k + 1)])[0])
        torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)


def test_a_draft_models_greedy_steps_chain_from_its_graphs_on_the_gpu(tmp_path):
    # tests/engine's fixtures are not visible from tests/cuda: tiny random Llamas built here. The
    # draft is another random Llama (drafts mostly rejected) and the target itself (all kept).
    from engine.generation.speculative.draft_model import ModelDrafter

    target_dir, other_dir = tmp_path / "target", tmp_path / "other"
    build_tiny_model("LlamaForCausalLM", target_dir)
    build_tiny_model("LlamaForCausalLM", other_dir, seed=1)
    target = load_model(target_dir, device="cuda", dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 33, 64)]

    def generate(drafter=None):
        gen = Generator(target, cache_tokens=2048, page_size=16, max_batch_size=4, drafter=drafter)
        return [r.token_ids for r in gen.generate([Job(p, 40, stop_token_ids=()) for p in prompts])], gen

    plain, _ = generate()
    for draft_model in (load_model(other_dir, device="cuda", dtype="float32"), target):
        drafter = ModelDrafter(draft_model, vocab_size=320, cache_tokens=2048, page_size=16)
        chained = []  # the greedy steps fed on the device by the previous step's argmax
        drafter.graphs.run_greedy = lambda items, ids, log=chained, run=drafter.graphs.run_greedy: (
            log.append(ids is not None) or run(items, ids)
        )
        tokens, gen = generate(drafter)
        assert tokens == plain
        assert gen.speculation.stats.drafted > 0 and chained and all(chained)
        assert drafter.graphs.failed is None and drafter.graphs.replays >= len(chained)
