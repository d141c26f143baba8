"""How much memory a model choice needs (weights + KV cache for a context length) and what this
machine has. An estimate for the model page, not an allocator: it errs on the generous side.

KV cache per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element, read from
``config.json`` (``text_config`` for multimodal configs). Layers that use a sliding window (Gemma 2/3
``layer_types``/``sliding_window_pattern``, Mistral ``sliding_window``) hold at most the window.

Machine memory: RAM from ``psutil`` when installed, else ``/proc/meminfo``; GPU memory from torch
only if the process already imported it (the GUI must not pay torch's import for a label), else from
``nvidia-smi`` when present.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from engine.units import format_bytes

# Activations, CUDA context, allocator slack: a flat allowance plus a share of the weights.
OVERHEAD_FIXED = 512 << 20
OVERHEAD_FRACTION = 0.05


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def _sliding_layers(cfg: dict[str, Any], layers: int) -> list[bool]:
    """Which layers use sliding-window attention."""
    window = cfg.get("sliding_window")
    if not window:
        return [False] * layers
    types = cfg.get("layer_types")
    # Step 3.5's configs list their multi-token-prediction layers too, after the model's own
    if isinstance(types, list) and len(types) >= layers:
        return [t == "sliding_attention" for t in types[:layers]]
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:  # Gemma 3: every pattern-th layer is global
        return [(i + 1) % pattern != 0 for i in range(layers)]
    if isinstance(pattern, str) and pattern:  # EXAONE 4: "LLLG" repeated, the last layer global
        return [pattern[i % len(pattern)] == "L" and i < layers - 1 for i in range(layers)]
    model_type = str(cfg.get("model_type", ""))
    if model_type.startswith("gemma2"):  # Gemma 2 alternates, starting with a local layer
        return [i % 2 == 0 for i in range(layers)]
    if cfg.get("use_sliding_window") is False:
        return [False] * layers
    return [True] * layers  # Mistral-style: every layer windows


def kv_cache_bytes(config: dict[str, Any], context_length: int, bytes_per_element: float = 2.0) -> int:
    """Bytes of K and V for ``context_length`` tokens (fp16 by default; 1.0 for 8-bit, 0.5 for 4-bit)."""
    cfg = text_config(config)
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 0)
    # Step 3.5's configs call KV heads attention groups
    kv_heads = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_groups") or heads)
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    if not (layers and kv_heads and head_dim):
        return 0
    window = int(cfg.get("sliding_window") or 0)
    per_token_layer = 2 * kv_heads * head_dim * bytes_per_element
    total = 0.0
    for sliding in _sliding_layers(cfg, layers):
        tokens = min(context_length, window) if sliding and window else context_length
        total += per_token_layer * tokens
    return int(total)


def max_context(config: dict[str, Any]) -> int | None:
    cfg = text_config(config)
    value = cfg.get("max_position_embeddings")
    return int(value) if value else None


@dataclass(frozen=True)
class MachineMemory:
    ram_total: int
    ram_available: int
    gpus: tuple[tuple[str, int, int], ...] = ()  # (name, total, free) per GPU

    @property
    def vram_total(self) -> int:
        return sum(g[1] for g in self.gpus)

    @property
    def vram_free(self) -> int:
        return sum(g[2] for g in self.gpus)


def machine_memory() -> MachineMemory:
    total, available = _ram()
    return MachineMemory(ram_total=total, ram_available=available, gpus=tuple(_gpus()))


def _ram() -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception:
        pass
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return values.get("MemTotal", 0), values.get("MemAvailable", values.get("MemFree", 0))


def _gpus() -> list[tuple[str, int, int]]:
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                out = []
                for i in range(torch.cuda.device_count()):
                    free, total = torch.cuda.mem_get_info(i)
                    out.append((torch.cuda.get_device_name(i), int(total), int(free)))
                return out
        except Exception:
            pass
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        text = subprocess.run(
            [exe, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            try:
                gpus.append((parts[0], int(parts[1]) << 20, int(parts[2]) << 20))
            except ValueError:
                continue
    return gpus


def _expert_share(config: dict[str, Any]) -> float:
    """The share of a mixture of experts' parameters in its routed experts (0 for a dense model),
    counted from the config: the experts' projections against the attention's and the
    embedding's (norms and routers are too small to matter)."""
    cfg = text_config(config)
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    hidden = int(cfg.get("hidden_size") or 0)
    layers = int(cfg.get("num_hidden_layers") or 0)
    width = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    if not (experts and hidden and layers and width):
        return 0.0
    moe_layers = max(0, layers - int(cfg.get("first_k_dense_replace") or 0))
    routed = moe_layers * experts * 3 * hidden * width
    heads = int(cfg.get("num_attention_heads") or 0)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    attention = layers * hidden * head_dim * (2 * heads + 2 * kv_heads)
    embedding = int(cfg.get("vocab_size") or 0) * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return routed / (routed + attention + embedding)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    overhead: int
    context_length: int
    machine: MachineMemory
    # The weights of the routed experts (a mixture of experts; 0 for a dense model) and the
    # decoder layers: what the GPU could leave to system memory (gpu_split).
    expert_weights: int = 0
    layers: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead

    @property
    def verdict(self) -> str:
        """``'gpu'``: fits in GPU memory; ``'cpu'``: fits in RAM only (slow); ``'no'``: does not fit."""
        if self.machine.gpus and self.total <= self.machine.vram_total:
            return "gpu"
        if self.total <= self.machine.ram_available:
            return "cpu"
        return "no"

    def describe(self) -> str:
        h = format_bytes
        need = (
            f"needs about {h(self.total)} (weights {h(self.weights)} + KV cache {h(self.kv_cache)} for "
            f"{self.context_length} tokens + {h(self.overhead)} overhead)"
        )
        m = self.machine
        have = f"this machine: {h(m.ram_available)} RAM free of {h(m.ram_total)}"
        if m.gpus:
            have += f", GPU {h(m.vram_total)} ({', '.join(g[0] for g in m.gpus)})"
        else:
            have += ", no GPU found"
        verdict = {
            "gpu": "fits in GPU memory",
            "cpu": "fits in RAM only (CPU, slow)",
            "no": "does not fit",
        }[self.verdict]
        split = self.gpu_split()
        return f"{verdict}: {need}; {have}" + (f"; {split}" if split else "")

    def gpu_split(self) -> str | None:
        """Where a model too big for the GPU would run with part of it in system memory: its
        routed experts there (``--experts-on cpu``) where the rest then fits the GPU, else its
        first layers on the GPU (``--gpu-layers N``); None where it fits whole or there is no GPU."""
        m, h = self.machine, format_bytes
        if not m.gpus or self.total <= m.vram_total:
            return None
        vram = m.gpus[0][1]
        if self.expert_weights:
            gpu = self.total - int(self.expert_weights * (1 + OVERHEAD_FRACTION))
            if gpu <= vram:
                return (
                    f"with its experts in system memory: GPU ≈ {h(gpu)} + system memory ≈ "
                    f"{h(self.expert_weights)}"
                )
        if not self.layers:
            return None
        per_layer = (self.weights + self.kv_cache) / self.layers * (1 + OVERHEAD_FRACTION)
        on_gpu = max(0, min(self.layers, int((vram - (self.total - per_layer * self.layers)) // per_layer)))
        host = int((self.weights + self.kv_cache) * (self.layers - on_gpu) / self.layers)
        return (
            f"with its first {on_gpu} of {self.layers} layers on the GPU: GPU ≈ "
            f"{h(self.total - int(host * (1 + OVERHEAD_FRACTION)))} + system memory ≈ {h(host)}"
        )


def estimate_memory(
    config: dict[str, Any] | None,
    weights_bytes: int,
    context_length: int,
    *,
    kv_bytes_per_element: float = 2.0,
    machine: MachineMemory | None = None,
) -> MemoryEstimate:
    kv = kv_cache_bytes(config or {}, context_length, kv_bytes_per_element)
    overhead = OVERHEAD_FIXED + int(OVERHEAD_FRACTION * weights_bytes)
    cfg = text_config(config or {})
    return MemoryEstimate(
        weights=weights_bytes,
        kv_cache=kv,
        overhead=overhead,
        context_length=context_length,
        machine=machine or machine_memory(),
        expert_weights=int(weights_bytes * _expert_share(config or {})),
        layers=int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0),
    )
