"""TP ranks in lockstep: one scheduler host issuing every op on each simulated rank.

SGLang runs one scheduler process per TP rank.  The ranks of a prefill group make the same
decisions (one radix tree, one allocator state: the ranks' trees stay identical because every
acknowledgement is agreed over the group with an ``all_reduce`` MIN in ``writing_check`` /
``loading_check``), so the slot indices are the same on every rank, while each rank has its own
GPU: its own device pool, host pool, streams, CUDA events and PCIe link.

The model keeps ONE scheduler host and ONE decision per iteration and issues each stream op
once per rank (:class:`RankedHost`).  Rank 0's names are the run's plain names (a session of
one rank is exactly the single-rank session); rank ``r >= 1`` gets every buffer, stream, event
and op id suffixed ``@r`` (:func:`rank_name`): ``kv_buffer@1``, ``load@1``,
``hicache.load0.L3@1``.  Its streams and device buffers sit on device ``r`` of the run, so the
executor's link key ``device // gpus_per_link`` gives each rank its own link unless the profile
says GPUs share one (:func:`rank_header`).

Host calls: ``query(event)`` queries the event on every rank (each rank's scheduler queries
its own) and is True only when all are complete; ``sync_steps(event=..., stream=...)`` yields
one ``host_sync`` per rank, rank by rank (each issued after the previous returned, as the
static re-run of the recorded schedule issues them), so a blocking call returns when every
rank's target has completed.
"""
from __future__ import annotations

from sim.errors import InputError, show

__all__ = ["RANK_SEP", "RankedHost", "rank_header", "rank_name"]

#: separator of a rank suffix (``kv_buffer@1``)
RANK_SEP = "@"
#: op keys that name a buffer, stream or event (renamed per rank), and the op id
_RENAMED = ("stream", "buffer", "src", "dst", "event", "id")


def rank_name(name: str, rank: int) -> str:
    """``name`` on ``rank``: itself on rank 0, ``name@rank`` on the others."""
    return name if rank == 0 else f"{name}{RANK_SEP}{rank}"


def rank_header(header: dict, ranks: int) -> dict:
    """``header`` (a schedule header of rank 0: buffers, plain stream names, events) with
    ``ranks - 1`` copies of every buffer, stream and event, renamed for ranks ``1..ranks-1``;
    a copy's device buffers and streams sit on device ``r`` (host buffers keep their entry:
    a host buffer's device field plays no part in the link model)."""
    if ranks == 1:
        return header
    buffers = list(header["buffers"])
    streams = [s if isinstance(s, dict) else {"name": s, "device": 0} for s in header["streams"]]
    events = list(header["events"])
    for r in range(1, ranks):
        for b in header["buffers"]:
            c = {**b, "name": rank_name(b["name"], r)}
            if c.get("location") == "device":
                c["device"] = r
            buffers.append(c)
        streams += [{**s, "name": rank_name(s["name"], r), "device": r} for s in streams[:len(header["streams"])]]
        events += [rank_name(e, r) for e in header["events"]]
    return {**header, "buffers": buffers, "streams": streams, "events": events}


class RankedHost:
    """The scheduler's host of a TP group of ``ranks`` simulated ranks (module doc), over the
    run's :class:`sim.executor.Host` ``base``.

    ``issue(op, ranks=None)`` issues ``op`` on each rank (default all, in rank order; rank
    ``r``'s copy with every buffer, stream, event and id renamed by :func:`rank_name`) and
    returns rank 0's op id (or the first rank's issued).  ``query(event)``: every rank queried,
    True when all report complete.  ``synchronize`` with an event or stream is one rank's call:
    use :meth:`sync_steps`; a device synchronize (no argument) covers every rank at once.
    Everything else (``now``, ``profile``, ``unfinished``, ``delay``, ``name``) is the base
    host's."""

    def __init__(self, base, ranks: int = 1):
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise InputError("ranks", f"expected an integer >= 1, got {show(ranks)}")
        self.base = base
        self.ranks = ranks
        self.name = base.name
        self._ex = base._ex

    @property
    def now(self) -> float:
        return self.base.now

    @property
    def profile(self):
        return self.base.profile

    def unfinished(self) -> list:
        return self.base.unfinished()

    def delay(self, duration_us: float):
        return self.base.delay(duration_us)

    def names(self, name: str) -> list[str]:
        """``name`` on every rank, rank 0 first."""
        return [rank_name(name, r) for r in range(self.ranks)]

    @staticmethod
    def op_for(op: dict, rank: int) -> dict:
        """Rank ``rank``'s copy of ``op`` (``op`` itself on rank 0)."""
        if rank == 0:
            return op
        return {k: (rank_name(v, rank) if k in _RENAMED and isinstance(v, str) else v) for k, v in op.items()}

    def _ranks(self, ranks) -> range | list:
        if ranks is None:
            return range(self.ranks)
        ranks = list(ranks)
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.ranks)]
        if bad or not ranks:
            raise InputError("ranks", f"expected ranks in 0..{self.ranks - 1}, got {show(ranks)}")
        return ranks

    def issue(self, op: dict, *, ranks=None) -> str:
        ids = [self.base.issue(self.op_for(op, r)) for r in self._ranks(ranks)]
        return ids[0]

    def query(self, event: str, *, rank: int | None = None) -> bool:
        """``rank`` None: every rank's ``event`` queried (each rank polls its own), True when all
        are complete; else that rank's only."""
        if rank is not None:
            return self.base.query(rank_name(event, self._ranks([rank])[0]))
        outcomes = [self.base.query(n) for n in self.names(event)]
        return all(outcomes)

    def synchronize(self, *, event: str | None = None, stream: str | None = None):
        if self.ranks > 1 and (event is not None or stream is not None):
            raise InputError("synchronize", "an event or stream synchronize of several ranks is one host_sync per "
                             "rank: use sync_steps()")
        return self.base.synchronize(event=event, stream=stream)

    def sync_steps(self, *, event: str | None = None, stream: str | None = None):
        """Generator: each rank's ``host_sync`` of ``event`` / ``stream`` in rank order, each
        issued once the previous one has been waited for (yield each, as a host program
        does); neither given: one device synchronize."""
        if event is None and stream is None:
            yield self.base.synchronize()
            return
        for r in range(self.ranks):
            yield self.base.synchronize(event=None if event is None else rank_name(event, r),
                                        stream=None if stream is None else rank_name(stream, r))
