"""What compressing the data-parallel gradient buckets costs and saves
(decision ``grad_compression``, :class:`~autopar.plans.kinds.GradCompression`).

A bucket's price stays affine in its parts, so the bucket recurrence of
:mod:`autopar.search.buckets` stays exact: each gradient brings the bytes it puts on
the link (``wire``) and the seconds its compression computes (``work``), and the
compression kind scales the all-reduce's latency and per-byte price:

* ``bf16``: each rank casts its bucket to bf16 and exchanges it (an all-to-all, half
  an all-reduce's bytes and latencies) while the backward runs; after the backward
  every rank sums its chunk in fp32 and the sums are gathered in bf16, the other half,
  which nothing hides (the bucket's *tail*).  Half the bytes of an fp32 bucket, plus
  the casts and the fp32 sum (memory-bound: 3.5 bytes moved per gradient byte).
* ``powersgd``: a gradient viewed as an ``n x m`` matrix sends ``(n + m) r`` values
  instead of ``n m`` where that is at most half; the others go whole
  (:func:`autopar.runtime.compression.low_rank`).  Two all-reduces a bucket (``P``
  with the whole ones, then ``Q``), three ``n m r`` matmuls and the error feedback's
  passes over the bucket.  They are issued in bucket order as a bucket launches, and
  the backward waits: nothing hides (the items are priced as ready at the end of the
  backward).  Its error-feedback buffers hold one more copy of the reduced
  gradients for the whole run (:func:`persistent_bytes`).
"""

from __future__ import annotations

from autopar.cost_models import MeshSpec, compute_time
from autopar.plans.decisions import PlanOptions, prices
from autopar.plans.kinds import POWERSGD_RANK, GradCompression
from autopar.runtime.compression import low_rank
from autopar.search.stages.layer_stats import ParamStat

BF16_MOVED = 3.5
"""Bytes the bf16 path moves per fp32 gradient byte: the cast to bf16 (read 1, write
0.5), the chunks summed in fp32 and cast back (about 0.5 + 0.25 + 0.25 over the
ranks), and the gathered bf16 copied into the fp32 bucket (read 0.5, write 1)."""
POWERSGD_MOVED = 11.0
"""Bytes PowerSGD moves per byte of a compressed gradient: the error added (read 2,
write 1), ``M Q`` and ``M^T P`` (read 1 each), ``P Q^T`` (write 1), the new error
(read 2, write 1) and the approximation copied into the bucket (read 1, write 1)."""
POWERSGD_WHOLE_MOVED = 7.0
"""Bytes it moves per byte of a gradient sent whole: the error added (3), packed
beside the ``P`` factors (2) and unpacked (2)."""
LATENCIES = {GradCompression.NONE.value: 1.0, GradCompression.BF16.value: 0.5,
             GradCompression.POWERSGD.value: 2.0}
"""A bucket's latency on the link during the backward, in all-reduce latencies: bf16's
all-to-all is half an all-reduce's hops (the gather's half is its tail), PowerSGD's
two all-reduces two."""


def kinds(opts: PlanOptions) -> list[tuple[str, int]]:
    """The (kind, rank) pairs the search prices: the forced kind, all three under
    ``"auto"``, none when compression was not allowed."""
    asked = opts.grad_compression
    rank = opts.compression_rank or POWERSGD_RANK
    if asked is None or asked == GradCompression.NONE.value:
        return [(GradCompression.NONE.value, 0)]
    if asked == "auto":
        return [(GradCompression.NONE.value, 0), (GradCompression.BF16.value, 0),
                (GradCompression.POWERSGD.value, rank)]
    return [(asked, rank if asked == GradCompression.POWERSGD.value else 0)]


@prices("grad_compression")
def bucket_terms(p: ParamStat, kind: str, rank: int, mesh: MeshSpec) -> tuple[float, float]:
    """``(wire, work)`` of ``p``'s gradient under ``kind``: the bytes it puts on the link
    and the seconds of compression compute it adds to its bucket."""
    if kind == GradCompression.BF16.value:
        elem = p.bytes / p.numel if p.numel else 4.0
        wire = p.bytes * min(1.0, 2.0 / elem)
        return wire, compute_time(mesh, 0.0, BF16_MOVED * p.bytes)
    if kind == GradCompression.POWERSGD.value:
        nmr = low_rank(p.shape, rank)
        if nmr is None:
            return p.bytes, compute_time(mesh, 0.0, POWERSGD_WHOLE_MOVED * p.bytes)
        n, m, r = nmr
        elem = p.bytes / (n * m)
        return (n + m) * r * elem, compute_time(mesh, 6.0 * n * m * r, POWERSGD_MOVED * p.bytes)
    return p.bytes, 0.0


def persistent_bytes(kind: str, reduced: float) -> float:
    """Bytes compression holds for the whole run beside ``reduced`` bytes of gradients
    in data-parallel buckets: PowerSGD's error feedback, one copy of them."""
    return reduced if kind == GradCompression.POWERSGD.value else 0.0


__all__ = ["BF16_MOVED", "LATENCIES", "POWERSGD_MOVED", "POWERSGD_WHOLE_MOVED", "bucket_terms", "kinds",
           "persistent_bytes"]
