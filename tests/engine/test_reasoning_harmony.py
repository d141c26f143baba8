"""gpt-oss's harmony replies split into reasoning (the analysis channel, and tool calls) and the
answer (the final channel), on token streams as the generator produces them: one token a step,
its text decoded with the special tokens left out (the markers are special), multi-byte
characters held back until complete; and through ChatSession.stream, whose chunks carry the two
parts apart.

The tokenizer is a small byte-level BPE with harmony's markers as special tokens; the chat
template a minimal harmony-style one written here (the real one is not downloaded in tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.api import GenerationRequest
from engine.generation.job import JobResult
from engine.generation.sampling import SamplingSettings
from engine.reasoning import ReplyParts, reply_splitter
from engine.reasoning.harmony import MARKERS
from engine.tokenizer import Tokenizer

TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{%- else -%}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
ANALYSIS = "The user asks for 2+2; naïve arithmetic says 4 — easy ✓."
FINAL = "2 + 2 = 4. Café au lait ☕ for everyone!"
REPLY = (
    f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>"
)


def _write_tokenizer(directory: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    corpus = [ANALYSIS, FINAL, "assistant analysis final commentary to=functions.get_weather json user"] * 30
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|return|>", "chat_template": TEMPLATE} if "<|return|>" in specials else {}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    specials = ["<|endoftext|>", *MARKERS.values()]
    return Tokenizer.from_dir(_write_tokenizer(tmp_path_factory.mktemp("harmony"), specials))


def _steps(tokenizer: Tokenizer, text: str, eos: bool = True) -> list[tuple[str, list[int]]]:
    """``text`` generated one token a step, as the generator reports it: the text each token
    completes (special tokens left out), the end-of-sequence token not decoded and the held
    tail flushed with it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = tokenizer.incremental_decoder()
    steps = []
    for i, token in enumerate(ids):
        if eos and i == len(ids) - 1:
            steps.append((decoder.flush(), [token]))
        else:
            steps.append((decoder.add(token), [token]))
    return steps


def _split(tokenizer: Tokenizer, steps) -> tuple[ReplyParts, list[ReplyParts]]:
    splitter = reply_splitter(tokenizer)
    assert splitter is not None
    parts = [splitter.feed(text, ids) for text, ids in steps]
    parts.append(splitter.finish())
    total = ReplyParts()
    for p in parts:
        total += p
    return total, parts


def test_a_vocabulary_without_the_markers_has_no_splitter(tmp_path) -> None:
    plain = Tokenizer.from_dir(_write_tokenizer(tmp_path / "plain", ["<|endoftext|>"]))
    assert reply_splitter(plain) is None and reply_splitter(None) is None


def test_token_by_token_the_analysis_is_reasoning_and_the_final_is_the_answer(tokenizer) -> None:
    steps = _steps(tokenizer, REPLY)
    assert "".join(text for text, _ in steps) == "analysis" + ANALYSIS + "assistantfinal" + FINAL
    assert any(text == "" for text, _ in steps[1:-1])  # some characters spanned several tokens
    total, parts = _split(tokenizer, steps)
    assert total == ReplyParts(reasoning=ANALYSIS, answer=FINAL)
    # Streamed as it comes: the reasoning is out before the answer starts, nothing waits for the end.
    first_answer = next(i for i, p in enumerate(parts) if p.answer)
    assert "".join(p.reasoning for p in parts[:first_answer]) == ANALYSIS
    assert parts[-1] == ReplyParts()


def test_a_tool_call_is_reasoning_and_its_header_is_neither(tokenizer) -> None:
    call = '{"city": "Paris"}'
    reply = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{call}<|call|>"
    )
    total, _ = _split(tokenizer, _steps(tokenizer, reply))
    assert total == ReplyParts(reasoning="Need the weather." + call)


def test_a_reply_cut_off_while_thinking_has_no_answer(tokenizer) -> None:
    total, _ = _split(tokenizer, _steps(tokenizer, f"<|channel|>analysis<|message|>{ANALYSIS}", eos=False))
    assert total == ReplyParts(reasoning=ANALYSIS)
    # cut inside the final message's header: the channel's name is not shown either
    cut = f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>fin"
    assert _split(tokenizer, _steps(tokenizer, cut, eos=False))[0] == ReplyParts(reasoning=ANALYSIS)


def test_a_reply_without_any_marker_is_all_answer(tokenizer) -> None:
    total, parts = _split(tokenizer, _steps(tokenizer, FINAL, eos=False))
    assert total == ReplyParts(answer=FINAL) and parts[-1] == total  # known only at the end


class _ScriptedGenerator:
    """Stands in for the Generator: every job is answered with ``steps`` (text, ids), a step
    at a time, the last one ending it as an end-of-sequence token does."""

    def __init__(self, steps: list[tuple[str, list[int]]]) -> None:
        self.steps, self.jobs, self.context_length = steps, [], 512

    def enqueue(self, job) -> None:
        self.jobs.append(job)

    def iterate(self):
        for i, (text, ids) in enumerate(self.steps):
            last = i == len(self.steps) - 1
            yield JobResult(self.jobs[-1], text, ids, last, "eos" if last else None, new_tokens=i + 1)

    def cancel(self, job) -> None:
        pass


def test_the_session_streams_reasoning_apart_from_the_answer(tokenizer, tmp_path) -> None:
    """ChatSession.stream (the app's way in) with the harmony template: the prompt ends where the
    assistant's turn starts, the chunks' text is the answer alone and their reasoning the analysis;
    stream_ids without splitting gives the plain text, header words and all."""
    from tiny_gpt_oss import build_tiny_gpt_oss

    from engine.model import load_model
    from engine.session import ChatSession

    build_tiny_gpt_oss(tmp_path / "model", num_hidden_layers=2)
    session = ChatSession(load_model(tmp_path / "model", device="cpu"), tokenizer, cache_tokens=64)
    session.generator = _ScriptedGenerator(_steps(tokenizer, REPLY))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chunks = list(session.stream(messages, GenerationRequest({"temperature": 0.0}, max_new_tokens=100)))
    prompt = tokenizer.decode(session.generator.jobs[-1].input_ids, skip_special_tokens=False)
    assert prompt == "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant"
    assert "".join(c.text for c in chunks) == FINAL
    assert "".join(c.reasoning for c in chunks) == ANALYSIS
    assert chunks[-1].done and chunks[-1].stop_reason == "eos"
    plain = list(session.stream_ids([1, 2], SamplingSettings.greedy()))
    assert "".join(c.text for c in plain) == "analysis" + ANALYSIS + "assistantfinal" + FINAL
    assert all(c.reasoning == "" for c in plain)
