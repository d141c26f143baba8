"""Decode graphs under tensor parallelism, the part the CPU can check (gloo): the protocol by
which rank 0 names each graph to capture or replay and the other ranks follow, a run of one rank
in a process group, and graphs staying off on the CPU. The captures themselves run on GPUs
(tests/cuda/test_tp_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_cases import assert_logits_close, greedy_jobs, step_logits

from engine.generation.cuda_graph import WARMUP_STEPS, DecodeGraphs
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model
from engine.options import EngineOptions
from engine.parallel.launch import start_tensor_parallel
from engine.parallel.step_plan import DropGraphs, GraphStep


class _EagerGraph:
    """Stands for a captured CUDA graph on the CPU: a replay runs the captured step again, into
    the same output tensor. Capturing runs nothing (as a real capture: its collectives run only
    when replayed), so the other ranks' collectives still pair with rank 0's."""

    def __init__(self, step, out: torch.Tensor) -> None:
        self.step, self.out = step, out

    def replay(self) -> None:
        self.out.copy_(self.step())


def _eager_capture(self: DecodeGraphs, entry) -> bool:
    """``DecodeGraphs._warm_up_and_capture`` with the capture replaced by :class:`_EagerGraph`."""

    def step():
        return self.hooks.forward(self.model, self.cache, entry.inputs, entry.key[2])

    for _ in range(WARMUP_STEPS - 1):
        step()
    out = step().clone()  # the last warm-up gives the output's shape
    entry.graph, entry.logits = _EagerGraph(step, out), out
    return True


def _greedy_tokens(gen: Generator, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    jobs = [Job(p, tokens, stop_token_ids=[]) for p in prompts]
    for job in jobs:
        gen.enqueue(job)
    out: dict = {job: [] for job in jobs}
    while gen.num_remaining_jobs:
        for r in gen.iterate():
            out[r.job] += r.token_ids
    return [out[job] for job in jobs]


PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(70, 75))]


def test_followers_replay_the_graphs_rank_0_names(tiny_model_factory, monkeypatch) -> None:
    """Rank 0's Generator runs decode steps through DecodeGraphs over two gloo ranks, with each
    capture a stand-in that replays eagerly; rank 1 follows the GraphStep messages (on the CPU it
    runs each named step eagerly). Its inputs buffer comes only from rank 0's broadcast inside
    the step, so a follower on another bucket could not pair its collectives: the tokens are
    the single process's, and each bucket was captured once and replayed every later step."""
    monkeypatch.setattr(DecodeGraphs, "_warm_up_and_capture", _eager_capture)
    sent: list[object] = []
    import engine.parallel.leader as leader

    real_send = leader.messages.send

    def spy(message: object) -> None:
        sent.append(message)
        real_send(message)

    monkeypatch.setattr(leader.messages, "send", spy)
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    single = load_model(directory, device="cpu")
    options = EngineOptions(pipelined_decode=False)
    reference = _greedy_tokens(
        Generator(single, cache_tokens=512, page_size=16, options=options), PROMPTS, 24
    )
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")
    with run:
        gen = Generator(model, cache_tokens=512, page_size=16, options=options)
        gen._use_graphs = True  # the CPU never replays graphs; the stand-in capture above does
        tokens = _greedy_tokens(gen, PROMPTS, 24)
        graphs = gen._graphs
        assert graphs is not None and graphs.failed is None
        steps = [m for m in sent if isinstance(m, GraphStep)]
        captures = [m.key for m in steps if m.capture]
        replays = [m.key for m in steps if not m.capture]
        assert len(captures) == len(set(captures))  # each graph captured once, on every rank
        assert set(replays) == set(captures) and len(replays) == graphs.replays
        assert all(argmax_only for _, _, argmax_only in captures)  # plain greedy: argmax rows
        assert {(b, p) for b, p, _ in captures} == set(graphs.captured)
        # Three jobs take the 3-row graph; rows left after the first ends take smaller ones.
        assert any(b == 3 for b, _, _ in captures) and graphs.replays >= 20
    assert tokens == reference


