"""Ring attention: exact scaled dot-product attention over a sequence sharded on mesh axes.

Each rank holds a contiguous chunk of q, k and v along the sequence (dim 2).  The K/V
blocks travel once around the ring of the axes' ranks (point-to-point: send to the
successor, receive from the predecessor); each rank attends its queries to every block
it sees and merges the blocks with the log-sum-exp (online softmax) rule, so the result
is exact.  Autograd does the backward: each shift is an autograd function whose backward
shifts the gradient the other way, so key/value gradients from every rank's queries
travel back to the block's owner.

Causal attention skips blocks that lie entirely in the future.  With contiguous chunks
the last rank then does ``n`` blocks and rank 0 one; ``balance`` re-lays the sequence
"zigzag" (torchtitan, Megatron CP): of ``2n`` sub-chunks rank ``r`` holds ``r`` and
``2n-1-r``, every rank does the same work, and the output is moved back.

Each block is computed with plain torch ops (memory O(local q x block k)); on GPUs a
fused flash kernel that returns the log-sum-exp (``_scaled_dot_product_flash_attention``)
is the way to take later, merging the blocks with the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Function

from autopar.runtime.mesh import current
from autopar.runtime.tls import issue

_SHIFT_TAG = 1 << 20  # above every sub-chunk tag (chunk ids) used by the re-layout


@dataclass(frozen=True)
class Ring:
    """The ranks of one ring: global ranks in ring (= sequence chunk) order, this rank's
    position in it, and the process group they share."""

    ranks: tuple[int, ...]
    pos: int
    group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        """Number of ranks on the ring."""
        return len(self.ranks)

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]],
                 recvs: list[tuple[torch.Tensor, int, int]]) -> None:
        """Send and receive ``(tensor, peer position, tag)`` as one batch and wait.  Messages
        to one peer go in tag order on both sides: NCCL ignores tags and matches in order."""
        ops = [dist.P2POp(dist.isend, t, self.ranks[p], self.group, tag) for t, p, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, self.ranks[p], self.group, tag) for t, p, tag in recvs]
        if ops:
            for w in issue(dist.batch_isend_irecv, ops):
                w.wait()


def ring_of(axes: tuple[int, ...]) -> Ring:
    """The ring over mesh ``axes`` of the current mesh: the only place that reads the mesh
    and its groups (tests and simulators replace it).  Positions follow the sequence
    layout: row-major over the coordinates on ``axes``, the first axis the major one."""
    m = current()
    mesh = m.device_mesh.mesh[m.stage] if m.stages > 1 else m.device_mesh.mesh  # the sub-mesh
    line = mesh[tuple(slice(None) if a in axes else c for a, c in enumerate(m.coord))]
    order = sorted(axes)  # the dims ``line`` kept, in mesh order: put them in ``axes`` order
    ranks = line.permute(*(order.index(a) for a in axes)).reshape(-1).tolist()
    pos = 0
    for a in axes:
        pos = pos * m.shape[a] + m.coord[a]
    return Ring(tuple(ranks), pos, m.group_of(tuple(axes)))


class _Shift(Function):
    """Forward: pass ours to the successor, take the predecessor's; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, ring, d=1):  # noqa: D102
        ctx.ring = ring
        x, out = x.contiguous(), torch.empty_like(x, memory_format=torch.contiguous_format)
        ring.exchange([(x, (ring.pos + d) % ring.size, _SHIFT_TAG)],
                      [(out, (ring.pos - d) % ring.size, _SHIFT_TAG)])
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return _Shift.forward(ctx, g, ctx.ring, -1), None, None


Layout = tuple[tuple[int, ...], ...]  # per ring position, the sub-chunk ids it holds in order


def _move(x: torch.Tensor, ring: Ring, have: Layout, want: Layout) -> torch.Tensor:
    """Rows of ``x`` laid out as ``have`` -> rows laid out as ``want`` (see ``_Move``)."""
    where = {c: (p, j) for p, cs in enumerate(have) for j, c in enumerate(cs)}
    goes = {c: p for p, cs in enumerate(want) for c in cs}
    me, x = ring.pos, x.contiguous()
    out = x.new_empty((len(want[me]), *x.shape[1:]))
    sends = [(x[j], goes[c], c) for j, c in enumerate(have[me]) if goes[c] != me]
    recvs = []
    for i, c in enumerate(want[me]):
        p, j = where[c]
        if p == me:
            out[i] = x[j]
        else:
            recvs.append((out[i], p, c))  # the sub-chunk id is the tag: order is fixed
    ring.exchange(sorted(sends, key=lambda s: s[2]), sorted(recvs, key=lambda s: s[2]))
    return out


class _Move(Function):
    """Re-lay sub-chunks: row ``j`` of ``x`` is sub-chunk ``have[pos][j]``; the result's
    rows are ``want[pos]``.  The backward moves the gradient back the same way."""

    @staticmethod
    def forward(ctx, x, ring, have, want):  # noqa: D102
        ctx.args = (ring, want, have)
        return _move(x, ring, have, want)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return _move(g, *ctx.args), None, None, None


