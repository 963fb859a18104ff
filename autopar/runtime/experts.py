"""Mixture-of-experts expert layers as one op, and its local forms.

``autopar::moe_experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k],
gate_up_proj [E, 2I, H], down_proj [E, H, I], act) -> [T, H]`` is what a Hugging Face
experts module (``MixtralExperts`` and its copies: concatenated gate/up, no bias)
computes: for every routed (token, slot) pair, expert ``e = top_k_index[t, j]`` runs
``down_e(act(gate_e(x_t)) * up_e(x_t))``, scaled by ``top_k_weights[t, j]`` and summed
into the token's row.  Capture (:mod:`autopar.capture.hf_experts`) makes each such module
call this op, so routing's data-dependent ``nonzero``/``where`` never reaches the graph.

Local forms (:func:`autopar.sharding.rules.moe_experts.localize_experts` picks them):

- tokens split, experts whole (data parallel), or everything replicated: the op itself
  on the local tensors (its kernel is :func:`routed_experts`);
- experts split on ``E`` over an axis, tokens whole there: :func:`partial_experts`,
  only the local experts' contributions (the output is a Partial sum);
- tokens and experts split over the same axis (expert parallel):
  :func:`expert_parallel` sends each routed row to the rank holding its expert with
  an uneven all-to-all, computes there and sends the result back the same way.

The op's kernel mirrors transformers' loop (experts in ascending order, each one's rows
ordered by (slot, token)), so the single-process result is bit-for-bit the module's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from autopar.runtime import collectives as C
from autopar.runtime.tls import issue

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def act_name(fn: object) -> str | None:
    """The :data:`_ACTS` name of activation module/function ``fn`` (probed on values), or
    ``None`` when it is none of them."""
    probe = torch.linspace(-4.0, 4.0, 41, dtype=torch.float64)
    try:
        got = fn(probe)
    except Exception:  # noqa: BLE001 - an activation that does not take a tensor
        return None
    for name, ref in _ACTS.items():
        if isinstance(got, torch.Tensor) and got.shape == probe.shape and \
                torch.allclose(got.double(), ref(probe), rtol=0, atol=1e-12):
            return name
    return None


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    # rows in the weights' dtype, as autocast casts a linear's input: under bf16-mixed
    # the weights come cast (autopar/capture/mixed_precision.py) and the expert runs in bf16
    gate, up = F.linear(x.to(gate_up.dtype), gate_up).chunk(2, dim=-1)
    return F.linear(_ACTS[act](gate) * up, down)


def _assignments(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every routed (slot, token) pair sorted by expert, stably in (slot, token) order
    (transformers' order): (expert, token, slot) of each, as 1-D tensors."""
    t, k = index.shape
    flat = index.t().reshape(-1)  # (slot, token) order
    order = torch.sort(flat, stable=True).indices
    return flat[order], order % t, order // t


def routed_experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, act: str,
                   first: int = 0) -> torch.Tensor:
    """The op on this rank's tokens with experts ``first .. first + gate_up.shape[0] - 1``
    (pairs routed to other experts contribute nothing): differentiable, eager (the
    routing is data-dependent)."""
    out = torch.zeros_like(hidden)
    n = gate_up.shape[0]
    ran = False
    for e in range(n):
        slot, tok = torch.where(index.t() == first + e)
        if tok.numel() == 0 and (ran or e < n - 1):
            continue
        # the last expert runs even on no rows when none ran: _no_rows_keeps_grad
        ran = True
        y = _expert(hidden[tok], gate_up[e], down[e], act) * weights[tok, slot, None]
        out = out.index_add(0, tok, y.to(out.dtype))
    return out


# ------------------------------------------------------------------ the op
@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str) -> torch.Tensor:
    """Routed experts (see the module docstring)."""
    with torch.no_grad():
        return routed_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)


@moe_experts.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act):
    return torch.empty_like(hidden)


def _setup(ctx, inputs, output) -> None:
    hidden, index, weights, gate_up, down, act = inputs
    ctx.save_for_backward(hidden, index, weights, gate_up, down)
    ctx.act = act


def _backward(ctx, grad):
    hidden, index, weights, gate_up, down = ctx.saved_tensors
    leaves = [t.detach().requires_grad_() for t in (hidden, weights, gate_up, down)]
    with torch.enable_grad():
        out = routed_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], ctx.act)
        gh, gw, ggu, gd = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    z = [g if g is not None else torch.zeros_like(t) for g, t in zip((gh, gw, ggu, gd), leaves)]
    return z[0], None, z[1], z[2], z[3], None


