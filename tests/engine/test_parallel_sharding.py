"""The pieces of tensor parallelism that need no second process: which heads a rank takes,
splitting linears (dense and EXL3 on its 128-blocks), the vocabulary slices; and the reductions
across ranks (argmax, top-k) in a group of two processes."""

from __future__ import annotations

import pytest
import torch

from engine.errors import UsageError
from engine.modules.linear import DenseLinear
from engine.parallel.heads import head_shard, replication
from engine.parallel.slicing import SliceNotes, take_inputs, take_outputs
from engine.parallel.vocab import vocab_slice


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world"), [(8, 4, 2), (4, 2, 4), (4, 1, 2), (12, 3, 2), (8, 8, 8)]
)
def test_every_query_head_once_with_its_own_kv_head(heads, kv_heads, world) -> None:
    group = heads // kv_heads
    shards = [head_shard(heads, kv_heads, r, world) for r in range(world)]
    assert sorted(h for s in shards for h in s.q_heads) == list(range(heads))
    for s in shards:
        per_kv = len(s.q_heads) // len(s.kv_heads)
        assert len(s.q_heads) == per_kv * len(s.kv_heads)  # equal groups within the rank
        for i, q in enumerate(s.q_heads):
            assert s.kv_heads[i // per_kv] == q // group  # the KV head the query head reads
    copies = sum(len(s.kv_heads) for s in shards)
    assert copies == kv_heads * replication(heads, kv_heads, world)


def test_heads_that_cannot_split_are_refused() -> None:
    with pytest.raises(UsageError, match="cannot be split across 4 ranks"):
        head_shard(6, 3, 0, 4)  # groups of 2 cannot serve 4 ranks evenly


def test_dense_split_pieces_give_the_whole_output() -> None:
    torch.manual_seed(0)
    linear = DenseLinear(torch.randn(12, 8), torch.randn(12))
    x = torch.randn(5, 8)
    index = torch.tensor([4, 5, 0, 1])
    # Equal up to rounding: BLAS may sum a 4-output product in another order than a 12-output one.
    torch.testing.assert_close(take_outputs(linear, index)(x), linear(x)[:, index], rtol=1e-6, atol=1e-6)
    halves = torch.arange(8).tensor_split(2)
    pieces = [take_inputs(linear, h, keep_bias=i == 0)(x[:, h]) for i, h in enumerate(halves)]
    torch.testing.assert_close(pieces[0] + pieces[1], linear(x))


def test_exl3_split_on_blocks_stays_packed_and_exact(exl3_dir) -> None:
    from engine.exl3.exl3_linear import EXL3Linear
    from engine.model import load_model

    model = load_model(exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1", device="cpu", exl3_mode="streaming")
    up = model.module.blocks[0].feed_forward.gate_up.linears[1]  # 256 -> 512
    down = model.module.blocks[0].feed_forward.down  # 512 -> 256
    torch.manual_seed(0)
    x, h = torch.randn(3, 256), torch.randn(3, 512)
    notes = SliceNotes()
    cols = torch.cat([torch.arange(384, 512), torch.arange(0, 128)])  # blocks reordered
    piece = take_outputs(up, cols, notes)
    assert isinstance(piece, EXL3Linear) and not notes.decoded
    torch.testing.assert_close(piece(x), up(x)[:, cols], rtol=1e-5, atol=1e-5)
    parts = [take_inputs(down, torch.arange(r * 256, (r + 1) * 256), r == 0, notes) for r in range(2)]
    assert all(isinstance(p, EXL3Linear) for p in parts) and not notes.decoded
    total = parts[0](h[:, :256]) + parts[1](h[:, 256:])
    torch.testing.assert_close(total, down(h), rtol=1e-5, atol=1e-5)
    cut = take_outputs(up, torch.arange(64, 192), notes)  # straddles two blocks: decoded
    assert isinstance(cut, DenseLinear) and notes.decoded == [up.key]
    torch.testing.assert_close(cut(x), up(x)[:, 64:192], rtol=1e-5, atol=1e-5)


def test_vocab_slices_cover_the_vocabulary() -> None:
    slices = [vocab_slice(10, r, 4) for r in range(4)]
    assert slices == [(0, 3), (3, 6), (6, 9), (9, 10)]


def _reduce_on_ranks(rank: int, port: int, logits: torch.Tensor, out) -> None:
    import datetime

    import torch.distributed as dist

    from engine.parallel.vocab import VocabParallelHead, parallel_argmax, parallel_top_k

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        vocab = logits.shape[1]
        weight = torch.eye(vocab)  # a head whose logits are its input
        head = VocabParallelHead.from_linear(DenseLinear(weight), vocab, rank, 2, SliceNotes())
        local = head.local_logits(logits)
        argmax = parallel_argmax(local, head.start)
        values, ids = parallel_top_k(local, head.start, 3)
        gathered = head(logits)
        if rank == 0:
            out.put((argmax, values, ids, gathered))
    finally:
        dist.destroy_process_group()


def test_argmax_and_top_k_across_ranks_match_the_whole_row() -> None:
    import torch.multiprocessing as mp

    from engine.parallel.launch import free_port

    torch.manual_seed(0)
    logits = torch.randn(4, 9)
    logits[1, 2] = logits[1, 7] = 10.0  # a tie across the two ranks' slices: the lower id wins
    context = mp.get_context("spawn")
    out, port = context.Queue(), free_port()
    other = context.Process(target=_reduce_on_ranks, args=(1, port, logits, out))
    other.start()
    _reduce_on_ranks(0, port, logits, out)
    other.join(30)
    argmax, values, ids, gathered = out.get(timeout=10)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    assert argmax[1] == 2
    top = logits.topk(3, dim=-1)
    torch.testing.assert_close(values, top.values)
    assert torch.equal(gathered, logits)


def test_gated_delta_net_splits_by_key_heads() -> None:
    from pathlib import Path

    from engine.cache.state import RecurrentState
    from engine.layers import sequence_states
    from engine.model import load_model
    from engine.modules.gated_delta_net import GatedDeltaNet
    from engine.parallel.reduced import AllReduced
    from engine.parallel.sharding import local_states, shard_model

    directory = Path(__file__).parent.parent / "data" / "tiny-hybrids" / "qwen3_5"
    model = load_model(directory, device="cpu")  # 2 key heads, 4 value heads of 32
    report = shard_model(model.module, 1, 2)
    net = model.module.blocks[0].mixer
    assert isinstance(net, AllReduced) and isinstance(net.inner, GatedDeltaNet)
    assert (net.inner.k_heads, net.inner.v_heads) == (1, 2)
    assert net.inner.conv.channels == 32 + 32 + 2 * 32
    assert net.inner.out_proj.in_features == 64 and net.inner.out_proj.bias is None
    assert not report.replicated
    state = local_states(sequence_states(model.spec), model.module)[0]
    assert isinstance(state, RecurrentState)
    assert state.shapes["conv"] == (128, 3) and state.shapes["delta"] == (2, 32, 32)


def test_int8_linears_and_embeddings_split_without_decoding() -> None:
    from engine.modules.int8 import Int8Embedding, Int8Linear
    from engine.parallel.vocab import VocabParallelEmbedding

    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (12, 96), dtype=torch.int8)
    scale = torch.rand(12) / 100
    linear = Int8Linear(codes, scale, torch.randn(12))
    x = torch.randn(5, 96)
    rows = torch.tensor([7, 8, 0])
    piece = take_outputs(linear, rows)
    assert isinstance(piece, Int8Linear) and torch.equal(piece.codes, codes[rows])
    torch.testing.assert_close(piece(x), linear(x)[:, rows], rtol=1e-6, atol=1e-6)
    halves = torch.arange(96).tensor_split(2)
    parts = [take_inputs(linear, h, keep_bias=i == 0) for i, h in enumerate(halves)]
    assert all(isinstance(p, Int8Linear) for p in parts)
    torch.testing.assert_close(parts[0](x[:, :48]) + parts[1](x[:, 48:]), linear(x), rtol=1e-5, atol=1e-5)

    table = Int8Embedding(codes, scale, torch.float32)
    ids = torch.tensor([0, 5, 6, 11])
    # Outside a process group each slice looks up its own ids only: the slices sum to the table.
    slices = [VocabParallelEmbedding.from_embedding(table, r, 2) for r in range(2)]
    assert slices[0].dtype == torch.float32 and slices[0].weight.shape[0] == 6
    assert torch.equal(slices[0](ids) + slices[1](ids), table(ids))
