"""The mixture-of-experts block against a naive per-token loop, and MoE checkpoints as they come:
per-expert or fused expert tensors, missing tensors named, a bad top-k refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from synthetic_shapes import tiny_moe_shape

from engine.cache.paged import PagedKVCache
from engine.errors import ModelLoadError
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE

HIDDEN, WIDTH = 16, 24


def _expert(gen: torch.Generator) -> GatedMLP:
    def w(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) / inp**0.5

    gate_up = ProjectionGroup(
        [(DenseLinear(w(WIDTH, HIDDEN)), [WIDTH]), (DenseLinear(w(WIDTH, HIDDEN)), [WIDTH])]
    )
    return GatedMLP(gate_up, DenseLinear(w(HIDDEN, WIDTH)), "silu")


def _block(experts: int, top_k: int, normalize: bool, shared: bool = False, seed: int = 0) -> SparseMoE:
    gen = torch.Generator().manual_seed(seed)
    # The last expert's router bias keeps it from ever being chosen: an expert with no tokens.
    bias = torch.zeros(experts)
    bias[-1] = -1e4
    router = DenseLinear(torch.randn(experts, HIDDEN, generator=gen), bias)
    extra = {}
    if shared:
        extra = dict(shared=_expert(gen), shared_gate=DenseLinear(torch.randn(1, HIDDEN, generator=gen)))
    return SparseMoE(router, [_expert(gen) for _ in range(experts)], top_k, normalize, **extra)


def _naive(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, straight from the definition: softmax over every expert, the top k, their
    probabilities (renormalised or not) times their outputs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(block.router(x[t : t + 1])[0], dim=-1)
        top = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[: block.top_k]
        total = sum(float(probs[e]) for e in top) if block.normalize else 1.0
        for e in top:
            out[t] += float(probs[e]) / total * block.experts[e](x[t : t + 1])[0]
        if block.shared is not None:
            out[t] += torch.sigmoid(block.shared_gate(x[t : t + 1])[0]) * block.shared(x[t : t + 1])[0]
    return out


@pytest.mark.parametrize(
    ("experts", "top_k", "normalize", "shared"),
    [(8, 2, True, False), (8, 2, False, False), (5, 3, True, False), (4, 1, False, True)],
)
def test_moe_block_matches_per_token_loop(experts, top_k, normalize, shared):
    block = _block(experts, top_k, normalize, shared)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    calls = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_pre_hook(lambda m, args, e=e: calls.append((e, args[0].shape[0])))
    got = block(x)
    ran = list(calls)
    assert got.shape == x.shape
    torch.testing.assert_close(got, _naive(block, x), rtol=1e-5, atol=1e-6)
    # Each expert ran once, over exactly the tokens routed to it; the unreachable one never ran.
    _, chosen = block.route(x)
    routed = torch.bincount(chosen.flatten(), minlength=experts).tolist()
    assert ran == [(e, n) for e, n in enumerate(routed) if n]
    assert routed[-1] == 0 and sum(routed) == 40 * top_k
    # Routing is exercised: more than top_k experts are used over the batch.
    assert sum(n > 0 for n in routed) > top_k


def test_moe_block_keeps_leading_dims_and_dtype():
    block = _block(6, 2, True).to(torch.bfloat16)
    x = torch.randn(3, 5, HIDDEN).to(torch.bfloat16)
    y = block(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), block(x.reshape(15, HIDDEN)).reshape(3, 5, HIDDEN).float())


def test_top_k_outside_the_experts_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        _block(4, 5, True)


# -- checkpoints ------------------------------------------------------------------------------


def _logits(directory) -> torch.Tensor:
    model = load_model(directory, device="cpu")
    cache = PagedKVCache.for_model(model.spec, 64, page_size=16)
    return score_tokens(model.module, cache, list(range(3, 35)))


def _fuse_experts(directory, moe: str, new_moe: str, names: tuple[str, str, str]) -> None:
    """Rewrite a per-expert checkpoint with transformers 5's in-memory layout: each layer's experts
    as one ``gate_up_proj`` [E, 2f, h] and one ``down_proj`` [E, h, f], the block under
    ``new_moe``."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    out = {}
    layers = {k.split(".")[2] for k in tensors if f".{moe}.experts." in k}
    for k, v in tensors.items():
        if f".{moe}.experts." not in k:
            out[k.replace(f".{moe}.gate.", f".{new_moe}.gate.")] = v
    gate, up, down = names
    for i in layers:
        p = f"model.layers.{i}.{moe}.experts"
        n = len({k for k in tensors if k.startswith(p + ".") and k.endswith(f".{gate}.weight")})
        q = f"model.layers.{i}.{new_moe}.experts"
        out[f"{q}.gate_up_proj"] = torch.stack(
            [
                torch.cat([tensors[f"{p}.{e}.{gate}.weight"], tensors[f"{p}.{e}.{up}.weight"]])
                for e in range(n)
            ]
        )
        out[f"{q}.down_proj"] = torch.stack([tensors[f"{p}.{e}.{down}.weight"] for e in range(n)])
    save_file(out, str(path))


