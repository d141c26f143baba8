"""No network: the Hub client says so within seconds, once, instead of retrying for minutes.

Before, a search against an unreachable endpoint went through huggingface_hub's five retries
inside each of our eight (about 90 logged warnings, minutes of waiting). Now one TCP connect with a
short timeout decides, before the first request and before any retry of a network error."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from engine.hub import HubClient, SearchQuery
from engine.hub.errors import HubConnectionError, HubOfflineError
from engine.hub.reachability import unreachable_reason


def closed_port() -> int:
    """A local port nothing listens on (bound, then released): connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("endpoint", [f"http://127.0.0.1:{closed_port()}", "http://no-such-host.invalid"])
def test_an_unreachable_endpoint_is_reported_offline_in_seconds(endpoint: str, caplog) -> None:
    client = HubClient(endpoint=endpoint, probe_timeout=2.0)  # the default retry policy: 8 attempts
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    with pytest.raises(HubOfflineError, match="No network: cannot reach") as raised:
        client.search(SearchQuery(text="llama"))
    assert time.monotonic() - started < 10
    assert isinstance(raised.value, HubConnectionError)  # callers that knew the old error still do
    # No retry was made, so none was logged.
    assert [r for r in caplog.records if "Retrying" in r.getMessage()] == []


def test_a_black_holed_address_gives_up_after_the_probe_timeout(monkeypatch) -> None:
    # An address that never answers (a firewall dropping packets): the connect times out.
    def hang(address, timeout):
        time.sleep(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", hang)
    started = time.monotonic()
    assert unreachable_reason("https://hub.example:443", timeout=0.5, fresh=True) == "no answer"
    assert time.monotonic() - started < 2


def test_a_reachable_hub_still_answers(fake_hub) -> None:
    fake_hub.add_repo("org/model", {"config.json": "{}"}, downloads=3)
    assert unreachable_reason(fake_hub.endpoint, fresh=True) is None
    assert [h.repo_id for h in HubClient().search(SearchQuery())] == ["org/model"]


def test_a_proxy_is_probed_instead_of_the_hub(monkeypatch) -> None:
    # Behind a proxy the Hub itself may be unreachable directly; the proxy is what must answer.
    seen = []

    def connect(address, timeout):
        seen.append(address)
        raise ConnectionRefusedError

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.setattr(socket, "create_connection", connect)
    assert unreachable_reason("https://huggingface.co", fresh=True) == "connection refused"
    assert seen == [("proxy.example", 3128)]
