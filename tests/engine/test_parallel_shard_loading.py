"""A tensor-parallel rank reads only its shard from the safetensors files
(engine.parallel.shard_loading): the same shard as loading the whole model and cutting it, from
about 1/N of the bytes. Runs in one process: outside a process group the collectives are the
identity, so each rank's shard is built here in turn."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from test_int8_weights import write_int8

from engine.config import ModelConfig
from engine.loading.safetensors_store import WeightStore
from engine.model import build_model
from engine.parallel.shard_loading import ShardBuilder
from engine.parallel.sharding import shard_model
from engine.parallel.stored_linear import StoredLinear, load_stored


class CountingStore(WeightStore):
    """A weight store that adds up the stored bytes of every tensor it hands out."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.bytes_read = 0

    def _count(self, *tensors: torch.Tensor) -> None:
        self.bytes_read += sum(t.numel() * t.element_size() for t in tensors)

    def _count_stored(self, key: str, tensor: torch.Tensor) -> None:
        self.bytes_read += tensor.numel() * self.meta(key).element_size()  # before any conversion

    def get(self, key, dtype=None, device=None, shape=None):
        tensor = super().get(key, dtype, device, shape)
        self._count_stored(key, tensor)
        return tensor

    def int8_matrix(self, key, shape=None):
        pair = super().int8_matrix(key, shape)
        self._count(*pair)
        return pair

    def get_part(self, key, dim, start, end, dtype=None, device=None):
        tensor = super().get_part(key, dim, start, end, dtype, device)
        self._count_stored(key, tensor)
        return tensor

    def int8_part(self, key, dim, start, end):
        pair = super().int8_part(key, dim, start, end)
        self._count(*pair)
        return pair

    def all_bytes(self) -> int:
        return sum(_stored_bytes(self, k) for k in self.keys())


def _stored_bytes(store: WeightStore, key: str) -> int:
    meta = store.meta(key)
    if store.is_int8(key):  # listed as its dequantized matrix: count the codes and row scales
        return meta.numel() + 4 * meta.shape[0]
    return meta.numel() * meta.element_size()


def _shard(directory: Path, rank: int, world: int, from_parts: bool, exl3_mode: str | None = None):
    """Rank ``rank``'s shard and the store it was read from: read in parts, or loaded whole and cut."""
    store = CountingStore(directory)
    builder = partial(ShardBuilder, rank=rank, world=world) if from_parts else None
    extra = {"make_builder": builder} if builder else {}
    model = build_model(ModelConfig.from_dir(directory), store, "cpu", exl3_mode=exl3_mode, **extra)
    with torch.inference_mode():
        report = shard_model(model.module, rank, world)
        load_stored(model.module)
    return model, store, report


def _same_shard(a, b) -> None:
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


def _logits(model) -> torch.Tensor:
    from parallel_cases import step_logits

    return torch.cat([t.reshape(-1) for t in step_logits(model)])


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("LlamaForCausalLM")[0]


@pytest.mark.parametrize(
    ("variant", "world"),
    [
        ("LlamaForCausalLM", 2),
        ("LlamaForCausalLM", 4),
        ("Gemma2ForCausalLM", 2),  # a tied head: the embedding's slice, read again
        ("Qwen3MoeForCausalLM", 2),  # experts dealt round-robin: the others' are never read
    ],
)
def test_rank_reads_a_1_over_n_share(tiny_model_factory, variant, world) -> None:
    directory = tiny_model_factory(variant)[0]
    for rank in range(world):
        parts, store, _ = _shard(directory, rank, world, from_parts=True)
        whole, whole_store, _ = _shard(directory, rank, world, from_parts=False)
        _same_shard(parts, whole)
        assert not any(isinstance(m, StoredLinear) for m in parts.module.modules())
        total = store.all_bytes()
        assert whole_store.bytes_read >= total  # the old way reads everything
        # The norms (read whole by every rank) are well under 1% of this model; on 4 ranks its
        # 2 KV heads are each held by two ranks, so k/v projections are read at 1/2, not 1/4.
        assert store.bytes_read <= total / world * (1.02 if world == 2 else 1.1)


def test_int8_rank_reads_its_codes_only(tiny_llama, tmp_path) -> None:
    directory = write_int8(tiny_llama, tmp_path / "int8")
    parts, store, _ = _shard(directory, 1, 2, from_parts=True)
    whole, _, _ = _shard(directory, 1, 2, from_parts=False)
    _same_shard(parts, whole)
    assert store.bytes_read <= store.all_bytes() / 2 * 1.05  # a column part reads every row's scale


def test_exl3_rank_reads_whole_blocks_and_decodes_only_cut_ones(exl3_dir) -> None:
    directory = exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1"
    for rank in range(2):
        parts, store, report = _shard(directory, rank, 2, True, "streaming")
        whole, _, whole_report = _shard(directory, rank, 2, False, "streaming")
        _same_shard(parts, whole)
        assert report.decoded == whole_report.decoded
        total = store.all_bytes()
        # Linears whose split cuts a Hadamard block are read whole (and decoded) one at a time.
        cut = sum(_stored_bytes(store, k) for k in store.keys() if k.rsplit(".", 1)[0] in report.decoded)
        assert 0 < cut < 0.05 * total  # k/v: one 64-wide KV head per rank
        assert store.bytes_read <= (total - cut) / 2 * 1.02 + cut


def test_shard_loaded_ranks_sum_to_the_single_process_logits(tiny_llama) -> None:
    """The vocabulary-parallel head returns the rank's own slice outside a group: the slices of
    both ranks, and the row-parallel sums, are checked by the process tests; here the shard of a
    world of one is the whole model."""
    from engine.model import load_model

    single = load_model(tiny_llama, device="cpu")
    alone, _, _ = _shard(tiny_llama, 0, 1, from_parts=False)
    torch.testing.assert_close(_logits(alone), _logits(single), rtol=0, atol=0)
