"""Where the calibration hidden states live, and page-locking them where that is the host.

The states are ``cal_rows x cal_cols x hidden`` float32 values, two copies while a block runs (its
input and its unquantized output) and a third when tuning towards the unquantized model: 8.4 GB
each for an 8B model's default calibration. They stay on the device where they fit and go to
host memory where they do not (:func:`state_device`); host states are page-locked
(:class:`HostPins`) so that each chunk of rows crosses PCIe at full speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.convert.slots import LinearSlot

STATE_SHARE = 0.6  # "auto" keeps the states on the device while they take at most this share of it


def state_device(
    place: str,
    device: torch.device,
    shape: torch.Size | tuple[int, int],
    hidden_size: int,
    copies: int,
    per_block: list[list[LinearSlot]],
    log: Callable[[str], None],
) -> torch.device:
    """Where the calibration hidden states go: ``copies`` float32 buffers of ``shape`` rows x cols
    x ``hidden_size`` (the input and the unquantized output of the block being converted, and the
    unquantized model's state when tuning towards it). ``place`` "auto" puts them on a CUDA
    device while they and the largest block's float32 weights take at most :data:`STATE_SHARE` of
    its free memory (the rest is for the Hessians, the quantizer and the forward's activations),
    otherwise on the host."""
    need = copies * shape[0] * shape[1] * hidden_size * 4 / 1e9  # GB
    if device.type != "cuda":
        return device  # a CPU conversion: the host is the device
    if place == "device":
        log(f" -- calibration states: {need:.1f} GB on {device} (--states device)")
        return device
    if place == "host":
        log(f" -- calibration states: {need:.1f} GB in host memory (--states host)")
        return torch.device("cpu")
    block = max(sum(s.in_features * s.out_features for s in slots) for slots in per_block) * 4 / 1e9
    free = torch.cuda.mem_get_info(device)[0] / 1e9
    if need + block <= STATE_SHARE * free:
        log(f" -- calibration states: {need:.1f} GB on {device} ({free:.1f} GB free)")
        return device
    log(
        f" -- calibration states: {need:.1f} GB in host memory: with the largest block ({block:.1f} "
        f"GB) they would take more than {STATE_SHARE:.0%} of the {free:.1f} GB free on {device}"
    )
    return torch.device("cpu")


class HostPins:
    """Page-locks (pins) host tensors in place for fast copies to and from a CUDA ``device``.

    Pageable host memory is copied through a driver staging buffer at a fraction of PCIe speed;
    registering the tensor's own pages (``cudaHostRegister``) pins exactly its bytes, where
    ``pin_memory=True`` would round an 8.4 GB buffer up to a 16 GB power-of-two block. A tensor
    stays referenced here until :meth:`unpin` or :meth:`release` (unregistering freed memory is
    an error). For any other device (a CPU conversion) nothing is touched: CUDA is never
    initialised. Where registration fails the tensor stays pageable (slower, same results) and
    a note is logged."""

    def __init__(self, device: torch.device, log: Callable[[str], None]) -> None:
        self.device = device
        self.log = log
        self._pinned: dict[int, torch.Tensor] = {}  # data pointer -> tensor

    def __enter__(self) -> HostPins:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def pin(self, t: torch.Tensor) -> bool:
        """Page-lock ``t``'s memory (a contiguous host tensor); False where it was not."""
        if self.device.type != "cuda" or t.device.type != "cpu" or t.numel() == 0:
            return False
        ptr = t.data_ptr()
        if ptr in self._pinned:
            return True
        cudart = torch.cuda.cudart()
        register = getattr(cudart, "cudaHostRegister", None)
        if register is None or not t.is_contiguous():
            self.log(" -- note: host states stay in pageable memory (cannot page-lock them here)")
            return False
        err = int(register(ptr, t.numel() * t.element_size(), 0))
        if err != 0:
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:
                clear()  # the failure is handled here; later kernel checks must not report it
            gb = t.numel() * t.element_size() / 1e9
            self.log(
                f" -- note: could not page-lock {gb:.1f} GB of host states (CUDA error {err}); "
                "they stay pageable: slower copies, same results"
            )
            return False
        self._pinned[ptr] = t
        return True

    def unpin(self, t: torch.Tensor) -> None:
        """Unregister ``t`` (if pinned here) and let go of it."""
        if self._pinned.pop(t.data_ptr() if t.numel() else -1, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def release(self) -> None:
        """Unregister every pinned tensor (before they can be freed)."""
        for t in list(self._pinned.values()):
            self.unpin(t)


__all__ = ["STATE_SHARE", "HostPins", "state_device"]
