"""Long prompts' attention in query blocks (``engine.modules.attention.SCORE_BLOCK_BYTES``): the
same result as one pass, with each block handed only the keys it can see."""

from __future__ import annotations

import pytest
import torch

from engine.modules import attention
from engine.modules.attention import attend

HEADS, KV_HEADS, D = 4, 2, 16


def _case(n: int, past: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS, D, generator=g)
    k = torch.randn(past + n, KV_HEADS, D, generator=g)
    v = torch.randn(past + n, KV_HEADS, D, generator=g)
    sinks = torch.randn(HEADS, generator=g)
    return q, k, v, torch.arange(past, past + n), torch.arange(past + n), sinks


OPTIONS = [
    pytest.param({}, id="causal"),
    pytest.param({"window": 5}, id="window"),
    pytest.param({"softcap": 3.0}, id="softcap"),
    pytest.param({"sinks": True, "window": 7}, id="sinks-window"),
    pytest.param({"bidirectional": [(3, 11)]}, id="bidirectional"),
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("n,past", [(23, 0), (17, 9)])
def test_blocks_equal_one_pass(monkeypatch, options, n, past) -> None:
    q, k, v, q_pos, k_pos, sinks = _case(n, past, seed=n + past)
    kwargs = dict(options)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = sinks
    whole = attend(q, k, v, q_pos, k_pos, D**-0.5, **kwargs)
    seen: list[tuple[int, int]] = []
    inner = attention.attend

    def spy(q, k, *args, **kw):
        seen.append((q.shape[0], k.shape[0]))
        return inner(q, k, *args, **kw)

    # Room for 4 queries' scores over every key: blocks of 4 (the last one shorter).
    monkeypatch.setattr(attention, "SCORE_BLOCK_BYTES", 4 * 4 * HEADS * (past + n))
    monkeypatch.setattr(attention, "attend", spy)
    blocked = inner(q, k, v, q_pos, k_pos, D**-0.5, **kwargs)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)
    if past == 0 and not kwargs:  # plain causal: SDPA's causal kernels take it whole
        assert not seen
        return
    assert [rows for rows, _ in seen] == [4] * (n // 4) + ([n % 4] if n % 4 else [])
    if "bidirectional" not in kwargs:  # nothing after a block's last query is handed to it
        assert seen[0][1] == past + 4 - max(0, past + 1 - kwargs.get("window", past + 1))
    if "window" in kwargs:  # a block sees at most its rows plus the window
        assert all(keys <= rows + kwargs["window"] - 1 for rows, keys in seen)


@pytest.mark.parametrize("window", [None, 12, 100])
def test_plain_causal_prompts_at_flash_head_sizes_stay_whole(monkeypatch, window) -> None:
    """SDPA's causal kernels never form the scores, so such a prompt (a window as long as the
    prompt included) is not cut."""
    q, k, v, q_pos, k_pos, _ = _case(12, 0, seed=1)
    monkeypatch.setattr(attention, "SCORE_BLOCK_BYTES", 1)
    calls = []
    monkeypatch.setattr(attention, "_attend_in_blocks", lambda *a: calls.append(a))
    attend(q, k, v, q_pos, k_pos, D**-0.5, window)
    assert not calls
