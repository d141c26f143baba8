"""SmolLM2-135M-Instruct (real weights, imported from its GGUF) against transformers loading the
same GGUF: greedy generations and perplexity of the float32 import (the exact dequantized weights);
a factual answer, prefix reuse across chat turns, and the perplexity of the starter model's compact
int8 import."""

from pathlib import Path

import pytest
import torch

from engine.commands.ppl import perplexity
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model
from engine.session import ChatSession
from engine.tokenizer import Tokenizer

TEXT = Path(__file__).parents[1] / "data" / "public_domain.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def session(smollm2_dir):
    return ChatSession.load(smollm2_dir, device="cpu", cache_tokens=2048)


@pytest.fixture(scope="module")
def f32_session(smollm2_f32_dir):
    return ChatSession.load(smollm2_f32_dir, device="cpu", cache_tokens=2048)


def test_greedy_generation_matches_transformers(f32_session, reference):
    session = f32_session
    tok = session.tokenizer
    jobs = [Job(tok.encode_chat([{"role": "user", "content": p}]), max_new_tokens=64) for p in PROMPTS]
    ours = Generator(session.model, tok, cache_tokens=2048).generate(jobs)  # all three batched
    for job, result in zip(jobs, ours):
        ids = torch.tensor([list(job.input_ids)])
        with torch.no_grad():
            out = reference.generate(
                ids,
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=sorted(session.model.config.eos_token_ids),
            )
        expected = out[0, ids.shape[1] :].tolist()
        assert result.token_ids == expected
        assert result.text == tok.decode(expected)


def test_capital_of_france(session):
    from engine.generation.sampling import SamplingSettings

    chunks = list(
        session.stream_chat(
            [{"role": "user", "content": PROMPTS[0]}], SamplingSettings.greedy(), max_new_tokens=32
        )
    )
    assert "Paris" in "".join(c.text for c in chunks)
    assert chunks[-1].done and chunks[-1].stop_reason == "eos"


@pytest.fixture(scope="module")
def reference_perplexity(reference, smollm2_f32_dir) -> tuple[float, int]:
    """The perplexity of transformers' model on the windows ``perplexity`` scores, and their count."""
    tokenizer = Tokenizer.from_dir(smollm2_f32_dir)
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, 512):
        window = torch.tensor([ids[start : start + 512]])
        if window.shape[1] < 2:
            break
        with torch.no_grad():
            logits = reference(window).logits[0]
        nll += torch.nn.functional.cross_entropy(logits[:-1], window[0, 1:], reduction="sum").item()
        n += window.shape[1] - 1
    return float(torch.tensor(nll / n).exp()), n


def test_perplexity_matches_transformers(smollm2_f32_dir, reference_perplexity):
    tokenizer = Tokenizer.from_dir(smollm2_f32_dir)
    model = load_model(smollm2_f32_dir, device="cpu")
    ours, count = perplexity(model, tokenizer, TEXT.read_text(), ctx=512)
    theirs, n = reference_perplexity
    assert count == n
    assert abs(ours - theirs) / theirs < 0.005
    assert 1.5 < ours < 100  # a real model on English prose


def test_compact_starter_perplexity_is_within_two_percent(smollm2_dir, reference_perplexity):
    # int8 matrices with row scales, run by the CPU's int8 kernel with bfloat16 activations.
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    model = load_model(smollm2_dir, device="cpu")
    ours, count = perplexity(model, tokenizer, TEXT.read_text(), ctx=512)
    theirs, n = reference_perplexity
    assert count == n
    assert abs(ours - theirs) / theirs < 0.02


def test_second_chat_turn_reuses_the_first_turns_pages(session):
    tok = session.tokenizer
    gen = Generator(session.model, tok, cache_tokens=2048, page_size=16)
    turn1 = [{"role": "user", "content": "Name three colours of the rainbow."}]
    (r1,) = gen.generate([Job(tok.encode_chat(turn1), max_new_tokens=24)])
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.text},
        {"role": "user", "content": "And two more?"},
    ]
    ids2 = tok.encode_chat(turn2)
    before = gen.prefilled_tokens
    (r2,) = gen.generate([Job(ids2, max_new_tokens=16)])
    assert r2.cached_tokens >= 32  # at least the pages of the first prompt
    assert gen.prefilled_tokens - before == len(ids2) - r2.cached_tokens
    cold = Generator(session.model, tok, cache_tokens=2048, page_size=16).generate(
        [Job(ids2, max_new_tokens=16)]
    )
    assert r2.token_ids == cold[0].token_ids
