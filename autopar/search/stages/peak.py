"""One stage's memory peak under a config, for any choice of recomputed and kept-gathered
layers (:class:`StagePeak`): what :func:`autopar.search.stages.price.price_stage` reads
to choose recomputation, ZeRO-3's kept layers, the gradient buffers and the gather
chunks, and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.search.stages.layer_stats import LayerStat

Arrivals = tuple[list[float], float, float]
""":func:`autopar.search.stages.memory.gradient_arrivals`: the gradient bytes each layer's
backward allocates, the largest on its way into its bucket, and the bytes whole from the
step's start."""


@dataclass(slots=True)
class StagePeak:
    """The terms of a stage's peak that do not depend on which layers are recomputed or
    kept gathered, computed once per stage price: :meth:`peak` is the split search's
    inner loop (~7 calls per stage price), so everything it can share is here."""

    layers: list[LayerStat]
    held: float
    """Bytes resident the whole step: parameters, optimizer state, buffers, PowerSGD's
    error feedback, less what offload keeps on the host."""
    grads: list[float]
    """Per layer, the gradient bytes once the step's reduction ends."""
    tr: list[float]
    """Per layer, ZeRO-3's whole parameters gathered for its forward."""
    trb: list[float]
    """The same for its backward: under mixed precision backward keeps a weight's
    low-precision copy when the weight is only cast, so only the others are re-gathered."""
    present: bool
    """The gradients of earlier micro-batches are alive at the activation peak."""
    flats: float
    """ZeRO-1/2's flat reduce buckets at the end of backward."""
    extra_inflight: int
    """Micro-batches in flight beyond the first (their activations are held too)."""
    held_w: float
    """Zero-bubble: the weight-gradient inputs waiting from each ``B`` to its ``W``."""
    arrivals: Arrivals
    """When backward allocates the gradients; reassigned as the buckets are chosen."""
    gathered_fwd: list[float] = field(init=False)
    gathered_bwd: list[float] = field(init=False)
    flow: list[float] = field(init=False)
    activations: list[float] = field(init=False)

    def __post_init__(self) -> None:
        layers, tr, trb = self.layers, self.tr, self.trb
        n = len(layers)
        # what peak() reads when no ZeRO-3 layer is kept gathered (most calls): the gathers
        # at each layer's forward (it and its prefetched successor) and backward (it and
        # its predecessor), and every layer's whole activations
        self.gathered_fwd = [0.0 + tr[k] + (tr[k + 1] if k + 1 < n else 0.0) for k in range(n)]
        # and, in a layer's backward, two gradients at once as autograd passes one op's on
        # to the next: the layer's widest (the logits' under a cross-entropy, the MLP's
        # hidden in a block), or its output's when that is wider
        self.flow = [2.0 * max(st.out_bytes, st.largest) for st in layers]
        self.gathered_bwd = [self.flow[k] + max(0.0, trb[k]) + (trb[k - 1] if k else 0.0)
                             for k in range(n)]
        self.activations = [st.activations for st in layers]

    def _kept_gathered(self, kp: frozenset[str]) -> tuple[list[float], list[float], float]:
        """ZeRO-3's gathered bytes at each layer's forward and backward, and the bytes of
        the kept layers (``kp``), which hold their whole parameters from forward to
        backward; a layer's backward prefetches the nearest layer before it that is not
        kept (runtime/zero3.py)."""
        layers, tr, trb, n = self.layers, self.tr, self.trb, len(self.layers)
        hold = [trb[k] if layers[k].key in kp else 0.0 for k in range(n)]
        held_before = [0.0]  # the kept layers' bytes before layer k: held_before[k]
        ahead = [0.0] * n  # what layer k's backward prefetches
        last = 0.0
        for k, h in enumerate(hold):
            held_before.append(held_before[-1] + h)
            ahead[k], last = last, (last if h else trb[k])
        g_fwd = [held_before[k] + tr[k] + (tr[k + 1] if k + 1 < n else 0.0) for k in range(n)]
        g_bwd = [self.flow[k] + held_before[k] + max(hold[k], trb[k]) + ahead[k] for k in range(n)]
        return g_fwd, g_bwd, sum(hold)

    def peak(self, rc: list[LayerStat], kp: frozenset[str] = frozenset()) -> dict[str, float]:
        """The step's peak with ``rc`` recomputed and ``kp`` kept gathered, split into
        ``activations``, ``grads`` and ``transient``.

        The peak is the largest of three moments (autopar.runtime.memstats measures them):
        the forward, each layer's activations so far with ZeRO-3's gather of it and its
        prefetched successor; backward, swept back to front (it frees a layer's
        activations as it makes its gradients): the layers before ``k`` keep theirs,
        layer ``k``'s are whole (re-materialised when recomputed), the gradients of the
        layers after ``k`` exist, and ZeRO-3 has re-gathered ``k`` and prefetched
        ``k - 1``; the end of backward: every gradient, ZeRO-1/2's flat buckets and the
        largest gradient on its way into its data-parallel bucket.  A kept ZeRO-3 layer
        holds its whole parameters from its forward to its backward, in every
        micro-batch in flight.  The sums are taken in one fixed order so that the split
        search and the chosen split agree bit for bit."""
        layers, present = self.layers, self.present
        arrive, spike, persist = self.arrivals
        keys = {st.key for st in rc}
        n = len(layers)
        if kp:
            g_fwd, g_bwd, held_sum = self._kept_gathered(kp)
        else:
            g_fwd, g_bwd, held_sum = self.gathered_fwd, self.gathered_bwd, 0.0
        kept = [st.out_bytes if st.key in keys else st.activations for st in layers] if keys \
            else self.activations
        # kept gradient buffers are whole from the step's start (``persist``)
        grads_then = sum(self.grads) if present else persist
        fa = fb = best = cum = 0.0
        for k in range(n):
            cum += kept[k]
            if cum + g_fwd[k] > best:
                fa, fb, best = cum, g_fwd[k], cum + g_fwd[k]
        total_kept = sum(kept)
        ba, bb, bc = total_kept, grads_then, 0.0
        best, before, made = total_kept + grads_then, total_kept, grads_then
        for k in range(n - 1, -1, -1):
            before -= kept[k]
            live = before + (layers[k].activations if layers[k].key in keys else kept[k])
            if live + made + g_bwd[k] > best:
                ba, bb, bc, best = live, made, g_bwd[k], live + made + g_bwd[k]
            # layer k's gradients appear as its backward ends, freeing its activations
            made = grads_then if present else made + arrive[k]
        extra = self.extra_inflight * (total_kept + held_sum) + self.held_w
        fwd_a, bwd_a = fa + extra, ba + extra
        end_g, end_t = sum(self.grads), (self.trb[0] if n else 0.0) + self.flats + spike
        # the largest moment, the first of equals (as max over the three would)
        sums = (fwd_a + grads_then + fb, bwd_a + bb + bc, 0.0 + end_g + end_t)
        if sums[0] >= sums[1] and sums[0] >= sums[2]:
            return {"activations": fwd_a, "grads": grads_then, "transient": fb}
        if sums[1] >= sums[2]:
            return {"activations": bwd_a, "grads": bb, "transient": bc}
        return {"activations": 0.0, "grads": end_g, "transient": end_t}

    def total(self, rc: list[LayerStat], kp: frozenset[str] = frozenset()) -> float:
        """Bytes per device at the peak: what is resident plus :meth:`peak`."""
        return self.held + sum(self.peak(rc, kp).values())


__all__ = ["Arrivals", "StagePeak"]