def test_a_failed_capture_on_rank_0_drops_the_graphs_everywhere(tiny_model_factory, monkeypatch) -> None:
    """Rank 0's capture fails after the other ranks captured theirs: they drop them, and every
    later step runs eagerly on all ranks (the same tokens)."""

    def fail(self, entry) -> bool:
        for _ in range(WARMUP_STEPS):  # the other ranks' warm-up steps pair with these
            self.hooks.forward(self.model, self.cache, entry.inputs, entry.key[2])
        self.failed = "RuntimeError: not capturable"
        self._graphs.clear()
        return False

    monkeypatch.setattr(DecodeGraphs, "_warm_up_and_capture", fail)
    sent: list[object] = []
    import engine.parallel.leader as leader

    real_send = leader.messages.send
    monkeypatch.setattr(leader.messages, "send", lambda m: (sent.append(m), real_send(m)))
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    options = EngineOptions(pipelined_decode=False)
    reference = _greedy_tokens(
        Generator(load_model(directory, device="cpu"), cache_tokens=512, page_size=16, options=options),
        PROMPTS[:1],
        12,
    )
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")
    with run:
        gen = Generator(model, cache_tokens=512, page_size=16, options=options)
        gen._use_graphs = True
        tokens = _greedy_tokens(gen, PROMPTS[:1], 12)
        assert gen._graphs.failed and gen._graphs.replays == 0
    kinds = [type(m).__name__ for m in sent]
    assert kinds.count("GraphStep") == 1 and kinds.count("DropGraphs") == 1
    assert isinstance(sent[kinds.index("GraphStep") + 1], DropGraphs)
    assert tokens == reference


def test_graphs_stay_off_on_the_cpu(tiny_model_factory) -> None:
    """A CPU run's Generator replays no graph: every step is an eager plan, as before."""
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")
    with run:
        assert model.module.static_decode  # the shard itself could replay, on a GPU
        gen = Generator(model, cache_tokens=512, page_size=16)
        _greedy_tokens(gen, PROMPTS[:1], 4)
        assert not gen._use_graphs and gen._graphs is None


def test_one_rank_in_a_process_group_matches_the_single_process(tiny_model_factory, monkeypatch) -> None:
    """The test entry point ``group_of_one``: one rank, a real (gloo) process group, the model
    sharded whole and its collectives issued; the same logits and tokens as the plain model."""
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    single = load_model(directory, device="cpu")
    reference_logits = step_logits(single)
    reference_tokens, _ = greedy_jobs(single, tokens=16)
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (calls.append(t.shape), real(t, *a, **k))[1])
    model, run, _ = start_tensor_parallel(directory, 1, device="cpu", group_of_one=True)
    with run:
        assert dist.is_initialized() and dist.get_world_size() == 1 and run.pids == []
        assert type(model.module).__name__ == "LeaderModule"
        assert_logits_close(step_logits(model), reference_logits)
        tokens, _ = greedy_jobs(model, tokens=16)
        assert calls  # the row-parallel sums ran as collectives
    assert not dist.is_initialized()  # closing the run left its group
    assert tokens == reference_tokens


def test_all_reduce_cost_runs_on_every_rank(tiny_model_factory) -> None:
    """``bench --tp N --allreduce-cost``'s figure: rank 0 asks, the other ranks time the same
    all-reduces alongside it (on the CPU, eagerly), and the run goes on afterwards."""
    from engine.bench import speed as bench
    from engine.parallel.allreduce_cost import all_reduce_cost, describe

    directory = tiny_model_factory("LlamaForCausalLM")[0]
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")
    with run:
        cost = all_reduce_cost(model, replays=5, rounds=3)
        assert not cost["in_graph"] and cost["all_reduces_in_graph"] == len(model.module.blocks)
        assert cost["width"] == model.spec.hidden_size
        assert cost["graph_us"] > 0 and cost["per_step_us"] == cost["per_all_reduce_us"] * (
            2 * len(model.module.blocks) + 1
        )
        assert "all-reduce over 2 ranks" in describe(cost, 2)
        assert_logits_close(step_logits(model), step_logits(load_model(directory, device="cpu")))
    with pytest.raises(SystemExit, match="--allreduce-cost needs --tp"):
        bench.main(["--synthetic", "llama3.1-8b", "--allreduce-cost", "--no-peer", "--device", "cpu"])