moe_experts.register_autograd(_backward, setup_context=_setup)
MOE_EXPERTS = torch.ops.autopar.moe_experts.default


# ------------------------------------------------------------------ local forms
# _no_rows_keeps_grad: when no routed row reaches any of this rank's experts, one of them
# still runs on zero rows.  Its weights then get a gradient of zeros, as in the single
# process (where the stacked expert tensor gets a gradient whenever any expert ran),
# not ``None``: an optimizer skips a parameter whose gradient is ``None``, so AdamW's
# weight decay and momentum would stop for this rank's experts alone and the shards
# would drift from the model they split.
def partial_experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, act: str,
                    axis: int) -> torch.Tensor:
    """Experts split on ``E`` over ``axis`` and tokens whole there: this rank's experts'
    share of every token (a Partial sum over ``axis``)."""
    first = C.current().coord[axis] * gate_up.shape[0]
    return routed_experts(hidden, index, weights, gate_up, down, act, first)


def _uneven_all_to_all(x: torch.Tensor, send: list[int], recv: list[int], axis: int) -> torch.Tensor:
    g, _ = C._group(axis)
    out = x.new_empty((sum(recv), *x.shape[1:]))
    issue(dist.all_to_all_single, out, x.contiguous(), output_split_sizes=list(recv),
                           input_split_sizes=list(send), group=g)
    return out


class _UnevenAllToAll(Function):
    """Rows ``send[j]`` of ``x`` (in order) go to rank ``j`` of ``axis``; ``recv[j]``
    rows come from rank ``j``.  The backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send, recv, axis):  # noqa: D102
        ctx.send, ctx.recv, ctx.axis = send, recv, axis
        return _uneven_all_to_all(x, send, recv, axis)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return _uneven_all_to_all(g, ctx.recv, ctx.send, ctx.axis), None, None, None


def uneven_all_to_all(x: torch.Tensor, send: list[int], recv: list[int], axis: int) -> torch.Tensor:
    """Differentiable uneven all-to-all of ``x``'s rows over mesh ``axis``."""
    return _UnevenAllToAll.apply(x, list(send), list(recv), axis)


def expert_parallel(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, act: str,
                    axis: int) -> torch.Tensor:
    """Expert parallelism over ``axis``: this rank holds some tokens and experts
    ``coord * E_local ..``; every routed (token, slot) row goes to its expert's rank.

    1. sort this rank's pairs by expert (so by destination), count per destination;
    2. exchange the counts (an even all-to-all), then the rows and their expert ids
       (uneven all-to-alls);
    3. run each local expert on the rows routed to it;
    4. send the results back (the reverse uneven all-to-all), scale by the routing
       weights and add into the tokens' rows.
    """
    g, n = C._group(axis)
    e_local = gate_up.shape[0]
    first = C.current().coord[axis] * e_local
    expert, tok, slot = _assignments(index)
    dest = torch.div(expert, e_local, rounding_mode="floor")
    send_t = torch.bincount(dest, minlength=n).to(torch.int64)
    recv_t = torch.empty_like(send_t)
    issue(dist.all_to_all_single, recv_t, send_t, group=g)
    send, recv = send_t.tolist(), recv_t.tolist()
    # rows travel in the experts' dtype (bf16 under bf16-mixed: half the bytes); the
    # expert would cast them on arrival anyway, so the values are the same
    rows = uneven_all_to_all(hidden[tok].to(gate_up.dtype), send, recv, axis)
    with torch.no_grad():
        got = _uneven_all_to_all(expert.unsqueeze(1), send, recv, axis).squeeze(1) - first
    # rows from each source are sorted by expert; group them by expert across sources
    order = torch.sort(got, stable=True).indices
    counts = torch.bincount(got, minlength=e_local).tolist()
    pieces = [_expert(rows[part], gate_up[e], down[e], act)
              for e, part in enumerate(torch.split(order, counts)) if part.numel()]
    if not pieces:  # no rows for this rank's experts: _no_rows_keeps_grad
        pieces.append(_expert(rows[:0], gate_up[0], down[0], act))
    y = torch.cat(pieces)[torch.argsort(order)]  # back to arrival order
    back = uneven_all_to_all(y, recv, send, axis)
    out = torch.zeros_like(hidden)
    return out.index_add(0, tok, (back * weights[tok, slot, None]).to(out.dtype))


__all__ = ["MOE_EXPERTS", "act_name", "expert_parallel", "moe_experts", "partial_experts",
           "routed_experts", "uneven_all_to_all"]
