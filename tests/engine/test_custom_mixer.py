"""A mixer kind that exists only in this file, and a family that uses it beside attention: what
docs/ADDING_AN_ARCHITECTURE.md describes, done without touching an engine file.

The kind, ``token_counter``, is identity-ish with a recurrent state: each sequence's count of the
tokens it has seen, kept between steps in the sequence's recurrent-state slot. Its output is
``proj(x) + count / period * scale``, so a wrong count (a state read from the wrong slot, or not
carried from one step to the next) changes the logits. A correct count is the token's position
plus one, which gives a reference that keeps no state at all (:class:`PositionCounter`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from eager_graphs import use_eager_graphs
from safetensors.torch import load_file, save_file
from torch import nn

from engine.architectures import REGISTRY
from engine.architectures.llama import Llama
from engine.cache.paged import KVCacheLayer, PagedKVCache, cache_footprint
from engine.cache.pages import page_keys
from engine.cache.recurrent import RecurrentStateLayer
from engine.cache.state import RecurrentState
from engine.cache_footprint import CacheFootprint
from engine.config import ModelConfig
from engine.config_footprint import HYBRID_FOOTPRINTS, layer_type_footprint
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import StepItem, run_step, score_tokens
from engine.inspect import inspect_model
from engine.layers import MIXERS, MixerKind, MixerSpec
from engine.loading.builder import LayerReader
from engine.model import load_model
from engine.modules.attention import Attention
from engine.modules.batch import BatchLayout
from engine.modules.linear import LinearSite
from engine.options import EngineOptions

COUNTER = "token_counter"
COUNTING_LAYERS = (1, 3)  # of 4; the others attend

# -- the kind: module, spec, names, build function, state --------------------------------------


class TokenCounter(nn.Module):
    """``proj(x) + count / period * scale``, ``count`` the tokens the sequence has seen so far
    (this one included), carried from step to step in the layer's recurrent state."""

    def __init__(self, proj: nn.Module, scale: torch.Tensor, period: float) -> None:
        super().__init__()
        self.proj = proj
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.period = period

    def quantizable_linears(self) -> list[LinearSite]:
        return [LinearSite("proj", self, "proj")]

    def forward(self, x: torch.Tensor, batch: BatchLayout, cache: RecurrentStateLayer) -> torch.Tensor:
        counts = self.counts(batch, cache["count"])
        return self.proj(x) + (counts / self.period).to(x.dtype)[:, None] * self.scale

    @staticmethod
    def counts(batch: BatchLayout, state: torch.Tensor) -> torch.Tensor:
        """Each row's count, the state ``[slots + 1, 1]`` moved on past this step."""
        if batch.decode is not None:  # one token per row, slots from the fixed-shape tables
            slots = batch.decode.state_slots.long()
            before = torch.where(batch.positions == 0, 0.0, state[slots, 0])
            state[slots, 0] = before + 1
            return before + 1
        counts = torch.empty(batch.num_tokens, dtype=state.dtype, device=state.device)
        for seq in batch.sequences:
            before = state[seq.state_slot, 0] if seq.past > 0 else 0.0  # a new sequence starts at 0
            rows = slice(seq.start, seq.start + seq.length)
            counts[rows] = before + torch.arange(1, seq.length + 1, dtype=state.dtype, device=state.device)
            state[seq.state_slot, 0] = counts[rows][-1]
        return counts


@dataclass(frozen=True)
class TokenCounterSpec(MixerSpec):
    kind: ClassVar[str] = COUNTER

    period: float = 16.0


@dataclass(frozen=True)
class TokenCounterNames:
    kind: ClassVar[str] = COUNTER

    proj: str = "counter.proj"
    scale: str = "counter.scale"


def build_token_counter(
    reader: LayerReader, spec: TokenCounterSpec, names: TokenCounterNames
) -> TokenCounter:
    h = reader.hidden_size
    return TokenCounter(reader.linear(names.proj, h, h), reader.tensor(names.scale, [h]), spec.period)