@pytest.mark.parametrize(
    ("variant", "moe", "names"),
    [
        ("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
        ("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
    ],
)
def test_fused_experts_load_like_per_expert(variant, moe, names, tiny_model_factory, tiny_model_copy):
    directory, _ = tiny_model_factory(variant)
    fused = tiny_model_copy(variant, "fused")
    _fuse_experts(fused, moe, "mlp", names)
    keys = load_file(fused / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    torch.testing.assert_close(_logits(fused), _logits(directory), rtol=0, atol=0)


@pytest.fixture
def moe_copy(tiny_model_copy):
    return tiny_model_copy("Qwen3MoeForCausalLM")


def _drop(directory, key: str) -> None:
    tensors = load_file(directory / "model.safetensors")
    del tensors[key]
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.1.mlp.experts.5.up_proj.weight",
        "model.layers.3.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.2.mlp.down_proj.weight",  # the dense layer (mlp_only_layers)
    ],
)
def test_missing_moe_tensor_is_named(moe_copy, key):
    _drop(moe_copy, key)
    with pytest.raises(ModelLoadError, match=f"'{key}' is missing"):
        load_model(moe_copy, device="cpu")


def test_more_experts_per_token_than_experts_is_named(moe_copy):
    config = json.loads((moe_copy / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (moe_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok is 9.*8 experts"):
        load_model(moe_copy, device="cpu")


def test_qwen3_moe_dense_and_sparse_layers(tiny_model_factory):
    directory, _ = tiny_model_factory("Qwen3MoeForCausalLM")
    model = load_model(directory, device="cpu")
    kinds = [type(b.feed_forward).__name__ for b in model.module.blocks]
    assert kinds == ["SparseMoE", "SparseMoE", "GatedMLP", "SparseMoE"]
    moe = model.module.blocks[0].feed_forward
    assert len(moe.experts) == 8 and moe.top_k == 2


# -- generation ---------------------------------------------------------------------------------


def _greedy(model, prompts, **kwargs) -> list[list[int]]:
    from engine.generation.generator import Generator
    from engine.generation.job import Job

    gen = Generator(model, cache_tokens=512, page_size=16, **kwargs)
    jobs = [Job(p, max_new_tokens=6, stop_token_ids=()) for p in prompts]
    return [r.token_ids for r in gen.generate(jobs)]


def test_moe_model_generates_the_same_batched_as_alone(tiny_model_factory):
    """Continuous batching of a MoE model: the experts each row gets do not depend on the rows
    it shares a step with."""
    directory, _ = tiny_model_factory("MixtralForCausalLM")
    model = load_model(directory, device="cpu")
    prompts = [list(range(3, 8)), list(range(40, 70)), list(range(100, 111))]
    together = _greedy(model, prompts)
    assert together == [_greedy(model, [p])[0] for p in prompts]
    assert all(len(t) == 6 for t in together)


def test_moe_model_decodes_without_cuda_graphs(tiny_model_factory, capsys):
    """On a CUDA device a MoE model's Generator turns graph capture off (with a notice), and the
    graph runner refuses its steps too; a dense model's keeps graphs on."""
    import dataclasses

    from engine.generation.cuda_graph import DecodeGraphs
    from engine.generation.generator import Generator
    from engine.generation.step import StepItem
    from engine.options import EngineOptions

    moe = load_model(tiny_model_factory("Qwen3MoeForCausalLM")[0], device="cpu")
    dense = load_model(tiny_model_factory("LlamaForCausalLM")[0], device="cpu")
    assert not moe.module.static_decode and dense.module.static_decode
    for model, graphs in ((moe, False), (dense, True)):
        # Only the flag is read here: nothing runs, so a CPU model may pose as a CUDA one.
        posing = dataclasses.replace(model, device=torch.device("cuda"))
        cache = PagedKVCache.for_model(model.spec, 64, page_size=16)
        assert Generator(posing, cache=cache, options=EngineOptions(cuda_graphs=True))._use_graphs is graphs
    assert "mixture-of-experts model: decode steps run without CUDA graphs" in capsys.readouterr().err

    cache = PagedKVCache.for_model(moe.spec, 64, page_size=16)
    table = cache.pages.allocate(1)
    runner = DecodeGraphs(moe.module, cache, max_batch=2, min_pages=1)
    assert runner.run([StepItem([5], 3, table, "last")]) is None
    assert "mixture-of-experts" in runner.failed


def test_synthetic_moe_model_builds_with_quantized_experts_and_a_dense_router():
    """``bench --synthetic`` shapes may be MoE: random EXL3 experts (shared one too), dense routers."""
    from engine.exl3 import EXL3Linear
    from engine.loading.synthetic_store import synthetic_model

    shape = tiny_moe_shape(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        shared_expert_intermediate_size=256,
        num_experts=4,
        decoder_sparse_step=2,  # layer 0 dense, layer 1 sparse
    )
    model = synthetic_model(shape, bits=3, dtype=torch.float32, exl3_mode="dense")
    dense, sparse = (b.feed_forward for b in model.module.blocks)
    assert isinstance(dense, GatedMLP) and isinstance(sparse, SparseMoE)
    assert isinstance(sparse.router, DenseLinear) and isinstance(sparse.shared_gate, DenseLinear)
    assert isinstance(sparse.experts[3].down, EXL3Linear) and isinstance(sparse.shared.down, EXL3Linear)
    cache = PagedKVCache.for_model(model.spec, 32, page_size=16)
    assert torch.isfinite(score_tokens(model.module, cache, list(range(3, 19)))).all()
