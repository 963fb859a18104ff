"""A small GPT-style language model whose MLPs are mixtures of experts, in the
GShard/Switch formulation with fixed shapes (no data-dependent indexing), so the whole
model captures with ``torch.export`` and expert parallelism is a plain sharding choice.

Per MoE layer (G groups of S tokens, model dim M, E experts, capacity C per group):

* tokens ``[B, T, M]`` are reshaped into groups ``xg [G, S, M]`` (``groups`` defaults
  to the batch size, so sharding the batch shards the groups);
* a router ``M -> E`` gives probabilities ``[G, S, E]``; top-k (k = 2 by default)
  picks each token's experts;
* a token's position in its expert's buffer is the running count of tokens sent to
  that expert before it (``cumsum`` over the one-hot choices along S; the second
  choices queue behind every first choice, as in GShard); tokens at position ``>= C``
  are dropped, ``C = ceil(capacity_factor * S * k / E)``;
* ``combine [G, S, E, C]`` holds the (renormalised) gate of each kept token at its
  slot, ``dispatch`` the same as 0/1;
* ``einsum("gsec,gsm->egcm")`` dispatches, the experts (batched weights
  ``w_in [E, M, H]``, ``w_out [E, H, M]``) run as ``egcm,emh->egch`` then GELU then
  ``egch,ehm->egcm``, and ``einsum("gsec,egcm->gsm")`` combines;
* the Switch/GShard load-balancing loss ``E * sum_e f_e * p_e`` (``f_e``: fraction
  of tokens whose first choice is ``e``, ``p_e``: mean router probability of ``e``,
  both per group, then averaged over groups) is added to the LM loss with the
  coefficient ``aux_coef``, so the model returns one scalar.

Expert parallelism shards ``w_in``/``w_out`` on E and the groups on the batch; the
dispatched tensor ``[E, G, C, M]`` then moves from groups-sharded to experts-sharded
by an all-to-all, and back before the combine.

``build()`` is the factory the CLI and the tests use: ``autopar plan examples/moe.py:build``.
Under torchrun it plans, shards and trains a few steps::

    torchrun --nproc-per-node 2 examples/moe.py --mesh 2 --ep
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import Attention, GPTConfig  # noqa: E402  (examples/ is not a package)


@dataclass(frozen=True)
class MoEConfig:
    """Shape of the model; the defaults are small enough for CPU tests.

    ``groups`` = 0 means one group per sequence (the batch size).  ``capacity_factor``
    below ``1.0`` makes the buffers smaller than an even split of the tokens, so some
    tokens are dropped even when the router balances perfectly.
    """

    vocab: int = 128
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2
    experts: int = 4
    hidden: int = 64
    top_k: int = 2
    capacity_factor: float = 1.0
    groups: int = 0
    aux_coef: float = 0.01

    def __post_init__(self) -> None:
        if self.top_k not in (1, 2):
            raise ValueError(f"top_k must be 1 (Switch) or 2 (GShard), got {self.top_k}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} needs at least as many experts")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor}")

    def attention(self) -> GPTConfig:
        """The dense attention's config (examples/gpt.py's)."""
        return GPTConfig(vocab=self.vocab, seq=self.seq, dim=self.dim, heads=self.heads,
                         layers=self.layers)


def capacity(tokens_per_group: int, experts: int, top_k: int, factor: float) -> int:
    """Expert buffer size per group: ``ceil(factor * S * k / E)`` (at least 1)."""
    return max(1, math.ceil(factor * tokens_per_group * top_k / experts))


def route(probs: torch.Tensor, top_k: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GShard routing with fixed shapes.

    ``probs [G, S, E]`` -> ``(combine [G, S, E, C], first [G, S, E])`` where ``combine``
    holds each kept token's gate at its expert slot and ``first`` is the one-hot of
    every token's first choice before dropping (for the load-balancing loss).
    """
    e = probs.shape[-1]
    gates, idx = probs.topk(top_k, dim=-1)  # [G, S, k]
    if top_k > 1:  # GShard renormalises the kept gates over the chosen experts
        gates = gates / gates.sum(-1, keepdim=True)
    slots = torch.arange(cap, device=probs.device)
    combine = probs.new_zeros(*probs.shape, cap)
    first = None
    queued = None  # tokens already placed in each expert, per group: [G, 1, E]
    for j in range(top_k):
        mask = F.one_hot(idx[..., j], e)  # [G, S, E] int64
        if first is None:
            first = mask
        # position in the expert's buffer: earlier tokens of this choice, then all of
        # the earlier choices (cumsum runs along S, never across groups)
        pos = torch.cumsum(mask, dim=1) - 1
        if queued is not None:
            pos = pos + queued
        kept = mask * (pos < cap)
        queued = kept.sum(1, keepdim=True) if queued is None else queued + kept.sum(1, keepdim=True)
        # a dropped token's row of ``kept`` is all zero, so its slot never matters
        slot = (pos * kept).sum(-1)  # [G, S]
        at = (slot.unsqueeze(-1) == slots).to(probs.dtype)  # [G, S, C]
        combine = combine + (gates[..., j, None, None] * kept.unsqueeze(-1).to(probs.dtype)
                             * at.unsqueeze(2))
    return combine, first


