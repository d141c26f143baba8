"""The fixed-shape decode path (padded block tables + device lengths, what CUDA graphs replay)
computes the same logits as the per-sequence step, on the CPU."""

import pytest
import torch
from eager_graphs import use_eager_graphs

from engine.cache.paged import PagedKVCache
from engine.generation.cuda_graph import DecodeGraphs, _bucket
from engine.generation.decode_inputs import DecodeInputs, run_decode_step
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import StepItem, run_step
from engine.model import load_model
from engine.options import EngineOptions

PAGE = 8
PROMPTS = (7, 8, 21)  # first decode at the last slot of a page, at a new page, past Gemma 2's window


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _setup(tiny_model_factory, variant: str, bits: int):
    directory, _ = tiny_model_factory(variant)
    model = load_model(directory, device="cpu", dtype="float32")

    def cache():
        return PagedKVCache.for_model(model.spec, 40 * PAGE, page_size=PAGE, bits=(bits, bits))

    return model, cache


def _prefill(model, cache, tables, gen):
    """Prompts of ``PROMPTS`` lengths into ``cache``; returns the decode items of the first step."""
    items = []
    for n, table in zip(PROMPTS, tables):
        prompt = torch.randint(3, 320, (n,), generator=gen).tolist()
        run_step(model.module, cache, [StepItem(prompt[:-1], 0, table, None)])
        items.append(StepItem([prompt[-1]], n - 1, table))
    return items


def _tables(cache):
    """Scattered, interleaved pages (a sequence's pages are not consecutive)."""
    pages = cache.pages.allocate(30)
    return [pages[0::3], pages[1::3][::-1], pages[2::3]]


@pytest.mark.parametrize(
    "variant,bits",
    [("LlamaForCausalLM", 16), ("Gemma2ForCausalLM", 16), ("LlamaForCausalLM", 4), ("Qwen3ForCausalLM", 8)],
)
def test_fixed_shape_decode_matches_per_sequence_step(tiny_model_factory, variant, bits):
    model, make_cache = _setup(tiny_model_factory, variant, bits)
    ref_cache, cache = make_cache(), make_cache()
    tables = _tables(ref_cache)
    assert _tables(cache) == tables
    (scratch,) = cache.pages.allocate(1)
    ref_items = _prefill(model, ref_cache, tables, torch.Generator().manual_seed(1))
    items = _prefill(model, cache, tables, torch.Generator().manual_seed(1))
    for step in range(12):  # lengths cross page boundaries (8, 16, 24) and Gemma 2's window (16)
        expected = run_step(model.module, ref_cache, ref_items)
        # Alternate the fixed shapes: exact, padded rows (scratch page), padded table columns.
        # A quantized cache keeps the real batch: padding rows change the GEMM's blocking, hence
        # the last bit of a key, which can flip a code (a different, equally good rounding).
        batch, pages = [(3, None), (4, 5), (8, 10)][step % 3]
        batch = batch if bits == 16 else 3
        got = run_decode_step(model.module, cache, items, max_pages=pages, batch=batch, scratch_page=scratch)
        # Even at the real batch a code can flip: the per-sequence reference runs other GEMM
        # shapes than the fixed-shape step (seen on a Xeon at 8 bits: 4e-4 relative); a wrong page
        # or table entry moves the logits by order 1.
        tol = 1e-5 if bits == 16 else 2e-3
        for g, e in zip(got, expected):
            assert g.shape == e.shape == (1, 320)
            assert _rel(g, e) < tol
        tokens = [int(e.argmax()) for e in expected]
        ref_items = [StepItem([t], i.past + 1, i.block_table) for t, i in zip(tokens, ref_items)]
        items = [StepItem([t], i.past + 1, i.block_table) for t, i in zip(tokens, items)]


