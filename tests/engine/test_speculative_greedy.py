"""Greedy decoding with drafts gives exactly the tokens of plain decoding: every drafter, drafts
kept whole, cut short or rejected at once, jobs with and without drafts in one batch, stop
strings, constraints, and models whose recurrent state has to be rolled back (tiny random
hybrids); the starter model with n-gram and draft-model drafting (slow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from drafters import OracleDrafter
from eager_graphs import use_eager_graphs

from engine.errors import UsageError
from engine.generation import constraints as C
from engine.generation.cuda_graph import DecodeGraphs
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.speculative.draft_model import ModelDrafter
from engine.generation.speculative.factory import make_drafter, parse_draft
from engine.generation.speculative.ngram import NgramDrafter
from engine.model import load_model
from engine.options import EngineOptions


def _prompts(lengths, seed=1, high=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (n,), generator=g).tolist() for n in lengths]


def _looping(prompt: list[int], times: int = 3) -> list[int]:
    """A prompt that repeats itself: n-gram lookup finds something to propose."""
    return prompt * times


def _plain(model, jobs_of, **kw) -> list:
    return Generator(model, **kw).generate(jobs_of())


def _check(model, prompts, drafter, new=40, batch=16, **kw):
    """Drafted and plain greedy results of ``prompts`` are the same, and drafts were made and
    judged both ways; every page and state slot comes back."""

    def jobs():
        return [Job(p, new, stop_token_ids=()) for p in prompts]

    plain = _plain(model, jobs, cache_tokens=2048, page_size=16, max_batch_size=batch, **kw)
    if callable(drafter):
        drafter = drafter({tuple(p): r.token_ids for p, r in zip(prompts, plain)})
    gen = Generator(model, cache_tokens=2048, page_size=16, max_batch_size=batch, drafter=drafter, **kw)
    drafted = gen.generate(jobs())
    for a, b in zip(plain, drafted):
        assert b.token_ids == a.token_ids
        assert b.stop_reason == a.stop_reason and b.new_tokens == a.new_tokens
    assert gen.cache.pages.available == gen.cache.num_pages
    assert gen.cache.state_slots.available == gen.cache.state_slots.count
    return gen.speculation.stats


@pytest.mark.parametrize("wrong", [0.0, 0.3, 0.9])
def test_oracle_drafts_right_and_wrong_give_plain_tokens(llama, wrong):
    prompts = _prompts([5, 40, 70, 17])
    stats = _check(llama, prompts, lambda answers: OracleDrafter(answers, wrong), batch=3)
    assert stats.drafted > 0
    if wrong == 0.0:
        assert stats.accepted == stats.drafted
    else:
        assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize(
    "variant", ["Qwen3_5ForCausalLM", "NemotronHForCausalLM", "Lfm2ForCausalLM", "Qwen3NextForCausalLM"]
)
def test_hybrid_models_roll_back_their_recurrent_state(tiny_model_factory, variant):
    # Gated delta nets, Mamba-2 and short convolutions: a partly rejected draft restores the
    # state from before the step and feeds the kept tokens again.
    directory, _ = tiny_model_factory(variant)
    model = load_model(directory, device="cpu")
    prompts = _prompts([5, 40, 70])
    stats = _check(model, prompts, lambda answers: OracleDrafter(answers, 0.3), new=48)
    assert 0 < stats.accepted < stats.drafted


def test_ngram_drafts_on_repeating_prompts(llama):
    prompts = [_looping(p) for p in _prompts([6, 11, 20])] + _prompts([9])
    stats = _check(llama, prompts, NgramDrafter(), new=48)
    assert stats.drafted > 0 and stats.accepted > 0


def test_a_draft_model_with_the_same_vocabulary(llama, tiny_model_factory):
    # Another random Llama of the same vocabulary: its drafts are mostly wrong; the tiny Llama
    # itself: always right (and each proposal brings its cache up to the target's tokens).
    other_dir, _ = tiny_model_factory("LlamaForCausalLM-llama3")
    other = load_model(other_dir, device="cpu")
    prompts = _prompts([5, 33, 64])
    for draft_model in (other, llama):
        drafter = ModelDrafter(draft_model, vocab_size=320, cache_tokens=2048, page_size=16)
        stats = _check(llama, prompts, drafter, new=40, batch=2)
        assert stats.drafted > 0
        assert drafter.cache.pages.available == drafter.cache.num_pages  # forgotten with each job
    assert stats.accepted == stats.drafted  # the model drafting for itself


def test_a_draft_models_steps_replay_from_graphs(llama, tiny_model_factory, monkeypatch):
    # On a GPU the draft model's steps replay from CUDA graphs (a stand-in capture here, which
    # runs the fixed-shape step): its one-token steps as decode rows, its catch-ups of a few
    # tokens as verify rows. It drafts what its eager steps draft, and the tokens are plain ones.
    use_eager_graphs(monkeypatch)
    other_dir, _ = tiny_model_factory("LlamaForCausalLM-llama3")
    other = load_model(other_dir, device="cpu")
    prompts = _prompts([5, 33, 64])
    eager = ModelDrafter(other, vocab_size=320, cache_tokens=2048, page_size=16)
    assert eager.graphs is None  # a CPU model
    eager_stats = _check(llama, prompts, eager, new=40, batch=2)
    graphed = ModelDrafter(other, vocab_size=320, cache_tokens=2048, page_size=16)
    graphed.graphs = DecodeGraphs(other.module, graphed.cache, max_batch=16)  # as on a GPU
    chained = []  # greedy draft steps fed by the previous step's argmax on the device
    run_greedy = graphed.graphs.run_greedy
    monkeypatch.setattr(
        graphed.graphs, "run_greedy", lambda items, ids: chained.append(ids) or run_greedy(items, ids)
    )
    stats = _check(llama, prompts, graphed, new=40, batch=2)
    assert (stats.drafted, stats.accepted) == (eager_stats.drafted, eager_stats.accepted)
    assert 0 < stats.accepted < stats.drafted
    assert graphed.graphs.replays > 0
    assert chained and all(ids is not None and ids.dtype == torch.int64 for ids in chained)
    assert max(rows for rows, _ in graphed.graphs.captured) > 2  # a catch-up of several tokens
    assert graphed.cache.pages.available == graphed.cache.num_pages


def test_a_hybrid_draft_model_rolls_back_too(tiny_model_factory, llama):
    directory, _ = tiny_model_factory("Qwen3_5ForCausalLM")
    draft = load_model(directory, device="cpu")
    drafter = ModelDrafter(draft, vocab_size=320, cache_tokens=2048, page_size=16)
    stats = _check(llama, _prompts([8, 30]), drafter, new=40)
    assert stats.drafted > 0


def test_stop_strings_and_a_token_limit_inside_a_draft(tiny_model_factory, tmp_path_factory):
    from test_constraints import ByteTokenizer

    directory, _ = tiny_model_factory("LlamaForCausalLM")
    model = load_model(directory, device="cpu")
    tok = ByteTokenizer(tmp_path_factory.mktemp("bytes"))
    prompts = _prompts([6, 25, 12], high=256)
    plain = Generator(model, tok, cache_tokens=1024, page_size=16).generate(
        [Job(p, 60, stop_token_ids=()) for p in prompts]
    )
    # A stop string from the middle of each plain reply: the drafted run must stop at it too.
    stops = [r.text[len(r.text) // 2 : len(r.text) // 2 + 2] for r in plain]

    def jobs():
        return [Job(p, 60, stop_strings=[s], stop_token_ids=()) for p, s in zip(prompts, stops)]

    answers = {tuple(p): r.token_ids for p, r in zip(prompts, plain)}
    want = Generator(model, tok, cache_tokens=1024, page_size=16).generate(jobs())
    gen = Generator(model, tok, cache_tokens=1024, page_size=16, drafter=OracleDrafter(answers, 0.1))
    got = gen.generate(jobs())
    assert [(r.text, r.token_ids, r.stop_reason) for r in got] == [
        (r.text, r.token_ids, r.stop_reason) for r in want
    ]
    assert all(r.stop_reason == "stop_string" for r in got)
    assert gen.speculation.stats.accepted > 0
    # A budget that ends inside a draft: never a token more than asked for.
    (short,) = Generator(model, tok, page_size=16, drafter=OracleDrafter(answers, 0.0)).generate(
        [Job(prompts[0], 7, stop_token_ids=())]
    )
    assert short.token_ids == plain[0].token_ids[:7] and short.stop_reason == "max_new_tokens"


def test_constrained_output_with_drafts(tiny_model_factory, tmp_path_factory):
    # The constraint's mask applies at every drafted position: a draft it forbids is rejected.
    from test_constraints import ByteTokenizer

    directory, _ = tiny_model_factory("LlamaForCausalLM")
    model = load_model(directory, device="cpu")
    tok = ByteTokenizer(tmp_path_factory.mktemp("bytes"))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}}
    prompts = _prompts([4, 9], high=256)

    def jobs():
        return [Job(p, 48, constraint=C.json_schema(schema), stop_token_ids=()) for p in prompts]

    plain = Generator(model, tok, cache_tokens=1024, page_size=16).generate(jobs())
    answers = {tuple(p): r.token_ids for p, r in zip(prompts, plain)}
    gen = Generator(model, tok, cache_tokens=1024, page_size=16, drafter=OracleDrafter(answers, 0.3))
    got = gen.generate(jobs())
    assert [(r.text, r.stop_reason, r.error) for r in got] == [
        (r.text, r.stop_reason, r.error) for r in plain
    ]
    for r in got:
        if r.stop_reason == "constraint_complete":
            json.loads(r.text)
    assert 0 < gen.speculation.stats.accepted < gen.speculation.stats.drafted


def test_jobs_with_and_without_drafts_share_steps(llama):
    # The oracle knows only some prompts: the others decode one token a step in the same batch,
    # and jobs join (prefill) while others verify drafts.
    prompts = _prompts([5, 40, 70, 17, 23, 9])

    def jobs():
        return [Job(p, 30, stop_token_ids=()) for p in prompts]

    plain = Generator(llama, cache_tokens=2048, page_size=16, max_batch_size=4).generate(jobs())
    answers = {tuple(p): r.token_ids for p, r in list(zip(prompts, plain))[::2]}
    gen = Generator(
        llama, cache_tokens=2048, page_size=16, max_batch_size=4, drafter=OracleDrafter(answers, 0.2)
    )
    assert [r.token_ids for r in gen.generate(jobs())] == [r.token_ids for r in plain]
    assert gen.speculation.stats.accepted > 0


def test_draft_settings_are_checked():
    assert parse_draft("off") == ("off", None) and parse_draft(None) == ("off", None)
    assert parse_draft("auto") == ("auto", None)
    assert parse_draft("model:/x/y") == ("model", Path("/x/y"))
    for bad in ("ngrams", "model:", "draft"):
        with pytest.raises(UsageError, match="--draft takes off, auto, ngram, model:DIR or mtp"):
            parse_draft(bad)


def test_mtp_on_a_model_without_mtp_heads_is_refused(llama):
    # MTP drafting itself: tests/engine/test_mtp_drafter.py.
    with pytest.raises(UsageError, match="has no MTP heads"):
        make_drafter("mtp", llama)


def test_engine_options_choose_the_drafter(llama):
    gen = Generator(
        llama, cache_tokens=256, page_size=16, options=EngineOptions(draft="ngram", draft_tokens=3)
    )
    assert gen.speculation.drafter.kind == "ngram" and gen.speculation.max_tokens == 3
    assert Generator(llama, cache_tokens=256, page_size=16).speculation is None
    env = EngineOptions.from_environment({"TRELLIS_DRAFT": "ngram", "TRELLIS_DRAFT_TOKENS": "6"})
    assert (env.draft, env.draft_tokens) == ("ngram", 6)


# -- the starter model -----------------------------------------------------------------------

BENCH_PROMPTS = Path(__file__).parents[2] / "engine" / "bench" / "data" / "speculative_prompts.json"


def starter_prompt_texts() -> list[str]:
    """Ten prompts: the bench's code-edit and chat sets and two more."""
    sets = json.loads(BENCH_PROMPTS.read_text())
    extra = ["Write a haiku about the sea.", "List five prime numbers."]
    return [*sets["code-edit"], *sets["chat"], *extra]


