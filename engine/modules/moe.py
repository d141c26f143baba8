"""The sparse mixture-of-experts block (Shazeer et al., 2017; Mixtral, Qwen-MoE): a router picks
``top_k`` of ``n`` gated-MLP experts per token and mixes their outputs by its probabilities."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.modules.linear import LinearSite


class SparseMoE(nn.Module):
    """``sum_{e in topk(p)} w_e * expert_e(x)`` with ``p = softmax(router(x))``.

    ``w`` is ``p`` at the chosen experts, renormalised to sum to one where ``normalize`` is set
    (Qwen-MoE's ``norm_topk_prob``; Mixtral's softmax over the top-k logits is the same thing).
    Experts are any modules of ``[tokens, hidden] -> [tokens, hidden]`` (``GatedMLP`` over dense
    or EXL3 linears). ``shared`` (Qwen2-MoE) is an expert every token goes through, scaled by
    ``sigmoid(shared_gate(x))``.
    """

    # Which experts run, and on how many rows, depends on the router's choice: a decode step has
    # no fixed shapes for a CUDA graph to capture.
    dynamic_decode = "mixture-of-experts"

    def __init__(
        self,
        router: nn.Module,
        experts: list[nn.Module],
        top_k: int,
        normalize: bool,
        shared: nn.Module | None = None,
        shared_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= len(experts):
            raise ValueError(f"top_k must be within 1..{len(experts)} experts, got {top_k}")
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.top_k, self.normalize = top_k, normalize
        self.shared, self.shared_gate = shared, shared_gate

    def quantizable_linears(self) -> list[LinearSite]:
        """Every expert's linears and the shared expert's; the router (and the shared expert's
        gate) stay as they are, as ExLlamaV3 keeps them."""
        routed = [
            replace(site, routed=True) for expert in self.experts for site in expert.quantizable_linears()
        ]
        return routed + (self.shared.quantizable_linears() if self.shared is not None else [])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, both ``[tokens, top_k]``: float32 mixing weights and the
        chosen experts' indices."""
        # The softmax runs in float32 whatever the activations are: in bf16 the probabilities of
        # close experts would round together and the top-k choice would flip between runs.
        probs = self.router(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.route(x)
        # Sort the (token, slot) pairs by expert so each expert runs once over a contiguous list
        # of its tokens; an expert nobody chose is skipped. The per-expert counts are read on the
        # host (one sync per layer): the loop needs them to slice, which is also why a MoE model
        # decodes without CUDA graphs (engine.generation.generator).
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        mix = weights.reshape(-1)[order].unsqueeze(1)
        # Summed in float32: a token's top-k contributions are added one expert at a time.
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                rows = tokens[start : start + n]
                y = expert(x.index_select(0, rows))
                out.index_add_(0, rows, y.float() * mix[start : start + n])
            start += n
        if self.shared is not None:
            gate = torch.sigmoid(self.shared_gate(x).float())
            out += gate * self.shared(x).float()
        return out.to(x.dtype).reshape(shape)
