"""``--experts-on cpu``: the routed experts in host memory, run on the CPU, the rest on the model's
device. On this machine both are the CPU, so the run goes through the same host path a GPU model
takes (pack, copy, dispatch, copy back) and must give the plain run's logits and greedy tokens;
placement itself is checked by building the model on the ``meta`` device with its experts on the
host."""

from __future__ import annotations

import pytest
import torch
from generation_cases import random_prompts
from parallel_cases import assert_logits_close, step_logits
from tiny_gpt_oss import build_tiny_gpt_oss

from engine.errors import UsageError
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model
from engine.modules import host_experts
from engine.modules.moe import SparseMoE

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt-oss-host")
    build_tiny_gpt_oss(directory)
    return directory


def _moe_dir(variant, tiny_model_factory, gpt_oss_dir):
    return gpt_oss_dir if variant == "gpt-oss" else tiny_model_factory(variant)[0]


def _greedy_pair(model, tokens: int = 32) -> list[list[int]]:
    """Two greedy jobs of ``tokens`` tokens decoded in one batch."""
    gen = Generator(model, cache_tokens=512, page_size=16, max_batch_size=2)
    jobs = [Job(p, tokens, stop_token_ids=[]) for p in random_prompts([29, 17], seed=5)]
    return [r.token_ids for r in gen.generate(jobs)]


def _moes(model) -> list[SparseMoE]:
    return [m for m in model.module.modules() if isinstance(m, SparseMoE)]


@pytest.mark.parametrize("variant", ["Qwen3MoeForCausalLM", "gpt-oss"])
def test_experts_on_host_give_the_plain_logits_and_tokens(
    variant, tiny_model_factory, gpt_oss_dir, monkeypatch
):
    directory = _moe_dir(variant, tiny_model_factory, gpt_oss_dir)
    plain = load_model(directory, device="cpu")
    hosted = load_model(directory, device="cpu", experts_on="cpu")
    assert hosted.experts_device == CPU and plain.experts_device is None
    assert all(moe.experts_host == CPU for moe in _moes(hosted)) and _moes(hosted)
    calls = []
    real = host_experts.mix_on_host
    monkeypatch.setattr(host_experts, "mix_on_host", lambda *a: calls.append(a[1].shape) or real(*a))
    assert_logits_close(step_logits(hosted), step_logits(plain))
    assert calls, "the host path was not taken"
    tokens = _greedy_pair(hosted)
    assert tokens == _greedy_pair(plain) and all(len(t) == 32 for t in tokens)


def test_a_model_with_experts_on_host_decodes_without_graphs(tiny_model_factory) -> None:
    directory = tiny_model_factory("Qwen3MoeForCausalLM")[0]
    hosted = load_model(directory, device="cpu", experts_on="cpu")
    assert hosted.module.dynamic_decode == host_experts.REASON
    assert not hosted.module.static_decode


def test_the_experts_are_built_on_the_host_and_the_rest_on_the_device(tiny_model_factory) -> None:
    """The model on ``meta`` (a stand-in for the GPU) with its experts on the host: every routed
    expert's tensor is in host memory, every other tensor on the model's device."""
    directory = tiny_model_factory("Qwen3MoeForCausalLM")[0]
    model = load_model(directory, device="meta", dtype=torch.float32, experts_on="cpu")
    assert model.device == torch.device("meta")
    expert_tensors = set()
    for moe in _moes(model):
        assert moe.experts_host == CPU
        for t in [*moe.experts.parameters(), *moe.experts.buffers()]:
            assert t.device == CPU
            expert_tensors.add(id(t))
        assert moe.router.weight.device.type == "meta"
    others = [t for t in [*model.module.parameters(), *model.module.buffers()] if id(t) not in expert_tensors]
    assert others and all(t.device.type == "meta" for t in others)


def test_mix_on_host_copies_once_each_way() -> None:
    """The inputs, weights and choices go over in one tensor and the sum comes back in one."""
    x = torch.randn(3, 8)
    weights, chosen = torch.rand(3, 2), torch.tensor([[0, 5], [3, 1], [5, 4]])
    seen = []

    def dispatch(inputs, mix, experts):
        seen.append((inputs, mix, experts))
        return inputs.float() * mix.sum(-1, keepdim=True) + experts.sum(-1, keepdim=True)

    moves = []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device):
            moves.append(args[0])
        return real_to(self, *args, **kwargs)

    torch.Tensor.to = counting_to
    try:
        out = host_experts.mix_on_host(dispatch, x, weights, chosen, CPU)
    finally:
        torch.Tensor.to = real_to
    inputs, mix, experts = seen[0]
    assert torch.equal(inputs, x) and torch.equal(mix, weights) and torch.equal(experts, chosen)
    assert experts.dtype == torch.int64
    assert torch.equal(out, x * weights.sum(-1, keepdim=True) + chosen.sum(-1, keepdim=True))
    assert len(moves) == 2  # over and back


def test_experts_on_needs_a_mixture_and_a_known_place(tiny_model_factory) -> None:
    dense = tiny_model_factory("LlamaForCausalLM")[0]
    with pytest.raises(UsageError, match="no mixture-of-experts layers"):
        load_model(dense, device="cpu", experts_on="cpu")
    moe = tiny_model_factory("Qwen3MoeForCausalLM")[0]
    with pytest.raises(UsageError, match="--experts-on must be one of device, cpu"):
        load_model(moe, device="cpu", experts_on="gpu")


def test_a_layers_experts_are_gathered_into_one_region(tiny_model_factory) -> None:
    """What is page-locked on a GPU machine: one region per layer, each tensor a view of it at an
    aligned offset, the values and the layer's output unchanged."""
    directory = tiny_model_factory("Qwen3MoeForCausalLM")[0]
    moe = _moes(load_model(directory, device="cpu"))[0]
    before = [t.clone() for t in moe.experts.parameters()]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    expected = moe(x)
    region = host_experts.gather(moe.experts)
    tensors = list(moe.experts.parameters())
    assert region is not None and len(tensors) == len(before)
    for t, old in zip(tensors, before):
        assert t.untyped_storage().data_ptr() == region.untyped_storage().data_ptr()
        assert t.data_ptr() % host_experts.ALIGNMENT == 0 and torch.equal(t, old)
    assert torch.equal(moe(x), expected)