def count_state(spec: TokenCounterSpec) -> RecurrentState:
    return RecurrentState({"count": (1,)}, dtype=torch.float32)


TOKEN_COUNTER = MixerKind(TokenCounterNames(), build_token_counter, count_state)


# -- the family: Llama whose layers of type "token_counter" count instead of attending ---------


class CountingLlama(Llama):
    hf_names = ("CountingLlamaForCausalLM",)

    def mixer(self, cfg: ModelConfig, layer_type: str, rope) -> MixerSpec:
        if layer_type == COUNTER:
            return TokenCounterSpec(float(cfg.get("count_period", 16.0)))
        return super().mixer(cfg, layer_type, rope)


def counting_footprint(cfg) -> CacheFootprint:
    """The family's layers as the app's torch-free memory estimate reads them from config.json:
    one float32 count per counting layer, keys and values in the others."""
    heads = cfg["num_attention_heads"]
    kv = (cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return layer_type_footprint(cfg["layer_types"], {COUNTER: (1, 4)}, kv)


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The kind's one registry line, the family's, and the family's torch-free footprint for the
    app's memory estimate (``engine.config_footprint``)."""
    with pytest.MonkeyPatch.context() as m:
        m.setitem(MIXERS, COUNTER, TOKEN_COUNTER)
        m.setitem(HYBRID_FOOTPRINTS, "CountingLlamaForCausalLM", counting_footprint)
        m.setitem(REGISTRY, "CountingLlamaForCausalLM", CountingLlama)
        yield


@pytest.fixture(scope="module")
def counting_dir(tiny_model_factory, tmp_path_factory) -> Path:
    """The tiny Llama with layers 1 and 3 made counters: their attention weights replaced by the
    counter's ``proj`` (near the identity) and ``scale``."""
    source, _ = tiny_model_factory("LlamaForCausalLM")
    directory = tmp_path_factory.mktemp("counting-llama")
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["CountingLlamaForCausalLM"]
    config["layer_types"] = [COUNTER if i in COUNTING_LAYERS else "full_attention" for i in range(4)]
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(source / "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    h = config["hidden_size"]
    for i in COUNTING_LAYERS:
        p = f"model.layers.{i}."
        tensors = {k: v for k, v in tensors.items() if not k.startswith(p + "self_attn.")}
        tensors[p + "counter.proj.weight"] = torch.eye(h) + 0.05 * torch.randn(h, h, generator=gen)
        tensors[p + "counter.scale"] = torch.randn(h, generator=gen)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def counting(counting_dir):
    return load_model(counting_dir, device="cpu")


class PositionCounter(nn.Module):
    """The counter without state: a token's count is its position plus one."""

    def __init__(self, counter: TokenCounter) -> None:
        super().__init__()
        self.counter = counter

    def forward(self, x: torch.Tensor, batch: BatchLayout, cache) -> torch.Tensor:
        counts = (batch.positions + 1).to(torch.float32)
        return self.counter.proj(x) + (counts / self.counter.period).to(x.dtype)[:, None] * self.counter.scale


@pytest.fixture(scope="module")
def reference(counting_dir):
    """The same model with stateless counters: what the stateful one must compute."""
    model = load_model(counting_dir, device="cpu")
    for i in COUNTING_LAYERS:
        block = model.module.blocks[i]
        block.mixer = PositionCounter(block.mixer)
    return model


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 23, 12)]


# -- the tests ---------------------------------------------------------------------------------


def test_layers_of_both_kinds_get_their_own_state(counting):
    blocks = counting.module.blocks
    assert [type(b.mixer) for b in blocks] == [Attention, TokenCounter, Attention, TokenCounter]
    cache = PagedKVCache.for_model(counting.spec, 64, page_size=8, max_sequences=3)
    kinds = [type(cache.layer(i)) for i in range(4)]
    assert kinds == [KVCacheLayer, RecurrentStateLayer, KVCacheLayer, RecurrentStateLayer]
    assert cache.layer(1)["count"].shape == (3 + 1, 1)  # a slot per sequence and a scratch row
    assert cache.state_slots.available == 3 and cache.pages.reuse_prefixes
    # Snapshots of the counters' state for prefix reuse: two per sequence, one per page at most.
    assert cache.snapshots.capacity == 6 and len(cache.snapshots) == 0


