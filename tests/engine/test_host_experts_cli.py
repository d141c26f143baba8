"""``--experts-on cpu`` from the command line: generate gives the plain run's tokens, bench reports
its figures with the placement named, and serve and generate refuse what they cannot do."""

from __future__ import annotations

import json
import shutil

import pytest
from synthetic_shapes import tiny_moe_shape

from engine import cli
from engine.bench import speed as bench

TINY_MOE = tiny_moe_shape()
SMALL_RUN = ["--prompt", "24", "--context", "24", "--decode-tokens", "3", "--repeats", "1"]


@pytest.fixture(scope="module")
def moe_with_tokenizer(tiny_llama_hf, tmp_path_factory):
    """A tiny random Qwen3-MoE with the fixtures' tokenizer (a vocabulary of its size)."""
    import transformers as tf
    from tiny_models import COMMON, build_tiny_model

    directory = tmp_path_factory.mktemp("moe-cli")
    config = tf.Qwen3MoeConfig(
        **{**COMMON, "vocab_size": 2048},
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    build_tiny_model("Qwen3MoeForCausalLM", directory, config=config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_hf / name, directory / name)
    return directory


def _generate(directory, capsys, *extra: str) -> list[int]:
    argv = ["generate", "-m", str(directory), "-p", "Once upon a time", "-n", "12", "--device", "cpu"]
    assert cli.main([*argv, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["token_ids"]


def test_generate_with_experts_on_cpu_gives_the_plain_tokens(moe_with_tokenizer, capsys, monkeypatch) -> None:
    monkeypatch.setenv("TRELLIS_DRAFT", "off")
    plain = _generate(moe_with_tokenizer, capsys)
    assert len(plain) == 12
    assert _generate(moe_with_tokenizer, capsys, "--experts-on", "cpu") == plain


def test_generate_serve_and_bench_take_the_placement_options() -> None:
    parser = cli.build_parser()
    for command, more in (("generate", ["-p", "Hi"]), ("serve", []), ("bench", [])):
        args = parser.parse_args([command, "-m", "DIR", *more, "--experts-on", "cpu", "--gpu-layers", "3"])
        assert args.experts_on == "cpu" and args.gpu_layers == 3
    with pytest.raises(cli.CommandLineError, match="invalid choice: 'disk'"):
        parser.parse_args(["generate", "-m", "DIR", "-p", "Hi", "--experts-on", "disk"])


def test_bench_reports_a_row_with_experts_on_cpu(tmp_path, capsys) -> None:
    shape = tmp_path / "moe.json"
    shape.write_text(json.dumps(TINY_MOE))
    out = tmp_path / "b.json"
    argv = ["--synthetic", str(shape), "--bpw", "4", "--no-peer", "--json", str(out), "--device", "cpu"]
    assert bench.main([*argv, "--experts-on", "cpu", *SMALL_RUN]) == 0
    r = json.loads(out.read_text())
    assert r["experts_on"] == "cpu" and r["cuda_graphs"] is False
    (row,) = r["rows"]
    assert row["decode_tokens_per_s"] > 0 and "peak_memory_bytes" in row  # None off the GPU
    assert "experts on the CPU" in capsys.readouterr().out


def test_bench_refuses_a_layer_split_of_a_synthetic_model(tmp_path) -> None:
    shape = tmp_path / "moe.json"
    shape.write_text(json.dumps(TINY_MOE))
    with pytest.raises(SystemExit, match="--gpu-layers need -m/--model DIR"):
        bench.main(["--synthetic", str(shape), "--no-peer", "--device", "cpu", "--gpu-layers", "1"])


def test_the_apps_session_loads_with_experts_on_cpu(moe_with_tokenizer) -> None:
    """What the app's worker asks for (``ParallelChoice(experts_on="cpu")``)."""
    import torch

    from engine.errors import UsageError
    from engine.parallel.session import ParallelChatSession

    session = ParallelChatSession.load_parallel(moe_with_tokenizer, device="cpu", experts_on="cpu")
    assert session.model.experts_device == torch.device("cpu") and session.run is None
    assert session.model.module.dynamic_decode == "experts-in-host-memory"
    with pytest.raises(UsageError, match="one at a time"):
        ParallelChatSession.load_parallel(moe_with_tokenizer, device="cpu", experts_on="cpu", gpu_layers=2)
