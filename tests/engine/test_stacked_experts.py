"""A mixture's EXL3 experts stacked per projection kind (engine.modules.stacked_experts): what is
stacked, that the experts then hold views of the stacks and compute the same, what declines, and
that without the GPU kernels a mixture's decode step stays eager."""

from __future__ import annotations

import torch
from synthetic_shapes import tiny_moe_shape

from engine import kernels
from engine.exl3 import EXL3Linear
from engine.modules.feed_forward import FeedForward
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.modules.stacked_experts import ExpertActivation, stack_experts

HIDDEN, WIDTH = 128, 200  # WIDTH pads to 256: the stacks keep the padded (stored) sizes


def _exl3(
    gen: torch.Generator, n_in: int, n_out: int, bits: int, bias: bool = False, codebook: str = "3inst"
):
    pad_in, pad_out = -(-n_in // 128) * 128, -(-n_out // 128) * 128
    trellis = torch.randint(-(2**15), 2**15, (pad_in // 16, pad_out // 16, 16 * bits), generator=gen)
    suh = torch.where(torch.rand(pad_in, generator=gen) < 0.5, -1.0, 1.0) / n_in**0.5
    svh = torch.where(torch.rand(pad_out, generator=gen) < 0.5, -1.0, 1.0)
    b = torch.randn(n_out, generator=gen) if bias else None
    return EXL3Linear(
        trellis.to(torch.int16), suh.half(), svh.half(), codebook, n_in, n_out, b, mode="streaming"
    )


def _gated(gen, bits=(3, 3, 4), bias=False, activation="silu", limit=None, codebook="3inst") -> GatedMLP:
    gate, up = (
        _exl3(gen, HIDDEN, WIDTH, bits[0], bias, codebook),
        _exl3(gen, HIDDEN, WIDTH, bits[1], bias, codebook),
    )
    down = _exl3(gen, WIDTH, HIDDEN, bits[2], bias, codebook)
    group = ProjectionGroup([(gate, [WIDTH]), (up, [WIDTH])])
    if limit is None:
        return GatedMLP(group, down, activation)
    return GatedMLP(group, down, activation, limit, limit_after_act=False, up_offset=1.0)


def _router(gen: torch.Generator, experts: int) -> DenseLinear:
    return DenseLinear(torch.randn(experts, HIDDEN, generator=gen))


def test_gated_experts_stack_into_views_and_compute_the_same():
    gen = torch.Generator().manual_seed(0)
    experts = [_gated(gen, bias=True, activation="quick_gelu", limit=7.0) for _ in range(4)]
    x = torch.randn(5, HIDDEN, generator=gen)
    before = [expert(x) for expert in experts]
    originals = [expert.down.trellis.clone() for expert in experts]
    stack = stack_experts(experts)
    assert stack is not None and stack.num_experts == 4
    assert stack.activation == ExpertActivation("quick_gelu", True, 7.0, False, 1.0)
    assert tuple(stack.gate.trellis.shape) == (4, HIDDEN // 16, 256 // 16, 16 * 3)
    assert tuple(stack.down.trellis.shape) == (4, 256 // 16, HIDDEN // 16, 16 * 4)
    assert (stack.up.in_features, stack.up.out_features, stack.up.padded_out) == (HIDDEN, WIDTH, 256)
    assert (stack.down.bits, stack.down.padded_in, stack.down.padded_out) == (4, 256, HIDDEN)
    assert tuple(stack.down.suh.shape) == (4, 256) and tuple(stack.down.svh.shape) == (4, HIDDEN)
    assert stack.up.bias.dtype == torch.float32 and tuple(stack.up.bias.shape) == (4, WIDTH)
    for e, expert in enumerate(experts):
        gate, up = expert.gate_up.linears
        # each expert's buffers are its slice of the stacks, not copies
        assert gate.trellis.data_ptr() == stack.gate.trellis[e].data_ptr()
        assert up.suh.data_ptr() == stack.up.suh[e].data_ptr()
        assert expert.down.svh.data_ptr() == stack.down.svh[e].data_ptr()
        assert torch.equal(expert.down.trellis, originals[e])
        assert torch.equal(stack.down.bias[e], expert.down.bias.float())
        assert torch.equal(expert(x), before[e])
    assert stack.current()


def test_plain_experts_stack_with_their_activation_name():
    gen = torch.Generator().manual_seed(1)
    experts = [
        FeedForward(_exl3(gen, HIDDEN, WIDTH, 2), _exl3(gen, WIDTH, HIDDEN, 2), "relu2") for _ in range(3)
    ]
    stack = stack_experts(experts)
    assert stack is not None and stack.gate is None
    assert stack.activation == ExpertActivation("relu2", False)
    assert stack.up.trellis.shape[0] == 3 and stack.up.bias is None


def test_a_moved_or_recast_expert_makes_the_stacks_stale():
    gen = torch.Generator().manual_seed(2)
    block = SparseMoE(_router(gen, 4), [_gated(gen) for _ in range(4)], 2, True)
    assert block.stacked is not None and block.stacked.current()
    block.float()  # the fp16 sign vectors become new fp32 tensors
    assert not block.stacked.current()


def _unchanged_after_declining(experts) -> None:
    ptrs = [expert.down.trellis.data_ptr() for expert in experts]
    assert stack_experts(experts) is None
    assert [expert.down.trellis.data_ptr() for expert in experts] == ptrs


def test_experts_of_different_bits_codebooks_or_activations_are_not_stacked():
    gen = torch.Generator().manual_seed(3)
    _unchanged_after_declining([_gated(gen), _gated(gen), _gated(gen, bits=(3, 3, 5))])
    _unchanged_after_declining([_gated(gen), _gated(gen, codebook="mcg")])
    _unchanged_after_declining([_gated(gen), _gated(gen, activation="gelu")])
    _unchanged_after_declining([_gated(gen), _gated(gen, limit=7.0)])
    _unchanged_after_declining([_gated(gen), _gated(gen, bias=True)])


def test_dense_fused_or_custom_experts_are_not_stacked():
    gen = torch.Generator().manual_seed(4)
    dense = GatedMLP(
        ProjectionGroup(
            [
                (DenseLinear(torch.randn(WIDTH, HIDDEN)), [WIDTH]),
                (DenseLinear(torch.randn(WIDTH, HIDDEN)), [WIDTH]),
            ]
        ),
        DenseLinear(torch.randn(HIDDEN, WIDTH)),
        "silu",
    )
    assert stack_experts([dense, dense]) is None
    fused = GatedMLP(
        ProjectionGroup([(_exl3(gen, HIDDEN, 2 * WIDTH, 3), [WIDTH, WIDTH])]),
        _exl3(gen, WIDTH, HIDDEN, 3),
        "silu",
    )
    assert stack_experts([fused]) is None
    custom = FeedForward(_exl3(gen, HIDDEN, WIDTH, 2), _exl3(gen, WIDTH, HIDDEN, 2), torch.nn.ReLU())
    assert stack_experts([custom]) is None
    assert stack_experts([]) is None


def test_without_the_gpu_kernels_a_mixture_decodes_eagerly_and_through_dispatch(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    block = SparseMoE(_router(gen, 4), [_gated(gen) for _ in range(4)], 2, True)
    assert block.stacked is not None
    assert block.dynamic_decode == "mixture-of-experts"  # CPU stacks: no device-routed kernels
    assert not kernels.moe.supports(block.stacked) and not kernels.moe.supports(None)
    x = torch.randn(3, HIDDEN, generator=gen)
    weights, chosen = block.route(x)
    assert kernels.moe.expert_mlp(x, weights, chosen, block.stacked) is None
    calls = []
    monkeypatch.setattr(SparseMoE, "_dispatch", lambda self, *a: calls.append(a) or torch.zeros(3, HIDDEN))
    block(x)
    assert len(calls) == 1


def test_the_kernels_activations_are_the_modules_activations():
    from engine.modules.mlp import ACTIVATIONS

    assert set(kernels.moe.ACT_IDS) <= set(ACTIVATIONS)
    assert {"silu", "relu2", "quick_gelu"} <= set(kernels.moe.ACT_IDS)  # Qwen/Mixtral, NemotronH, gpt-oss


def test_a_loaded_exl3_mixture_stacks_its_experts_at_load():
    from engine.loading.synthetic_store import synthetic_model

    shape = tiny_moe_shape(num_experts=4)
    packed = synthetic_model(shape, bits=3, dtype=torch.float32, exl3_mode="streaming")
    dense = synthetic_model(shape, bits=3, dtype=torch.float32, exl3_mode="dense")
    for block, twin in zip(packed.module.blocks, dense.module.blocks):
        moe = block.feed_forward
        assert isinstance(moe, SparseMoE) and moe.stacked is not None
        assert moe.stacked.num_experts == 4 and moe.stacked.gate.bits == 3
        assert twin.feed_forward.stacked is None  # dense experts: nothing to stack
        x = torch.randn(3, 128, generator=torch.Generator().manual_seed(7))
        # the same random weights, packed (stacked views) and reconstructed
        assert torch.allclose(moe(x), twin.feed_forward(x), rtol=1e-4, atol=1e-5)
