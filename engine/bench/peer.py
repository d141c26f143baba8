"""The ``bench`` peer: Hugging Face ``transformers`` on the same shape or checkpoint, same device.

Its fastest documented decoding setup: ``generate`` with a static KV cache, which makes
``generate`` compile the one-token forward with ``torch.compile`` (mode ``reduce-overhead``,
i.e. CUDA graphs) on a CUDA device. The prompt itself runs uncompiled, as in ``generate``.
When compiling fails the decode is measured again without it, and the result says so.

Figures match ours: decode tokens/s from a near-empty context (1 prompt token) and at
``context`` tokens, as (N - 1) tokens over t(N new tokens) - t(1 new token), both runs on the
same static cache shape so the compiled graph is reused; prefill tokens/s of one forward over
``prompt`` tokens computing only the last position's logits (what generation needs).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from engine.bench.roofline import module_decode_bytes
from engine.bench.timing import median_time


def build_from_config(hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype):
    """A randomly initialised transformers model of ``hf_config``, created on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    cfg.pop("architectures", None)
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    # Parameters are allocated directly on the device; the init kernels run there too.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()  # a no-op unless a release ignores the device context


def build_from_dir(model_dir: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def _generate(model, ids: torch.Tensor, cache, new: int, use_compile: bool) -> None:
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        disable_compile=not use_compile,
    )


def _static_cache(model, length: int, batch: int):
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=length)  # transformers 5
    except TypeError:  # 4.x wanted the batch, device and dtype up front
        return StaticCache(
            config=model.config,
            max_batch_size=batch,
            max_cache_len=length,
            device=model.device,
            dtype=model.dtype,
        )


def bench_transformers(model, device: torch.device, args, compile: bool = True) -> dict[str, Any]:
    """Decode and prefill figures of ``model`` (see module docstring) and whether it compiled."""
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.get_text_config().vocab_size
    n, b = args.decode_tokens, args.batch
    result: dict[str, Any] = {"compile_requested": compile}

    @torch.inference_mode()
    def prefill():
        ids = torch.randint(0, vocab, (1, args.prompt_tokens), generator=gen).to(device)
        model(ids, use_cache=False, logits_to_keep=1)

    result["prefill_tokens_per_s"] = args.prompt_tokens / median_time(prefill, args.repeats, device)

    def decode(context: int, use_compile: bool) -> float:
        ids = torch.randint(0, vocab, (1, context), generator=gen).repeat(b, 1).to(device)
        cache = _static_cache(model, context + n, b)

        @torch.inference_mode()
        def run(new: int) -> None:
            cache.reset()
            with warnings.catch_warnings():  # newer releases rename past_key_values; both work
                warnings.simplefilter("ignore", FutureWarning)
                _generate(model, ids, cache, new, use_compile)

        t1 = median_time(lambda: run(1), args.repeats, device)
        tn = median_time(lambda: run(n), args.repeats, device)
        return b * (n - 1) / max(tn - t1, 1e-9)

    use_compile = compile and device.type == "cuda"  # generate compiles only on accelerators
    try:
        result["decode_tokens_per_s"] = decode(1, use_compile)
        result["decode_ctx_tokens_per_s"] = decode(args.context, use_compile)
    except Exception as exc:  # noqa: BLE001 - any compile failure: measure without it, say so
        if not use_compile:
            raise
        torch._dynamo.reset()
        result["note"] = f"torch.compile failed ({type(exc).__name__}: {str(exc)[:300]}); measured uncompiled"
        use_compile = False
        result["decode_tokens_per_s"] = decode(1, False)
        result["decode_ctx_tokens_per_s"] = decode(args.context, False)
    result["compiled"] = use_compile
    return result


def _global_attribute(config, name: str):
    """``config.name``, or None where it is absent or (configs with per-layer values, as Gemma 4's in
    some transformers releases) refused as a model-wide value: the byte count is an estimate."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError, not an AttributeError
        return None


def peer_decode_bytes(model, dtype: torch.dtype):
    """Bytes per decode step of the transformers model (bf16 weights, dense bf16 KV cache)."""
    from engine.bench.roofline import kv_bytes_per_token

    c = model.config.get_text_config()
    head_dim = _global_attribute(c, "head_dim") or c.hidden_size // c.num_attention_heads
    kv_heads = _global_attribute(c, "num_key_value_heads") or c.num_attention_heads
    bits = torch.finfo(dtype).bits
    kvb = kv_bytes_per_token(c.num_hidden_layers, kv_heads, head_dim, (bits, bits))
    return module_decode_bytes(model, model.get_input_embeddings().weight, kvb)
