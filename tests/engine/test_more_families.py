"""MiMo, IQuest-Coder, HyperCLOVA X, nanochat, Solar Open and DeciLM (Nemotron-NAS) on tiny random
checkpoints (tiny_more_families.py): logits over a 64-token prompt, prefilled in chunks across
pages, against transformers' modeling code where it has the family and, for DeciLM, against the
reference below; then what each family reads from its config and checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from parity import random_ids, rel_err
from tiny_more_families import BUILDERS, DECI_BLOCKS, build_deci, build_hyperclovax, deci_config

from engine.architectures.deci import ffn_width
from engine.cache.paged import PagedKVCache
from engine.errors import ModelLoadError
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.modules.feed_forward import FeedForward
from engine.modules.moe import SparseMoE

TOL = 1e-4


def _logits(directory, ids: list[int]) -> torch.Tensor:
    model = load_model(directory, device="cpu")
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    return score_tokens(model.module, cache, ids, chunk=20)  # chunked prefill across pages


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``family -> (directory, reference)``, each built once."""
    cache = {}

    def get(family: str):
        if family not in cache:
            directory = tmp_path_factory.mktemp(family)
            cache[family] = (directory, BUILDERS[family](directory))
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(BUILDERS))
def test_logits_match_the_reference(family, built):
    directory, reference = built(family)
    ids = random_ids(64)
    expected = reference(torch.tensor(ids))
    got = _logits(directory, ids)
    assert got.shape == expected.shape
    assert rel_err(got, expected) < TOL


def test_hyperclovax_without_post_norms_matches_transformers(tmp_path):
    reference = build_hyperclovax(tmp_path, post_norms=False)
    ids = random_ids(64, seed=3)
    assert rel_err(_logits(tmp_path, ids), reference(torch.tensor(ids))) < TOL
    model = load_model(tmp_path, device="cpu")
    assert all(b.mixer_out_norm is None and b.feed_forward_out_norm is None for b in model.module.blocks)
    assert {b.residual_scale for b in model.module.blocks} == {0.6}


def test_mimo_leaves_its_multi_token_prediction_layer_unread(built):
    from safetensors import safe_open

    directory, _ = built("MiMoForCausalLM")
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        assert "model.mtp_layers.0.input_proj.weight" in f.keys()
    model = load_model(directory, device="cpu")
    assert len(model.module.blocks) == 4
    assert model.module.blocks[0].mixer.qkv.linears[0].bias is not None  # Qwen2's q bias


def test_nanochat_stores_no_norm_and_turns_rope_backwards(built):
    from safetensors import safe_open

    directory, _ = built("NanoChatForCausalLM")
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        assert not any("norm" in key for key in f.keys())
    model = load_model(directory, device="cpu")
    assert model.module.embed_norm is not None and model.module.final_softcap == 15.0
    block = model.module.blocks[0]
    assert isinstance(block.feed_forward, FeedForward) and block.mixer.rope.inv_freq.max() < 0