def test_inputs_rewrite_only_changed_table_rows_and_pad_on_the_scratch_page():
    inputs = DecodeInputs(batch=4, max_pages=3, page_size=PAGE, device="cpu")
    items = [StepItem([11], 9, [5, 6]), StepItem([12], 0, [7])]
    inputs.fill(items, scratch_page=2)
    a = inputs.buffer.view(-1)
    b = 4
    assert a[:b].tolist() == [11, 12, 0, 0]  # ids
    assert a[b : 2 * b].tolist() == [9, 0, 0, 1]  # positions
    assert a[2 * b : 3 * b].tolist() == [6 * PAGE + 1, 7 * PAGE, 2 * PAGE, 2 * PAGE + 1]  # write slots
    ids, layout = inputs.views()
    assert layout.decode.lengths.dtype == layout.decode.block_tables.dtype == torch.int32  # no conversion
    assert layout.decode.lengths.tolist() == inputs.lengths().tolist() == [10, 1, 1, 2]
    assert layout.decode.block_tables.tolist() == [[5, 6, 5], [7, 7, 7], [2, 2, 2], [2, 2, 2]]
    assert inputs.tables().data_ptr() == layout.decode.block_tables.data_ptr()  # views of the buffer
    assert ids.data_ptr() == inputs.buffer.data_ptr()
    inputs.host[3 * b :].view(torch.int32)[b] = 99  # a row not rewritten when its table is unchanged ...
    inputs.fill(items, scratch_page=2)
    assert inputs.tables()[0, 0].item() == 99
    inputs.fill([StepItem([11], 10, [5, 8])], scratch_page=2)  # ... and rewritten when it changed
    assert inputs.tables().tolist()[:2] == [[5, 8, 5], [2, 2, 2]]


def test_decode_graphs_bucket_pad_and_free_the_scratch_page(tiny_model_factory, monkeypatch):
    use_eager_graphs(monkeypatch)
    model, make_cache = _setup(tiny_model_factory, "LlamaForCausalLM", 16)
    ref_cache, cache = make_cache(), make_cache()
    tables = _tables(ref_cache)
    _tables(cache)
    ref_items = _prefill(model, ref_cache, tables, torch.Generator().manual_seed(2))
    items = _prefill(model, cache, tables, torch.Generator().manual_seed(2))
    graphs = DecodeGraphs(model.module, cache, max_batch=8, max_pages=4, exact_rows=2)
    free = cache.pages.available
    for _ in range(12):
        expected = run_step(model.module, ref_cache, ref_items)
        got = graphs.run(items)
        if max(i.past for i in items) >= 4 * PAGE:  # beyond max_pages: the caller runs eagerly
            assert got is None
            got = run_step(model.module, cache, items)
        assert cache.pages.available == free  # the padding page went back
        for g, e in zip(got, expected):
            assert _rel(g, e) < 1e-5
        tokens = [int(e.argmax()) for e in expected]
        ref_items = [StepItem([t], i.past + 1, i.block_table) for t, i in zip(tokens, ref_items)]
        items = [StepItem([t], i.past + 1, i.block_table) for t, i in zip(tokens, items)]
    assert graphs.captured == [(4, 4)]  # 3 sequences pad to 4 rows (2 exact); 3..4 pages to 4
    assert graphs.run([StepItem([1, 2], 0, tables[0])]) is None  # a prefill chunk never fits


def test_buckets():
    assert [_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [_bucket(n, 32, exact=8) for n in (1, 3, 5, 7, 8, 9, 12, 17)] == [1, 3, 5, 7, 8, 16, 16, 32]
    assert _bucket(5, 6) == 6
    assert [_bucket(n, 128, 8) for n in (1, 8, 9, 100, 128)] == [8, 8, 16, 128, 128]


def test_generator_uses_graphs_only_on_cuda_and_not_when_disabled(tiny_model_factory, monkeypatch):
    directory, _ = tiny_model_factory("LlamaForCausalLM")
    model = load_model(directory, device="cpu", dtype="float32")
    assert not Generator(model, cache_tokens=256, page_size=PAGE)._use_graphs  # CPU model
    assert not EngineOptions.from_environment({"TRELLIS_NO_GRAPHS": "1"}).cuda_graphs
    assert EngineOptions.from_environment({"TRELLIS_NO_GRAPHS": "0"}).cuda_graphs
    assert EngineOptions().cuda_graphs
    # Forced on (as on a GPU), with capture stubbed: the generator's tokens are unchanged.
    use_eager_graphs(monkeypatch)
    jobs = lambda: [Job(list(range(3, 3 + n)), max_new_tokens=10, stop_token_ids=()) for n in (5, 17, 9)]  # noqa: E731
    eager = Generator(model, cache_tokens=512, page_size=PAGE).generate(jobs())
    gen = Generator(model, cache_tokens=512, page_size=PAGE)
    gen._use_graphs = True
    graphed = gen.generate(jobs())
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert gen._graphs is not None and gen._graphs.captured
    assert gen.cache.pages.available == gen.cache.num_pages