class MoE(nn.Module):
    """Top-k mixture of GELU experts over groups of tokens (see the module docstring)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(cfg.experts, cfg.dim, cfg.hidden) / math.sqrt(cfg.dim))
        self.w_out = nn.Parameter(torch.randn(cfg.experts, cfg.hidden, cfg.dim) / math.sqrt(cfg.hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, M]`` -> (output ``[B, T, M]``, load-balancing loss, a scalar)."""
        b, t, m = x.shape
        cfg = self.cfg
        g = cfg.groups or b
        s = b * t // g
        xg = x.reshape(g, s, m)
        probs = self.router(xg).softmax(-1)  # [G, S, E]
        combine, first = route(probs, cfg.top_k, capacity(s, cfg.experts, cfg.top_k,
                                                          cfg.capacity_factor))
        dispatch = (combine > 0).to(x.dtype)
        xe = torch.einsum("gsec,gsm->egcm", dispatch, xg)
        h = F.gelu(torch.einsum("egcm,emh->egch", xe, self.w_in))
        ye = torch.einsum("egch,ehm->egcm", h, self.w_out)
        y = torch.einsum("gsec,egcm->gsm", combine, ye)
        # Switch eq. 4: E * sum_e f_e * P_e per group, averaged over the groups
        frac = first.to(probs.dtype).mean(1)  # [G, E]
        aux = cfg.experts * (frac * probs.mean(1)).sum(-1).mean()
        return y.reshape(b, t, m), aux


class MoEBlock(nn.Module):
    """Pre-norm transformer block with gpt.py's attention and an MoE instead of the MLP."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg.attention())
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block output, this block's load-balancing loss)."""
        x = x + self.attn(self.ln1(x))
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class MoEGPT(nn.Module):
    """Decoder-only MoE language model returning cross-entropy + aux_coef * aux losses."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2 and "router" not in name:
                nn.init.normal_(p, std=0.02 / math.sqrt(1 + p.shape[0] / p.shape[1]))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The scalar training loss."""
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        aux = x.new_zeros(())
        for blk in self.blocks:
            x, a = blk(x)
            aux = aux + a
        logits = self.head(self.ln_f(x))
        lm = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return lm + self.cfg.aux_coef * aux


def build(layers: int = 2, dim: int = 32, heads: int = 4, experts: int = 4, hidden: int = 64,
          vocab: int = 128, seq: int = 16, batch: int = 4, top_k: int = 2,
          capacity_factor: float = 1.0, groups: int = 0, aux_coef: float = 0.01,
          ) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Factory for the CLI and tests: the model and one example batch."""
    torch.manual_seed(0)
    cfg = MoEConfig(vocab=vocab, seq=seq, dim=dim, heads=heads, layers=layers, experts=experts,
                    hidden=hidden, top_k=top_k, capacity_factor=capacity_factor, groups=groups,
                    aux_coef=aux_coef)
    model = MoEGPT(cfg)
    tokens = torch.randint(0, vocab, (batch, seq))
    labels = torch.roll(tokens, -1, dims=1)
    return model, (tokens, labels)


def routing_stats(model: MoEGPT, tokens: torch.Tensor, labels: torch.Tensor) -> list[tuple[int, int]]:
    """Per MoE layer, (token-expert assignments, assignments kept within capacity) on
    one batch: the difference is what the capacity dropped.  Runs the model eagerly
    and re-routes each router's probabilities with :func:`route`."""
    probs: list[torch.Tensor] = []
    hooks = [blk.moe.router.register_forward_hook(
        lambda mod, inp, out: probs.append(out.detach().softmax(-1))) for blk in model.blocks]
    try:
        with torch.no_grad():
            model(tokens, labels)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.cfg
    stats = []
    for p in probs:
        g, s, e = p.shape
        combine, _ = route(p, cfg.top_k, capacity(s, e, cfg.top_k, cfg.capacity_factor))
        stats.append((g * s * cfg.top_k, int((combine > 0).sum())))
    return stats


