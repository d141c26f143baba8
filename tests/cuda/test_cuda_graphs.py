"""Decode steps replayed from CUDA graphs give what the eager step gives (issue 6)."""

import dataclasses
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import kernels
from engine.cache.paged import PagedKVCache
from engine.generation.cuda_graph import DecodeGraphs
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import StepItem, run_step, score_tokens
from engine.kernels import attention, fused, loader
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPTS = (5, 16, 29)  # the first one crosses a 16-token page boundary within 32 new tokens


def _jobs(batch: int) -> list[Job]:
    return [
        Job(list(range(3 + i, 3 + i + n)), max_new_tokens=32, stop_token_ids=())
        for i, n in enumerate(PROMPTS[:batch])
    ]


def _generate(model, batch: int, graphs: bool, options: EngineOptions | None = None):
    options = dataclasses.replace(options or EngineOptions(), cuda_graphs=graphs)
    gen = Generator(model, cache_tokens=1024, page_size=16, options=options)
    results = gen.generate(_jobs(batch))
    assert gen.cache.pages.available == gen.cache.num_pages  # padding pages were given back
    return [r.token_ids for r in results], gen


def _assert_same_tokens(model, batch, eager, graphed):
    """Equal greedy tokens; where fp16 rounding differs between the two paths, a divergence is
    allowed only at a near tie of the eager logits (then the rest of the sequence differs). bf16
    rounds 8x coarser than fp16: its near ties are wider."""
    tie = 6e-2 if model.dtype == torch.bfloat16 else 2e-2
    for job, a, b in zip(_jobs(batch), eager, graphed):
        if a == b:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        cache = PagedKVCache.for_model(model.spec, 1024, page_size=16, dtype=model.dtype, device="cuda")
        logits = score_tokens(model.module, cache, list(job.input_ids) + a[:i])[-1]
        gap = (logits[a[i]] - logits[b[i]]).abs().item()
        assert gap < tie * logits.abs().max().item(), f"diverged at token {i} with a margin of {gap}"


