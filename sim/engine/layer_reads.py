"""A forward's per-layer reads judged by the KV oracle together (issue 9's speed).

A per-layer forward (one that waits on a load-back's layer events, or the overlap loop's)
reads each pool role once per layer: 43 reads of one role in DeepSeek V4, each judged by
:meth:`sim.engine.oracle.KVOracle.check_reads` when the run captures it, about 170 us a call
of which most is the call's fixed cost.  :class:`LayerReads` keeps the reads the race verdict
found ``ok`` that saw their buffer as it stands (no copy item mid-flight in their bytes), each
with a snapshot of the buffer at its capture (``CompactBuffer.clone``: O(blocks)), and judges
those of one rank and role in one call, each pool layer against its own read's snapshot
(:class:`~sim.engine.oracle.LayerContents`, ``by_layer=True``: a row per read).

Why each read gets the verdict it would get when captured:

* the check is a pure function of the read's bytes (its snapshot), its entries and the
  expected keys (content keys are filed per store and never change; ``made_for`` is the
  forward's), and of what the oracle remembers of each (pool layer, page) pair;
* the pairs a read looks at are its own pool layer's, and no two reads kept at once share a
  pool layer of one buffer (a second one flushes the first), so judging them together or one
  after another reads and updates the same remembered pairs the same way;
* what the oracle remembers changes otherwise only when the run's memory is written
  (``KVOracle.written``): :meth:`written` is told first and flushes when a write touches a
  pool layer a kept read covers, so every read is judged before anything forgets its pairs,
  as it would have been at its capture;
* the tally (``PrefillEngine._tally``) is applied read by read in capture order, and every
  other read is judged only after the kept ones (:meth:`flush`), so the corrupted reads are
  listed in the same order.

Which requests' pairs share a call of ``_check_group`` (groups of about ``CHUNK_SAMPLES``
sampled bytes) differs, so the oracle's sampling counters (``entries_sampled``,
``pairs_one_piece``) may differ; the verdicts cannot (each equals the full check's:
``tests/test_oracle_incremental.py``), and neither can ``entries_checked``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import numpy as np

from sim.engine.oracle import KVOracle, LayerContents

__all__ = ["LayerReads"]


class _Kept(NamedTuple):
    op_id: str
    info: object            # the read's ReadInfo (one pool layer)
    consumer: int
    rank: int
    snapshot: object        # the buffer as the read saw it (a CompactBuffer)


class LayerReads:
    """The ``ok`` per-layer reads of the forward being judged, kept for one oracle call per
    rank and role (module doc).  ``oracles[rank]`` judges rank ``rank``'s reads;
    ``layer_bytes[buffer]`` is each watched buffer's layer size; ``tally(op_id, status,
    info, consumer, rank, rids, kv_wrong, topk)`` applies one read's verdict."""

    def __init__(self, oracles: Sequence[KVOracle], layer_bytes: dict[str, int], tally: Callable):
        self.oracles = list(oracles)
        self.layer_bytes = dict(layer_bytes)
        self.tally = tally
        self._kept: list[_Kept] = []
        self._made_for = None
        self._layers: dict[str, set] = {}       # buffer -> pool layers of the reads kept
        self._entries: dict[tuple, object] = {}  # (rank, role) -> the entries its reads were made of
        self.calls = 0                          # oracle calls made by flush (tests and benchmarks count them)

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, op_id: str, rec: tuple, contents) -> bool:
        """Keep read ``op_id`` (``rec``: the engine's ``(ReadInfo, consumer, made_for, rank)``;
        ``contents``: its buffer as it saw it) to judge later; False (nothing kept, nothing
        flushed) when it is not a one-layer read of a role the oracle checks incrementally."""
        info, consumer, made_for, rank = rec
        if info.layer < 0 or len(info.pool_layers) != 1 or not self.oracles[rank].can_merge(info.role):
            return False
        pl = info.pool_layers[0]
        seen = self._layers.get(info.buffer)
        ent = self._entries.get((rank, info.role))
        if self._kept and (made_for is not self._made_for or (seen is not None and pl in seen)
                           or (ent is not None and ent is not info.entries)):
            self.flush()                        # another forward, this pool layer read again, other entries
            seen = None
        self._made_for = made_for
        self._entries[(rank, info.role)] = info.entries
        if seen is None:
            seen = self._layers.setdefault(info.buffer, set())
        seen.add(pl)
        self._kept.append(_Kept(op_id, info, consumer, rank, contents.clone()))
        return True

    def written(self, buffer: str, offsets, lengths) -> None:
        """The run's memory was written at ``[offsets, offsets + lengths)`` of ``buffer``
        (before the oracle forgets those pages): flush if that touches a pool layer of a read
        kept."""
        seen = self._layers.get(buffer)
        if not seen:
            return
        lb = self.layer_bytes[buffer]
        o = np.asarray(offsets, np.int64).ravel()
        n = np.asarray(lengths, np.int64).ravel()
        m = n > 0
        if not m.any():
            return
        lo, hi = int(o[m].min()) // lb, (int((o[m] + n[m]).max()) - 1) // lb
        if any(lo <= pl <= hi for pl in seen):
            self.flush()

    def flush(self) -> None:
        """Judge every read kept (one oracle call per rank and role), then apply each read's
        verdict in capture order."""
        kept = self._kept
        if not kept:
            return
        self._kept, self._layers, self._entries = [], {}, {}
        made_for, self._made_for = self._made_for, None
        groups: dict[tuple, list[int]] = {}
        for i, k in enumerate(kept):
            groups.setdefault((k.rank, k.info.role), []).append(i)
        wrong: list = [None] * len(kept)
        for (rank, _), idx in groups.items():
            oracle = self.oracles[rank]
            self.calls += 1
            if len(idx) == 1:
                k = kept[idx[0]]
                got = oracle.check_reads(k.info, None, made_for, k.snapshot)
                wrong[idx[0]] = {rid for rid, bad in got.items() if bad.any()}
                continue
            first = kept[idx[0]].info
            layers = tuple(kept[i].info.pool_layers[0] for i in idx)
            merged = dataclasses.replace(first, op_id=f"{first.op_id}+{len(idx) - 1}", layer=-1, pool_layers=layers)
            got = oracle.check_reads(merged, None, made_for,
                                     LayerContents({kept[i].info.pool_layers[0]: kept[i].snapshot for i in idx}),
                                     by_layer=True)
            for j, i in enumerate(idx):
                wrong[i] = {rid for rid, bad in got.items() if bad[j].any()}
        for k, kv_wrong in zip(kept, wrong):
            self.tally(k.op_id, "ok", k.info, k.consumer, k.rank, set(), kv_wrong, None)