def _einsum_name(k: int) -> str:
    """The graph name torch.export gives the ``k``-th einsum of the model."""
    return "einsum" if k == 0 else f"einsum_{k}"


def ep_pins(layers: int = 2, mesh_axes: int = 1, expert_axis: int = -1) -> dict[str, str]:
    """Pins for expert parallelism on ``expert_axis`` of a ``mesh_axes``-axis mesh.

    Expert weights are sharded on E there and replicated on the other axes; the batch
    (hence the groups) is sharded on every axis, and so are each layer's dispatched
    tokens ``[E, G, C, M]`` and combined output ``[G, S, M]``, so the experts' input
    must move from groups-sharded to experts-sharded (an all-to-all) and back.  The
    rest is the planner's.  The dispatch and combine are each layer's first and last
    einsum (graph names ``einsum``, ``einsum_3``, ``einsum_4``, ...; a pin naming a
    node that does not exist is an error, so a renaming cannot go unnoticed).

    With groups on two axes the expert axis should be the inner one (the default,
    -1): the all-to-all then runs inside the outer axis's chunk of groups; on the
    outer axis the swap is no single all-to-all (autopar/sharding/redistribute.py).
    """
    ax = expert_axis % mesh_axes
    w = "".join("S(0)" if a == ax else "R" for a in range(mesh_axes))
    pins = {"*w_in": w, "*w_out": w, "input:0": "S(0)" * mesh_axes,
            "input:1": "S(0)" * mesh_axes}
    for i in range(layers):
        pins[_einsum_name(4 * i)] = "S(1)" * mesh_axes  # dispatched [E, G, C, M]
        pins[_einsum_name(4 * i + 3)] = "S(0)" * mesh_axes  # combined [G, S, M]
    return pins


def ep_tp_pins(layers: int = 2) -> dict[str, str]:
    """Pins for EP x TP on a 2-axis mesh: experts split on E over axis 0 and, inside each
    expert, Megatron-style over axis 1 (``w_in`` by its hidden columns, ``w_out`` by its
    hidden rows: one all-reduce of the experts' output on axis 1); groups split on axis 0
    only, so the dispatched tokens move by all-to-all on axis 0."""
    pins = {"*w_in": "S(0)S(2)", "*w_out": "S(0)S(1)", "input:0": "S(0)R", "input:1": "S(0)R"}
    for i in range(layers):
        pins[_einsum_name(4 * i)] = "S(1)R"  # dispatched [E, G, C, M]
        pins[_einsum_name(4 * i + 3)] = "S(0)R"  # combined [G, S, M]
    return pins


def main() -> None:
    """Plan on the first batch, then train a few steps."""
    from autopar import MeshSpec, auto_parallel

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mesh", default="2")
    ap.add_argument("--preset", default="cpu-gloo")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ep", action="store_true", help="pin expert parallelism on the last mesh axis")
    args = ap.parse_args()
    model, (tokens, labels) = build()
    mesh = MeshSpec.preset(args.preset, shape=MeshSpec.parse_shape(args.mesh))
    pins = ep_pins(model.cfg.layers, len(mesh.shape)) if args.ep else None
    pmodel = auto_parallel(model, example_inputs=(tokens, labels), mesh=mesh, pins=pins)
    if pmodel.rank == 0:
        print(pmodel.plan)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = pmodel.train_step(tokens, labels)
        opt.step()
        opt.zero_grad()
        if pmodel.rank == 0:
            print(f"step {step} loss {loss.item():.4f}")
    pmodel.shutdown()


if __name__ == "__main__":
    main()