def test_the_state_is_carried_across_chunks_and_steps(counting, reference):
    """A prompt in chunks, then decode steps: the slot counts every token, and the logits are
    those of the stateless reference."""
    tokens = _prompts()[1] + [7, 8, 9]
    expected = score_tokens(reference.module, PagedKVCache.for_model(reference.spec, 64, page_size=8), tokens)
    cache = PagedKVCache.for_model(counting.spec, 64, page_size=8, max_sequences=2)
    other = cache.state_slots.allocate()  # another sequence's slot: must stay untouched
    slot, pages = cache.state_slots.allocate(), cache.pages.allocate(4)
    got, past = [], 0
    for chunk in (tokens[:9], tokens[9:23], tokens[23:24], tokens[24:25], tokens[25:]):
        (logits,) = run_step(counting.module, cache, [StepItem(chunk, past, pages, "all", state_slot=slot)])
        got.append(logits)
        past += len(chunk)
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-5, atol=1e-5)
    for i in COUNTING_LAYERS:
        count = cache.layer(i)["count"]
        assert count[slot, 0] == len(tokens) and count[other, 0] == 0


def _check_against_reference(reference, prompts, results) -> None:
    for prompt, result in zip(prompts, results):
        assert len(result.token_ids) == 6 and result.cached_tokens == 0
        sequence = prompt + result.token_ids
        cache = PagedKVCache.for_model(reference.spec, 64, page_size=8)
        logits = score_tokens(reference.module, cache, sequence[:-1])[len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == result.token_ids


@pytest.mark.parametrize("batched_decode", [False, True])
def test_continuous_batching_keeps_one_state_per_sequence(counting, reference, batched_decode):
    """Three jobs at once (prompts prefilled in chunks beside the others' decode steps; decode
    steps row by row, or in the fixed-shape path with the slots in its tables): each job's tokens
    are those of the stateless reference, and each slot comes back when its job finishes."""
    prompts = _prompts()
    options = EngineOptions(batched_decode=batched_decode)
    gen = Generator(counting, cache_tokens=256, page_size=8, max_chunk_tokens=8, options=options)
    slots, seen = gen.cache.state_slots, set()
    jobs = [Job(p, max_new_tokens=6, stop_token_ids=()) for p in prompts]
    for job in jobs:
        gen.enqueue(job)
    results = {job: [] for job in jobs}
    while gen.num_remaining_jobs:
        for r in gen.iterate():
            results[r.job].append(r)
        running = [run.state_slot for run in gen._active]
        assert None not in running and len(set(running)) == len(running)  # a slot each
        seen |= set(running)
    assert len(seen) == 3 and slots.available == slots.count  # all given back
    merged = [replace(rs[-1], token_ids=[t for r in rs for t in r.token_ids]) for rs in results.values()]
    _check_against_reference(reference, prompts, merged)


def test_a_freed_slot_starts_its_next_sequence_from_zero(counting, reference):
    """Two slots for three jobs: the third waits for a slot, gets one a finished job held (its
    count still there), and counts from zero."""
    prompts = _prompts()
    cache = PagedKVCache.for_model(counting.spec, 256, page_size=8, max_sequences=2)
    gen = Generator(counting, cache=cache, max_chunk_tokens=8)
    jobs = [Job(p, max_new_tokens=6, stop_token_ids=()) for p in prompts]
    results = gen.generate(jobs)
    assert cache.state_slots.available == 2
    _check_against_reference(reference, prompts, results)
    # The shortest job finished first and the third took its slot: the slots now hold the counts
    # of the second and third jobs, each its prompt and generated tokens but the last.
    counts = sorted(int(c) for c in cache.layer(1)["count"][:2, 0])
    assert counts == sorted(len(p) + 6 - 1 for p in prompts[1:])


def _record_logits(gen: Generator, monkeypatch) -> dict[Job, list[torch.Tensor]]:
    """Each job's logits rows, one per new token, of the steps ``gen`` runs from now on (a CPU
    generator without CUDA graphs runs every step through ``_eager_step``)."""
    rows: dict[Job, list[torch.Tensor]] = {}
    step = gen._eager_step

    def recording(items):
        out = step(items)
        job_of = {run.state_slot: run.job for run in gen._active}
        for item, row in zip(items, out):
            if row is not None:
                rows.setdefault(job_of[item.state_slot], []).append(row[-1])
        return out

    monkeypatch.setattr(gen, "_eager_step", recording)
    return rows


def _assert_cold_logits(reference, prompt: list[int], result, rows: list[torch.Tensor]) -> None:
    """The logits a job's tokens were chosen from are those of a cold run of the stateless
    reference (a state restored from the wrong snapshot, or not at all, shifts the counts)."""
    sequence = prompt + result.token_ids
    cache = PagedKVCache.for_model(reference.spec, 128, page_size=8)
    expected = score_tokens(reference.module, cache, sequence[:-1])[len(prompt) - 1 :]
    torch.testing.assert_close(torch.stack(rows), expected, rtol=1e-5, atol=1e-5)


def _run_alone(gen: Generator, prompt: list[int], logits: dict, new_tokens: int = 4):
    """One job's result and the prompt tokens it actually computed."""
    before = gen.prefilled_tokens
    (result,) = gen.generate([Job(prompt, max_new_tokens=new_tokens, stop_token_ids=())])
    return result, gen.prefilled_tokens - before


def _dirty_free_slots(gen: Generator) -> None:
    """What a freed slot may hold: counts no sequence resumes from."""
    for i in COUNTING_LAYERS:
        gen.cache.layer(i)["count"].fill_(1000.0)


@pytest.mark.parametrize("batched_decode", [False, True])
def test_a_repeated_prompt_resumes_from_the_snapshot_at_its_last_full_page(
    counting, reference, monkeypatch, batched_decode
):
    prompt = list(range(3, 40))  # 37 tokens: four full pages of 8, a snapshot after them
    options = EngineOptions(batched_decode=batched_decode)
    gen = Generator(counting, cache_tokens=256, page_size=8, options=options)
    logits = _record_logits(gen, monkeypatch)
    first, computed = _run_alone(gen, prompt, logits)
    assert (first.cached_tokens, computed) == (0, 37)
    _dirty_free_slots(gen)
    second, computed = _run_alone(gen, prompt, logits)
    assert (second.cached_tokens, computed) == (32, 5)
    assert second.token_ids == first.token_ids
    for result in (first, second):
        _assert_cold_logits(reference, prompt, result, logits[result.job])


# The decode paths a CPU generator can take: row by row, the fixed-shape step, and pipelined (the
# next step launched before the host reads the last one's tokens).
DECODE_PATHS = {
    "eager": EngineOptions(batched_decode=False),
    "fixed-shape": EngineOptions(batched_decode=True),
    "pipelined": EngineOptions(pipelined_decode=True),
}


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_a_chats_next_turn_resumes_after_the_last_full_page_of_the_reply(
    counting, reference, monkeypatch, path
):
    """Turn two (turn one's prompt and reply, then a new message) resumes from the snapshot the
    decode step that filled the reply's last full page left: only what follows is computed.
    Turn three resumes after turn two's reply in the same way."""
    gen = Generator(counting, cache_tokens=256, page_size=8, options=DECODE_PATHS[path])
    logits = _record_logits(gen, monkeypatch)
    turn = _prompts()[1] + list(range(50, 64))  # 37 tokens, then 37 + 6 + 10 = 53, then 69
    # Turn one computes 37 + 5 tokens (its last new token is never fed back): pages up to 40.
    for cached in (0, 40, 56):
        _dirty_free_slots(gen)
        result, computed = _run_alone(gen, turn, logits, new_tokens=6)
        assert result.cached_tokens == cached and computed == len(turn) - cached
        _assert_cold_logits(reference, turn, result, logits[result.job])
        turn = turn + result.token_ids + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert gen.cache.snapshots.held == 0


def test_a_job_cancelled_with_a_page_filling_step_in_flight_leaves_no_snapshot_of_it(
    counting, reference, monkeypatch
):
    """Pipelined, the step that fills a page copies the state when it is launched; the job is
    cancelled before its tokens are read: the copy is given back, unfiled, and a next turn resumes
    from the prompt's snapshot (the page was never registered)."""
    gen = Generator(counting, cache_tokens=256, page_size=8, options=DECODE_PATHS["pipelined"])
    prompt = _prompts()[1] + list(range(50, 66))  # 39 tokens: the first decode step fills page 5
    job = Job(prompt, max_new_tokens=20, stop_token_ids=())
    gen.enqueue(job)
    run = gen._by_job[job]
    while gen._flight is None:  # the prompt's steps, then the first decode step is launched
        gen.iterate()
    assert run.held_snapshots and gen.cache.snapshots.held == 1
    gen.cancel(job)
    assert gen.cache.snapshots.held == 0 and len(gen.cache.snapshots) == 1  # the prompt's, at 32
    _dirty_free_slots(gen)
    logits = _record_logits(gen, monkeypatch)
    turn = run.tokens + [11, 12, 13]
    result, computed = _run_alone(gen, turn, logits)
    assert (result.cached_tokens, computed) == (32, len(turn) - 32)
    _assert_cold_logits(reference, turn, result, logits[result.job])


def test_a_long_reply_keeps_the_snapshot_of_its_last_full_page_which_goes_with_it(counting):
    """Each page a decode step fills replaces the job's previous decode snapshot (a long reply
    takes one row of the pool, not one per page); snapshots count in the pool and go when their
    pages are evicted."""
    gen = Generator(counting, cache_tokens=256, page_size=8, options=DECODE_PATHS["pipelined"])
    prompt = _prompts()[1] + list(range(50, 64))  # 37 tokens: a snapshot after page 4
    (result,) = gen.generate([Job(prompt, max_new_tokens=30, stop_token_ids=())])
    keys = page_keys((prompt + result.token_ids)[:64], 8)  # 66 computed: pages up to 64 filled
    pool = gen.cache.snapshots
    assert [i + 1 for i, key in enumerate(keys) if key in pool] == [4, 8]
    assert len(pool) == 2 and pool.held == 0
    gen.cache.pages.allocate(gen.cache.pages.available)  # evicts every cached page
    assert len(pool) == 0


def test_a_prompt_shorter_than_a_page_leaves_no_snapshot(counting, reference, monkeypatch):
    gen = Generator(counting, cache_tokens=256, page_size=8)
    logits = _record_logits(gen, monkeypatch)
    prompt = [5, 6, 7, 8, 9]
    for _ in range(2):
        result, computed = _run_alone(gen, prompt, logits, new_tokens=3)  # nor fills one decoding
        assert (result.cached_tokens, computed) == (0, 5)
        _assert_cold_logits(reference, prompt, result, logits[result.job])
    assert len(gen.cache.snapshots) == 0


def test_a_cancelled_prefill_leaves_the_snapshots_it_completed(counting, reference, monkeypatch):
    """Chunks of one page leave a snapshot at every page boundary (the checkpoints of a long
    prompt); a job cancelled after two chunks leaves two, and the next run of its prompt resumes
    after the second."""
    gen = Generator(counting, cache_tokens=256, page_size=8, max_chunk_tokens=8)
    assert gen.snapshot_every == 1
    prompt = list(range(3, 40))
    job = Job(prompt, max_new_tokens=4, stop_token_ids=())
    gen.enqueue(job)
    gen.iterate()
    gen.iterate()
    gen.cancel(job)
    assert len(gen.cache.snapshots) == 2 and gen.cache.state_slots.available == gen.cache.state_slots.count
    _dirty_free_slots(gen)
    logits = _record_logits(gen, monkeypatch)
    result, computed = _run_alone(gen, prompt, logits)
    assert (result.cached_tokens, computed) == (16, 21)
    _assert_cold_logits(reference, prompt, result, logits[result.job])


@pytest.mark.parametrize("batched_decode", [False, True])
def test_jobs_batched_together_resume_from_a_shared_prefix(counting, reference, monkeypatch, batched_decode):
    """A system prompt's snapshot serves three jobs prefilled (in chunks beside each other's
    decode steps) and decoded together: each restores it into its own slot."""
    system = list(range(100, 120))  # 20 tokens: checkpoints after pages 1 and 2
    options = EngineOptions(batched_decode=batched_decode)
    gen = Generator(counting, cache_tokens=512, page_size=8, max_chunk_tokens=8, options=options)
    gen.generate([Job(system + [1, 2], max_new_tokens=2, stop_token_ids=())])
    _dirty_free_slots(gen)
    logits = _record_logits(gen, monkeypatch)
    prompts = [system + p for p in _prompts()]
    results = gen.generate([Job(p, max_new_tokens=6, stop_token_ids=()) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert result.cached_tokens == 16
        _assert_cold_logits(reference, prompt, result, logits[result.job])
    assert gen.cache.state_slots.available == gen.cache.state_slots.count


def test_the_memory_estimate_counts_what_the_cache_allocates(counting_dir, counting):
    """The app's torch-free estimate (config.json only) sees the counters as recurrent layers:
    keys and values of the two attention layers, the counters' state per sequence and the
    snapshot pool, exactly what the engine's cache of the model takes."""
    info = inspect_model(counting_dir)
    assert info.footprint == cache_footprint(counting.spec)
    assert len(info.footprint.kv_layers) == 2 and info.footprint.state_layers == ((1, 4), (1, 4))
    for tokens, bits in ((64, (16, 16)), (4096, (16, 16)), (4096, (4, 6))):
        cache = PagedKVCache.for_model(counting.spec, tokens, page_size=64, dtype=torch.float32, bits=bits)
        assert info.kv_cache_bytes(tokens, 4, bits) == cache.nbytes


def test_padding_rows_of_a_decode_graph_keep_off_the_sequences_state(counting, reference, monkeypatch):
    """The CUDA-graph runner pads 3 rows to 4 (the scratch page and the scratch state slot); a
    stand-in capture replays the step eagerly on the CPU."""
    from engine.generation.cuda_graph import DecodeGraphs

    use_eager_graphs(monkeypatch)
    prompts = _prompts()
    cache = PagedKVCache.for_model(counting.spec, 256, page_size=8, max_sequences=3)
    items = []
    for p in prompts:
        slot, pages = cache.state_slots.allocate(), cache.pages.allocate(5)
        run_step(counting.module, cache, [StepItem(p, 0, pages, None, state_slot=slot)])
        items.append(StepItem([9], len(p), pages, state_slot=slot))
    graphs = DecodeGraphs(counting.module, cache, max_batch=4, min_pages=1, exact_rows=2)  # 3 rows pad to 4
    for step in range(3):
        logits = graphs.run(items)
        assert graphs.captured == [(4, 4)]
        for p, row in zip(prompts, logits):
            ref = score_tokens(
                reference.module,
                PagedKVCache.for_model(reference.spec, 64, page_size=8),
                p + [9] * (step + 1),
            )
            torch.testing.assert_close(row[0], ref[-1], rtol=1e-5, atol=1e-5)
        items = [replace(item, past=item.past + 1) for item in items]
    for p, item in zip(prompts, items):
        assert cache.layer(3)["count"][item.state_slot, 0] == len(p) + 3


def test_the_converter_quantizes_the_counters_linear_and_copies_its_scale(
    counting_dir, tmp_path, monkeypatch
):
    """The converter lists each layer's linears from its modules: the counter's ``proj`` is
    quantized, its ``scale`` copied as stored, and the result loads and generates."""
    from quant_helpers import cheap_encoder, tiny_convert_options

    import engine.convert.quantize as quantize_mod
    from engine.convert.pipeline import convert_model
    from engine.exl3 import EXL3Linear

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    options = tiny_convert_options()
    convert_model(counting_dir, tmp_path / "exl3", options, log=lambda m: None)
    keys = set(load_file(str(tmp_path / "exl3" / "model.safetensors")))
    assert {"model.layers.1.counter.proj.trellis", "model.layers.3.counter.scale"} <= keys
    quantized = load_model(tmp_path / "exl3", device="cpu")
    assert isinstance(quantized.module.blocks[1].mixer.proj, EXL3Linear)
    (result,) = Generator(quantized, cache_tokens=64, page_size=8).generate(
        [Job([5, 6, 7], max_new_tokens=3)]
    )
    assert len(result.token_ids) >= 1


def test_a_synthetic_model_of_the_hybrid_shape_builds(counting_dir):
    """Benchmarks' random-weight models take their tensors from the layers' kinds too."""
    from engine.loading.synthetic_store import synthetic_model

    config = json.loads((counting_dir / "config.json").read_text())
    model = synthetic_model(config, bits=4, dtype=torch.float32, exl3_mode="dense")
    assert isinstance(model.module.blocks[3].mixer, TokenCounter)
    assert isinstance(model.module.blocks[3].mixer.proj, torch.nn.Module)
    cache = PagedKVCache.for_model(model.spec, 32, page_size=16)
    assert torch.isfinite(score_tokens(model.module, cache, list(range(3, 19)))).all()


@pytest.mark.cuda
def test_decode_graphs_capture_the_counter_on_a_gpu(counting_dir):
    """On a GPU the counting model's decode steps are captured in CUDA graphs and replayed,
    pipelined (each row's state slot travels in the step's input buffer): the tokens are those of
    eager steps, and every slot comes back."""
    model = load_model(counting_dir, device="cuda", dtype="float32")
    jobs = [Job(p, max_new_tokens=12, stop_token_ids=()) for p in _prompts()]
    tokens = {}
    for graphs in (False, True):
        gen = Generator(model, cache_tokens=256, page_size=8, options=EngineOptions(cuda_graphs=graphs))
        tokens[graphs] = [r.token_ids for r in gen.generate(jobs)]
        assert gen.cache.state_slots.available == gen.cache.state_slots.count
    assert gen._graphs is not None and gen._graphs.failed is None and gen._graphs.captured
    assert tokens[True] == tokens[False]


@pytest.mark.cuda
def test_a_chats_next_turn_resumes_from_a_snapshot_on_a_gpu(counting_dir):
    """On a GPU (CUDA graphs, pipelined decode) a decode step's snapshot is copied on the stream
    right behind the replay that fills the page, before the next one is launched: two chats'
    second turns, run together, resume after their replies' last full pages and give a cold
    generator's tokens."""
    model = load_model(counting_dir, device="cuda", dtype="float32")
    gen = Generator(model, cache_tokens=256, page_size=8)
    assert gen._use_graphs and gen._pipeline
    turn1 = [list(range(3, 40)), list(range(100, 130))]  # 37 and 30 tokens
    first = gen.generate([Job(p, max_new_tokens=12, stop_token_ids=()) for p in turn1])
    # Computed: 37 + 11 and 30 + 11 tokens; turn two's prompts: 54 and 47 tokens.
    turn2 = [p + r.token_ids + [11, 12, 13, 14, 15] for p, r in zip(turn1, first)]
    jobs = [Job(p, max_new_tokens=12, stop_token_ids=()) for p in turn2]
    warm = gen.generate(jobs)
    assert gen._graphs is not None and gen._graphs.failed is None and gen._graphs.captured
    cold = Generator(model, cache_tokens=256, page_size=8).generate(jobs)
    assert [r.cached_tokens for r in warm] == [48, 40] and [r.cached_tokens for r in cold] == [0, 0]
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert gen.cache.snapshots.held == 0
