"""Search, model pages, branches and model cards through the real huggingface_hub client."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from fake_hub import PatternBlob, tiny_llama_config
from hub_helpers import FAST_RETRY, add_tiny_repo

from engine.hub.client import HubClient, SearchQuery, strip_front_matter
from engine.hub.errors import GatedRepoError, HubConnectionError, RepoNotFoundError, RevisionNotFoundError
from engine.units import parse_count


@pytest.fixture
def catalogue(fake_hub):
    def day(d):
        return datetime(2025, 3, d, tzinfo=UTC)

    add_tiny_repo(
        fake_hub, "meta/llama-8B", downloads=900, likes=10, last_modified=day(1), params=8_000_000_000
    )
    fake_hub.add_repo(
        "turbo/llama-8B-exl3",
        {"config.json": json.dumps(tiny_llama_config()), "README.md": "# exl3"},
        branches={
            b: {"config.json": "{}", "model.safetensors": b"x" * 10} for b in ("2.0bpw", "4.0bpw", "10.0bpw")
        },
        tags=["exl3", "text-generation"],
        downloads=50,
        likes=99,
        last_modified=day(20),
        params=8_000_000_000,
    )
    fake_hub.add_repo(
        "odd/mamba-1B",
        {"config.json": json.dumps({"architectures": ["MambaForCausalLM"]})},
        downloads=500,
        likes=1,
        last_modified=day(10),
        params=1_000_000_000,
    )
    fake_hub.add_repo(
        "google/gemma-70B-exl3",
        {"config.json": json.dumps(tiny_llama_config(architectures=["Gemma2ForCausalLM"]))},
        tags=["exl3"],
        downloads=5,
        params=70_000_000_000,
    )
    return fake_hub


def ids(hits):
    return [h.repo_id for h in hits]


def test_search_text_and_sort(catalogue):
    c = HubClient()
    assert ids(c.search(SearchQuery("llama"))) == ["meta/llama-8B", "turbo/llama-8B-exl3"]
    assert ids(c.search(SearchQuery("", sort="likes")))[:2] == ["turbo/llama-8B-exl3", "meta/llama-8B"]
    assert ids(c.search(SearchQuery("", sort="updated")))[0] == "turbo/llama-8B-exl3"
    hit = c.search(SearchQuery("mamba"))[0]
    assert hit.architectures == ("MambaForCausalLM",) and not hit.supported and not hit.exl3


def test_search_filters(catalogue):
    c = HubClient()
    assert ids(c.search(SearchQuery("", exl3=True))) == ["turbo/llama-8B-exl3", "google/gemma-70B-exl3"]
    assert "odd/mamba-1B" not in ids(c.search(SearchQuery("", supported_only=True)))
    small = c.search(SearchQuery("", max_params=parse_count("10B"), min_params=parse_count("2B")))
    assert ids(small) == ["meta/llama-8B", "turbo/llama-8B-exl3"]
    both = c.search(SearchQuery("", exl3=True, supported_only=True, max_params=9e9))
    assert ids(both) == ["turbo/llama-8B-exl3"]
    assert all(h.exl3 and h.supported for h in both)
    assert catalogue.requests_for("num_parameters=min%3A2B%2Cmax%3A10B") or catalogue.requests_for(
        "num_parameters=min:2B,max:10B"
    )


def test_model_page_details_branches_card(catalogue):
    c = HubClient()
    d = c.model_details("meta/llama-8B")
    shard = next(f for f in d.files if f.path.endswith("00001-of-00002.safetensors"))
    blob = catalogue.repos["meta/llama-8B"].resolve("main")[1][shard.path]
    assert shard.size == blob.size and shard.sha256 == blob.sha256
    cfg = next(f for f in d.files if f.path == "config.json")
    assert cfg.sha256 is None and cfg.blob_id
    assert d.license == "apache-2.0" and d.gated is False
    assert d.weights_size == 3 << 20
    assert d.commit == catalogue.repos["meta/llama-8B"].branches["main"]
    assert c.model_card("meta/llama-8B").startswith("# Tiny")
    assert c.config("meta/llama-8B")["num_key_value_heads"] == 2

    names = [b.name for b in c.branches("turbo/llama-8B-exl3")]
    assert names == ["main", "2.0bpw", "4.0bpw", "10.0bpw"]
    d4 = c.model_details("turbo/llama-8B-exl3", "4.0bpw")
    assert [f.path for f in d4.files] == ["config.json", "model.safetensors"]
    assert d4.commit == catalogue.repos["turbo/llama-8B-exl3"].branches["4.0bpw"]


def test_model_page_errors(catalogue):
    c = HubClient(retry=FAST_RETRY)
    with pytest.raises(RepoNotFoundError, match="nobody/nothing not found"):
        c.model_details("nobody/nothing")
    with pytest.raises(RevisionNotFoundError, match="'3.0bpw' not found"):
        c.model_details("turbo/llama-8B-exl3", "3.0bpw")
    assert c.fetch_text("odd/mamba-1B", "README.md") is None


def test_gated_card_needs_token(fake_hub):
    add_tiny_repo(fake_hub, "org/gated", gated="auto", tokens={"hf_x"})
    c = HubClient()
    assert c.model_details("org/gated").gated == "auto"  # metadata is public, files are not
    with pytest.raises(GatedRepoError, match="org/gated is gated"):
        c.model_card("org/gated")
    assert HubClient(token="hf_x").model_card("org/gated").startswith("# Tiny")


def test_metadata_calls_retry_server_errors(fake_hub, monkeypatch):
    add_tiny_repo(fake_hub)
    fake_hub.fault("README.md", "status", status=503, times=2)
    assert HubClient(retry=FAST_RETRY).model_card("org/tiny").startswith("# Tiny")


def test_unreachable_endpoint_is_a_clear_error(monkeypatch):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    c = HubClient(endpoint=f"http://127.0.0.1:{port}", retry=FAST_RETRY)
    with pytest.raises(HubConnectionError, match=f"cannot reach http://127.0.0.1:{port}"):
        c.model_details("org/tiny")


def test_endpoint_is_read_per_call(fake_hub, monkeypatch):
    c = HubClient()
    assert c.endpoint == fake_hub.endpoint
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.invalid/")
    assert c.endpoint == "http://mirror.invalid"


def test_front_matter_and_pattern_blob():
    assert strip_front_matter("---\nlicense: mit\n---\n# Hi\n") == "# Hi\n"
    assert strip_front_matter("# No front matter") == "# No front matter"
    blob = PatternBlob(3 << 20, seed=5)
    assert blob.read((1 << 20) - 2, 4) == blob.read(0, 3 << 20)[(1 << 20) - 2 : (1 << 20) + 2]
    assert blob.read(0, 16) != blob.read(1 << 20, 16)  # blocks differ
