"""Rank 0 plans for everyone: publish its plan, or its error, and wait for it, bounded.

A blocking broadcast would make every other rank wait for rank 0's whole capture and
search inside a collective: with a short process-group timeout they time out while
rank 0 is still planning, and when rank 0 fails they see only gloo's "Connection
closed by peer".  Instead rank 0 writes ``{"plan": ...}`` or ``{"error": type, message}``
under a fresh key of the process group's store, and the other ranks poll that key
with their own deadline, printing a progress line every ``report_every`` seconds.

* An error on rank 0 is raised on every rank with the same autopar type and message.
* Rank 0 dead (the store is gone) or silent past the deadline: an error naming rank 0.
* After every rank has captured and lowered the shared plan, and before the first
  collective, :func:`all_arrived` checks that every rank is there (through the store, so
  a short process-group timeout cannot cut the wait for a rank still capturing), so a
  hung rank ends the job within the timeout with its rank in the message, and a rank
  whose capture failed ends every rank with its error.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch.distributed as dist

from autopar import errors
from autopar.errors import AutoparError, RankTimeoutError

_CALLS = [0]  # every rank calls publish/wait the same number of times: a fresh key each


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def _key() -> str:
    _CALLS[0] += 1
    return f"autopar/plans/{_CALLS[0]}"


def error_payload(e: BaseException) -> dict:
    """What other ranks need to raise the same error."""
    return {"error": type(e).__name__, "message": str(e)}


def rebuild(payload: dict, what: str = "rank 0 failed while planning") -> BaseException:
    """The error another rank published: the same autopar type and message (other types
    come back as :class:`AutoparError` saying ``what`` and naming the original type)."""
    cls = getattr(errors, payload["error"], None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(payload["message"])
        except TypeError:
            pass
    return AutoparError(f"{what}: {payload['error']}: {payload['message']}")


def publish(payload: dict, timeout: float = 600.0) -> None:
    """Rank 0: make ``payload`` (JSON-able) available to the other ranks.  An error
    payload waits (at most ``timeout`` s) until they have read it: the store lives in
    rank 0's process, so a rank 0 that raises and exits at once could take it along (a
    plan is followed by :func:`all_arrived`, which every rank reaches after reading)."""
    store = _store()
    data = json.dumps(payload)
    if store is None:  # no store to poll: fall back to a blocking broadcast
        dist.broadcast_object_list([data], src=0)
        return
    key = _key()
    store.set(key, data)
    deadline = time.monotonic() + (timeout if "error" in payload else 0.0)
    while store.add(key + "/read", 0) < dist.get_world_size() - 1 and time.monotonic() < deadline:
        time.sleep(0.02)


def wait(timeout: float, report_every: float = 30.0) -> dict:
    """Other ranks: rank 0's payload, within ``timeout`` seconds."""
    store = _store()
    if store is None:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return json.loads(box[0])
    key = _key()
    t0 = last = time.monotonic()
    while True:
        try:
            if store.check([key]):
                payload = json.loads(store.get(key))
                store.add(key + "/read", 1)  # rank 0 may now go on (or exit)
                return payload
        except (RuntimeError, OSError, dist.DistStoreError) as e:
            raise RankTimeoutError(f"rank {dist.get_rank()}: lost rank 0 while it was planning "
                                   f"({type(e).__name__}: {str(e)[:200]}); see rank 0's error") from e
        now = time.monotonic()
        if now - t0 > timeout:
            raise RankTimeoutError(
                f"rank {dist.get_rank()}: rank 0 did not publish its plan within {timeout:g} s "
                "(rank 0 captures and searches for every rank): is rank 0 alive and calling "
                "auto_parallel with the same arguments? Raise timeout= for very large models")
        if now - last >= report_every:
            last = now
            print(f"[autopar rank {dist.get_rank()}] waiting for rank 0's plan: {now - t0:.0f} s "
                  f"of {timeout:g} s", file=sys.stderr, flush=True)
        time.sleep(0.05)


def all_arrived(timeout: float, failure: BaseException | None = None) -> None:
    """Every rank reached this point within ``timeout`` seconds, or an error naming the
    ranks that did not.  Store-based, not a collective: the process group's own timeout
    (the user's ``init_process_group(timeout=...)``, maybe seconds) does not bound the
    wait, only ``timeout`` does, so ranks still capturing and lowering after rank 0
    finished do not time out rank 0's next collective.  A rank that arrives with a
    ``failure`` (its capture or lowering raised) makes every rank raise that error."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if failure is not None:
            raise failure
        return
    store = _store()
    if store is None:
        _monitored_barrier(timeout, failure)
        return
    key, me, world = _key() + "/arrived", dist.get_rank(), dist.get_world_size()
    store.set(f"{key}/{me}", json.dumps(error_payload(failure) if failure is not None else {}))
    if failure is not None:
        store.add(f"{key}/failed", 1)
    store.add(f"{key}/n", 1)
    t0, pause = time.monotonic(), 0.005
    while store.add(f"{key}/n", 0) < world:
        if time.monotonic() - t0 > timeout:
            missing = [r for r in range(world) if not store.check([f"{key}/{r}"])]
            raise RankTimeoutError(
                f"rank {me}: not every rank arrived within {timeout:g} s (rank"
                f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not): is "
                "it alive and calling auto_parallel with the same arguments?")
        time.sleep(pause)
        pause = min(2 * pause, 0.2)  # a thousand ranks polling rank 0's store
    if not store.add(f"{key}/failed", 0):
        return
    # some rank failed: every rank raises; the store may live in rank 0's process, so
    # rank 0 waits (bounded) until every rank has read the errors before it raises
    errors = [json.loads(store.get(f"{key}/{r}")) for r in range(world)]
    store.add(f"{key}/read", 1)
    deadline = time.monotonic() + timeout
    while me == 0 and store.add(f"{key}/read", 0) < world and time.monotonic() < deadline:
        time.sleep(0.02)
    if failure is not None:
        raise failure
    r = next(r for r, payload in enumerate(errors) if payload)
    raise rebuild({**errors[r], "message": f"rank {r}: {errors[r]['message']}"},
                  f"rank {r} failed while capturing or lowering the plan")


def _monitored_barrier(timeout: float, failure: BaseException | None) -> None:
    """:func:`all_arrived` without a store to poll (gloo's barrier names the ranks that
    did not arrive; other backends rely on their own collective timeout)."""
    if failure is not None:
        raise failure
    if dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as e:
        raise RankTimeoutError(f"rank {dist.get_rank()}: not every rank arrived within {timeout:g} s "
                               f"({str(e).splitlines()[0][:300]})") from e


__all__ = ["all_arrived", "error_payload", "publish", "rebuild", "wait"]
