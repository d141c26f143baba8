"""The Hub page's memory estimate for a model too big for the GPU: the split that would run it,
its experts in system memory (a mixture of experts) or its first layers on the GPU."""

from __future__ import annotations

from engine.hub.memory import MachineMemory, estimate_memory

GIB = 1 << 30
MOE = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "moe_intermediate_size": 768,
    "vocab_size": 151936,
}
DENSE = {k: v for k, v in MOE.items() if k not in ("num_experts", "moe_intermediate_size")}


def _box(gpu: int) -> MachineMemory:
    return MachineMemory(ram_total=128 * GIB, ram_available=100 * GIB, gpus=(("RTX 4090", gpu, gpu),))


def test_a_mixture_too_big_for_the_gpu_keeps_its_experts_in_system_memory() -> None:
    est = estimate_memory(MOE, 60 * GIB, 4096, machine=_box(24 * GIB))
    assert est.verdict == "cpu"
    assert 0.9 * 60 * GIB < est.expert_weights < 60 * GIB  # nearly all of a 30B-A3B is experts
    split = est.gpu_split()
    assert split is not None and split.startswith("with its experts in system memory: GPU ≈ ")
    assert split in est.describe()


def test_a_dense_model_too_big_for_the_gpu_puts_its_first_layers_there() -> None:
    est = estimate_memory(DENSE, 48 * GIB, 4096, machine=_box(24 * GIB))
    assert est.expert_weights == 0
    split = est.gpu_split()
    assert split is not None and "of 48 layers on the GPU" in split
    n = int(split.split("first ")[1].split(" of")[0])
    assert 0 < n < 48
    # n layers fit, n + 1 do not
    per_layer = (est.weights + est.kv_cache) / 48 * 1.05
    assert est.total - (48 - n) * per_layer <= 24 * GIB < est.total - (48 - n - 1) * per_layer


def test_no_split_where_it_fits_or_there_is_no_gpu() -> None:
    assert estimate_memory(MOE, 10 * GIB, 4096, machine=_box(24 * GIB)).gpu_split() is None
    no_gpu = MachineMemory(ram_total=128 * GIB, ram_available=100 * GIB)
    assert estimate_memory(MOE, 60 * GIB, 4096, machine=no_gpu).gpu_split() is None
