"""Assemble the module library into a model, reading each weight from a :class:`WeightStore`.

The builder turns a :class:`~engine.layers.spec.ModelSpec` and the architecture's
:class:`~engine.architectures.base.TensorNames` into modules. Each layer is built by its kinds'
build functions (``engine.layers``), which read the layer's weights through a
:class:`LayerReader`: the one place where a checkpoint key becomes a module. Linears go through
:meth:`ModelBuilder.linear`, which returns a dense, int8 or EXL3 linear depending on what the
checkpoint stores under that key (and the device); every linear and norm keeps the key it was read
from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from engine.architectures.base import TensorNames
from engine.errors import UsageError
from engine.layers import FEED_FORWARDS, MIXERS, LayerSpec, ModelSpec
from engine.layers import per_layer_input as ple
from engine.loading.safetensors_store import WeightStore
from engine.modules.decoder import CausalLM, DecoderBlock
from engine.modules.int8 import Int8Embedding, Int8Linear
from engine.modules.layer_norm import LayerNorm
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mrope import MultimodalRotaryEmbedding
from engine.modules.norms import RMSNorm
from engine.modules.rope import RopeSpec, RotaryEmbedding

Progress = Callable[[float, str], None]
# The rotary modules the layers of one model share, one per (RoPE setting, head size); filled as
# layers are built. Keyed by the RopeSpec's identity: its equality ignores its params.
SharedRotary = dict[tuple[int, int, torch.device], RotaryEmbedding]


class ModelBuilder:
    def __init__(
        self,
        spec: ModelSpec,
        names: TensorNames,
        store: WeightStore,
        dtype: torch.dtype,
        device: torch.device | str,
        context: int,
        exl3_mode: str | None = None,
    ) -> None:
        self.spec, self.names, self.store = spec, names, store
        self.dtype, self.device, self.context = dtype, torch.device(device), context
        self._exl3_mode = exl3_mode
        # Where the routed experts of mixture-of-experts layers are built (``place_experts``;
        # None: on ``device`` with the rest); ``_decode_on``: where EXL3 weights are decoded while
        # such experts are built on the host (the model's device: a GPU dequantizes far faster).
        self.experts_device: torch.device | None = None
        self._decode_on: torch.device | None = None
        # Each decoder layer's device for a layer split (``place_layers``; None: all on ``device``).
        self.layer_devices: list[torch.device] | None = None
        # Per layer built, the keys of the stored tensors it keeps as they are, outside any linear
        # or norm (LayerReader.tensor): what a converter copies besides those.
        self.kept_tensors: dict[int, list[str]] = {}

    def place_experts(self, device: torch.device | str | None) -> None:
        """Build the routed experts of every mixture-of-experts layer on ``device`` (the host,
        for ``--experts-on cpu``: ``engine.modules.host_experts``); None: on the model's device."""
        self.experts_device = None if device is None else torch.device(device)

    def place_layers(self, devices: Sequence[torch.device | str] | None) -> None:
        """Build decoder layer ``i`` straight on ``devices[i]`` (a layer split: no device ever
        holds more than its part, and EXL3 layers on a GPU stay packed); the embedding, final norm
        and head on the model's device. None: every layer on the model's device."""
        if devices is not None and len(devices) != self.spec.num_layers:
            raise UsageError(f"{len(devices)} layer devices for the model's {self.spec.num_layers} layers")
        self.layer_devices = None if devices is None else [torch.device(d) for d in devices]

    @contextmanager
    def on_layer_device(self, i: int) -> Iterator[None]:
        """Within: tensors and linears are made on layer ``i``'s device (:meth:`place_layers`)."""
        device = self.layer_devices[i] if self.layer_devices is not None else self.device
        with self._building(device=device):
            yield

    @contextmanager
    def routed_experts(self) -> Iterator[None]:
        """Within: tensors and linears are made on :attr:`experts_device` (where one is set), EXL3
        ones dequantized once into dense weights of the model's dtype (the CPU runs those
        fastest), decoded on the model's device and then moved."""
        host = self.experts_device
        if host is None or host == self.device:
            yield
            return
        with self._building(device=host, _exl3_mode="dense", _decode_on=self.device):
            yield

    @contextmanager
    def _building(self, **where: Any) -> Iterator[None]:
        """Within: these attributes (where and how tensors are made) set, then restored."""
        saved = {name: getattr(self, name) for name in where}
        for name, value in where.items():
            setattr(self, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    # -- leaves ---------------------------------------------------------------------------

    def tensor(
        self, key: str, shape: list[int] | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        return self.store.get(key, dtype=dtype or self.dtype, device=self.device, shape=shape)

    def optional(self, key: str, shape: list[int]) -> torch.Tensor | None:
        return self.tensor(key, shape) if self.store.has(key) else None

    def keeps_int8(self, key: str) -> bool:
        """Whether the int8 matrix stored under ``key`` (``engine.loading.int8``) stays int8: on
        the CPU, where its matmul reads a quarter of float32's bytes. A GPU runs it dequantized
        (read as a plain weight), which its kernels are made for."""
        is_int8 = getattr(self.store, "is_int8", None)  # a store of plain weights may lack it
        return self.device.type == "cpu" and is_int8 is not None and is_int8(key)

    def linear(self, key: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """A linear stored under ``key`` (``key.weight`` dense or int8 with ``key.weight_scale``,
        or EXL3 tensors ``key.trellis`` ...)."""
        bias_t = self.optional(f"{key}.bias", [out_features]) if bias else None
        if self.keeps_int8(f"{key}.weight"):
            codes, scale = self.store.int8_matrix(f"{key}.weight", [out_features, in_features])
            return Int8Linear(codes, scale, bias_t, key=key)
        if self.store.has(f"{key}.trellis"):
            from engine.exl3 import load_exl3_linear

            layer = load_exl3_linear(
                self.store.get,
                key,
                in_features,
                out_features,
                mode=self.exl3_mode(),
                dtype=self.dtype,
                device=self._decode_on or self.device,
            )
            if bias_t is not None:
                layer.bias = bias_t
            return layer.to(self.device)
        return DenseLinear(self.tensor(f"{key}.weight", [out_features, in_features]), bias_t, key=key)

    def has_linear(self, key: str) -> bool:
        """Whether the checkpoint stores a linear under ``key`` (dense or EXL3)."""
        return self.store.has(f"{key}.weight") or self.store.has(f"{key}.trellis")

    def exl3_mode(self) -> str:
        """EXL3 linears stay packed ("streaming") where the CUDA kernels decode them on the fly;
        elsewhere (CPU, or no extension) they are reconstructed once into dense weights.
        An explicit mode given to the builder wins (streaming saves memory on the CPU too)."""
        if self._exl3_mode is not None:
            return self._exl3_mode
        if self.device.type == "cuda":
            from engine import kernels

            if kernels.extension() is not None:
                return "streaming"
        return "dense"

    def norm(self, key: str, dim: int | tuple[int, ...]) -> RMSNorm | LayerNorm:
        """The norm stored under ``key``: an RMSNorm, or a LayerNorm where the model's norms
        subtract the mean (``ModelSpec.layer_norm``). ``dim`` a shape ``[rows, width]``: each row
        normalised over ``width`` with a scale of its own (Cohere's per-head q/k norms)."""
        if self.spec.unweighted_norms:  # nothing stored under the key
            return self.unscaled_norm(dim)
        weight = self.tensor(f"{key}.weight", [dim] if isinstance(dim, int) else list(dim))
        if self.spec.layer_norm:
            return LayerNorm(weight, None, self.spec.norm_eps, key=key)
        return RMSNorm(weight, self.spec.norm_eps, self.spec.norm_offset, key=key)

    def unscaled_norm(self, dim: int) -> RMSNorm:
        """An RMSNorm with no learned scale (nothing stored: Gemma 4's value and router norms)."""
        return RMSNorm(torch.ones(dim, dtype=self.dtype, device=self.device), self.spec.norm_eps)

    # -- blocks ---------------------------------------------------------------------------

    def block(self, i: int, rope: SharedRotary) -> DecoderBlock:
        """Layer ``i``: its mixer and feed-forward built by their kinds, with their norms (a layer
        may lack either sub-layer, and then its norms)."""
        n = self.names
        reader = LayerReader(self, n.prefix + n.layer.format(i=i), rope)
        block = self.layer_block(self.spec.layers[i], reader)
        self.kept_tensors[i] = reader.kept
        return block

    def layer_block(self, layer: LayerSpec, reader: LayerReader) -> DecoderBlock:
        """A decoder layer of the kinds ``layer`` names, read through ``reader`` (at any prefix:
        a main layer, or a multi-token-prediction layer stored apart)."""
        n, h = self.names, self.spec.hidden_size
        parts: dict[str, Any] = {}
        if layer.mixer is not None:
            mixer = MIXERS[layer.mixer.kind]
            if layer.pre_norms:
                parts["mixer_norm"] = reader.norm(n.mixer_norm, h)
            parts["mixer"] = mixer.build(reader, layer.mixer, n.part(mixer.names))
            parts["state"] = mixer.state(layer.mixer)
            if layer.sandwich_norms:
                parts["mixer_out_norm"] = reader.norm(n.mixer_out_norm, h)
        if layer.feed_forward is not None:
            feed_forward = FEED_FORWARDS[layer.feed_forward.kind]
            if layer.pre_norms and not layer.feed_forward.reads_residual and not layer.parallel:
                parts["feed_forward_norm"] = reader.norm(n.feed_forward_norm, h)
            parts["feed_forward"] = feed_forward.build(reader, layer.feed_forward, n.part(feed_forward.names))
            if layer.sandwich_norms:
                parts["feed_forward_out_norm"] = reader.norm(n.feed_forward_out_norm, h)
        if layer.per_layer_input:
            parts["per_layer_input"] = ple.build_branch(reader, self.spec.per_layer_inputs, n.part(ple.NAMES))
        if layer.output_scale:
            parts["output_scale"] = reader.tensor(n.output_scale, [1])
        if layer.residual_scale != 1.0:
            parts["residual_scale"] = layer.residual_scale
        if layer.parallel:
            parts["parallel"] = True
        return DecoderBlock(**parts)

    def rotary(self) -> SharedRotary:
        """An empty set of shared rotary modules, for the blocks of one model to fill."""
        return {}

    def embedding(self) -> nn.Embedding | Int8Embedding:
        s, n = self.spec, self.names
        key, shape = n.prefix + n.embed + ".weight", [s.vocab_size, s.hidden_size]
        if self.keeps_int8(key):
            return Int8Embedding(*self.store.int8_matrix(key, shape), self.dtype)
        return nn.Embedding.from_pretrained(self.tensor(key, shape), freeze=True)

    def tied_head(self, embedding: nn.Module, bias: torch.Tensor | None) -> nn.Module:
        """The LM head of a model whose head is its embedding table."""
        if isinstance(embedding, Int8Embedding):
            return embedding.head(bias)
        return DenseLinear(embedding.weight, bias)

    def final_norm(self) -> RMSNorm:
        return self.norm(self.names.prefix + self.names.final_norm, self.spec.hidden_size)

    def embed_norm(self) -> RMSNorm | None:
        """The norm of the embeddings before the first layer (``ModelSpec.embed_norm``: the final
        norm's settings, nanochat), or None."""
        return self.final_norm() if self.spec.embed_norm else None

    def build(self, progress: Progress | None = None) -> CausalLM:
        s, n = self.spec, self.names
        rope = self.rotary()
        embedding = self.embedding()
        blocks = []
        for i in range(s.num_layers):
            with self.on_layer_device(i):
                blocks.append(self.block(i, rope))
            if progress:
                progress((i + 1) / (s.num_layers + 1), f"loaded layer {i + 1}/{s.num_layers}")
        # A tied head reuses the embedding, unless a quantized head was stored for it (EXL3
        # quantizes the head separately even when the unquantized model ties it).
        if s.tie_word_embeddings and not self.store.has(f"{n.lm_head}.trellis"):
            bias = self.tensor(f"{n.lm_head}.bias", [s.vocab_size]) if s.head_bias else None
            lm_head: nn.Module = self.tied_head(embedding, bias)
        else:
            lm_head = self.linear(n.lm_head, s.hidden_size, s.vocab_size, s.head_bias)
        model = CausalLM(
            embedding,
            blocks,
            self.final_norm(),
            lm_head,
            s.embed_scale,
            s.final_softcap,
            ple.build_per_layer_inputs(self, n.part(ple.NAMES)) if s.per_layer_inputs else None,
            embed_norm=self.embed_norm(),
            logit_scale=s.logit_scale,
        )
        if progress:
            progress(1.0, "model loaded")
        return model.eval()


class LayerReader:
    """One layer's weights as its kinds' build functions read them: names are relative to the
    layer's key prefix (``model.layers.3.``)."""

    def __init__(self, builder: ModelBuilder, prefix: str, rope: SharedRotary) -> None:
        self._builder, self.prefix, self._rope = builder, prefix, rope
        self.kept: list[str] = []  # keys read by tensor()

    @property
    def hidden_size(self) -> int:
        return self._builder.spec.hidden_size

    def key(self, name: str) -> str:
        return self.prefix + name

    def has(self, name: str) -> bool:
        return self._builder.store.has(self.key(name))

    def has_linear(self, name: str) -> bool:
        return self._builder.has_linear(self.key(name))

    def tensor(self, name: str, shape: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A stored tensor the module keeps as it is (say, a recurrent kind's decay rates), in the
        model's dtype or ``dtype`` (float32 where 16 bits would change results: a router's
        selection bias); a converter copies it unquantized."""
        self.kept.append(self.key(name))
        return self._builder.tensor(self.key(name), shape, dtype)

    def routed_experts(self):
        """A context within which the layer's routed experts are read (where the model keeps them:
        :meth:`ModelBuilder.routed_experts`)."""
        return self._builder.routed_experts()

    def packed_tensor(self, name: str, shape: list[int] | None) -> torch.Tensor:
        """A stored tensor that packs several weights, which the module takes apart (the fused
        experts of transformers 5); a converter stores the parts under their own keys. ``shape``
        None: as stored, for a caller that accepts more than one layout."""
        return self._builder.tensor(self.key(name), shape)

    def linear(self, name: str, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        return self._builder.linear(self.key(name), in_features, out_features, bias)

    def norm(self, name: str, dim: int | tuple[int, ...]) -> RMSNorm | LayerNorm:
        return self._builder.norm(self.key(name), dim)

    def unscaled_norm(self, dim: int) -> RMSNorm:
        return self._builder.unscaled_norm(dim)

    def projections(
        self,
        names: Sequence[str],
        in_features: int,
        sizes: Sequence[int],
        bias: bool = False,
        fused: str | None = None,
    ) -> ProjectionGroup:
        """Projections of one input (q/k/v, gate/up): stored one linear per name, or as one
        ``fused`` linear split into ``sizes``. A fused checkpoint may come with its projections
        split (EXL3 conversions store them quantized one by one under the split names), so it is
        read fused unless the split ones are there; a damaged fused checkpoint's error then names
        its fused tensor."""
        if fused and not self.has_linear(names[0]):
            linear = self.linear(fused, in_features, sum(sizes), bias)
            return ProjectionGroup([(linear, list(sizes))], output_keys=[self.key(n) for n in names])
        return ProjectionGroup(
            [(self.linear(n, in_features, size, bias), [size]) for n, size in zip(names, sizes)]
        )

    def rotary(self, spec: RopeSpec, head_dim: int) -> RotaryEmbedding:
        """The rotary module for ``spec``, shared by every layer with the same setting (a step
        computes its cos/sin tables once per module)."""
        key = (id(spec), head_dim, self._builder.device)  # per device: a layer split's parts
        if key not in self._rope:
            # Vision-language families rotate by three position axes (see engine.modules.mrope).
            rotary = MultimodalRotaryEmbedding if "mrope_section" in spec.params else RotaryEmbedding
            self._rope[key] = rotary(spec, head_dim, self._builder.context).to(self._builder.device)
        return self._rope[key]
