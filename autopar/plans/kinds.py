"""The values plan-level decisions take (:mod:`autopar.plans.decisions` declares the
decisions themselves)."""

from __future__ import annotations

from enum import StrEnum

import torch


class Schedule(StrEnum):
    """How micro-batches flow through pipeline stages."""

    NONE = "none"
    """No pipeline (one stage); micro-batches, if any, are gradient accumulation."""
    GPIPE = "gpipe"
    """All forwards, then all backwards: every stage holds all micro-batches' activations."""
    ONE_F_ONE_B = "1f1b"
    """Warm-up forwards, then one forward / one backward: stage ``s`` of ``p`` holds at
    most ``p - s`` micro-batches' activations."""
    ZERO_BUBBLE = "zero-bubble"
    """1F1B with each backward split into ``B`` (input gradients, sent on at once) and
    ``W`` (weight gradients, deferred into what would be bubbles; ZB-H1 of Qi et al.,
    2023): a third of 1F1B's bubble, at up to ``2p - 1`` micro-batches in flight on the
    first stage (a micro-batch's activations live until its ``W``)."""
    INTERLEAVED = "interleaved-1f1b"
    """1F1B over ``v`` model chunks per rank (Megatron's virtual stages): rank ``s`` runs
    virtual stages ``s, s + p, .., s + (v - 1) p``, which divides the fill and drain by
    ``v`` at the price of ``v`` times the point-to-point messages and more micro-batches
    in flight (:mod:`autopar.plans.schedules`)."""


class Precision(StrEnum):
    """How the planned module computes: the model's own dtypes, or bf16 / fp16 mixed
    precision (fp16 needs loss scaling: ``ParallelModule.grad_scaler()``)."""

    NATIVE = "native"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"

    @property
    def low(self) -> torch.dtype | None:
        """The dtype low-precision ops compute in (None for :attr:`NATIVE`)."""
        return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(self.value)

    @classmethod
    def parse(cls, value: str | Precision | None) -> Precision:
        """``None`` is :attr:`NATIVE`; anything other than a known name is a ValueError."""
        if value is None:
            return cls.NATIVE
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"unknown precision {value!r}; known: {known}") from None


class ContextParallel(StrEnum):
    """``context_parallel=``: which sequence split attention may use (default: searched).

    ``off``: attention never splits the sequence; ``gather-kv``: only query rows split,
    keys and values gathered; ``exchange``: q, k and v split and exchanged inside the op
    (Ulysses where the heads divide, ring attention otherwise)."""

    OFF = "off"
    GATHER_KV = "gather-kv"
    EXCHANGE = "exchange"


class GradCompression(StrEnum):
    """How data-parallel gradient buckets cross the link (``grad_compression=``).  Both
    change the numbers the step computes, so the search weighs them only when the user
    passes ``"auto"``."""

    NONE = "none"
    """Sent as they are (fp32 under mixed precision)."""
    BF16 = "bf16"
    """Sent in bf16 and summed in fp32: each rank's bucket is cast to bf16 and
    exchanged (all-to-all), every rank sums its chunk of the bucket in fp32, and the
    sums are gathered back in bf16 (:mod:`autopar.runtime.compression`)."""
    POWERSGD = "powersgd"
    """Low-rank (rank ``compression_rank``) with error feedback (Vogels et al., 2019):
    torch's ``powerSGD_hook`` run on each bucket."""


GRAD_COMPRESSIONS: tuple[str, ...] = ("none", "bf16", "powersgd", "auto")
"""What ``grad_compression=`` accepts: a kind, or ``"auto"`` (the search picks one)."""
POWERSGD_RANK = 4
"""PowerSGD's rank when ``compression_rank`` is not given (the paper's default for
language models trades 1-4)."""


class Offload(StrEnum):
    """What lives in host memory between steps (``offload=``): nothing, the optimizer's
    part, or under ZeRO-3 the parameters' shards too (:mod:`autopar.search.offload`)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    """The optimizer state and the parameters and gradients it steps (this rank's part:
    its ZeRO shard, else the whole) are host copies: the optimizer steps on the host,
    the gradients go down after the backward and the updated values up before the next
    forward.  The device keeps what the graph computes with."""
    PARAMS = "params"
    """ZeRO-3 only: the parameter shards themselves live on the host (FSDP2's
    ``CPUOffloadPolicy``); each layer's gather copies its shards up first, and the
    reduce-scattered gradients go down.  The device holds gathered layers only."""


OFFLOADS: tuple[str, ...] = ("none", "optimizer", "params", "auto")
"""What ``offload=`` accepts: a level, or ``"auto"`` (the search weighs them)."""


SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
"""What ``schedule=`` accepts (:attr:`Schedule.NONE` is no pipeline, not a choice)."""
CONTEXT_PARALLEL: tuple[str, ...] = tuple(c.value for c in ContextParallel)


__all__ = ["CONTEXT_PARALLEL", "GRAD_COMPRESSIONS", "OFFLOADS", "POWERSGD_RANK", "SCHEDULES",
           "ContextParallel", "GradCompression", "Offload", "Precision", "Schedule"]
