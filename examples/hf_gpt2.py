"""Hugging Face GPT-2 built from a small config (no weights, no hub access).

``build()`` returns a wrapper whose forward returns the language-modelling loss, so
it plans and trains like the hand-written models.
"""

from __future__ import annotations

import os

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class GPT2Loss(nn.Module):
    """``GPT2LMHeadModel`` returning only ``.loss`` (labels shifted inside HF)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def build(layers: int = 2, dim: int = 64, heads: int = 4, vocab: int = 128, seq: int = 16,
          batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny GPT-2 (dropout off so runs are deterministic) and one batch."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    model = GPT2Loss(GPT2LMHeadModel(cfg))
    tokens = torch.randint(0, vocab, (batch, seq))
    return model, (tokens, tokens.clone())
