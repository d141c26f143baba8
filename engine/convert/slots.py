"""The quantizable linears of a decoder block, as the converter sees them.

A :class:`LinearSlot` is where one linear sits in the block's module tree, the checkpoint key it
was read from (and is stored under, quantized) and the bits it gets. Slots are made once per
block from the blocks built on the ``meta`` device (:mod:`engine.convert.source_model`) and
pointed at the real modules when a block is built, so the bits set on them stay put.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class LinearSlot:
    """One quantizable linear: where it sits in the module tree and its checkpoint key."""

    key: str
    kind: str  # q, k, v, o, gate, up, down
    parent: nn.Module | None  # None while its block is not built (engine.convert.source_model)
    attr: str  # attribute name on parent, or index into parent (a ModuleList) as str
    in_features: int
    out_features: int
    bits: int = 0
    # A mixture-of-experts expert's linear: its inputs are only the tokens the router sends it,
    # so its Hessian may rest on few rows (see engine.convert.hessians.HessianHook).
    routed: bool = False

    def get(self) -> nn.Module:
        return self.parent[int(self.attr)] if self.attr.isdigit() else getattr(self.parent, self.attr)

    def set(self, module: nn.Module) -> None:
        if self.attr.isdigit():
            self.parent[int(self.attr)] = module
        else:
            setattr(self.parent, self.attr, module)


def unfuse_projections(group: nn.Module) -> None:
    """Make a fused projection (one linear whose output is split, e.g. Phi-3's ``qkv_proj``) one
    dense linear per output, in place, keyed by its ``output_keys``: the reference layout stores
    a fused checkpoint's projections quantized separately under the split names (``q_proj``,
    ``k_proj``, ...), and quantizing them apart gives each its own scales and bits. The outputs
    stay the same. A group without output keys stays fused."""
    from engine.modules.linear import DenseLinear, ProjectionGroup

    if len(group.linears) != 1 or len(group.splits[0]) == 1 or group.output_keys is None:
        return
    fused, sizes = group.linears[0], group.splits[0]
    weights = fused.weight.detach().split(sizes, dim=0)
    biases = fused.bias.detach().split(sizes) if fused.bias is not None else [None] * len(sizes)
    parts = zip(weights, biases, sizes, group.output_keys, strict=True)
    split = ProjectionGroup([(DenseLinear(w.clone(), b, key=k), [n]) for w, b, n, k in parts])
    group.linears, group.splits = split.linears, split.splits


def block_linears(block: nn.Module) -> list[LinearSlot]:
    """The quantizable linears of one decoder block, as its modules list them
    (``quantizable_linears``), under the checkpoint keys they were read from. Fused projections
    are split first (:func:`unfuse_projections`) and keyed by the split names. A
    mixture-of-experts block gives each expert's gate/up/down (keyed one linear per expert,
    whether the source fused them or not) and its shared expert's; its router is not quantized."""
    from engine.modules.linear import ProjectionGroup

    for module in block.modules():
        if isinstance(module, ProjectionGroup):
            unfuse_projections(module)
    slots = []
    for site in block.quantizable_linears():
        linear = site.get()
        slots.append(
            LinearSlot(
                linear.key,
                site.role,
                site.parent,
                site.attr,
                linear.in_features,
                linear.out_features,
                routed=site.routed,
            )
        )
    return slots


def checkpoint_order(block: nn.Module) -> list[str]:
    """The keys of the block's modules read from the checkpoint (linears and norms), in module
    order: the order the output lists them in (EXL3_FORMAT.md section 2). A module made from
    several stored ones (``source_keys``: Qwen3.5's b and a as one matrix) lists those."""
    keys: list[str] = []
    for module in block.modules():
        sources = getattr(module, "source_keys", None)
        keys += sources if sources else [module.key] if getattr(module, "key", "") else []
    return keys


__all__ = ["LinearSlot", "block_linears", "checkpoint_order", "unfuse_projections"]
