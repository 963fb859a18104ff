"""A small GPT-style language model (separate q/k/v projections) used by the
README, the tests and the benchmarks.

``build()`` is the factory the CLI uses: ``autopar plan examples/gpt.py:build``.
Run as a script under torchrun to plan, shard and train it for a few steps::

    torchrun --nproc-per-node 4 examples/gpt.py --mesh 2x2
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; the defaults are small enough for CPU tests."""

    vocab: int = 256
    seq: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q_proj = nn.Linear(cfg.dim, cfg.dim)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim)
        self.out_proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.heads
        q = self.q_proj(x).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.heads, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.out_proj(y)


class MLP(nn.Module):
    """Two-layer feed-forward block with GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model returning the mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(1 + p.shape[0] / p.shape[1]))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def build(layers: int = 4, dim: int = 64, heads: int = 4, vocab: int = 256, seq: int = 32,
          batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Factory for the CLI and tests: the model and one example batch."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=vocab, seq=seq, dim=dim, heads=heads, layers=layers)
    model = GPT(cfg)
    tokens = torch.randint(0, vocab, (batch, seq))
    labels = torch.roll(tokens, -1, dims=1)
    return model, (tokens, labels)


def main() -> None:
    """Plan on the first batch, then train a few steps on this rank's shard."""
    from autopar import MeshSpec, auto_parallel

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mesh", default="4")
    ap.add_argument("--preset", default=None,
                    help="price the plan on this preset (default: measure the running job)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    model, (tokens, labels) = build()
    # a shape alone: the plan is priced on a calibration of this job (kept on disk)
    mesh = MeshSpec.preset(args.preset, shape=MeshSpec.parse_shape(args.mesh)) if args.preset else args.mesh
    pmodel = auto_parallel(model, example_inputs=(tokens, labels), mesh=mesh)
    if pmodel.rank == 0:
        print(pmodel.plan)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = pmodel.train_step(tokens, labels)  # forward + backward, every micro-batch/stage
        opt.step()
        opt.zero_grad()
        if pmodel.rank == 0:
            print(f"step {step} loss {loss.item():.4f}")
    pmodel.shutdown()


if __name__ == "__main__":
    main()
