"""``python -m engine profile-step`` on the CPU: both steps profiled, the matmuls found."""

import json

from engine.bench import profile_step

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def test_profile_step_reports_prefill_and_decode(tmp_path, capsys):
    shape, out = tmp_path / "tiny.json", tmp_path / "profile.json"
    shape.write_text(json.dumps(TINY))
    argv = ["--synthetic", str(shape), "--bpw", "4", "--prompt", "48", "--decode-tokens", "3"]
    assert profile_step.main([*argv, "--top", "8", "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["steps"]] == ["prefill 48", "decode 3"]
    for step in result["steps"]:
        assert step["wall_ms"] > 0 and 0 < len(step["top"]) <= 8
        assert any("mm" in row["name"] or "linear" in row["name"] for row in step["top"])
        assert all(row["calls"] > 0 and row["ms"] > 0 for row in step["top"])
    assert "== decode 3" in capsys.readouterr().out


def test_critical_path_charges_each_kernel_what_it_adds():
    # a runs 0-10; b is launched early (chained) at 2 and ends at 13: it adds 3; c starts after a
    # gap (idle 13-15) and ends at 20; d overlaps c entirely (adds nothing); a again at 20-24.
    kernels = [("b", 2.0, 13.0), ("a", 0.0, 10.0), ("c", 15.0, 20.0), ("d", 16.0, 19.0), ("a", 20.0, 24.0)]
    path = profile_step.critical_path(kernels)
    assert path.shares == {"a": 14.0, "b": 3.0, profile_step.IDLE: 2.0, "c": 5.0}
    assert sum(path.shares.values()) == 24.0  # the span, first start to last end
    assert path.gaps == [(2.0, "b", "c")]  # the idle time, with the kernels on either side
    empty = profile_step.critical_path([])
    assert empty.shares == {} and empty.gaps == []