def test_nanochat_in_its_own_layout_is_refused_with_a_message(built, tmp_path):
    from safetensors.torch import save_file

    directory, _ = built("NanoChatForCausalLM")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    save_file({"transformer.wte.weight": torch.zeros(320, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="nanochat's own layout"):
        load_model(tmp_path, device="cpu")


def test_solar_open_has_experts_in_every_layer_and_no_output_bias(built):
    directory, _ = built("SolarOpenForCausalLM")
    model = load_model(directory, device="cpu")
    blocks = model.module.blocks
    assert all(isinstance(b.feed_forward, SparseMoE) for b in blocks)
    moe = blocks[0].feed_forward
    assert (moe.scoring, moe.top_k, moe.num_groups, moe.groups_per_token, moe.scale) == (
        "sigmoid",
        2,
        2,
        1,
        2.0,
    )
    assert blocks[0].mixer.rope.rotary_dim == 16  # the whole head
    assert blocks[0].mixer.o_proj.bias is None


# --- DeciLM (Nemotron-NAS): a reference written from the Hub's modeling_decilm.py -------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


def deci_reference(w: dict[str, torch.Tensor], config: dict, ids: list[int]) -> torch.Tensor:
    """DeciLM's forward pass as its modeling file defines it: a Llama decoder layer per block
    config, whose attention (with ``num_attention_heads / n_heads_in_group`` KV heads) and gated
    SiLU MLP (``ffn_mult`` wide) are each skipped with their pre-norm where ``no_op`` says."""
    h, heads, eps = config["hidden_size"], config["num_attention_heads"], config["rms_norm_eps"]
    d, n = h // heads, len(ids)
    inv = 1.0 / config["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(n).float()[:, None] * inv[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i, block in enumerate(config["block_configs"]):
        p = f"model.layers.{i}."
        if not block["attention"].get("no_op"):
            kv = heads // block["attention"]["n_heads_in_group"]
            y = _rms(x, w[p + "input_layernorm.weight"], eps)
            q = _rotate((y @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d), cos, sin)
            k = _rotate((y @ w[p + "self_attn.k_proj.weight"].T).view(n, kv, d), cos, sin)
            v = (y @ w[p + "self_attn.v_proj.weight"].T).view(n, kv, d)
            k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            x = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(n, h) @ w[p + "self_attn.o_proj.weight"].T
        if not block["ffn"].get("no_op"):
            y = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


@pytest.fixture(scope="module")
def deci(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deci")
    return directory, build_deci(directory)


def test_deci_logits_match_the_reference(deci):
    directory, weights = deci
    ids = random_ids(64)
    with torch.no_grad():
        expected = deci_reference(weights, deci_config(), ids)
    assert rel_err(_logits(directory, ids), expected) < TOL


def test_deci_layers_take_their_shapes_from_the_block_configs(deci):
    directory, _ = deci
    model = load_model(directory, device="cpu")
    for block, (group, mult) in zip(model.module.blocks, DECI_BLOCKS):
        if group is None:
            assert block.mixer is None and block.mixer_norm is None and block.state is None
        else:
            assert block.mixer.num_kv_heads == 4 // group
        if mult is None:
            assert block.feed_forward is None and block.feed_forward_norm is None
        else:
            assert block.feed_forward.down.in_features == ffn_width(mult, 64)
    assert [ffn_width(m, 64) for m in (1.0, 7.0)] == [256, 512]
    cache = PagedKVCache.for_model(model.spec, 64, page_size=16)
    assert cache.layer(2) is None and cache.layer(1) is not None  # no attention: no KV pages


def test_deci_cache_footprint_from_its_config_is_the_engines(deci):
    """The app's torch-free memory estimate counts each layer's own KV heads, and none for a
    layer without attention."""
    from engine.cache.paged import cache_footprint
    from engine.config_footprint import config_footprint

    directory, _ = deci
    model = load_model(directory, device="cpu")
    footprint = config_footprint(json.loads((directory / "config.json").read_text()))
    assert footprint == cache_footprint(model.spec)
    assert footprint.kv_layers == ((2, 16), (1, 16), (4, 16), (2, 16))


def test_deci_decodes_a_batch_as_each_sequence_alone(deci):
    """Continuous batching over layers of different KV widths and a layer with no cache."""
    directory, _ = deci
    model = load_model(directory, device="cpu")
    jobs = [Job(random_ids(n, seed=n), max_new_tokens=8, stop_token_ids=()) for n in (5, 23, 12)]
    together = [r.token_ids for r in Generator(model, cache_tokens=512, page_size=8).generate(jobs)]
    alone = [
        r.token_ids for job in jobs for r in Generator(model, cache_tokens=512, page_size=8).generate([job])
    ]
    assert together == alone


def _no_op_layer(config: dict) -> None:
    config["block_configs"][0]["attention"]["no_op"] = True
    config["block_configs"][0]["ffn"]["no_op"] = True


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c["block_configs"][1]["attention"].update(replace_with_linear=True),
            "replace_with_linear",
        ),
        (lambda c: c["block_configs"][3]["ffn"].update(sparsify=["x"]), "sparsify"),
        (_no_op_layer, "neither attention nor an MLP"),
        (lambda c: c["block_configs"][0]["ffn"].pop("ffn_mult"), "neither ffn_mult nor intermediate_size"),
        (lambda c: c["block_configs"].pop(), "block_configs has 4 entries"),
        (lambda c: c["block_configs"][0]["attention"].update(n_heads_in_group=3), "groups of 3"),
    ],
)
def test_deci_configs_it_cannot_run_are_refused_with_a_message(change, message, tmp_path):
    from engine.architectures import architecture_for
    from engine.config import ModelConfig

    config = deci_config()
    change(config)
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        architecture_for("DeciLMForCausalLM").spec(ModelConfig.from_dir(tmp_path))
