"""engine.cache.snapshots: snapshots of the recurrent layers' state for prefix reuse, kept by page
key, gone with their page, least recently used out first when the pool is full."""

from __future__ import annotations

import pytest
import torch

from engine.cache.paged import PagedKVCache
from engine.cache.pages import page_keys
from engine.cache.snapshots import snapshot_positions
from engine.cache.state import KVPages, RecurrentState
from engine.generation.generator import Generator
from engine.generation.job import Job, JobResult
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.options import EngineOptions

# Attention, two recurrent kinds of several tensors each (one in its own dtype), and a layer that
# keeps nothing: the pool copies every named tensor of every recurrent layer, whatever the kind.
STATES = [
    KVPages(1, 8),
    RecurrentState({"matrix": (2, 3), "window": (4,)}),
    None,
    RecurrentState({"count": (1,)}, dtype=torch.float64),
]
RECURRENT = (1, 3)


def _cache(num_pages: int = 4, snapshots: int | None = None) -> PagedKVCache:
    return PagedKVCache.for_layers(STATES, num_pages, page_size=4, max_sequences=2, snapshots=snapshots)


def _state(cache: PagedKVCache, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for i in RECURRENT for t in cache.layer(i).tensors.values()]


def _fill(cache: PagedKVCache, slot: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for i in RECURRENT:
        for t in cache.layer(i).tensors.values():
            t[slot] = torch.randn(t[slot].shape, generator=gen, dtype=torch.float64).to(t.dtype)


def _named_page(cache: PagedKVCache, tokens: list[int]) -> tuple[int, bytes]:
    (page,) = cache.pages.allocate(1)
    (key,) = page_keys(tokens, cache.page_size)
    cache.pages.register(page, key)
    return page, key


def test_a_snapshot_restores_every_tensor_of_every_recurrent_layer():
    cache = _cache()
    _, key = _named_page(cache, [1, 2, 3, 4])
    _fill(cache, 0, seed=1)
    kept = _state(cache, 0)
    cache.snapshots.save(key, 0)
    _fill(cache, 0, seed=2)  # the sequence goes on
    _fill(cache, 1, seed=3)  # a slot holding another sequence's leftovers
    after = _state(cache, 0)
    cache.snapshots.restore(key, 1)
    for got, want in zip(_state(cache, 1), kept):
        assert torch.equal(got, want)
    for got, want in zip(_state(cache, 0), after):  # the source slot is left alone
        assert torch.equal(got, want)


def test_a_snapshot_goes_with_its_page():
    cache = _cache(num_pages=4)
    page, key = _named_page(cache, [1, 2, 3, 4])
    cache.snapshots.save(key, 0)
    cache.pages.release([page])  # cached, unreferenced: still matchable, snapshot kept
    assert key in cache.snapshots and cache.snapshots.resume_point([key]) == 1
    cache.pages.allocate(3)  # the never-used pages first
    assert key in cache.snapshots
    cache.pages.allocate(1)  # now the cached page is evicted, and its snapshot with it
    assert key not in cache.snapshots and len(cache.snapshots) == 0
    assert cache.snapshots.resume_point([key]) == 0


def test_forgetting_the_cached_pages_forgets_their_snapshots():
    cache = _cache()
    page, key = _named_page(cache, [1, 2, 3, 4])
    cache.snapshots.save(key, 0)
    cache.pages.release([page])
    cache.pages.clear_cached()
    assert len(cache.snapshots) == 0


def test_a_full_pool_evicts_the_least_recently_used_snapshot():
    cache = _cache(num_pages=8, snapshots=2)
    keys = [_named_page(cache, [n] * 4)[1] for n in range(3)]
    cache.snapshots.save(keys[0], 0)
    cache.snapshots.save(keys[1], 0)
    cache.snapshots.restore(keys[0], 1)  # used: now the most recent
    cache.snapshots.save(keys[2], 0)
    assert [k in cache.snapshots for k in keys] == [True, False, True]


def test_resuming_stops_at_the_last_matched_page_with_a_snapshot():
    cache = _cache(num_pages=8)
    keys = page_keys(list(range(16)), 4)
    for key in keys:
        (page,) = cache.pages.allocate(1)
        cache.pages.register(page, key)
    cache.snapshots.save(keys[1], 0)
    assert cache.snapshots.resume_point(keys) == 2
    assert cache.snapshots.resume_point(keys[:1]) == 0
    cache.snapshots.save(keys[3], 0)
    assert cache.snapshots.resume_point(keys) == 4


def test_the_pool_counts_in_the_cache_and_a_model_without_recurrent_layers_has_none():
    cache = _cache(num_pages=4)  # two slots: a pool of four snapshots (at most one per page)
    state_bytes = 4 * (2 * 3 + 4) + 8 * 1  # float32 matrix and window, a float64 count
    assert cache.snapshots.capacity == 4 and cache.snapshots.nbytes == 4 * state_bytes
    kv = 4 * 4 * 2 * 8 * 4  # pages x page size x (K, V) x head size x float32
    assert cache.nbytes == kv + (2 + 1 + 4) * state_bytes
    plain = PagedKVCache.for_layers([KVPages(1, 8)], 4, page_size=4)
    assert plain.snapshots is None and plain.nbytes == kv and plain.state_slots.count == 0


@pytest.mark.parametrize(
    "prompt_len, start, every, expected",
    [
        (37, 0, 100, [32]),  # the end of the last full page
        (32, 0, 100, [24, 32]),  # ends on a boundary: also the page a repeat can match to
        (5, 0, 1, []),  # shorter than a page: none
        (37, 0, 1, [8, 16, 24, 32]),  # checkpoints every page
        (37, 16, 1, [24, 32]),  # resumed at 16: only those ahead
        (40, 0, 2, [16, 32, 40]),
    ],
)
def test_snapshot_positions(prompt_len, start, every, expected):
    assert snapshot_positions(prompt_len, start, 8, every) == expected


def _two_turns(model, options: EngineOptions) -> tuple[JobResult, int]:
    """A chat's second turn (the first turn's prompt and reply, then five new tokens): its
    result and the prompt tokens it computed. Its logits must be a cold computation's (its
    tokens are each step's argmax, so equal logits give equal tokens)."""
    gen = Generator(model, cache_tokens=256, page_size=8, options=options)
    logits = []
    step = gen._eager_step  # every step of a CPU generator without CUDA graphs

    def recording(items):
        out = step(items)
        logits.extend(row[-1] for row in out if row is not None)
        return out

    gen._eager_step = recording
    turn1 = torch.randint(3, 300, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    (first,) = gen.generate([Job(turn1, max_new_tokens=5, stop_token_ids=())])
    turn2 = turn1 + first.token_ids + [7, 8, 9, 10, 11]
    logits.clear()
    before = gen.prefilled_tokens
    (second,) = gen.generate([Job(turn2, max_new_tokens=5, stop_token_ids=())])
    cache = PagedKVCache.for_model(model.spec, 128, page_size=8)
    cold = score_tokens(model.module, cache, (turn2 + second.token_ids)[:-1])[len(turn2) - 1 :]
    torch.testing.assert_close(torch.stack(logits), cold, rtol=1e-5, atol=1e-5)
    return second, gen.prefilled_tokens - before


# Turn one computes 45 + 4 tokens: its decode steps fill the page that ends at 48, and turn two
# (55 tokens) resumes there.
RESUMED_AT = 48


@pytest.mark.parametrize("variant", ["Qwen3NextForCausalLM", "Lfm2ForCausalLM", "NemotronHForCausalLM"])
def test_a_chats_next_turn_resumes_on_the_real_recurrent_kinds(variant, tiny_model_factory):
    """Gated delta nets, short convolutions and Mamba-2 (convolution windows and state matrices)
    snapshot and restore with no code of their own: turn two resumes at the end of turn one's
    last full page, which a decode step filled, and its logits are a cold computation's."""
    model = load_model(tiny_model_factory(variant)[0], device="cpu")
    second, computed = _two_turns(model, EngineOptions())
    assert second.cached_tokens == RESUMED_AT and computed == 55 - RESUMED_AT


@pytest.mark.parametrize(
    "options",
    [
        EngineOptions(batched_decode=False),
        EngineOptions(batched_decode=True),
        EngineOptions(pipelined_decode=True),
    ],
    ids=["eager", "fixed-shape", "pipelined"],
)
def test_a_qwen3_5_chats_next_turn_resumes_after_the_reply_on_every_decode_path(options, tiny_model_factory):
    model = load_model(tiny_model_factory("Qwen3_5ForCausalLM")[0], device="cpu")
    second, computed = _two_turns(model, options)
    assert second.cached_tokens == RESUMED_AT and computed == 55 - RESUMED_AT
