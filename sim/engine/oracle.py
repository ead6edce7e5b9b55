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
KV with one write per pool covering its layers (SGLang's ``set_kv_buffer``: one kernel per layer
and pool), whose single ``owner`` is
only the batch's first request; the engine's own bookkeeping (``record_store`` per request)
says which request's tokens each unit of that write holds.  Store numbers are unique per
engine run, so stale bytes of an earlier store never pass for a later one's.

A content key is ``(session, n)`` for a token prefix of length ``n`` (``(-1, n)`` when the
prefix lies inside the system prompt every session shares), so turns of one session and
sessions sharing the system prompt share content as the radix cache does; a workload whose
tokens are not a :class:`~sim.engine.workload.TokenSource` is keyed by a hash of its ids.
Sampling the first byte of each field per entry catches every whole-entry error (stale,
foreign, misplaced, never written); a tear inside an entry is the race verdict's to report.

**Incremental verdicts** (``incremental=True``, the default; used where the read saw the
buffer as it stands, ``contents``: no copy item mid-flight in its bytes).  An entry's verdict
is a pure function of the provenance of its sampled bytes and of the expected key: content keys are
filed per store and never change, origins are immutable.  So the oracle remembers, per pool
layer and device unit (page row) of a paged buffer, the key its leading entries ``0..n-1``
were last judged right for (:meth:`KVOracle.judged`), and :meth:`KVOracle.written`, called for
every mutation of the run's memory (``CacheSession.watch_writes``), forgets every unit a write
or copy touched.  A read's entries of a unit whose remembered key is the one expected and
whose remembered ``n`` covers them are right without a look; only the rest are sampled.  So
a long context re-read turn after turn (and a chunked request's prefix, chunk after chunk) is
checked once per store or load-back, not once per read.  A unit is remembered only when
every sampled entry of it was right and the entries were exactly ``0..n-1`` (the request's
entries of a page, in sequence order); anything else leaves it as it was or forgets it, so a
remembered unit always states a verdict the full check gives.  ``incremental=False``, a read
that caught a copy item mid-flight in its bytes (``capture.torn``: the views, not the buffer)
and a non-paged layout take the full check (``tests/test_oracle_incremental.py`` compares the
two read by read).
"""
from __future__ import annotations

import hashlib
from typing import Mapping

import numpy as np

from sim.engine.workload import TokenSource, output_tokens, tokens
from sim.errors import InputError
from sim.pools.layouts import PagedLayout

__all__ = ["ContentKeyIds", "ContentKeys", "KVOracle", "LayerContents", "content_key"]


def content_key(req, n: int) -> tuple:
    """The content key of the first ``n`` tokens of request ``req``'s sequence (its input, then
    its output: a colocated request's decode KV)."""
    src = req.source
    if isinstance(src, TokenSource):
        return (-1, n) if n <= src.system_prompt_tokens else (req.session, n)
    ids = tokens(req) if n <= req.input_len else np.concatenate([tokens(req), output_tokens(req)])
    return ("h", hashlib.blake2b(ids[:n].tobytes(), digest_size=12).hexdigest())


class LayerContents:
    """The bytes of one paged buffer that reads of several pool layers saw, each pool layer
    as its own read saw it: ``parts[pool layer]`` is a ``CompactBuffer`` of the whole buffer
    (a snapshot taken at that read) of which only that layer's bytes are looked at.  What
    :meth:`KVOracle.check_reads` takes as ``contents`` to judge such reads in one call
    (``by_layer=True``).  The parts share one origin table (``table``)."""

    def __init__(self, parts: Mapping[int, object]):
        if not parts:
            raise InputError("parts", "expected at least one pool layer's contents")
        self.parts = dict(parts)
        tables = {id(b.table) for b in self.parts.values()}
        if len(tables) != 1:
            raise InputError("parts", f"expected contents sharing one origin table, got {len(tables)} tables")
        self.table = next(iter(self.parts.values())).table


def _pieces_at(contents, lo: np.ndarray, hi, layers):
    """For byte offsets ``lo`` of ``contents`` (a ``CompactBuffer``, or a
    :class:`LayerContents` with ``layers`` the pool layer of each offset): the origin id of
    the piece of provenance holding each, ``delta`` (a byte ``x`` of that piece has stream
    offset ``x + delta``), the piece's number, and the number of the piece holding each offset
    of ``hi`` (None: not asked), both numbered alike, so equal exactly when ``lo[i]`` and
    ``hi[i]`` lie in one piece."""
    if isinstance(contents, LayerContents):
        oid, delta, k = (np.empty(lo.size, np.int64) for _ in range(3))
        k_hi = None if hi is None else np.empty(lo.size, np.int64)
        base = 0
        for pl in np.unique(layers).tolist():
            m = np.flatnonzero(layers == pl)
            o, d, kk, kh, n = _pieces_one(contents.parts[pl], lo[m], None if hi is None else hi[m])
            oid[m], delta[m], k[m] = o, d, kk + base
            if hi is not None:
                k_hi[m] = kh + base
            base += n
        return oid, delta, k, k_hi
    return _pieces_one(contents, lo, hi)[:4]


def _pieces_one(buf, lo: np.ndarray, hi):
    """:func:`_pieces_at` over one ``CompactBuffer`` (its segment rows as the piece numbers:
    ``CompactBuffer.locate``), and a bound on those numbers."""
    if hi is None:
        row, oid, delta = buf.locate(lo)
        return oid, delta, row, None, buf.segment_count()
    n = lo.size
    row, oid, delta = buf.locate(np.concatenate([lo, hi]))
    return oid[:n], delta[:n], row[:n], row[n:], buf.segment_count()


class ContentKeyIds:
    """Dense ids of content keys (:func:`content_key`), in the order keys are first asked
    for: what :class:`KVOracle` files and compares instead of the keys.

    :meth:`id_of` gives one key's id, as ``dict.setdefault(key, len(dict))`` would;
    :meth:`ids` gives the ids of a request's prefixes of many lengths at once, the same ids
    in the same order of assignment (new keys numbered in the order of their first
    appearance in ``ns``).  A :class:`~sim.engine.workload.TokenSource` key ``(session, n)``
    (``(-1, n)`` inside the system prompt) is packed into one int64 and kept in a sorted
    array, so a whole request's keys are one ``searchsorted``; other keys (hashed token ids)
    stay in a dict.

    NOTE: a forward's check asks for the key of every page end of every request it reads
    (312 for an 80k-token context, per pool role): one dict lookup and one tuple each were
    about 6 % of a long ``incident`` run."""

    #: a packed key is ``(session + 1) << N_BITS | n``: ``n`` below 2**40, sessions below 2**22
    N_BITS = 40
    MAX_SESSION = (1 << 22) - 2

    def __init__(self):
        self._other: dict = {}                        # key that does not pack -> id
        self._keys = np.zeros(0, np.int64)            # packed keys, sorted
        self._vals = np.zeros(0, np.int64)            # their ids
        self._next = 0

    def __len__(self) -> int:
        return self._next

    def _packs(self, key) -> bool:
        return (type(key) is tuple and len(key) == 2 and all(isinstance(k, (int, np.integer)) for k in key)
                and -1 <= key[0] <= self.MAX_SESSION and 0 <= key[1] < (1 << self.N_BITS))

    def id_of(self, key) -> int:
        """The id of ``key`` (a new key gets the next id)."""
        if self._packs(key):
            return int(self._packed_ids(np.array([((int(key[0]) + 1) << self.N_BITS) | int(key[1])], np.int64))[0])
        got = self._other.get(key)
        if got is None:
            got = self._other[key] = self._next
            self._next += 1
        return got

    def ids(self, req, ns) -> np.ndarray:
        """``[id_of(content_key(req, n)) for n in ns]`` as an int64 array, the same ids."""
        ns = np.asarray(ns, np.int64)
        src = req.source
        if (isinstance(src, TokenSource) and 0 <= req.session <= self.MAX_SESSION
                and (not ns.size or (int(ns.min()) >= 0 and int(ns.max()) < (1 << self.N_BITS)))):
            group = np.where(ns <= src.system_prompt_tokens, 0, int(req.session) + 1).astype(np.int64)
            return self._packed_ids((group << self.N_BITS) | ns)
        return np.array([self.id_of(content_key(req, int(n))) for n in ns.tolist()], np.int64)

    def items(self):
        """``(key, id)`` pairs, as a dict's (tests and diagnostics)."""
        for p, i in zip(self._keys.tolist(), self._vals.tolist()):
            yield ((p >> self.N_BITS) - 1, p & ((1 << self.N_BITS) - 1)), i
        yield from self._other.items()

    def _packed_ids(self, packed: np.ndarray) -> np.ndarray:
        keys, vals = self._keys, self._vals
        i = np.searchsorted(keys, packed)
        hit = i < keys.size
        hit[hit] = keys[i[hit]] == packed[hit]
        if hit.all():
            return vals[i]
        out = np.empty(packed.size, np.int64)
        out[hit] = vals[i[hit]]
        miss = ~hit
        new, first, inv = np.unique(packed[miss], return_index=True, return_inverse=True)
        # numbered in the order of first appearance, as setdefault would
        new_ids = np.empty(new.size, np.int64)
        new_ids[np.argsort(first, kind="stable")] = np.arange(self._next, self._next + new.size, dtype=np.int64)
        self._next += new.size
        out[miss] = new_ids[inv.reshape(-1)]
        at = np.searchsorted(keys, new)
        self._keys, self._vals = np.insert(keys, at, new), np.insert(vals, at, new_ids)
        return out


class ContentKeys:
    """The content key id of each stored unit, ``(kind, store, unit) -> id``: what
    :meth:`KVOracle.record_store` files and the checks look up, many at a time.

    Per kind, one array of the packed keys ``store * 2**32 + unit``, sorted, with the ids
    beside it.  Filing merges the keys from the store's first on with the new ones (where a
    unit is filed twice, the later id stands).  The engine numbers its stores in the order it
    files them, so a new store's units go after every key there (filing appends) and a further
    request of the same store merges with that store's keys only; a store filed out of order
    costs a merge of every later key.  :meth:`lookup` is one ``searchsorted`` for a whole
    batch of pairs.

    NOTE: it replaced a dict keyed by ``(kind, store, unit)`` tuples: the checks made one
    dict lookup per (store, unit) pair, about 3 % of a long engine run, and each entry cost
    about 200 bytes (tuple and ints) where the arrays take 16."""

    #: units and stores are packed in 32 and 31 bits
    UNIT_BITS = 32

    def __init__(self):
        self._by_kind: dict[str, list] = {}          # kind -> [packed keys, ids, count]

    def __len__(self) -> int:
        return sum(n for _, _, n in self._by_kind.values())

    def file(self, kind: str, store: int, units: np.ndarray, ids: np.ndarray) -> None:
        """File ``ids[i]`` for ``(kind, store, units[i])``; ``units`` sorted and distinct."""
        units, ids = np.asarray(units, np.int64), np.asarray(ids, np.int64)
        if not units.size:
            return
        if not (0 <= store < (1 << 31) and int(units[0]) >= 0 and int(units[-1]) < (1 << self.UNIT_BITS)):
            raise InputError("store", f"expected a store in 0..2**31-1 and units in 0..2**32-1, got store {store}, "
                             f"units {int(units[0])}..{int(units[-1])}")
        packed = (np.int64(store) << self.UNIT_BITS) + units
        got = self._by_kind.get(kind)
        if got is None:
            got = self._by_kind[kind] = [np.zeros(max(64, 2 * packed.size), np.int64),
                                         np.zeros(max(64, 2 * packed.size), np.int64), 0]
        keys, vals, n = got
        lo = int(np.searchsorted(keys[:n], np.int64(store) << self.UNIT_BITS))
        if lo < n:
            # keys from this store on are there already (a further request of the store, or a
            # store filed out of order): merged, the new ids standing where a unit repeats
            keep = ~np.isin(keys[lo:n], packed)
            both_k = np.concatenate([keys[lo:n][keep], packed])
            order = np.argsort(both_k, kind="stable")
            packed, ids = both_k[order], np.concatenate([vals[lo:n][keep], ids])[order]
        need = lo + packed.size
        if need > keys.size:
            cap = max(need, 2 * keys.size)
            keys = np.concatenate([keys[:lo], np.zeros(cap - lo, np.int64)])
            vals = np.concatenate([vals[:lo], np.zeros(cap - lo, np.int64)])
        keys[lo:need], vals[lo:need] = packed, ids
        self._by_kind[kind] = [keys, vals, need]

    def lookup(self, kind: str, stores: np.ndarray, units: np.ndarray) -> np.ndarray:
        """The id filed for each ``(kind, stores[i], units[i])``, -1 where none is."""
        stores, units = np.asarray(stores, np.int64), np.asarray(units, np.int64)
        out = np.full(stores.shape, -1, np.int64)
        got = self._by_kind.get(kind)
        if got is None or not stores.size:
            return out
        keys, vals, n = got
        fits = (stores >= 0) & (stores < (1 << 31)) & (units >= 0) & (units < (1 << self.UNIT_BITS))
        packed = (stores << self.UNIT_BITS) + units
        i = np.minimum(np.searchsorted(keys[:n], packed), n - 1)
        hit = fits & (keys[i] == packed)
        out[hit] = vals[i[hit]]
        return out

    def get(self, key: tuple, default=None):
        """``(kind, store, unit) -> id`` of one unit (``default`` where none is filed), as a
        dict's ``get``."""
        kind, store, unit = key
        got = int(self.lookup(kind, np.array([store]), np.array([unit]))[0])
        return default if got < 0 else got


class KVOracle:
    """Content keys of stored units, and the check of reads against them (module doc).

    ``buffers``: pool role -> (device buffer, layout); ``kinds``: buffer -> its schedule kind;
    ``ratios``: pool role -> raw tokens per entry."""

    #: (store, unit, key) triples are packed into one int64 below this product of their ranges
    PACK_LIMIT = 1 << 62
    #: sampled bytes checked at once (see check_reads)
    CHUNK_SAMPLES = 1 << 18
    #: written(): up to this many extents are handled in plain Python
    FEW_EXTENTS = 128

    def __init__(self, buffers: Mapping[str, tuple], kinds: Mapping[str, str], ratios: Mapping[str, int], *,
                 incremental: bool = True):
        self.buffers = dict(buffers)
        self.kinds = dict(kinds)
        self.ratios = dict(ratios)
        self.incremental = bool(incremental)
        self.content = ContentKeys()                 # (kind, store, unit) -> content key id
        self._ids = ContentKeyIds()                  # content key -> id
        #: entries x pool layers judged (from the bytes or from what is remembered)
        self.entries_checked = 0
        #: entries x pool layers whose bytes were looked up (the rest were remembered right)
        self.entries_sampled = 0
        #: incremental check: (pool layer, page) pairs judged from one piece, and sample by sample
        self.pairs_one_piece = 0
        self.pairs_by_sample = 0
        # buffer -> (key id, n) per pool layer x page: entries 0..n-1 judged right for that key
        # since the page was last written (key -1: nothing remembered); module doc
        self._judged: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._layout_of = {name: lay for name, lay in self.buffers.values()}
        self._table = None                           # the origin table _fields mirrors
        self._fields = tuple(np.zeros(0, np.int64) for _ in range(5))   # owner, layer, unit bytes, kind, version
        self._field_rows = np.zeros((5, 0), np.int64)  # their storage (_origin_fields)
        self._kinds: dict[str, int] = {}
        # _expected_entries: (request id, role, entries, context) -> (request, key ids), of the
        # reads made for _memo_for (a forward's made_for; shared by every rank's oracle)
        self._expected_memo: dict[tuple, tuple] = {}
        self._memo_for: list = [None]

    def for_buffers(self, buffers: Mapping[str, tuple], kinds: Mapping[str, str]) -> "KVOracle":
        """An oracle of another copy of the same pools (a further TP rank's buffers:
        ``buffers``, ``kinds`` as in the constructor, the same roles and layouts) that shares
        this one's content keys (a store writes the same tokens' KV on every rank, so what
        :meth:`record_store` files here holds there) but remembers its own verdicts (what its
        buffers hold differs by rank)."""
        if set(buffers) != set(self.buffers):
            raise InputError("buffers", f"expected the pool roles {sorted(self.buffers)}, got {sorted(buffers)}")
        other = KVOracle(buffers, kinds, self.ratios, incremental=self.incremental)
        # NOTE: the expected keys are a function of the request and the shared content keys only
        other.content, other._ids = self.content, self._ids
        other._expected_memo, other._memo_for = self._expected_memo, self._memo_for
        return other

    def _kind_code(self, kind: str) -> int:
        return self._kinds.setdefault(kind, len(self._kinds))

    def _origin_fields(self, table) -> tuple:
        """Per origin id of ``table`` (the run's ``OriginTable``): owner, layer, unit bytes,
        a code of its kind and its version (the store that wrote it), as arrays (extended as
        the table grows: origins are immutable and their ids dense).

        NOTE: the arrays are views of a (5, capacity) array whose capacity doubles, so a
        long run extends them in amortised O(new origins), not by copying every origin's
        fields each time a check sees a few new ones."""
        if table is not self._table:
            self._table, self._field_rows = table, np.zeros((5, 0), np.int64)
            self._fields = tuple(np.zeros(0, np.int64) for _ in range(5))
        have = len(self._fields[0])
        n = len(table) if table is not None else 0
        if n > have:
            rows = self._field_rows
            if n > rows.shape[1]:
                grown = np.zeros((5, max(n, 2 * rows.shape[1], 1024)), np.int64)
                grown[:, :have] = rows[:, :have]
                rows = self._field_rows = grown
            new = [table[i] for i in range(have, n)]
            rows[0, have:n] = [o.owner for o in new]
            rows[1, have:n] = [o.layer for o in new]
            rows[2, have:n] = [o.unit_bytes for o in new]
            rows[3, have:n] = [self._kind_code(o.kind) for o in new]
            rows[4, have:n] = [o.version for o in new]
            self._fields = tuple(rows[k, :n] for k in range(5))
        return self._fields

    def _page_tokens(self, role: str) -> int:
        return self.buffers[role][1].entries_per_unit * self.ratios[role]

    def judged(self, buffer: str) -> tuple[np.ndarray, np.ndarray]:
        """What the oracle remembers of paged ``buffer`` (module doc): per pool layer ``l`` and
        page ``p`` (index ``l * pages + p``), the content key id whose entries ``0..n-1`` were
        judged right (-1: nothing) and ``n``."""
        got = self._judged.get(buffer)
        if got is None:
            lay = self._layout_of[buffer]
            n = lay.layers * lay.pages
            got = self._judged[buffer] = (np.full(n, -1, np.int64), np.zeros(n, np.int64))
        return got

    def written(self, buffer: str, offsets, lengths) -> None:
        """Bytes ``[offsets, offsets + lengths)`` of ``buffer`` in the run's memory have just
        been written (a write or a copy's items applied): forget every page they touch.
        Buffers the oracle does not check, and those it remembers nothing of, are ignored."""
        got = self._judged.get(buffer)
        if got is None:
            return
        ub = self._layout_of[buffer].page_bytes
        key = got[0]
        o = np.asarray(offsets, np.int64).ravel()
        n = np.asarray(lengths, np.int64).ravel()
        if o.size <= self.FEW_EXTENTS:
            # NOTE: most calls are a few extents (a copy item landing, a batch store's pages of
            # one layer): plain Python, where numpy's per-call overhead would be most of the cost
            size, one = key.size, []
            for a, m in zip(o.tolist(), n.tolist()):
                if m <= 0:
                    continue
                lo, hi = a // ub, -(-(a + m) // ub)
                if hi - lo == 1 and 0 <= lo < size:
                    one.append(lo)
                else:
                    key[min(max(lo, 0), size):min(max(hi, 0), size)] = -1
            if one:
                key[one] = -1
            return
        g0 = o // ub
        g1 = -(-(o + n) // ub)
        # NOTE: the common case checked in plain comparisons (np.clip's overhead was most of a
        # call): every extent non-empty and inside the buffer
        if not (n.min() > 0 and g0.min() >= 0 and g1.max() <= key.size):
            g0, g1 = np.minimum(np.maximum(g0, 0), key.size), np.minimum(np.maximum(g1, 0), key.size)
            live = g1 > g0                      # empty extents, or past the buffer's end: nothing there
            g0, g1 = g0[live], g1[live]
            if not g0.size:
                return
        span = g1 - g0
        if int(span.max()) == 1:
            key[g0] = -1
            return
        tot = int(span.sum())
        if tot <= key.size:
            key[np.repeat(g0, span) + (np.arange(tot) - np.repeat(np.cumsum(span) - span, span))] = -1
        else:
            mark = np.zeros(key.size + 1, np.int64)
            np.add.at(mark, g0, 1)
            np.add.at(mark, g1, -1)
            key[np.cumsum(mark[:-1]) > 0] = -1

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
            # the last position each unit completes: its entries sorted by (unit, position)
            order = np.lexsort((pos, units))
            u_s = units[order]
            last_of = np.flatnonzero(np.append(u_s[1:] != u_s[:-1], True))
            self.content.file(kind, store, u_s[last_of], self._ids.ids(req, pos[order][last_of] + 1))

    def _key_id(self, key: tuple) -> int:
        return self._ids.id_of(key)

    def _expected_entries(self, req, role: str, ne: int, n_ctx: int, first: int = 0) -> np.ndarray:
        """:meth:`expected` of ``req``'s entries ``first..first+ne-1`` of ``role`` (entry ``j``
        completed at position ``j * ratio + ratio - 1``), read-only and remembered per (request,
        role, ``ne``, ``n_ctx``, ``first``).

        NOTE: a forward reads a request's entries once per layer (43 reads of one role in a
        per-layer forward), each with the same entries and context; the keys are a pure
        function of those (content keys are ids assigned once and never change), so they are
        computed once per forward instead of once per read.  The request is held with its
        keys, so its ``id`` is not reused while remembered; what is remembered is one
        forward's (``check_reads`` forgets it when the reads' ``made_for`` changes), so it
        does not grow with the run."""
        memo = self._expected_memo
        mk = (id(req), role, ne, n_ctx, first)
        got = memo.get(mk)
        if got is not None and got[0] is req:
            return got[1]
        # NOTE: the key is one per unit (page): entry j lies in unit j // entries_per_unit, so
        # the keys are computed per unit and repeated, :meth:`expected`'s values (the same ids,
        # numbered in the same order: the units' prefix lengths do not decrease) without
        # sorting every entry's (a decode step asks again for every running request)
        r = self.ratios[role]
        epu = self.buffers[role][1].entries_per_unit
        span = epu * r
        u0, u1 = first // epu, -(-(first + ne) // epu)
        last = np.minimum(np.arange(u0, u1, dtype=np.int64) * span + (span - 1), n_ctx - 1)
        w = np.repeat(self._ids.ids(req, ((last + 1) // r) * r), epu)[first - u0 * epu:][:ne]
        w.setflags(write=False)
        memo[mk] = (req, w)
        return w

    def expected(self, req, role: str, position: np.ndarray, n_ctx: int) -> np.ndarray:
        """The content key id ``req``'s tokens give the unit holding each entry completed at
        ``position`` when ``n_ctx`` tokens of it are computed."""
        r = self.ratios[role]
        span = self._page_tokens(role)
        p0 = (position // span) * span
        last = np.minimum(p0 + span - 1, n_ctx - 1)
        n = ((last + 1) // r) * r
        uniq, inv = np.unique(n, return_inverse=True)
        return self._ids.ids(req, uniq)[inv]

    def check_read(self, info, obs_read, req, n_ctx: int) -> np.ndarray:
        """For a read (``ReadInfo``) made for ``req`` (``info.entries[req.rid]``, in sequence
        order from ``info.first.get(req.rid, 0)``, ``n_ctx`` tokens computed) and its observed
        views: a bool per entry, True where some pool layer's entry holds bytes that are not
        ``req``'s KV."""
        return self.check_reads(info, obs_read, {req.rid: (req, n_ctx)})[req.rid]

    def check_reads(self, info, obs_read, made_for: Mapping[int, tuple], contents=None,
                    by_layer: bool = False) -> dict[int, np.ndarray]:
        """:meth:`check_read` for every request ``rid -> (req, n_ctx)`` of ``made_for`` that
        the read has entries for, in groups of requests of about :attr:`CHUNK_SAMPLES` sampled
        bytes (the views are looked up once per group): ``{rid: bool per entry}``.
        ``contents``: the read's buffer (a ``CompactBuffer``) holding, at the read's offsets,
        exactly what its views saw (the buffer at the instant of the read, unless the done part
        of a copy item mid-flight lay in the read's bytes: ``ReadCapture.torn``); looked up once
        per group instead of per view.  ``by_layer`` (incremental checks only,
        :meth:`can_merge`): ``{rid: bool per (pool layer of info.pool_layers, entry)}``, each
        row what a read of that pool layer alone gives; ``contents`` may then be a
        :class:`LayerContents` (each pool layer's bytes as its own read saw them)."""
        if by_layer and not (contents is not None and self.can_merge(info.role)):
            raise InputError("by_layer", f"expected the incremental check (a paged layout and contents) for "
                             f"{info.role!r}; the full check has no per-layer rows")
        if by_layer and len(set(info.pool_layers)) != len(info.pool_layers):
            raise InputError("info.pool_layers", f"expected distinct pool layers (one row each), got "
                             f"{list(info.pool_layers)}")
        if made_for is not self._memo_for[0]:
            # reads of another forward: the keys remembered are the last forward's
            self._expected_memo.clear()
            self._memo_for[0] = made_for
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
                out.update(self._check_group(info, obs_read, group, contents, by_layer))
                group, n = {}, 0
        if group:
            out.update(self._check_group(info, obs_read, group, contents, by_layer))
        return out

    def can_merge(self, role: str) -> bool:
        """Whether reads of ``role`` that saw their buffer as it stands are checked
        incrementally, so that reads of several pool layers can be judged in one call
        (``check_reads(..., by_layer=True)``)."""
        return self.incremental and isinstance(self.buffers[role][1], PagedLayout)

    def _check_group(self, info, obs_read, made_for: Mapping[int, tuple], contents,
                     by_layer: bool = False) -> dict[int, np.ndarray]:
        name, lay = self.buffers[info.role]
        if contents is not None and self.can_merge(info.role):
            return self._check_incremental(info, made_for, contents, by_layer)
        kind = self.kinds[name]
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
            w = self._expected_entries(req, info.role, len(ent), n_ctx, info.first.get(rid, 0))
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
            self.entries_sampled += len(ent) * len(info.pool_layers)
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
        ok = self._sample_ok(kind, table, oid, so, in_unit, pls, want)
        bad = np.zeros(base, bool)
        bad[entry[~ok]] = True
        for rid, a, n in zip(rids, np.cumsum([0] + sizes[:-1]).tolist(), sizes):
            out[rid] = bad[a:a + n]
        return out

    def _sample_ok(self, kind, table, oid, so, in_unit, pls, want) -> np.ndarray:
        """Per sampled byte (its origin id and stream offset; where in its unit, in which pool
        layer and for which content key it should be): is it the expected KV?"""
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
                uu, uk = np.divmod(rest, n_k)
            else:
                uniq, inv = np.unique(np.stack([o, u, k], axis=1), axis=0, return_inverse=True)
                uo, uu, uk = uniq[:, 0], uniq[:, 1], uniq[:, 2]
            good = self.content.lookup(kind, uo, uu) == uk
            ok[np.flatnonzero(ok)] = good[inv.ravel()]
        return ok

    def _check_incremental(self, info, made_for: Mapping[int, tuple], contents,
                           by_layer: bool = False) -> dict[int, np.ndarray]:
        """:meth:`_check_group` for a paged buffer as it stands (``contents``): only the
        (pool layer, page) pairs not remembered right for the expected key are judged (module
        doc), then the pairs found right are remembered.

        A pair whose sampled bytes all lie in ONE piece of the buffer's provenance (a page
        written by one store or one page copy) is judged once: in a piece, a byte at ``x`` has
        stream offset ``x + delta``, so with the origin's unit as long as the page every
        sample's place in its source unit equals its place in the page exactly when
        ``page start + delta`` is a multiple of the page (then every sample's source unit is
        ``(page start + delta) // page bytes``); owner, kind and layer are the piece's.  So
        each sample's check gives the pair's one verdict.  Other pairs are checked sample by
        sample (:meth:`_sample_ok`).  ``by_layer``: ``bad`` per (pool layer, entry)
        (:meth:`check_reads`)."""
        name, lay = self.buffers[info.role]
        kind = self.kinds[name]
        epu, ub, lb = lay.entries_per_page, lay.page_bytes, np.int64(lay.layer_bytes)
        fs = lay.effective_fields
        f_off = np.array([f.offset for f in fs], np.int64)
        f_len = np.array([f.entry_bytes for f in fs], np.int64)
        jk, jn = self.judged(name)
        layers = np.asarray(info.pool_layers, np.int64)
        out: dict[int, np.ndarray] = {}
        rids, sizes, parts = [], [], []
        base = 0
        for rid, (req, n_ctx) in made_for.items():
            if rid not in info.entries:
                continue
            ent = np.asarray(info.entries[rid], np.int64)
            ne = len(ent)
            if not ne:
                out[rid] = np.zeros(0, bool)
                continue
            self.entries_checked += ne * len(layers)
            w = self._expected_entries(req, info.role, ne, n_ctx, info.first.get(rid, 0))
            ent, u, st, cnt, rmin, rmax, leading, ru, rw = self._page_runs(info.entries[rid], w, epu)
            g = layers[:, None] * lay.pages + ru[None, :]                 # (pool layers, runs)
            ml, mr = np.nonzero(~((jk[g] == rw[None, :]) & (jn[g] > rmax[None, :])))
            if ml.size:
                self.entries_sampled += int(cnt[mr].sum())
                parts.append((g[ml, mr], layers[ml], ru[mr], rw[mr], rmin[mr], rmax[mr], base + st[mr], cnt[mr],
                               leading[mr], ent, u, w, base))
            rids.append(rid)
            sizes.append(ne)
            base += ne
        if not rids:
            return out
        # the row of ``bad`` each pool layer's wrong entries go to: one row unless ``by_layer``
        row = np.zeros(int(layers.max()) + 1, np.int64)
        if by_layer:
            row[layers] = np.arange(layers.size)
        bad = np.zeros((layers.size if by_layer else 1, base), bool)
        if parts:
            pg, ppl, ppage, pkey, pmin, pmax, pst, pcnt, plead = (np.concatenate([x[k] for x in parts])
                                                                  for k in range(9))
            page0 = ppl * lb + ppage * ub
            lo = page0 + (f_off[None, :] + pmin[:, None] * f_len[None, :]).min(axis=1)
            hi = page0 + (f_off[None, :] + pmax[:, None] * f_len[None, :]).max(axis=1)
            oid, delta, k, k_hi = _pieces_at(contents, lo, hi, ppl)
            og_owner, og_layer, og_ub, og_kind, og_version = self._origin_fields(contents.table)
            one = (k == k_hi) & (og_ub[oid] == ub)
            right = np.zeros(pg.size, bool)
            n_one = int(one.sum())
            self.pairs_one_piece += n_one
            self.pairs_by_sample += pg.size - n_one
            # one piece: the pair's one verdict
            a = np.flatnonzero(one)
            if a.size:
                o1 = oid[a]
                src0 = page0[a] + delta[a]
                ok = (og_owner[o1] >= 0) & (og_kind[o1] == self._kind_code(kind)) & (og_layer[o1] == ppl[a]) \
                    & (src0 % ub == 0)
                sel = np.flatnonzero(ok)
                if sel.size:
                    # NOTE: one lookup per pair, all at once: pairs rarely repeat a (store, unit,
                    # key) triple (each pool layer has its own units)
                    ok[sel] = self.content.lookup(kind, og_version[o1][sel], (src0 // ub)[sel]) == pkey[a][sel]
                right[a] = ok
                wrong = a[~ok]
                if wrong.size:
                    c = pcnt[wrong]
                    bad[np.repeat(row[ppl[wrong]], c),
                        np.repeat(pst[wrong], c) + (np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c))] = True
            # several pieces (or another unit size): sample by sample
            b = np.flatnonzero(~one)
            if b.size:
                right[b] = self._pairs_by_sample(kind, lay, contents, parts, b, bad, row)
            # remember the pairs found right (their entries 0..n-1), forget those found wrong
            keep = right & plead
            if keep.any():
                gk, first = np.unique(pg[keep], return_index=True)
                jk[gk] = pkey[keep][first]
                jn[gk] = pcnt[keep][first]
            if not right.all():
                jk[pg[~right]] = -1
        for rid, a_, n in zip(rids, np.cumsum([0] + sizes[:-1]).tolist(), sizes):
            out[rid] = bad[:, a_:a_ + n] if by_layer else bad[0, a_:a_ + n]
        return out

    def _page_runs(self, entries, w: np.ndarray, epu: int) -> tuple:
        """A request's entries (``entries``: its slots of one role) cut into runs of one page
        and one expected key ``w`` (a request's entries of a page are consecutive, in sequence
        order): ``(entries as int64, page of each entry, each run's first entry, length, least
        and greatest place in its page, whether its entries are exactly places 0..length-1 of
        the page (only then can it be remembered), page, key)``.

        NOTE: remembered with the expected keys (:meth:`_expected_entries`): a per-layer forward
        reads the same entries of a request once per layer and pool, and the runs are a pure
        function of the entries and keys (the arrays are held with them, so their ids are not
        reused while remembered; callers only read them)."""
        memo = self._expected_memo
        mk = ("runs", id(entries), id(w), epu)
        got = memo.get(mk)
        if got is not None and got[0] is entries and got[1] is w:
            return got[2]
        ent = np.asarray(entries, np.int64)
        ne = len(ent)
        u, i = np.divmod(ent, epu)
        new = np.empty(ne, bool)
        new[0] = True
        np.not_equal(u[1:], u[:-1], out=new[1:])
        new[1:] |= w[1:] != w[:-1]
        st = np.flatnonzero(new)
        cnt = np.diff(np.append(st, ne))
        rmin, rmax = np.minimum.reduceat(i, st), np.maximum.reduceat(i, st)
        run_of = np.cumsum(new) - 1
        leading = np.minimum.reduceat((i == np.arange(ne) - st[run_of]).view(np.int8), st).astype(bool)
        runs = (ent, u, st, cnt, rmin, rmax, leading, u[st], w[st])
        memo[mk] = (entries, w, runs)
        return runs

    def _pairs_by_sample(self, kind, lay, contents, parts, sel: np.ndarray, bad: np.ndarray,
                         row: np.ndarray) -> np.ndarray:
        """Judge pairs ``sel`` (indices into the concatenated pairs of ``parts``, see
        :meth:`_check_incremental`) sample by sample, marking their wrong entries in row
        ``row[pool layer]`` of ``bad``; returns whether each pair was right."""
        nf, lb = len(lay.effective_fields), np.int64(lay.layer_bytes)
        offs, in_unit, entry, pls, want, lens = [], [], [], [], [], []
        first = 0
        for _, ppl, _, _, _, _, pst, pcnt, _, ent, u, w, base in parts:
            n = len(pst)
            m = sel[(sel >= first) & (sel < first + n)] - first
            first += n
            if not m.size:
                continue
            c = pcnt[m]
            tot = int(c.sum())
            e_idx = np.repeat(pst[m] - base, c) + (np.arange(tot) - np.repeat(np.cumsum(c) - c, c))
            pl_e = np.repeat(ppl[m], c)
            o, _ = lay.token_extents(0, ent[e_idx])                          # (entries, fields)
            in_unit.append((o - lay.unit_offsets(0, u[e_idx])[:, None]).ravel())
            offs.append((o + (pl_e * lb)[:, None]).ravel())
            entry.append(np.repeat(base + e_idx, nf))
            pls.append(np.repeat(pl_e, nf))
            want.append(np.repeat(w[e_idx], nf))
            lens.append(c * nf)
        offs, in_unit, entry, pls, want, lens = (np.concatenate(x) for x in (offs, in_unit, entry, pls, want, lens))
        oid, delta, _, _ = _pieces_at(contents, offs, None, pls)
        ok = self._sample_ok(kind, contents.table, oid, delta + offs, in_unit, pls, want)
        bad[row[pls[~ok]], entry[~ok]] = True
        return np.logical_and.reduceat(ok, np.cumsum(lens) - lens)