def _random_draft_model(smollm2_dir: Path, directory: Path) -> Path:
    """A random one-layer Llama with the starter model's vocabulary and tokenizer files."""
    import transformers as tf

    config = json.loads((smollm2_dir / "config.json").read_text())
    torch.manual_seed(0)
    small = tf.LlamaConfig(
        vocab_size=config["vocab_size"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    tf.LlamaForCausalLM(small).save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, directory / name)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("count", [3, pytest.param(10, marks=pytest.mark.acceptance)])
def test_the_starter_model_with_each_drafter(smollm2_f32_dir, tmp_path, count):
    # Ten prompts x 128 tokens is the acceptance run (-m acceptance); three by default.
    # The float32 import: plain and verify steps run different row counts, and the compact
    # starter's int8 matmuls round activations to bfloat16, where a near-tie can flip on rounding
    # alone (as in half precision on the GPU), which is not what this test is about.
    from engine.tokenizer import Tokenizer

    smollm2_dir = smollm2_f32_dir

    model = load_model(smollm2_dir, device="cpu")
    tok = Tokenizer.from_dir(smollm2_dir)
    texts = starter_prompt_texts()[:count]
    prompts = [tok.encode_chat([{"role": "user", "content": text}]) for text in texts]

    def run(draft: str | None, stop: str | None = None):
        options = EngineOptions(draft=draft or "off", draft_tokens=4)
        gen = Generator(model, tok, cache_tokens=2048, options=options)
        jobs = [Job(p, 128, stop_strings=[stop] if stop else ()) for p in prompts]
        return gen.generate(jobs), gen

    plain, _ = run(None)
    random_dir = _random_draft_model(smollm2_dir, tmp_path / "draft")
    for draft in ("ngram", f"model:{random_dir}", f"model:{smollm2_dir}"):
        got, gen = run(draft)
        assert [r.token_ids for r in got] == [r.token_ids for r in plain], draft
        assert gen.speculation.stats.drafted > 0, draft
    # The starter model drafting for itself: the upper bound, every greedy draft kept but those
    # past a reply's end (at most one draft of 4 per job).
    stats = gen.speculation.stats
    assert stats.drafted - 4 * len(prompts) <= stats.accepted <= stats.drafted
    # Stop strings: cut where plain decoding cuts.
    stop = plain[2].text[len(plain[2].text) // 2 :][:3]
    want, _ = run(None, stop)
    got, _ = run("ngram", stop)
    assert [(r.text, r.stop_reason) for r in got] == [(r.text, r.stop_reason) for r in want]


def test_a_draft_model_with_another_vocabulary_is_refused(llama):
    class SmallVocabulary:  # the target's tokenizer: 320 ids, where the draft's has 2048
        vocab_size = 320

        def id_to_token(self, i: int) -> str:
            return f"<{i}>"

    draft = Path(__file__).parents[1] / "data" / "tiny-hybrids" / "qwen3_5"
    with pytest.raises(UsageError, match="does not share the target's tokenizer"):
        make_drafter(f"model:{draft}", llama, SmallVocabulary())