# Gemma 3: sandwich norms and q/k norms around the fused residual norms; bf16: the real models' dtype.
@pytest.mark.parametrize("variant", ["LlamaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_greedy_generation_with_graphs_equals_eager(variant, batch, dtype, tmp_path):
    build_tiny_model(variant, tmp_path)
    model = load_model(tmp_path, device="cuda", dtype=dtype)
    eager, gen_eager = _generate(model, batch, graphs=False)
    graphed, gen = _generate(model, batch, graphs=True)
    assert gen_eager._graphs is None
    assert gen._graphs is not None and gen._graphs.failed is None, gen._graphs.failed
    assert gen._graphs.captured  # the decode steps really went through graphs
    assert [len(t) for t in graphed] == [32] * batch
    _assert_same_tokens(model, batch, eager, graphed)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_generation_with_graphs_equals_eager_exl3(exl3_dir, batch):
    model = load_model(exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1", device="cuda", dtype="float16")
    eager, _ = _generate(model, batch, graphs=False)
    graphed, gen = _generate(model, batch, graphs=True)
    assert gen._graphs.failed is None, gen._graphs.failed
    assert gen._graphs.captured
    _assert_same_tokens(model, batch, eager, graphed)


@pytest.mark.parametrize("bits", [16, 4])
def test_replayed_logits_follow_the_eager_step_across_page_boundaries(tmp_path, bits):
    """Step by step, teacher-forced: each replay's logits match run_step's, while lengths cross
    several page boundaries and the page bucket (so the captured graph) changes."""
    build_tiny_model("Gemma2ForCausalLM", tmp_path)
    model = load_model(tmp_path, device="cuda", dtype="float32")

    def make():
        return PagedKVCache.for_model(model.spec, 512, page_size=8, device="cuda", bits=(bits, bits))

    ref_cache, cache = make(), make()
    tables = [ref_cache.pages.allocate(12) for _ in range(3)]
    assert [cache.pages.allocate(12) for _ in range(3)] == tables
    gen = torch.Generator().manual_seed(0)
    items = []
    for n, table in zip((6, 8, 17), tables):
        prompt = torch.randint(3, 320, (n,), generator=gen).tolist()
        for c in (ref_cache, cache):
            run_step(model.module, c, [StepItem(prompt[:-1], 0, table, None)])
        items.append(StepItem([prompt[-1]], n - 1, table))
    graphs = DecodeGraphs(model.module, cache, max_batch=8, min_pages=1, exact_rows=2)  # 3 rows pad to 4
    for _ in range(40):
        expected = run_step(model.module, ref_cache, items)
        got = graphs.run(items)
        assert got is not None and graphs.failed is None, graphs.failed
        for g, e in zip(got, expected):
            rel = ((g - e).norm() / e.norm()).item()
            assert rel < (1e-4 if bits == 16 else 5e-2)
        tokens = [int(e.argmax()) for e in expected]
        items = [StepItem([t], i.past + 1, i.block_table) for t, i in zip(tokens, items)]
    assert {pages for _, pages in graphs.captured} >= {4, 8}  # replayed after the page bucket grew
    # A smaller batch reuses the pool with another graph.
    assert graphs.run(items[:1]) is not None


@pytest.mark.parametrize("variant", ["LlamaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_residual_norms_and_kv_writes_change_no_bit(variant, dtype, tmp_path, monkeypatch):
    """The decoder's fused add + RMSNorm, the one-launch KV write and RoPE + KV write in one
    launch (ext/fused_ops.cu) give the logits of the unfused kernels bit for bit: a prefill, then
    teacher-forced decode steps replayed from CUDA graphs (so the fused kernels are also
    captured)."""
    build_tiny_model(variant, tmp_path)
    model = load_model(tmp_path, device="cuda", dtype=dtype)

    def run() -> list[torch.Tensor]:
        return _forced_decode(model)

    used = Counter()

    def spy(module, name):
        real = getattr(module, name)

        def call(*args):
            result = real(*args)
            used[name] += result is not None
            return result

        return call

    with monkeypatch.context() as m:
        m.setattr(fused, "add_rms_norm", spy(fused, "add_rms_norm"))
        m.setattr(fused, "rope_kv_write", spy(fused, "rope_kv_write"))
        one_launch = run()
    assert used["add_rms_norm"] > 0 and used["rope_kv_write"] > 0  # the fused kernels ran
    with monkeypatch.context() as m:  # RoPE and the KV write as two launches
        m.setattr(fused, "rope_kv_write", lambda *args: None)
        m.setattr(attention, "kv_cache_write", spy(attention, "kv_cache_write"))
        apart = run()
    assert used["kv_cache_write"] > 0
    with monkeypatch.context() as m:
        m.setattr(fused, "add_rms_norm", lambda *args: None)
        m.setattr(fused, "rope_kv_write", lambda *args: None)
        m.setattr(attention, "kv_cache_write", lambda *args: None)
        plain = run()
    _assert_same_logits(one_launch, plain)
    _assert_same_logits(apart, plain)


def _forced_decode(model, bits: int = 16, steps: int = 24) -> list[torch.Tensor]:
    """Logits of a prefill of three prompts, then of ``steps`` teacher-forced decode steps of the
    three replayed from CUDA graphs (so the step's kernels are also captured)."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (6, 19, 11)]
    forced = torch.randint(3, 320, (steps, 3), generator=gen).tolist()
    cache = PagedKVCache.for_model(
        model.spec, 512, page_size=8, dtype=model.dtype, device="cuda", bits=(bits, bits)
    )
    tables = [cache.pages.allocate(8) for _ in prompts]
    items = [StepItem(p, 0, t, "last") for p, t in zip(prompts, tables)]
    out = run_step(model.module, cache, items)
    graphs = DecodeGraphs(model.module, cache, max_batch=4, min_pages=1)
    past = [len(p) for p in prompts]
    for tokens in forced:
        items = [StepItem([t], n, table) for t, n, table in zip(tokens, past, tables)]
        got = graphs.run(items)
        assert got is not None and graphs.failed is None, graphs.failed
        out += got
        past = [n + 1 for n in past]
    assert len(out) == 3 + 3 * steps
    return out


def _assert_same_logits(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), f"logits {i} differ: max {(g - e).abs().max().item()}"


CHAINED_CASES = [
    "LlamaForCausalLM-bfloat16-16",
    "LlamaForCausalLM-float16-4",
    "Gemma3ForCausalLM-bfloat16-16",
    "exl3",
]


@pytest.mark.parametrize("case", CHAINED_CASES)
def test_chained_launches_change_no_bit(case, tmp_path, request, monkeypatch):
    """Chained launches (ext/chained_launch.cuh: a kernel starts during the previous one and waits
    for it before touching its data) change when kernels start, never what they compute: the same
    logits bit for bit as unchained launches, through the captured graphs (the cluster GEMV, norms, RoPE,
    KV writes dense and quantized, attention and its combine, activation)."""
    if case == "exl3":
        path = request.getfixturevalue("exl3_dir") / "tiny-llama-exl3-4.0bpw-h6-mul1"
        dtype, bits = "float16", 16
    else:
        variant, dtype, bits_text = case.split("-")
        build_tiny_model(variant, tmp_path)
        path, bits = tmp_path, int(bits_text)
    model = load_model(path, device="cuda", dtype=dtype)
    ext = kernels.extension()
    if not kernels.chained_launches_supported(torch.device("cuda")):
        pytest.skip("chained launches need sm_90 and this extension")
    settings = []
    real = ext.set_chained_launches
    monkeypatch.setattr(ext, "set_chained_launches", lambda on: settings.append(on) or real(on))
    with monkeypatch.context() as m:  # as on a GPU without programmatic dependent launch
        m.setattr(loader, "chained_launches_supported", lambda device: False)
        plain = _forced_decode(model, bits)
    assert True not in settings
    chained = _forced_decode(model, bits)
    assert True in settings  # the steps really ran chained
    assert real(False) is False  # and every step switched it off again
    _assert_same_logits(chained, plain)


@pytest.mark.parametrize("batch", [1, 3])
def test_pipelined_graph_decode_equals_unpipelined(batch, tmp_path, monkeypatch):
    """The pipelined steps feed the graph its tokens from the device: the same graphs, the same
    inputs, so the same tokens bit for bit; also when jobs end at different steps (limits, a
    stop token) while the next step is already in flight."""
    build_tiny_model("LlamaForCausalLM", tmp_path)
    model = load_model(tmp_path, device="cuda", dtype="bfloat16")

    def run(pipeline: bool, stop: tuple[int, ...] = ()):
        options = EngineOptions(cuda_graphs=True, pipelined_decode=pipeline)
        gen = Generator(model, cache_tokens=1024, page_size=16, options=options)
        jobs = [
            Job(list(range(3 + i, 3 + i + n)), max_new_tokens=32 - 9 * i, stop_token_ids=stop)
            for i, n in enumerate(PROMPTS[:batch])
        ]
        results = gen.generate(jobs)
        assert gen.cache.pages.available == gen.cache.num_pages and gen._flight is None
        return [(r.token_ids, r.stop_reason) for r in results], gen

    landed = Counter()
    original = Generator._land
    monkeypatch.setattr(Generator, "_land", lambda self: landed.update([1]) or original(self))
    piped, gen = run(True)
    assert landed[1] >= 20 and gen._graphs.captured
    plain, _ = run(False)
    assert piped == plain
    stop = (piped[0][0][7],)  # the first job stops at its eighth token (or earlier)
    assert run(True, stop)[0] == run(False, stop)[0]
