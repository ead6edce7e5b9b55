"""The KV oracle: did a read made for a request see *that request's* KV, in any order?

The race verdict (``sim.verdicts``) compares a read with the same schedule run in
happens-before order, so it sees races and only races: a copy that moves the wrong bytes in
every order (a wrong page stride, a pool that is never backed up, a token routine with the
wrong constants) gives the same wrong bytes in both runs and passes.  The oracle checks the
meaning instead.  A KV entry's content is a pure function of the tokens up to it, so:

* when the forward stores request ``R``'s KV (``record_store``), every unit (page row, or
  token row) it writes gets a **content key**: the token prefix its entries were computed from
  (for a page, up to the last entry the request completed in it);
* when a read made for ``R`` sees an entry (``check_read``), the provenance of the entry's
  first byte of each field (whose bytes, which unit, where in the unit) must be a unit of the
  same buffer kind and pool layer, at the same place in the unit, whose content key is the
  key ``R``'s own tokens give for that entry.

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

    #: (owner, unit, key) triples are packed into one int64 below this product of their ranges
    PACK_LIMIT = 1 << 62

    def __init__(self, buffers: Mapping[str, tuple], kinds: Mapping[str, str], ratios: Mapping[str, int]):
        self.buffers = dict(buffers)
        self.kinds = dict(kinds)
        self.ratios = dict(ratios)
        self.content: dict[tuple, int] = {}          # (kind, owner, unit) -> content key id
        self._ids: dict[tuple, int] = {}             # content key -> id
        self.entries_checked = 0

    def _page_tokens(self, role: str) -> int:
        return self.buffers[role][1].entries_per_unit * self.ratios[role]

    def record_store(self, req, owner: int, entries: Mapping[str, np.ndarray], positions: Mapping[str, np.ndarray]):
        """``owner`` stored, per role, ``entries`` (of the role's buffer) completed at token
        ``positions`` of ``req``'s sequence: each unit written gets the key of the prefix up
        to the last entry completed in it."""
        for role, ent in entries.items():
            if not len(ent):
                continue
            name, lay = self.buffers[role]
            kind = self.kinds[name]
            units = np.asarray(ent, np.int64) // lay.entries_per_unit
            pos = np.asarray(positions[role], np.int64)
            for u in np.unique(units).tolist():
                last = int(pos[units == u].max())
                self.content[(kind, owner, u)] = self._key_id(content_key(req, last + 1))

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
        ent = np.asarray(info.entries[req.rid], np.int64)
        if not len(ent):
            return np.zeros(0, bool)
        name, lay = self.buffers[info.role]
        kind = self.kinds[name]
        r = self.ratios[info.role]
        want = self.expected(req, info.role, np.arange(len(ent), dtype=np.int64) * r + (r - 1), n_ctx)
        views = sorted(obs_read.views, key=lambda v: v.offset)
        v_off = np.array([v.offset for v in views], np.int64)
        unit_dest = ent // lay.entries_per_unit
        nf = len(lay.effective_fields)
        offs, in_unit, entry, pls = [], [], [], []
        for pl in info.pool_layers:
            o, _ = lay.token_extents(pl, ent)                    # (entries, fields)
            offs.append(o.ravel())
            in_unit.append((o - lay.unit_offsets(pl, unit_dest)[:, None]).ravel())
            entry.append(np.repeat(np.arange(len(ent)), nf))
            pls.append(np.full(o.size, pl, np.int64))
        offs, in_unit, entry, pls = (np.concatenate(x) for x in (offs, in_unit, entry, pls))
        k = np.searchsorted(v_off, offs, side="right") - 1
        owner = np.full(offs.size, -1, np.int64)
        okind = np.zeros(offs.size, bool)
        layer = np.full(offs.size, -1, np.int64)
        u_src = np.zeros(offs.size, np.int64)
        b_src = np.full(offs.size, -1, np.int64)
        for kk in np.unique(k).tolist():
            m = k == kk
            v = views[kk]
            p = v.compact.pieces(0, v.compact.nbytes)
            rel = offs[m] - v_off[kk]
            i = np.searchsorted(p.start, rel, side="right") - 1
            oid = np.asarray(p.origin_id)[i]
            so = np.asarray(p.stream_offset)[i] + rel - np.asarray(p.start)[i]
            ow, ki, la, ub = (np.empty(len(i), np.int64) for _ in range(4))
            kb = np.empty(len(i), bool)
            for x in np.unique(oid).tolist():
                og = v.compact.table[int(x)]
                sel = oid == x
                ow[sel], la[sel], ub[sel], kb[sel] = og.owner, og.layer, og.unit_bytes, og.kind == kind
            owner[m], layer[m], okind[m] = ow, la, kb
            u_src[m], b_src[m] = np.divmod(so, ub)
        ok = (owner >= 0) & okind & (layer == pls) & (b_src == in_unit)
        # the content of each distinct (owner, source unit, expected key) once; the triple is
        # packed into one int64 when it fits, so the dedup is a 1-D sort (the row-wise unique
        # of the triples is several times slower)
        w = want[entry]
        o, u, k = owner[ok], u_src[ok], w[ok]
        if o.size:
            n_u, n_k = int(u.max()) + 1, int(k.max()) + 1
            if (int(o.max()) + 1) * n_u * n_k < self.PACK_LIMIT:
                uniq, inv = np.unique((o * n_u + u) * n_k + k, return_inverse=True)
                uo, rest = np.divmod(uniq, n_u * n_k)
                triples = zip(uo.tolist(), *(x.tolist() for x in np.divmod(rest, n_k)))
            else:
                uniq, inv = np.unique(np.stack([o, u, k], axis=1), axis=0, return_inverse=True)
                triples = uniq.tolist()
            good = np.array([self.content.get((kind, a, b)) == c for a, b, c in triples], bool)
            ok[np.flatnonzero(ok)] = good[inv.ravel()]
        bad = np.zeros(len(ent), bool)
        np.logical_or.at(bad, entry, ~ok)
        self.entries_checked += len(ent) * len(info.pool_layers)
        return bad
