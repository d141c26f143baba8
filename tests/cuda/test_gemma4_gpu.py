"""Gemma 4 on a CUDA GPU: its full layers (heads of 512 whose keys double as values) and sliding
layers (heads of 256) decode through the paged-attention kernel, and every decode step's logits
are those the torch reference attention gives on the same GPU model (dense and 4-bit caches).

The model is a tiny random Gemma 4 with the published head sizes (tests/engine/tiny_gemma4.py),
settled so that a rounding difference in one layer does not grow into a different token. On it
(CPU, bf16, the reference attention altered) relative noise of 2e-3 on every attention output
moves the decode logits by <0.01 of their norm, the full layers' outputs shifted by one position
by ~0.14: TOL lies between."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from parity import random_ids, rel_err

from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.kernels import attention
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_gemma4 import perturb, settle, text_config  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("cuda_extension")]

# The published sizes: 256 in sliding layers, 512 in full ones, 8 query heads per full-layer kv
# head (the 31B: 32 over 4).
HEADS = dict(
    head_dim=256,
    global_head_dim=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_global_key_value_heads=1,
)
PROMPT, NEW = 150, 24
TOL = 3e-2


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory) -> Path:
    import transformers as tf

    directory = tmp_path_factory.mktemp("gemma4-heads-512")
    torch.manual_seed(0)
    model = tf.Gemma4ForCausalLM(text_config("31b", **HEADS)).float().eval()
    perturb(model)
    settle(model)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


class _KernelSpy:
    """Stands in for ``attention.paged_decode_attention``: records each call's head size and
    whether the kernel took it, and passes the answer on."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, q, *args, **kwargs):
        out = self.kernel(q, *args, **kwargs)
        self.calls.append((q.shape[-1], out is not None))
        return out


def _decode(model, cache_bits: tuple[int, int]) -> tuple[torch.Tensor, list[int]]:
    """Every decode step's logits ``[NEW, vocab]`` and the greedy tokens, through the fixed-shape
    decode path (one paged-attention call per layer and step), eagerly."""
    seen: list[torch.Tensor] = []
    hook = model.module.register_forward_hook(
        lambda m, a, out: seen.append(out.float()) if out.shape[0] else None
    )
    options = EngineOptions(cuda_graphs=False, batched_decode=True)
    try:
        gen = Generator(model, cache_tokens=512, page_size=16, cache_bits=cache_bits, options=options)
        job = Job(random_ids(PROMPT, seed=3), max_new_tokens=NEW, stop_token_ids=())
        (result,) = gen.generate([job])
    finally:
        hook.remove()
    assert len(result.token_ids) == NEW == len(seen)
    return torch.cat(seen), result.token_ids


@pytest.mark.parametrize("cache_bits", [(16, 16), (4, 4)])
def test_decode_through_the_kernel_equals_the_torch_attention(gemma4_dir, monkeypatch, cache_bits):
    model = load_model(gemma4_dir, device="cuda", dtype="bfloat16")
    spy = _KernelSpy(attention.paged_decode_attention)
    with monkeypatch.context() as patch:
        patch.setattr(attention, "paged_decode_attention", spy)
        got, tokens = _decode(model, cache_bits)
    taken = {d for d, took in spy.calls if took}
    declined = {d for d, took in spy.calls if not took}
    assert taken == {256, 512} and not declined, f"kernel took head sizes {taken}, declined {declined}"

    with monkeypatch.context() as patch:  # the kernel declines everything: the torch reference runs
        patch.setattr(attention, "paged_decode_attention", lambda *args, **kwargs: None)
        want, want_tokens = _decode(model, cache_bits)
    # Steps up to the first token that differs saw the same sequence; a difference is allowed only
    # at a near tie of the reference's logits.
    n = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), NEW)
    steps = min(n + 1, NEW)
    err = rel_err(got[:steps], want[:steps])
    assert err < TOL, f"cache {cache_bits}: logits {err:.2e} from the reference's over {steps} steps"
    if n < NEW:
        gap = (want[n, want_tokens[n]] - want[n, tokens[n]]).abs().item()
        assert gap < 1e-2 * want[n].abs().max().item(), f"cache {cache_bits}: token {n} differs by {gap}"
