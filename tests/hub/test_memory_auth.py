"""Memory estimates from config.json, and the token's lookup order and masking."""

from __future__ import annotations

import pytest
from fake_hub import tiny_llama_config

from engine.hub import auth
from engine.hub.memory import MachineMemory, estimate_memory, kv_cache_bytes, machine_memory


def test_kv_cache_llama():
    cfg = tiny_llama_config()  # 4 layers, 2 kv heads, head_dim 256/8 = 32
    assert kv_cache_bytes(cfg, 1000) == 2 * 4 * 2 * 32 * 2 * 1000
    assert kv_cache_bytes(cfg, 1000, bytes_per_element=0.5) == 2 * 4 * 2 * 32 * 1000 // 2


def test_kv_cache_gemma3_sliding_layers_hold_only_the_window():
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_size": 640,
            "sliding_window": 512,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        },
    }
    per_token_layer = 2 * 1 * 256 * 2
    assert kv_cache_bytes(cfg, 8192) == per_token_layer * (5 * 512 + 8192)


def test_kv_cache_exaone4_pattern_string_slides_its_l_layers_but_the_last():
    cfg = {
        "model_type": "exaone4",
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "sliding_window": 100,
        "sliding_window_pattern": "LLG",  # layers 0, 1, 3 slide; 2 and 4 (the last, an L) are global
    }
    per_token_layer = 2 * 1 * 64 * 2
    assert kv_cache_bytes(cfg, 1000) == per_token_layer * (3 * 100 + 2 * 1000)


def test_estimate_verdicts():
    cfg = tiny_llama_config()
    gpu_box = MachineMemory(
        ram_total=64 << 30, ram_available=32 << 30, gpus=(("H200", 140 << 30, 139 << 30),)
    )
    cpu_box = MachineMemory(ram_total=16 << 30, ram_available=8 << 30)
    assert estimate_memory(cfg, 4 << 30, 4096, machine=gpu_box).verdict == "gpu"
    est = estimate_memory(cfg, 4 << 30, 4096, machine=cpu_box)
    assert est.verdict == "cpu"
    assert est.total == est.weights + est.kv_cache + est.overhead
    assert "fits in RAM only" in est.describe() and "no GPU" in est.describe()
    assert estimate_memory(cfg, 40 << 30, 4096, machine=cpu_box).verdict == "no"


def test_machine_memory_reads_this_machine():
    m = machine_memory()
    assert m.ram_total > m.ram_available > 0


def test_secret_is_masked():
    s = auth.Secret("hf_abcdefghijklmnop")
    assert "abcdef" not in repr(s) and "abcdef" not in str(s) and "abcdef" not in f"{s}"
    assert s.reveal() == "hf_abcdefghijklmnop"


class MemoryKeyring:
    """A keyring backend in memory (the real one is not touched by tests)."""

    priority = 1

    def __init__(self):
        self.store = {}

    def get_password(self, service, user):
        return self.store.get((service, user))

    def set_password(self, service, user, value):
        self.store[(service, user)] = value

    def delete_password(self, service, user):
        del self.store[(service, user)]


@pytest.fixture
def memory_keyring(monkeypatch):
    kr = MemoryKeyring()
    import keyring

    monkeypatch.setattr(keyring, "get_keyring", lambda: kr)
    monkeypatch.setattr(keyring, "get_password", kr.get_password)
    monkeypatch.setattr(keyring, "set_password", kr.set_password)
    monkeypatch.setattr(keyring, "delete_password", kr.delete_password)
    return kr


def test_token_lookup_order(memory_keyring, monkeypatch):
    assert auth.resolve_token() is None
    assert auth.save_token("hf_fromkeyring") is True
    assert auth.resolve_token().reveal() == "hf_fromkeyring"
    monkeypatch.setenv("HF_TOKEN", "hf_fromenv")
    assert auth.resolve_token().reveal() == "hf_fromenv"
    assert auth.resolve_token("hf_explicit").reveal() == "hf_explicit"
    monkeypatch.delenv("HF_TOKEN")
    auth.delete_token()
    assert auth.resolve_token() is None


def test_no_keyring_backend_means_no_storage():
    assert auth.keyring_available() is False  # the null backend from conftest
    assert auth.save_token("hf_x") is False