class _Tie(Function):
    """Identity on ``x`` that also makes ``anchor`` part of the graph (zero gradient), so
    every rank runs the backward of every shift, even one whose last blocks it skipped:
    otherwise the ranks would issue different point-to-point sequences and hang."""

    @staticmethod
    def forward(ctx, x, anchor):  # noqa: D102
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        s, dt, dev = ctx.anchor
        return g, torch.zeros(s, dtype=dt, device=dev) if ctx.needs_input_grad[1] else None


@dataclass(frozen=True)
class Block:
    """One score block a rank computes: at ring ``step``, local query rows
    ``[q_off, q_off + q_len)`` against key rows ``[k_off, k_off + k_len)`` of the K/V block
    it holds then; ``partial`` when a causal mask cuts through it."""

    step: int
    q_off: int
    q_len: int
    k_off: int
    k_len: int
    partial: bool


def _segments(pos: int, n: int, length: int, balanced: bool) -> list[tuple[int, int, int]]:
    """(global start, length, local offset) of the sequence pieces ring position ``pos`` holds."""
    if not balanced:
        return [(pos * length, length, 0)]
    h = length // 2
    return [(pos * h, h, 0), ((2 * n - 1 - pos) * h, h, h)]


def ring_schedule(n: int, pos: int, len_q: int, len_k: int, is_causal: bool,
                  balanced: bool) -> list[Block]:
    """The blocks ring position ``pos`` of ``n`` computes, in order (local lengths
    ``len_q`` / ``len_k``; ``balanced``: the zigzag layout).  Causal blocks wholly in the
    future are left out; key pieces a query piece sees are adjacent in the local block."""
    out = []
    for t in range(n):
        ks = _segments((pos - t) % n, n, len_k, balanced)
        for qa, ql, qo in _segments(pos, n, len_q, balanced):
            # causal masking is top-left aligned, as SDPA's: query i sees keys <= i
            seen = [k for k in ks if not is_causal or k[0] <= qa + ql - 1]
            if seen:
                part = is_causal and any(k[0] + k[1] - 1 > qa for k in seen)
                out.append(Block(t, qo, ql, seen[0][2], sum(k[1] for k in seen), part))
    return out


def _positions(pos: int, n: int, length: int, balanced: bool) -> torch.Tensor:
    return torch.cat([torch.arange(a, a + n_) for a, n_, _ in _segments(pos, n, length, balanced)])


