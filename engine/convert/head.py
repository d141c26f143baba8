"""The output head: quantized at ``head_bits`` with the Hessian of the final-normed hidden state
of the quantized model, or kept at 16 bits (``head_bits = 16``). A tied head is quantized as a
copy of the embedding (docs/EXL3_FORMAT.md section 3.4)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.convert.block_quantizer import refit_note
from engine.convert.hessians import HessianHook
from engine.convert.options import ConvertOptions
from engine.convert.output import fp16_copy
from engine.convert.quantize import quantize_weight
from engine.convert.source_model import SourceModel


def quantize_head(
    source: SourceModel,
    hidden: torch.Tensor,
    options: ConvertOptions,
    chunk_rows: int,
    device: torch.device,
    log: Callable[[str], None],
) -> tuple[dict[str, torch.Tensor], dict]:
    """The head's stored tensors, from the quantized model's last hidden states ``hidden``
    ``(rows, cols, dim)``, and its report entry (empty when it stays at 16 bits)."""
    head_key = source.names.lm_head
    store = source.store
    head_weight = store.get(f"{head_key}.weight") if store.has(f"{head_key}.weight") else None
    tied = head_weight is None
    if tied:  # the converter quantizes a copy of the embedding (section 3.4)
        head_weight = store.get(source.names.prefix + source.names.embed + ".weight")
    # A head may add a bias, beside a tied weight too (Ernie 4.5's use_bias): stored in 16 bits.
    bias_key = f"{head_key}.bias"
    bias = store.get(bias_key) if store.has(bias_key) else None
    if options.head_bits == 16:
        head = fp16_copy(head_weight)
        # A bf16/fp16 tied head is the embedding's own tensor: safetensors refuses to save two
        # names over one memory, so the head gets its own copy.
        tensors = {f"{head_key}.weight": head.clone() if tied and head is head_weight else head}
        return tensors | ({bias_key: fp16_copy(bias)} if bias is not None else {}), {}
    qt = quantize_weight(
        head_weight.float(),
        head_hessian(source.shell.final_norm, hidden, chunk_rows, device),
        options.head_bits,
        options.codebook,
        seed=options.seed + 7,
        out_scales=options.out_scales,
        damping=options.damping,
        refit=options.refit,
        device=device,
        warn=lambda msg: log(f"    warning: {head_key}: {msg}"),
    )
    log(f"    {head_key:48s} K={options.head_bits}  proxy_err={qt.proxy_error:.6f}" + refit_note(qt))
    return qt.tensors(head_key, bias), {"bits": options.head_bits, "proxy_err": qt.proxy_error}


def head_hessian(
    final_norm: nn.Module, hidden: torch.Tensor, chunk_rows: int, device: torch.device
) -> torch.Tensor:
    """``E[x^T x]`` of the final-normed hidden states (the head's input) on ``device``."""
    dim = hidden.shape[-1]
    with torch.inference_mode():
        if device.type == "cpu":  # a CPU conversion: in one product, as it always was
            x = final_norm(hidden.reshape(-1, dim)).float()
            return x.T @ x / x.shape[0]
        # On a GPU, wherever the states live: the same sum a chunk of rows at a time, so the
        # normed states (8.4 GB for an 8B model) never exist whole on the device.
        hook = HessianHook(dim, device)
        for r0 in range(0, hidden.shape[0], chunk_rows):
            x = final_norm(hidden[r0 : r0 + chunk_rows].to(device).reshape(-1, dim))
            hook(final_norm, (x,))
        return hook.hessian()


__all__ = ["head_hessian", "quantize_head"]
