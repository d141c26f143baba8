"""The sparse mixture-of-experts block (Shazeer et al., 2017): a router scores ``n`` experts per
token, the best ``top_k`` run, and their outputs are mixed by the scores.

The families differ only in how the router's logits become choices and weights (all data
here): Mixtral and Qwen-MoE take a softmax over the experts; DeepSeek-V3, GLM-4.5, LFM2-MoE and
NemotronH a sigmoid per expert, choose with a learned per-expert bias added to the scores, and
may limit each token to its best groups of experts. Experts are gated MLPs (SwiGLU) or plain
two-layer ones (NemotronH's squared ReLU), any module of ``[tokens, d] -> [tokens, d]``.

Two ways to route, same function: torch ops (the reference and CPU path, and the GPU's for routers
the kernel does not read, such as Gemma 4's scaled one) or, on the GPU for up to
``engine.kernels.moe.MAX_TOKENS`` rows of a plain dense router, one launch that computes the
logits, scores, choice and weights (``engine.kernels.moe.route``). Neither syncs with the host.

Three ways to run the chosen experts, same function: :meth:`SparseMoE._dispatch` (the torch
reference and CPU path, also the GPU's where neither of the others applies) sorts the (token,
slot) pairs by expert and runs each chosen expert once on its rows; on the GPU, up to
``engine.kernels.moe.MAX_TOKENS`` rows of streaming EXL3 experts run in four fixed-shape launches
that read the chosen experts' indices on the device (``engine.kernels.moe.expert_mlp``), from the
experts' weights stacked per projection kind (``engine.modules.stacked_experts``). So such a
layer's decode step can be replayed from a CUDA graph, and without a shared expert it is five
launches: the router, gate/up, the activation, down, and the mix written in the activations' dtype.
Longer prefill chunks of such stacked experts run as one grouped GEMM per projection kind
(``engine.modules.grouped_experts``): each expert's weights are decoded once per chunk instead of
about ten launches per chosen expert.
With ``--experts-on cpu`` the routed experts live in host memory and :meth:`SparseMoE._dispatch`
runs there (``engine.modules.host_experts``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine import kernels
from engine.modules import grouped_experts, host_experts
from engine.modules.linear import DenseLinear, LinearSite
from engine.modules.stacked_experts import stack_experts

SCORINGS = ("softmax", "sigmoid")


class SparseMoE(nn.Module):
    """``sum_{e in chosen} w_e * expert_e(x)``, plus a shared expert every token goes through.

    Routing, from the router's logits ``r(x)`` (:meth:`route`):

    1. ``s = softmax(r)`` over the experts, or ``sigmoid(r)`` per expert (``scoring``);
    2. the experts are chosen by the top ``top_k`` of ``s + selection_bias`` (the bias, where
       there is one, steers the choice only: it is not part of the weights);
       with ``num_groups > 1`` the experts form that many equal groups, a group is worth the sum
       of its two best biased scores, and only the best ``groups_per_token`` groups compete;
    3. ``w = s`` at the chosen experts, renormalised to sum to one where ``normalize`` is set
       (Mixtral's softmax over the top-k logits is the same thing), times ``scale``.

    ``latent_in`` / ``latent_out`` (NemotronH's latent MoE): the routed experts work in a
    smaller width, entered and left through these linears; the router and the shared expert read
    ``x`` itself. ``shared`` is scaled by ``sigmoid(shared_gate(x))`` where there is such a gate
    (Qwen2-MoE).

    Gemma 4: the router reads ``x`` and the routed experts ``expert_norm(x)``; each chosen
    expert's weight is also multiplied by its learned ``expert_scale``, after step 3.
    """

    def __init__(
        self,
        router: nn.Module,
        experts: list[nn.Module],
        top_k: int,
        normalize: bool,
        shared: nn.Module | None = None,
        shared_gate: nn.Module | None = None,
        *,
        scoring: str = "softmax",
        selection_bias: torch.Tensor | None = None,
        scale: float = 1.0,
        num_groups: int = 1,
        groups_per_token: int = 1,
        latent_in: nn.Module | None = None,
        latent_out: nn.Module | None = None,
        expert_norm: nn.Module | None = None,
        expert_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        n = len(experts)
        if not 1 <= top_k <= n:
            raise ValueError(f"top_k must be within 1..{n} experts, got {top_k}")
        if scoring not in SCORINGS:
            raise ValueError(f"unsupported router scoring '{scoring}' (one of {', '.join(SCORINGS)})")
        if n % num_groups or not 1 <= groups_per_token <= num_groups:
            raise ValueError(
                f"{n} experts cannot form {num_groups} groups of which {groups_per_token} are kept"
            )
        if top_k > groups_per_token * (n // num_groups):
            raise ValueError(f"top_k {top_k} exceeds the experts of {groups_per_token} groups")
        if (latent_in is None) != (latent_out is None):
            raise ValueError("a latent MoE needs both its input and its output projection")
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.top_k, self.normalize, self.scale = top_k, normalize, scale
        self.scoring = scoring
        self.num_groups, self.groups_per_token = num_groups, groups_per_token
        self.register_buffer("selection_bias", selection_bias)
        self.latent_in, self.latent_out = latent_in, latent_out
        self.shared, self.shared_gate = shared, shared_gate
        self.expert_norm = expert_norm
        self.register_buffer("expert_scale", expert_scale)  # [experts], or None
        # The experts' weights stacked per projection kind for the device-routed kernels (the
        # experts then hold views of them); None where the experts are not alike streaming EXL3.
        self.stacked = stack_experts(experts)
        # Where the routed experts live and run when that is not where the rest of the layer is:
        # host memory, with --experts-on cpu (engine.modules.host_experts); None: with the rest.
        self.experts_host: torch.device | None = None

    @property
    def dynamic_decode(self) -> str | None:
        """Why a decode step's work depends on its tokens, or None where it does not: the torch
        path reads the per-expert counts on the host and runs the chosen experts on as many rows
        as chose them; the device-routed kernels (where they take these experts) launch the same
        shapes whatever the router chose, so a CUDA graph can replay the step. Experts in host
        memory run on the host's torch path."""
        if self.experts_host is not None:
            return host_experts.REASON
        return None if kernels.moe.supports(self.stacked) else "mixture-of-experts"

    def quantizable_linears(self) -> list[LinearSite]:
        """Every expert's linears, the latent projections and the shared expert's; the router
        (and the shared expert's gate) stay as they are, as ExLlamaV3 keeps them."""
        sites = [LinearSite("latent_in", self, "latent_in")] if self.latent_in is not None else []
        sites += [
            replace(site, routed=True) for expert in self.experts for site in expert.quantizable_linears()
        ]
        if self.latent_out is not None:
            sites.append(LinearSite("latent_out", self, "latent_out"))
        return sites + (self.shared.quantizable_linears() if self.shared is not None else [])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, both ``[tokens, top_k]``: float32 mixing weights and the
        chosen experts' indices (int64), in descending order of biased score."""
        routed = self._route_in_one_launch(x)
        if routed is not None:
            return routed
        # Scores in float32 whatever the activations are: in bf16 close experts' scores would
        # round together and the top-k choice would flip between runs.
        logits = self.router(x).float()
        scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        if self.selection_bias is None and self.num_groups == 1:
            weights, chosen = scores.topk(self.top_k, dim=-1)
        else:
            chosen = self._choose(scores)
            weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        if self.expert_scale is not None:
            weights = weights * self.expert_scale.float()[chosen]
        return weights, chosen

    def _route_in_one_launch(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`route` by the router kernel where it reads this router (a plain dense linear; on
        the GPU, a few rows), else None: the torch ops run."""
        if not x.is_cuda or type(self.router) is not DenseLinear:
            return None
        return kernels.moe.route(
            x,
            self.router.weight,
            self.router.bias,
            self.top_k,
            scoring=self.scoring,
            normalize=self.normalize,
            scale=self.scale,
            selection_bias=self.selection_bias,
            num_groups=self.num_groups,
            groups_per_token=self.groups_per_token,
            expert_scale=self.expert_scale,
        )

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The top ``top_k`` experts by biased score, among the best groups' experts only."""
        biased = scores if self.selection_bias is None else scores + self.selection_bias.float()
        if self.num_groups > 1:
            grouped = biased.reshape(-1, self.num_groups, biased.shape[-1] // self.num_groups)
            worth = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            best = worth.topk(self.groups_per_token, dim=-1).indices
            keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(-1, best, True)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).reshape(biased.shape)
        return biased.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.route(x)
        inner = self.latent_in(x) if self.latent_in is not None else x
        if self.expert_norm is not None:
            inner = self.expert_norm(inner)
        # Nothing is added to the routed mix in float32 without a shared expert: the kernels may
        # then write it in x's dtype (one conversion launch fewer).
        out = self._routed(inner, weights, chosen, x.dtype if self.shared is None else torch.float32)
        if self.latent_out is not None:
            out = self.latent_out(out.to(x.dtype)).float()
        if self.shared is not None:
            shared = self.shared(x).float()
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x).float()) * shared
            out += shared
        return out.to(x.dtype).reshape(shape)

    def _routed(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The routed experts' mix: the device-routed kernels where they apply (a few rows of
        stacked EXL3 experts on the GPU; summed in float32, stored as ``dtype``), or for a
        prefill chunk of them grouped GEMMs (``engine.modules.grouped_experts``, float32), else
        :meth:`_dispatch` in float32, on the host for experts kept there (one copy each way)."""
        if self.experts_host is not None:
            return host_experts.mix_on_host(self._dispatch, x, weights, chosen, self.experts_host)
        if x.is_cuda and self.stacked is not None:
            out = kernels.moe.expert_mlp(x, weights, chosen, self.stacked, out_dtype=dtype)
            if out is None:  # a prefill chunk: grouped GEMMs
                out = grouped_experts.grouped_prefill(x, weights, chosen, self.stacked)
            if out is not None:
                return out
        return self._dispatch(x, weights, chosen)

    def _dispatch(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The routed experts' mix, in float32 (a token's top-k contributions are added one
        expert at a time)."""
        # Sort the (token, slot) pairs by expert so each expert runs once over a contiguous list
        # of its tokens; an expert nobody chose is skipped. The per-expert counts are read on the
        # host (one sync per layer): the loop needs them to slice, which is why a decode step that
        # takes this path cannot be replayed from a CUDA graph (engine.generation.generator).
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        mix = weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                rows = tokens[start : start + n]
                y = expert(x.index_select(0, rows))
                out.index_add_(0, rows, y.float() * mix[start : start + n])
            start += n
        return out