def _mask_block(mask: torch.Tensor, qp: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
    """The global mask's entries for query positions ``qp`` and key positions ``kp``,
    leaving broadcast (size-1) dims alone."""
    if mask.dim() >= 2 and mask.size(-2) != 1:
        mask = mask.index_select(-2, qp.to(mask.device))
    if mask.dim() >= 1 and mask.size(-1) != 1:
        mask = mask.index_select(-1, kp.to(mask.device))
    return mask


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                   axes: tuple[int, ...], balance: bool = True) -> torch.Tensor:
    """This rank's sequence chunk of ``F.scaled_dot_product_attention(Q, K, V, attn_mask,
    is_causal=is_causal, scale=scale, enable_gqa=True)`` on the global tensors.

    ``q``, ``k``, ``v``: local ``[batch, heads, seq, head_dim]`` chunks of tensors sharded
    on dim 2 over mesh ``axes`` (even, contiguous; the first axis shards first).  k/v may
    have ``heads / g`` heads (grouped-query: q head ``h`` uses kv head ``h // g``).
    ``attn_mask``: None or the whole global mask (boolean, True = attend, or additive),
    broadcastable to ``[batch, heads, seq_q, seq_k]``; its gradient, if it has one, is a
    Partial sum (each rank's share).  ``is_causal`` with a mask applies both, as SDPA's CPU
    kernel does (its math backend refuses the pair); rows with no visible key give zeros
    and zero gradients, as SDPA does.  ``balance`` (causal only) runs the zigzag layout,
    and falls back to the plain ring when the local length is odd or q's and k's differ.
    Differentiable; every rank issues the same point-to-point operations in one order.
    """
    ring = ring_of(tuple(axes))
    n, me = ring.size, ring.pos
    lq, lk, hq, hk = q.size(2), k.size(2), q.size(1), k.size(1)
    if hq % hk:
        raise ValueError(f"ring_attention: {hq} query heads do not group over {hk} kv heads")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    balanced = is_causal and balance and n > 1 and lq == lk and ring_balanced(lq)
    # contiguous layout (rank r: sub-chunks 2r, 2r+1) and zigzag (rank r: r, 2n-1-r)
    contig = tuple((2 * p, 2 * p + 1) for p in range(n))
    zigzag = tuple((p, 2 * n - 1 - p) for p in range(n))
    if balanced:  # one message per peer for q, k and v together
        parts = [t.chunk(2, dim=2) for t in (q, k, v)]
        shapes = [p[0].shape for p in parts]
        packed = torch.stack([torch.cat([p[j].reshape(-1) for p in parts]) for j in (0, 1)])
        rows = [r.split([math.prod(s) for s in shapes]) for r in
                _Move.apply(packed, ring, contig, zigzag)]
        q, k, v = (torch.cat([r[i].view(shapes[i]) for r in rows], dim=2) for i in range(3))
    ks, vs = k.shape, v.shape
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])  # k and v travel as one message
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qpos = _positions(me, n, lq, balanced)
    state: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # q_off: M, L, O
    blocks = ring_schedule(n, me, lq, lk, is_causal, balanced)
    for t in range(n):
        if t:
            kv = _Shift.apply(kv, ring)
        kb, vb = kv[:k.numel()].view(ks), kv[k.numel():].view(vs)
        kpos = _positions((me - t) % n, n, lk, balanced)
        for b in (b for b in blocks if b.step == t):
            qp, kp = qpos[b.q_off:b.q_off + b.q_len], kpos[b.k_off:b.k_off + b.k_len]
            kk, vv = kb.narrow(2, b.k_off, b.k_len), vb.narrow(2, b.k_off, b.k_len)
            if hq != hk:
                kk, vv = kk.repeat_interleave(hq // hk, 1), vv.repeat_interleave(hq // hk, 1)
            s = (q.narrow(2, b.q_off, b.q_len) @ kk.transpose(-2, -1)).to(acc) * scale
            if attn_mask is not None:
                m = _mask_block(attn_mask, qp, kp)
                s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.to(acc)
            if b.partial:
                s = s.masked_fill(kp[None, :] > qp[:, None], -math.inf)
            state[b.q_off] = _merge(state.get(b.q_off), s, vv)
    pieces = []
    for _, ql, qo in _segments(me, n, lq, balanced):
        if qo in state:
            _, ll, o = state[qo]
            pieces.append(o / torch.where(ll > 0, ll, torch.ones_like(ll)))  # 0 if no key
        else:
            pieces.append(q.new_zeros((*q.shape[:2], ql, vs[-1]), dtype=acc))
    out = _Tie.apply(torch.cat(pieces, dim=2).to(q.dtype), kv)
    if balanced:
        out = torch.cat(list(_Move.apply(torch.stack(out.chunk(2, dim=2)), ring, zigzag, contig)),
                        dim=2)
    return out


def _merge(state: tuple[torch.Tensor, ...] | None, s: torch.Tensor,
           v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold scores ``s`` against values ``v`` into the running (max M, sum of exp L,
    unnormalised output O) of the log-sum-exp rule."""
    # the max only keeps exp() in range and cancels in O / L: detached (exact gradients);
    # a row with no visible key yet (max -inf) shifts by 0 so nothing becomes NaN
    mx = s.detach().amax(-1, keepdim=True)
    if state is not None:
        mx = torch.maximum(mx, state[0])
    shift = mx.masked_fill(mx == -math.inf, 0.0)
    p = torch.exp(s - shift)
    ll, o = p.sum(-1, keepdim=True), (p.to(v.dtype) @ v).to(s.dtype)
    if state is not None:
        a = torch.exp(state[0] - shift)
        ll, o = state[1] * a + ll, state[2] * a + o
    return mx, ll, o


def ring_balanced(local_len: int) -> bool:
    """Whether a causal ring over local sequence chunks of ``local_len`` runs zigzag
    balanced: the chunk must halve into two sub-chunks (odd lengths use the plain ring)."""
    return local_len > 0 and local_len % 2 == 0


def ring_attention_cost_factors(n: int, is_causal: bool, balance: bool) -> tuple[float, float]:
    """(compute, transfers) of :func:`ring_attention` on ``n`` ranks, for the planner;
    ``balance``: whether the zigzag layout runs (causal, :func:`ring_balanced` length).

    compute: the slowest rank's score-block work as a fraction of the global op's FLOPs
    as ``annotate.op_flops`` prices SDPA (the whole ``S_q x S_k`` score matrix, causal or
    not).  A block cut by the causal mask is computed whole (masked), so with local
    length ``L = S/n``:
      non-causal: n blocks of L^2 = 1/n;  causal, contiguous: rank n-1 does n-1 full
      blocks and its diagonal = 1/n;  causal, zigzag (h = L/2): the diagonal step costs
      3h^2, each of the n-1 others 2h^2 = (2n+1)/(4n^2), the same on every rank.
    (A fused causal kernel would halve diagonals: (2n-1)/(2n^2) contiguous, i.e. the
    (2n-1)/n^2 of the causal half; 1/(2n) zigzag.)

    transfers: bytes the busiest rank sends per forward, in local K/V blocks (k and v):
    n-1 ring shifts; the zigzag re-layout adds q, k, v there and the output back, of which
    one sub-chunk of two moves on 2 ranks and both on some rank for n >= 3: +1 and +2 K/V
    blocks when q has as many heads as k/v.  The backward sends the same again.
    """
    if n <= 1:
        return 1.0, 0.0
    if is_causal and balance:
        return (2 * n + 1) / (4 * n * n), float(n - 1 + (1 if n == 2 else 2))
    return 1.0 / n, float(n - 1)
