"""The KV oracle: did a read made for a request see *that request's* KV, in any order?

The race verdict (``sim.verdicts``) compares a read with the same schedule run in
happens-before order, so it sees races and only races: a copy that moves the wrong bytes in
every order (a wrong page stride, a pool that is never backed up, a token routine with the
wrong constants) gives the same wrong bytes in both runs and passes.  The oracle checks the
meaning instead.  A KV entry's content is a pure function of the tokens up to it, so:

* when the forward stores request ``R``'s KV (``record_store``), every unit (page row, or
  token row) it writes gets a **content key**: the token prefix its entries were computed from
  (for a page, up to the last entry the request completed in it), filed under the **store**
  that wrote it (the engine's number of that batch's store, which its write ops carry as
  their ``version``) and the unit;
* when a read made for ``R`` sees an entry (``check_read``), the provenance of the entry's
  first byte of each field (which write's bytes, which unit, where in the unit) must be a unit
  of the same buffer kind and pool layer, at the same place in the unit, whose content key
  (looked up by the origin's ``version`` = store and the unit) is the key ``R``'s own tokens
  give for that entry.

NOTE: the key is the store, not the write's ``owner``: the engine stores a whole batch's new
KV with one write per layer and pool (SGLang's ``set_kv_buffer``), whose single ``owner`` is
only the batch's first request; the engine's own bookkeeping (``record_store`` per request)
says which request's tokens each unit of that write holds.  Store numbers are unique per
engine run, so stale bytes of an earlier store never pass for a later one's.

A content key is ``(session, n)`` for a token prefix of length ``n`` (``(-1, n)`` when the
prefix lies inside the system prompt every session shares), so turns of one session and
sessions sharing the system prompt share content as the radix cache does; a workload whose
tokens are not a :class:`~sim.engine.workload.TokenSource` is keyed by a hash of its ids.
Sampling the first byte of each field per entry catches every whole-entry error (stale,
foreign, misplaced, never written); a tear inside an entry is the race verdict's to report.
"""
from __future__ import annotations

import hashlib
from typing import Mapping

import numpy as np

from sim.engine.workload import TokenSource, tokens
from sim.pools.layouts import PagedLayout

__all__ = ["KVOracle", "content_key"]


def content_key(req, n: int) -> tuple:
    """The content key of the first ``n`` tokens of request ``req``'s sequence."""
    src = req.source
    if isinstance(src, TokenSource):
        return (-1, n) if n <= src.system_prompt_tokens else (req.session, n)
    return ("h", hashlib.blake2b(tokens(req)[:n].tobytes(), digest_size=12).hexdigest())


