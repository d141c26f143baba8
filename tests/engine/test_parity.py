"""Our logits against transformers' on tiny random models of every supported architecture."""

import pytest
import torch
from parity import rel_err
from tiny_models import VARIANTS

from engine.cache.paged import PagedKVCache
from engine.generation.step import StepItem, run_step, score_tokens
from engine.model import load_model

TOL = 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant, tiny_model_factory):
    directory, reference = tiny_model_factory(variant)
    ids = torch.randint(0, reference.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0].float()
    model = load_model(directory, device="cpu")
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    got = score_tokens(model.module, cache, ids.tolist(), chunk=20)  # chunked prefill across pages
    assert got.shape == expected.shape
    assert rel_err(got, expected) < TOL


@pytest.mark.parametrize(
    "variant",
    [
        "LlamaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
    ],
)
def test_ragged_batch_matches_single_runs(variant, tiny_model_factory):
    """Three sequences of different lengths share the paged cache: chunked prefill together, then
    batched decode steps, give the same logits as each sequence alone."""
    directory, reference = tiny_model_factory(variant)
    model = load_model(directory, device="cpu")
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (37, 5, 70)]
    decode = [torch.randint(0, 320, (4,), generator=gen).tolist() for _ in seqs]

    alone = []
    for seq, extra in zip(seqs, decode):
        cache = PagedKVCache.for_model(model.spec, 128, page_size=16)
        alone.append(score_tokens(model.module, cache, seq + extra, chunk=512))

    cache = PagedKVCache.for_model(model.spec, 512, page_size=16)
    tables = [cache.pages.allocate(8) for _ in seqs]
    # Interleave pages so sequences do not sit in contiguous memory.
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(d < len(s) for d, s in zip(done, seqs)):  # prefill in chunks of at most 16 tokens
        items, owners = [], []
        for i, seq in enumerate(seqs):
            if done[i] < len(seq):
                piece = seq[done[i] : done[i] + 16]
                items.append(StepItem(piece, done[i], tables[i], "all"))
                owners.append(i)
                done[i] += len(piece)
        for i, logits in zip(owners, run_step(model.module, cache, items)):
            got[i].append(logits)
    for step in range(4):  # batched decode
        items = [
            StepItem([decode[i][step]], len(seqs[i]) + step, tables[i], "last") for i in range(len(seqs))
        ]
        for i, logits in enumerate(run_step(model.module, cache, items)):
            got[i].append(logits)
    for i in range(len(seqs)):
        assert rel_err(torch.cat(got[i]), alone[i]) < 1e-5
