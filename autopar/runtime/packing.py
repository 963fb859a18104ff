"""``pack=True``: right-padded batches run packed, their padding dropped.

A fine-tuning batch padded to its longest sequence (what ``DataCollatorWithPadding``
gives) computes on every padding token.  Under ``pack=True`` the module takes such a
batch as it comes and runs only its real tokens: each call's sequences are laid back to
back in a few rows (as Hugging Face's ``DataCollatorWithFlattening`` lays them), with
``position_ids`` restarting at 0 at each sequence and no ``attention_mask``, which a
Hugging Face causal LM reads as "these are separate sequences" (its packed-sequence
mask).  The outputs come back in the caller's layout: a ``[rows, width, ...]`` output
(the logits) is scattered back to ``[batch, length, ...]``, zeros at padding.  Opt-in,
not the default: a loop whose batches are left-padded or whose labels are not -100 at
padding runs as it is without it, and would be refused with it.

Exact where padding was ignored anyway: each real token sees the same tokens at the same
positions, and a label is predicted by the same logit.  So the call must be right-padded
(each row's real tokens first) and its ``labels`` ``-100`` at padding, as Hugging Face's
collators give them; the label of each sequence's first token is set to ``-100`` in the
pack, where in the padded batch it was the first label and never predicted.  A loss over
``labels`` inside the model is then the same token mean.  The plan is captured and priced
at the packed example (:func:`packed_example`), and :func:`check_model` refuses, before
planning, a model whose packed sequences see each other.

Rows: the whole batch (``batch="global"``) is packed into as many rows as the job has
ranks times the plan's micro-batches (forced ones when planning: the search sees the
packed batch), sequences dealt longest first to the row with the fewest tokens, so the
rows are of nearly equal length; under ``batch="local"`` each rank packs its own part
into one row per micro-batch, of its own length, as a data-parallel rank runs it, unless
the plan has the ranks' activations meet (a gathered input, a pipeline): then the ranks
agree on the widest row (one all-gather of an integer, :func:`widest`) and pad to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from autopar.errors import ConfigError
from autopar.plans.decisions import PlanOptions
from autopar.runtime.call_check import gather_rows
from autopar.runtime.inputs import InputMismatchError

MASK, POSITIONS, LABELS, IDS = "attention_mask", "position_ids", "labels", "input_ids"
IGNORE = -100
"""The label a Hugging Face loss skips (``ignore_index``)."""


@dataclass(frozen=True)
class Packed:
    """Where one call's real tokens went: ``source`` indexes the caller's flattened
    ``[batch * length]`` tokens, ``target`` the packed ``[rows * width]`` ones."""

    batch: int
    length: int
    rows: int
    width: int
    source: torch.Tensor
    target: torch.Tensor

    def unpack(self, out):
        """``out`` with every ``[rows, width, ...]`` tensor back in ``[batch, length,
        ...]`` (zeros at padding; differentiable); other leaves as they are."""
        def back(x):
            if not isinstance(x, torch.Tensor) or tuple(x.shape[:2]) != (self.rows, self.width):
                return x
            full = x.new_zeros((self.batch * self.length, *x.shape[2:]))
            full[self.source.to(x.device)] = x.reshape(-1, *x.shape[2:])[self.target.to(x.device)]
            return full.view(self.batch, self.length, *x.shape[2:])
        return pytree.tree_map(back, out)


def pack(kwargs: dict, rows: int, agree: Callable[[int], int] | None = None
         ) -> tuple[dict, Packed]:
    """``kwargs`` (a padded batch: ``input_ids``, maybe ``attention_mask`` and
    ``labels``) packed into at most ``rows`` rows, and where each token went; raises
    :class:`InputMismatchError` on what packing would not run exactly.  ``agree`` (ranks
    that must call with equal shapes: :func:`widest`) maps this rank's row width to the
    one every rank pads its rows to, or is told -1 when this rank cannot pack."""
    try:
        lengths = _checked(kwargs)
    except InputMismatchError:
        if agree is not None:
            agree(-1)  # the other ranks raise too, rather than wait for this one
        raise
    order, width = _deal(lengths, rows)
    if agree is not None:
        width = agree(width)
    ids = kwargs[IDS]
    b, n = ids.shape
    source, target, positions = _layout(lengths, order, n, width, ids.device)
    out = {k: v for k, v in kwargs.items() if k != MASK}
    for k, v in kwargs.items():
        if k != MASK and isinstance(v, torch.Tensor) and tuple(v.shape[:2]) == (b, n):
            out[k] = _packed(k, v, source, target, positions)
    out[POSITIONS] = positions
    return out, Packed(b, n, len(order), width, source, target)


def widest(device: torch.device) -> Callable[[int], int]:
    """``pack``'s ``agree`` for ranks that must call with equal shapes: every rank's
    width by one all-gather of an integer, the largest returned (the others pad their
    rows' tails); a rank that sent -1 could not pack, and every rank raises."""
    def agree(width: int) -> int:
        every = gather_rows([width], device)[:, 0].tolist()
        failed = [r for r, w in enumerate(every) if w < 0]
        if failed and width >= 0:
            raise InputMismatchError(f"rank(s) {failed} could not pack their batch under "
                                     "pack=True (their error says why); no rank ran this step")
        return max(every)
    return agree


def _checked(kwargs: dict) -> list[int]:
    """Each row's count of real tokens (all of them without ``attention_mask``), once the
    call is seen to be packable: token ids, no ``position_ids``, right-padded, labels
    -100 at padding."""
    if POSITIONS in kwargs:
        raise InputMismatchError("pack=True makes position_ids itself (restarting at each "
                                 "sequence): pass the padded batch without position_ids")
    ids = kwargs.get(IDS)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InputMismatchError("pack=True packs a batch of token ids: pass input_ids of "
                                 "shape [batch, length]")
    mask = kwargs.get(MASK)
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.to(ids.device).bool()
    lengths = _right_padded(mask)
    labels = kwargs.get(LABELS)
    if isinstance(labels, torch.Tensor) and labels.shape == ids.shape and bool((labels[~mask] != IGNORE).any()):
        raise InputMismatchError(
            "pack=True needs labels of -100 at padding (as Hugging Face's collators give "
            "them): a padding label here is predicted in the padded batch and not in the "
            "packed one, so the loss would differ")
    return lengths


def _right_padded(mask: torch.Tensor) -> list[int]:
    """Each row's count of real tokens; raises unless every row's come first."""
    lengths = mask.sum(1)
    first = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    if not torch.equal(first, mask):
        raise InputMismatchError(
            "pack=True runs right-padded batches (each row's real tokens first, as "
            "DataCollatorWithPadding gives with padding_side='right'); this attention_mask "
            "has padding before a real token (left padding?)")
    if int(lengths.sum()) == 0:
        raise InputMismatchError("pack=True was given a batch with no real token")
    return lengths.tolist()


def _deal(lengths: list[int], rows: int) -> tuple[list[list[int]], int]:
    """The rows (each its sequences' indices, in the caller's order) and their width:
    longest first to the row with the fewest tokens (ties: the lowest row), so the
    rows' lengths differ by at most one sequence's."""
    real = [i for i, k in enumerate(lengths) if k]
    count = max(1, min(rows, len(real)))
    load, order = [0] * count, [[] for _ in range(count)]
    for i in sorted(real, key=lambda i: (-lengths[i], i)):
        r = min(range(count), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        order[r].append(i)
    return [sorted(o) for o in order], max(load)


def _layout(lengths: list[int], order: list[list[int]], n: int, width: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flat source and target index of every real token, and the packed
    ``position_ids``: restarting at each sequence, and at the row's unused tail (a
    sequence of its own that nothing attends from)."""
    source, target = [], []
    positions = torch.zeros(len(order), width, dtype=torch.long)
    for r, seqs in enumerate(order):
        at = 0
        for i in seqs:
            k = lengths[i]
            source.append(torch.arange(i * n, i * n + k))
            target.append(torch.arange(r * width + at, r * width + at + k))
            positions[r, at:at + k] = torch.arange(k)
            at += k
        positions[r, at:] = torch.arange(width - at)
    return (torch.cat(source).to(device), torch.cat(target).to(device), positions.to(device))


def _packed(key: str, x: torch.Tensor, source: torch.Tensor,
            target: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Input ``key`` packed; ``labels`` also ``-100`` at each sequence's first token
    (where ``positions`` restart), so no sequence's last token predicts the next's."""
    fill = IGNORE if key == LABELS else 0
    out = x.new_full((positions.numel(), *x.shape[2:]), fill)
    out[target] = x.reshape(-1, *x.shape[2:])[source]
    out = out.view(*positions.shape, *x.shape[2:])
    if key == LABELS:
        out[positions == 0] = IGNORE
    return out


def global_rows(mesh_shape: tuple[int, ...], micro_batches: int) -> int:
    """The rows a whole (global) batch is packed into: one per device and micro-batch."""
    return math.prod(mesh_shape) * micro_batches


def example_rows(mesh_shape: tuple[int, ...], opts: PlanOptions) -> int:
    """The rows a ``pack=True`` example is packed into before the search: one per device
    and forced micro-batch.  Copies (which serve the planned shape only) are refused:
    a packed call's width is its own."""
    if opts.copies not in (None, 1):
        raise ConfigError("pack=True gives every call a shape of its own, and copies= runs "
                          "the planned shape only: plan without copies")
    return global_rows(mesh_shape, opts.micro_batches or 1)


def packed_example(model: torch.nn.Module, kwargs: dict | None, rows: int) -> dict:
    """The example a ``pack=True`` plan is captured and priced at: ``kwargs`` packed
    into ``rows`` rows (one per device), once :func:`check_model` passed."""
    if not kwargs:
        raise ConfigError("pack=True plans on example_kwargs (input_ids, attention_mask, "
                          "labels): pass the example batch as keyword arguments")
    packed = pack(dict(kwargs), rows)[0]
    check_model(model, packed)
    return packed


@torch.no_grad()
def check_model(model: torch.nn.Module, kwargs: dict) -> None:
    """Raise :class:`ConfigError` unless ``model`` keeps packed sequences apart: the
    second of two packed sequences gives the same logits whatever the first holds.
    Two forwards of a few tokens in eval mode; skipped on a model without real weights."""
    if any(p.is_meta for p in model.parameters()):
        return
    ids = kwargs[IDS][:1, :8]
    one = ids.new_zeros(ids.shape) if bool(ids.ne(0).any()) else ids.new_ones(ids.shape)
    k = ids.shape[1]
    positions = torch.arange(k, device=ids.device).repeat(1, 2)
    mode = model.training
    model.eval()
    try:
        a, b = (_logits(model, torch.cat([first, ids], 1), positions) for first in (ids, one))
    finally:
        model.train(mode)
    scale = 1.0 + float(a.abs().max())
    if float((a[:, k:] - b[:, k:]).abs().max()) > 1e-3 * scale:
        raise ConfigError(
            f"pack=True: {type(model).__name__} lets packed sequences see each other (the "
            "second of two gave other logits when the first changed), so it would not run a "
            "packed batch as the padded one; Hugging Face models that keep sequences apart by "
            "position_ids (DataCollatorWithFlattening's) can pack")


def _logits(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The model's logits on one packed row (``use_cache=False``: a Hugging Face model
    masks a pack only without a cache)."""
    out = model(input_ids=ids, position_ids=positions, use_cache=False)
    return (out.logits if hasattr(out, "logits") else out[0]).float()


__all__ = ["IGNORE", "Packed", "check_model", "example_rows", "global_rows", "pack", "packed_example", "widest"]