class KVOracle:
    """Content keys of stored units, and the check of reads against them (module doc).

    ``buffers``: pool role -> (device buffer, layout); ``kinds``: buffer -> its schedule kind;
    ``ratios``: pool role -> raw tokens per entry."""

    #: (store, unit, key) triples are packed into one int64 below this product of their ranges
    PACK_LIMIT = 1 << 62
    #: sampled bytes checked at once (see check_reads)
    CHUNK_SAMPLES = 1 << 18

    def __init__(self, buffers: Mapping[str, tuple], kinds: Mapping[str, str], ratios: Mapping[str, int]):
        self.buffers = dict(buffers)
        self.kinds = dict(kinds)
        self.ratios = dict(ratios)
        self.content: dict[tuple, int] = {}          # (kind, store, unit) -> content key id
        self._ids: dict[tuple, int] = {}             # content key -> id
        self.entries_checked = 0
        self._table = None                           # the origin table _fields mirrors
        self._fields = tuple(np.zeros(0, np.int64) for _ in range(5))   # owner, layer, unit bytes, kind, version
        self._kinds: dict[str, int] = {}

    def _kind_code(self, kind: str) -> int:
        return self._kinds.setdefault(kind, len(self._kinds))

    def _origin_fields(self, table) -> tuple:
        """Per origin id of ``table`` (the run's ``OriginTable``): owner, layer, unit bytes,
        a code of its kind and its version (the store that wrote it), as arrays (extended as the table grows: origins are
        immutable and their ids dense)."""
        if table is not self._table:
            self._table, self._fields = table, tuple(np.zeros(0, np.int64) for _ in range(5))
        have = len(self._fields[0])
        n = len(table) if table is not None else 0
        if n > have:
            new = [table[i] for i in range(have, n)]
            add = (np.array([o.owner for o in new], np.int64), np.array([o.layer for o in new], np.int64),
                   np.array([o.unit_bytes for o in new], np.int64),
                   np.array([self._kind_code(o.kind) for o in new], np.int64),
                   np.array([o.version for o in new], np.int64))
            self._fields = tuple(np.concatenate([f, x]) for f, x in zip(self._fields, add))
        return self._fields

    def _page_tokens(self, role: str) -> int:
        return self.buffers[role][1].entries_per_unit * self.ratios[role]

    def record_store(self, req, store: int, entries: Mapping[str, np.ndarray], positions: Mapping[str, np.ndarray]):
        """Store ``store`` (the ``version`` of its write ops, unique per run) wrote, for
        request ``req``, per role, ``entries`` (of the role's buffer) completed at token
        ``positions`` of ``req``'s sequence: each unit written gets the key of the prefix up
        to the last entry completed in it.  Requests of one batch share a store; where two
        of them write one unit, the later call's key stands (the later request's bytes)."""
        for role, ent in entries.items():
            if not len(ent):
                continue
            name, lay = self.buffers[role]
            kind = self.kinds[name]
            units = np.asarray(ent, np.int64) // lay.entries_per_unit
            pos = np.asarray(positions[role], np.int64)
            for u in np.unique(units).tolist():
                last = int(pos[units == u].max())
                self.content[(kind, store, u)] = self._key_id(content_key(req, last + 1))

    def _key_id(self, key: tuple) -> int:
        return self._ids.setdefault(key, len(self._ids))

    def expected(self, req, role: str, position: np.ndarray, n_ctx: int) -> np.ndarray:
        """The content key id ``req``'s tokens give the unit holding each entry completed at
        ``position`` when ``n_ctx`` tokens of it are computed."""
        r = self.ratios[role]
        span = self._page_tokens(role)
        p0 = (position // span) * span
        last = np.minimum(p0 + span - 1, n_ctx - 1)
        n = ((last + 1) // r) * r
        uniq, inv = np.unique(n, return_inverse=True)
        ids = np.array([self._key_id(content_key(req, int(x))) for x in uniq.tolist()], np.int64)
        return ids[inv]

    def check_read(self, info, obs_read, req, n_ctx: int) -> np.ndarray:
        """For a read (``ReadInfo``) made for ``req`` (``info.entries[req.rid]``, in sequence
        order, ``n_ctx`` tokens computed) and its observed views: a bool per entry, True where
        some pool layer's entry holds bytes that are not ``req``'s KV."""
        return self.check_reads(info, obs_read, {req.rid: (req, n_ctx)})[req.rid]

    def check_reads(self, info, obs_read, made_for: Mapping[int, tuple], contents=None) -> dict[int, np.ndarray]:
        """:meth:`check_read` for every request ``rid -> (req, n_ctx)`` of ``made_for`` that
        the read has entries for, in groups of requests of about :attr:`CHUNK_SAMPLES` sampled
        bytes (the views are looked up once per group): ``{rid: bool per entry}``.
        ``contents``: the read's buffer (a ``CompactBuffer``) holding, at the read's offsets,
        exactly what its views saw (the buffer at the instant of the read, when no copy into it
        was in flight); looked up once per group instead of per view."""
        _, lay = self.buffers[info.role]
        per_entry = len(lay.effective_fields) * len(info.pool_layers)
        out: dict[int, np.ndarray] = {}
        group, n = {}, 0
        # NOTE: in groups, so the temporary arrays (about ten int64 per sampled byte) stay
        # bounded whatever the batch's size and contexts
        for rid, item in made_for.items():
            if rid not in info.entries:
                continue
            group[rid] = item
            n += len(info.entries[rid]) * per_entry
            if n >= self.CHUNK_SAMPLES:
                out.update(self._check_group(info, obs_read, group, contents))
                group, n = {}, 0
        if group:
            out.update(self._check_group(info, obs_read, group, contents))
        return out

    def _check_group(self, info, obs_read, made_for: Mapping[int, tuple], contents) -> dict[int, np.ndarray]:
        name, lay = self.buffers[info.role]
        kind = self.kinds[name]
        r = self.ratios[info.role]
        nf = len(lay.effective_fields)
        out: dict[int, np.ndarray] = {}
        rids, sizes = [], []
        offs, in_unit, entry, pls, want = [], [], [], [], []
        base = 0
        for rid, (req, n_ctx) in made_for.items():
            if rid not in info.entries:
                continue
            ent = np.asarray(info.entries[rid], np.int64)
            if not len(ent):
                out[rid] = np.zeros(0, bool)
                continue
            w = self.expected(req, info.role, np.arange(len(ent), dtype=np.int64) * r + (r - 1), n_ctx)
            unit_dest = ent // lay.entries_per_unit
            e = np.repeat(np.arange(len(ent)), nf)
            if isinstance(lay, PagedLayout):
                # NOTE: a paged layout's pool layer k is layer 0 shifted by k layer sizes, and an
                # entry's place in its unit does not depend on the layer: every pool layer's
                # samples at once (the same values, in the same layer-major order, as the loop)
                o, _ = lay.token_extents(0, ent)                     # (entries, fields)
                layers = np.asarray(info.pool_layers, np.int64)
                o0, iu = o.ravel(), (o - lay.unit_offsets(0, unit_dest)[:, None]).ravel()
                offs.append((layers[:, None] * np.int64(lay.layer_bytes) + o0[None, :]).ravel())
                in_unit.append(np.tile(iu, len(layers)))
                entry.append(np.tile(base + e, len(layers)))
                want.append(np.tile(w[e], len(layers)))
                pls.append(np.repeat(layers, o0.size))
            else:
                for pl in info.pool_layers:
                    o, _ = lay.token_extents(pl, ent)                    # (entries, fields)
                    offs.append(o.ravel())
                    in_unit.append((o - lay.unit_offsets(pl, unit_dest)[:, None]).ravel())
                    entry.append(base + e)
                    want.append(w[e])
                    pls.append(np.full(o.size, pl, np.int64))
            rids.append(rid)
            sizes.append(len(ent))
            base += len(ent)
            self.entries_checked += len(ent) * len(info.pool_layers)
        if not rids:
            return out
        offs, in_unit, entry, pls, want = (np.concatenate(x) for x in (offs, in_unit, entry, pls, want))
        if contents is not None:
            lo, hi = int(offs.min()), int(offs.max()) + 1
            p = contents.pieces(lo, hi - lo)
            i = np.searchsorted(p.start, offs, side="right") - 1
            oid = np.asarray(p.origin_id)[i]
            so = np.asarray(p.stream_offset)[i] + offs - np.asarray(p.start)[i]
            return self._verdict(kind, contents.table, offs, oid, so, in_unit, entry, pls, want, base, rids,
                               sizes, out)
        views = sorted(obs_read.views, key=lambda v: v.offset)
        v_off = np.array([v.offset for v in views], np.int64)
        # NOTE: the sampled offsets grouped by the view holding them (one sort), each view's
        # pieces looked up once for every request of the read, and the origins' fields read
        # from per-table arrays: per-view boolean masks per request were O(views x offsets)
        k = np.searchsorted(v_off, offs, side="right") - 1
        order = np.argsort(k, kind="stable")
        ks = k[order]
        cuts = np.flatnonzero(np.diff(ks)) + 1
        oid = np.empty(offs.size, np.int64)
        so = np.empty(offs.size, np.int64)
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, ks.size].tolist()):
            kk = int(ks[a])
            idx = order[a:b]
            v = views[kk]
            p = v.compact.pieces(0, v.compact.nbytes)
            rel = offs[idx] - v_off[kk]
            i = np.searchsorted(p.start, rel, side="right") - 1
            oid[idx] = np.asarray(p.origin_id)[i]
            so[idx] = np.asarray(p.stream_offset)[i] + rel - np.asarray(p.start)[i]
        return self._verdict(kind, views[0].compact.table, offs, oid, so, in_unit, entry, pls, want, base, rids,
                           sizes, out)

    def _verdict(self, kind, table, offs, oid, so, in_unit, entry, pls, want, base, rids, sizes, out) -> dict:
        """The check of every sampled offset, from the origin id and stream offset of its byte."""
        og_owner, og_layer, og_ub, og_kind, og_version = self._origin_fields(table)
        owner, layer, ub = og_owner[oid], og_layer[oid], og_ub[oid]
        okind = og_kind[oid] == self._kind_code(kind)
        u_src, b_src = np.divmod(so, ub)
        ok = (owner >= 0) & okind & (layer == pls) & (b_src == in_unit)
        # the content of each distinct (store, source unit, expected key) once; the triple is
        # packed into one int64 when it fits, so the dedup is a 1-D sort (the row-wise unique
        # of the triples is several times slower)
        o, u, k = og_version[oid][ok], u_src[ok], want[ok]
        if o.size:
            n_u, n_k = int(u.max()) + 1, int(k.max()) + 1
            if (int(o.max()) + 1) * n_u * n_k < self.PACK_LIMIT:
                # NOTE: neighbouring samples mostly share their triple (the entries and fields of
                # one unit, in order), so runs of equal values are cut first (O(n)) and only the
                # runs are sorted
                packed = (o * n_u + u) * n_k + k
                new_run = np.empty(packed.size, bool)
                new_run[0] = True
                np.not_equal(packed[1:], packed[:-1], out=new_run[1:])
                uniq, inv_run = np.unique(packed[new_run], return_inverse=True)
                inv = inv_run[np.cumsum(new_run) - 1]
                uo, rest = np.divmod(uniq, n_u * n_k)
                triples = zip(uo.tolist(), *(x.tolist() for x in np.divmod(rest, n_k)))
            else:
                uniq, inv = np.unique(np.stack([o, u, k], axis=1), axis=0, return_inverse=True)
                triples = uniq.tolist()
            good = np.array([self.content.get((kind, a, b)) == c for a, b, c in triples], bool)
            ok[np.flatnonzero(ok)] = good[inv.ravel()]
        bad = np.zeros(base, bool)
        bad[entry[~ok]] = True
        for rid, a, n in zip(rids, np.cumsum([0] + sizes[:-1]).tolist(), sizes):
            out[rid] = bad[a:a + n]
        return out
