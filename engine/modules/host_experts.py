"""Routed experts in host memory, computed on the CPU, while everything else runs on the model's
device (``--experts-on cpu``): a mixture of experts larger than the GPU still runs, at the GPU's
speed for attention, router and shared expert and the CPU's for the few experts a token chose.

At load the builder makes the routed experts on the host (``ModelBuilder.routed_experts``): dense
or int8 as stored, EXL3 ones dequantized once into dense weights of the model's dtype (on the GPU,
then moved: far faster than decoding them on the CPU). Where the model is on a GPU each layer's
experts are gathered into one region of host memory and page-locked (pinned), so they cannot be
swapped out under the model.

Per mixture-of-experts layer and step (:func:`mix_on_host`): the routed tokens' inputs, their
mixing weights and their chosen experts go to the host in one copy (packed into one float32
tensor: bf16 and fp16 values and expert indices below 2**24 are exact in it), the chosen experts
run there on the torch path (``SparseMoE._dispatch``), and the weighted sum comes back in one
copy. The router is the same code on the same device as in the all-device run, so every choice is
the same. Such a step reads the per-expert counts on the host and so cannot be replayed from a
CUDA graph: the layer reports a ``dynamic_decode`` reason and the Generator decodes eagerly.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable

import torch
from torch import nn

from engine.errors import UsageError

# The values of ``--experts-on`` (the ``experts_on`` of ``engine.model.load_model``).
EXPERTS_ON = ("device", "cpu")
HOST = torch.device("cpu")
ALIGNMENT = 64  # bytes: where each tensor of a gathered region starts (int8 kernels need 64)
# Why a decode step of such a model cannot be replayed from a CUDA graph (``dynamic_decode``).
REASON = "experts-in-host-memory"

Dispatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def experts_device(experts_on: str | None) -> torch.device | None:
    """Where ``--experts-on`` puts the routed experts: the host for ``cpu``, None (the model's
    device) for ``device`` or None."""
    if experts_on in (None, "device"):
        return None
    if experts_on == "cpu":
        return HOST
    raise UsageError(f"--experts-on must be one of {', '.join(EXPERTS_ON)}, got {experts_on!r}")


def mix_on_host(
    dispatch: Dispatch, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, host: torch.device
) -> torch.Tensor:
    """``dispatch(x, weights, chosen)`` (the routed experts' float32 mix) run on ``host``, with one
    copy there and one back; the result is on ``x``'s device."""
    k = chosen.shape[-1]
    packed = torch.cat([x.float(), weights.float(), chosen.float()], dim=-1).to(host)
    d = x.shape[-1]
    inputs = packed[:, :d].to(x.dtype)
    mix = packed[:, d : d + k]
    experts = packed[:, d + k :].long()
    return dispatch(inputs, mix, experts).to(x.device)


def gather(module: nn.Module) -> torch.Tensor | None:
    """Copy every parameter and buffer of ``module`` in host memory into one byte buffer (each at
    an :data:`ALIGNMENT` offset) and make them views of it; the buffer, or None where there is
    nothing. One region per layer is what gets page-locked: ``Tensor.pin_memory`` would round each
    tensor up to a power of two (a third more for an expert's 3 MiB projection)."""
    found = [
        (sub, kind, name, t)
        for sub in module.modules()
        for kind in ("_parameters", "_buffers")
        for name, t in getattr(sub, kind).items()
        if t is not None and t.device.type == "cpu"
    ]
    if not found:
        return None
    offsets, total = [], 0
    for *_, t in found:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT
    region = torch.empty(total, dtype=torch.uint8)
    seen: dict[int, torch.Tensor] = {}  # one view for a tensor held twice
    for (sub, kind, name, t), start in zip(found, offsets):
        if id(t) not in seen:
            size = t.numel() * t.element_size()
            view = region[start : start + size].view(t.dtype).view(t.shape)
            view.copy_(t)
            seen[id(t)] = nn.Parameter(view, requires_grad=False) if kind == "_parameters" else view
        getattr(sub, kind)[name] = seen[id(t)]
    return region


def pin_module(module: nn.Module) -> bool:
    """Page-lock ``module``'s host tensors in place (:func:`gather`, then registered with CUDA
    until the module is freed); False where CUDA declined (they stay pageable and work the same)."""
    region = gather(module)
    if region is None:
        return True
    cudart = torch.cuda.cudart()
    register = getattr(cudart, "cudaHostRegister", None)  # in torch's bindings of the runtime
    ptr = region.data_ptr()
    if register is None or int(register(ptr, region.numel(), 0)) != 0:
        return False
    # The views keep the memory as long as the module holds them: unregister as it goes.
    weakref.finalize(module, cudart.cudaHostUnregister, ptr)
    return True


def keep_experts_on_host(module: nn.Module, host: torch.device, pin: bool) -> int:
    """Mark every mixture-of-experts layer of ``module`` (built with its routed experts on
    ``host``) to run them there, page-locking their weights where ``pin`` (one region per layer);
    the number of such layers."""
    from engine.modules.moe import SparseMoE

    count, declined = 0, 0
    for moe in module.modules():
        if isinstance(moe, SparseMoE):
            moe.experts_host = host
            if pin and not pin_module(moe.experts):
                declined += 1
            count += 1
    if declined:
        print(
            f"trellis: the experts of {declined} layers could not be page-locked; they run from "
            "pageable host memory",
            file=sys.stderr,
        )
    return count
