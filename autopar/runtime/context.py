"""Attention with the sequence split across ranks (the local forms of
``scaled_dot_product_attention`` under :func:`autopar.sharding.rules.attention.context_layout`).

- :func:`row_attention`: this rank holds some query rows and every key and value; it
  attends its rows (a causal mask is offset by the rank's first row).  No
  communication here: the key/value all-gather is an ordinary redistribution.
- :func:`ulysses_attention`: q, k and v hold a sequence chunk and every head.  One
  all-to-all per tensor and CP axis turns that into every position of a subset of the
  heads (DeepSpeed-Ulysses), the attention runs locally, and one all-to-all turns the
  output back.  The backward of each all-to-all is the reverse all-to-all
  (:func:`autopar.runtime.collectives.all_to_all`).
- ring attention (heads that do not divide) lives in :mod:`autopar.runtime.ring_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.runtime.collectives import all_to_all
from autopar.runtime.mesh import current
from autopar.runtime.ops import shard_offset

HEADS, SEQ = 1, 2


def _causal_rows(q_len: int, k_len: int, offset: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[q_len, k_len]``: global row ``offset + i`` may attend keys ``<= it``."""
    rows = torch.arange(offset, offset + q_len, device=device).unsqueeze(1)
    return rows >= torch.arange(k_len, device=device).unsqueeze(0)


def _with_causal(mask: torch.Tensor | None, causal: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` (boolean or additive) restricted further by the boolean ``causal``."""
    if mask is None:
        return causal
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf")).to(dtype)


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  is_causal: bool, scale: float | None, enable_gqa: bool,
                  axes: tuple[int, ...]) -> torch.Tensor:
    """Attention of this rank's query rows (sequence dim split over ``axes``) to whole
    keys and values.  ``mask`` already holds this rank's rows (or broadcasts over rows)."""
    if is_causal:
        off = shard_offset(axes, q.shape[SEQ])
        mask = _with_causal(mask, _causal_rows(q.shape[SEQ], k.shape[SEQ], off, q.device), q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=enable_gqa)


def _heads_slice(mask: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """A whole mask's head dim (dim -3, unless broadcast) cut as Ulysses cuts the heads:
    over the last CP axis first, then the earlier ones."""
    if mask.dim() < 3 or mask.shape[-3] == 1:
        return mask
    m = current()
    for a in reversed(axes):
        n = m.shape[a]
        size = mask.shape[-3] // n
        mask = mask.narrow(mask.dim() - 3, m.coord[a] * size, size)
    return mask


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                      enable_gqa: bool, axes: tuple[int, ...]) -> torch.Tensor:
    """Attention with q, k, v split on the sequence over ``axes`` (DeepSpeed-Ulysses).

    The sequence is gathered axis by axis, the last axis first (an earlier axis splits
    first, so the last holds the innermost chunks), each time scattering the heads; the
    output goes back the same way in reverse.  Every rank then attends whole sequences
    of ``heads / degree`` heads, so causal and padding masks apply as in one process
    (``mask`` is whole on the CP axes; its head dim, if any, is cut like the heads).
    """
    def to_heads(x: torch.Tensor) -> torch.Tensor:
        for a in reversed(axes):
            x = all_to_all(x, SEQ, HEADS, a)
        return x

    out = F.scaled_dot_product_attention(
        to_heads(q), to_heads(k), to_heads(v),
        attn_mask=None if mask is None else _heads_slice(mask, axes),
        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    for a in axes:
        out = all_to_all(out, HEADS, SEQ, a)
    return out


__all__ = ["row_attention", "ulysses_attention"]
