"""Happens-before over a schedule's ops, the latent races it leaves, and the
intra-launch races of single copies.

Edges (never timing): consecutive ops of one stream; a ``record`` to every
``wait`` bound to it; a host op (``host_sync``, ``host_delay``, ``host_query``,
``barrier``) to every op its host issues after it; a ``host_sync``'s targets
and a positive ``host_query``'s record to that op; a ``barrier``'s participants'
barrier ops to every op a participant issues after it.  A wait, sync or query
with no record issued before it binds to nothing and adds no edge (CUDA).
Issue order is a topological order of these edges, so vector clocks are
computed in one pass, with one component per stream and one per host:
``clock[op][c]`` is the number of ops of component ``c`` that happen before or
at ``op``.
``hb_graph`` builds the same relation as a networkx DiGraph, for explanation
(``networkx.shortest_path`` gives the chain that orders two ops) and for the
differential test that keeps the two equal.

**Latent race**: two different ops whose byte accesses overlap on one buffer,
at least one of the two overlapping accesses a write, with no happens-before
path either way.  A copy reads its source extents and writes its destination
extents (clipped to the buffers: bytes past the end are out-of-bounds writes,
reported separately).  There is one race per (buffer, op pair); its bytes are
the union of the conflicting overlaps (write/write, write/read, read/write) of
the two ops' accesses to that buffer.  ``race_scan`` finds them by sorting
each buffer's access intervals and sweeping (only intervals whose bytes
overlap are paired; accesses with identical interval sets are grouped, so k
accesses of the same bytes are one group, not k^2 interval pairs), then tests
happens-before once per overlapping access pair with vectorised clock
look-ups, in chunks (time grows with the overlapping access pairs, k^2 / 2
for k accesses of the same bytes; memory with the distinct overlapping
interval-set pairs plus one chunk), counts every racing pair and lists at
most ``limit`` of them.

**Intra-launch race**: one copy whose items write the same destination bytes
(two different items with overlapping clipped destination extents, the bytes
read past the source included).  The items of one launch run concurrently
(warps), so which item's bytes remain is not determined; the byte models
apply "the later extent wins", which is only one of the possible outcomes.
Overlapping extents of one item are in that item's program order (the later
extent wins, deterministically) and are not races.  ``intra_launch_races``
finds them per copy by sweeping each copy's per-item merged extents;
``indeterminate_read_bytes`` follows those bytes through the happens-before
order execution (the reference: every op alone, in issue order) to the reads
that see them: a copy's racing destination bytes become indeterminate, a copy
of indeterminate source bytes writes indeterminate bytes, and any other write
of a byte (a ``write`` op, another copy's extent) makes it determinate again.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from sim.bytes.compact import _ranks
from sim.memory import clipped_plan
from sim.schedule import Schedule

if TYPE_CHECKING:
    import networkx as nx

#: racing (buffer, op pair)s a report lists by default (all are counted)
RACE_LIMIT = 1000
#: candidate pairs handled per vectorised step (bounds the temporary arrays)
CHUNK_PAIRS = 1 << 19
#: ranges kept per race entry (``starts``/``ends``); ``bytes`` and ``n_ranges`` cover all
MAX_RACE_RANGES = 8


class HappensBefore:
    """Vector clocks with one component per stream and one per host.

    Component ``c`` of ``clock[op]`` counts the ops of stream or host ``c`` that
    happen before or at ``op``; ``pos[op]`` is the op's 1-based position in its own
    component (a stream op's stream, a host op's host).  Edges: stream order;
    record -> wait; a host's program order from each of its host ops
    (``host_sync``, ``host_delay``, ``host_query``, ``barrier``) to every op it
    issues later; a ``host_sync``'s targets and a positive ``host_query``'s record
    to that op; a ``barrier``: every participant's barrier op to every op a
    participant issues after it.  Stream ops issued by one host are not ordered
    by that alone (the GPU runs them asynchronously)."""

    def __init__(self, schedule: Schedule):
        self.s = schedule
        names = list(schedule.streams)
        self.stream_idx = {n: i for i, n in enumerate(names)}
        self.host_idx = {h: len(names) + i for i, h in enumerate(schedule.hosts)}
        n_ops, n_comp = len(schedule.ops), len(names) + len(schedule.hosts)
        self.clock = np.zeros((n_ops, n_comp), dtype=np.int64)
        self.pos = np.zeros(n_ops, dtype=np.int64)
        self.comp = np.zeros(n_ops, dtype=np.int64)          # component of each op
        hc = {h: np.zeros(n_comp, dtype=np.int64) for h in schedule.hosts}   # what each host knows
        barrier: dict[str, list] = {}                       # instance -> [joined clock, arrived]
        last: dict[str, int] = {}
        count = np.zeros(n_comp, dtype=np.int64)
        for op in schedule.ops:
            i = op.index
            c = hc[op.host].copy()
            if op.stream is not None:
                k = self.stream_idx[op.stream]
                if op.stream in last:
                    np.maximum(c, self.clock[last[op.stream]], out=c)
                if op.op == "wait" and op.bound_record is not None:
                    np.maximum(c, self.clock[op.bound_record], out=c)
                last[op.stream] = i
            else:
                k = self.host_idx[op.host]
                for t in op.sync_targets:
                    np.maximum(c, self.clock[t], out=c)
            count[k] += 1
            c[k] = count[k]
            self.clock[i], self.pos[i], self.comp[i] = c, count[k], k
            if op.stream is None:
                hc[op.host] = c
            if op.op == "barrier":
                inst = barrier.setdefault(op.barrier, [np.zeros(n_comp, dtype=np.int64), 0])
                np.maximum(inst[0], c, out=inst[0])
                inst[1] += 1
                if inst[1] == len(op.hosts):
                    for h in op.hosts:
                        hc[h] = np.maximum(hc[h], inst[0])

    def ordered(self, a: int, b: int) -> bool:
        """True if op a happens before op b."""
        return bool(self.clock[b][self.comp[a]] >= self.pos[a]) and a != b

    def concurrent(self, a: int, b: int) -> bool:
        return not self.ordered(a, b) and not self.ordered(b, a)

    def stream_of(self) -> np.ndarray:
        """Stream index of every op (-1 for host ops)."""
        return np.array([-1 if op.stream is None else self.stream_idx[op.stream] for op in self.s.ops],
                        dtype=np.int64)

    def concurrent_many(self, a: np.ndarray, b: np.ndarray, stream: np.ndarray | None = None) -> np.ndarray:
        """``concurrent(a[k], b[k])`` for every k, vectorised (stream ops only;
        ``stream`` is ``stream_of()``, passed to avoid recomputing it)."""
        stream = self.stream_of() if stream is None else stream
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        ab = self.clock[b, stream[a]] >= self.pos[a]
        ba = self.clock[a, stream[b]] >= self.pos[b]
        return ~ab & ~ba


def hb_graph(schedule: Schedule) -> nx.DiGraph:
    """Happens-before as an explicit graph (nodes are op indices), edge by edge as
    :class:`HappensBefore` describes it."""
    import networkx as nx     # here only: the executor imports this module and needs no graph

    g = nx.DiGraph()
    last: dict[str, int] = {}
    before: dict[str, list] = {h: [] for h in schedule.hosts}    # a host's latest host op(s)
    arrived: dict[str, list] = {}
    for op in schedule.ops:
        g.add_node(op.index, id=op.id, op=op.op, stream=op.stream, host=op.host)
        for p in before[op.host]:
            g.add_edge(p, op.index, why="host program order")
        if op.stream is not None:
            if op.stream in last:
                g.add_edge(last[op.stream], op.index, why="stream order")
            if op.op == "wait" and op.bound_record is not None:
                g.add_edge(op.bound_record, op.index, why="record -> wait")
            last[op.stream] = op.index
            continue
        for t in op.sync_targets:
            g.add_edge(t, op.index, why=f"{op.op} target")
        before[op.host] = [op.index]
        if op.op == "barrier":
            arrived.setdefault(op.barrier, []).append(op.index)
            if len(arrived[op.barrier]) == len(op.hosts):
                for h in op.hosts:
                    before[h] = list(arrived[op.barrier])
    return g


@dataclass
class Access:
    op: int
    buffer: str
    write: bool
    starts: np.ndarray      # merged, sorted, disjoint (touching runs merged)
    ends: np.ndarray


#: below this many extents, ``_merge`` merges in plain Python (numpy's per-call
#: overhead dominates for the one-to-few extents of a typical read or write)
SMALL_MERGE = 16
_I64_MAX = (1 << 63) - 1


def _merge(starts, lengths):
    if type(starts) is np.ndarray and type(lengths) is np.ndarray and starts.shape == (1,) == lengths.shape:
        # one extent (a one-unit read or write) in plain ints: what the general path gives
        s0 = int(starts[0])
        e0 = s0 + int(lengths[0])
        if e0 > s0 and e0 <= _I64_MAX:
            return np.array([s0], np.int64), np.array([e0], np.int64)
    starts = np.asarray(starts, np.int64)
    ends = starts + np.asarray(lengths, np.int64)
    if starts.shape == (1,) and ends.shape == (1,):
        # one extent (a one-unit read or write): merged already, unless it is empty
        return (starts.copy(), ends) if int(ends[0]) > int(starts[0]) else (starts[:0].copy(), ends[:0])
    if starts.size < SMALL_MERGE:
        out_s, out_e = [], []
        for s, e in sorted(zip(starts.tolist(), ends.tolist())):
            if e <= s:
                continue
            if out_e and s <= out_e[-1]:
                out_e[-1] = max(out_e[-1], e)
            else:
                out_s.append(s)
                out_e.append(e)
        return np.array(out_s, np.int64), np.array(out_e, np.int64)
    return merge_intervals(starts, ends)


def merge_intervals(starts, ends):
    """Union of intervals ``[starts, ends)``: sorted, disjoint, touching runs merged."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    run_end = np.maximum.accumulate(ends)
    new = np.r_[True, starts[1:] > run_end[:-1]]
    idx = np.flatnonzero(new)
    return starts[idx], np.maximum.reduceat(run_end, idx)


def accesses(schedule: Schedule) -> list[Access]:
    out = []
    per_plan: dict = {}      # (id(plan), sizes) -> (plan, merged read, merged write): copies share plans
    for op in schedule.ops:
        if op.op == "copy":
            src, dst = schedule.buffers[op.src], schedule.buffers[op.dst]
            key = (id(op.plan), src.nbytes, dst.nbytes)
            got = per_plan.get(key)
            if got is None or got[0] is not op.plan:
                c = clipped_plan(op.plan, src.nbytes, dst.nbytes)
                got = per_plan[key] = (op.plan, _merge(c.src, np.minimum(c.length, c.fill_start)),
                                       _merge(c.dst, c.fill_end))
                for a in (*got[1], *got[2]):
                    a.setflags(write=False)        # shared by every copy of this plan
            out.append(Access(op.index, op.src, False, *got[1]))
            out.append(Access(op.index, op.dst, True, *got[2]))
        elif op.op in ("read", "write"):
            out.append(Access(op.index, op.buffer, op.op == "write", *_merge(*op.extents)))
    return out


def _intersect_sets(a_starts, a_ends, b_starts, b_ends):
    """Intersection of intervals ``a`` (any, sorted or not) with a merged interval
    set ``b``: (starts, ends, index into a of each piece)."""
    lo = np.searchsorted(b_ends, a_starts, side="right")
    hi = np.searchsorted(b_starts, a_ends, side="left")
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    if total == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    ai = np.repeat(np.arange(a_starts.size), counts)
    bj = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(lo, counts)
    s = np.maximum(a_starts[ai], b_starts[bj])
    e = np.minimum(a_ends[ai], b_ends[bj])
    keep = e > s
    return s[keep], e[keep], ai[keep]


def intersect(a: Access, b: Access):
    """Intersection of two merged interval sets: (starts, ends), merged."""
    s, e, _ = _intersect_sets(a.starts, a.ends, b.starts, b.ends)
    return s, e


def _subtract(starts, ends, cut_starts, cut_ends):
    """Merged set minus merged set (both sorted, disjoint): merged result."""
    if starts.size == 0 or cut_starts.size == 0:
        return starts, ends
    # complement of the cut within [min, max), intersected with the set
    lo = min(int(starts[0]), int(cut_starts[0]))
    hi = max(int(ends[-1]), int(cut_ends[-1]))
    comp_s = np.r_[lo, cut_ends]
    comp_e = np.r_[cut_starts, hi]
    keep = comp_e > comp_s
    s, e, _ = _intersect_sets(starts, ends, comp_s[keep], comp_e[keep])
    return merge_intervals(s, e)


@dataclass
class RaceScan:
    """What ``race_scan`` found: ``races`` lists at most ``limit`` racing pairs
    (in order of buffer first access, then op pair), ``total`` counts all of them."""

    races: list[dict]
    total: int


def _buffer_groups(accs: list[Access]):
    """Group a buffer's accesses by identical interval sets.  Returns the
    member access indices of every group and the groups' intervals sorted by
    start: (members, starts, ends, group)."""
    sizes = np.fromiter((a.starts.size for a in accs), np.int64, len(accs))
    all_s = np.concatenate([a.starts for a in accs])
    all_e = np.concatenate([a.ends for a in accs])
    first = np.cumsum(sizes) - sizes
    group_of = np.empty(len(accs), np.int64)
    single = np.flatnonzero(sizes == 1)
    n_groups = 0
    if single.size:       # one interval: group by (start, end), vectorised
        pairs = np.stack([all_s[first[single]], all_e[first[single]]], axis=1)
        _, inv = np.unique(pairs, axis=0, return_inverse=True)
        group_of[single] = inv.ravel()
        n_groups = int(inv.max()) + 1
    gid: dict = {}
    for k in np.flatnonzero(sizes != 1).tolist():
        key = (accs[k].starts.tobytes(), accs[k].ends.tobytes())
        g = gid.get(key)
        if g is None:
            g = gid[key] = n_groups
            n_groups += 1
        group_of[k] = g
    order = np.argsort(group_of, kind="stable")
    counts = np.bincount(group_of, minlength=n_groups)
    members = np.split(order, np.cumsum(counts)[:-1])
    rep = order[np.cumsum(counts) - counts]             # one access per group
    lo, n = first[rep], sizes[rep]
    idx = np.repeat(lo, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    S, E = all_s[idx], all_e[idx]
    G = np.repeat(np.arange(n_groups, dtype=np.int64), n)
    o = np.argsort(S, kind="stable")
    return members, S[o], E[o], G[o]


def _dedupe(k: np.ndarray) -> np.ndarray:
    """Sorted distinct values of an int64 array (a sort; numpy's hash-based
    ``np.unique`` was 75x slower on millions of keys)."""
    k = np.sort(k)
    return k[np.r_[True, k[1:] != k[:-1]]] if k.size else k


def _overlapping_group_pairs(S, E, G, n_groups: int) -> np.ndarray:
    """Distinct pairs of groups whose intervals overlap, as keys ``g1 * n + g2``
    with g1 < g2 (intervals sorted by start; one group's intervals are disjoint)."""
    hi = np.searchsorted(S, E, side="left")          # intervals i+1..hi-1 start inside interval i
    counts = hi - np.arange(S.size) - 1
    keys = []
    cum = np.cumsum(counts)
    i0 = 0
    while i0 < S.size:
        # take intervals i0..i1-1 whose candidate count fits one chunk (at least one interval)
        base = cum[i0 - 1] if i0 else 0
        i1 = max(i0 + 1, int(np.searchsorted(cum, base + CHUNK_PAIRS, side="right")))
        c = counts[i0:i1]
        tot = int(c.sum())
        if tot:
            ii = np.repeat(np.arange(i0, i1), c)
            jj = ii + 1 + _ranks(c)
            ga, gb = G[ii], G[jj]
            keys.append(_dedupe(np.minimum(ga, gb) * n_groups + np.maximum(ga, gb)))
        i0 = i1
    if not keys:
        return np.zeros(0, np.int64)
    return _dedupe(np.concatenate(keys))


def _expand_group_pairs(g1, g2, members):
    """Yield (ia, ib) arrays of access indices (into the buffer's access list):
    every member pair of every group pair (g1 == g2: each unordered pair once),
    about CHUNK_PAIRS at a time.  Group pairs up to CHUNK_PAIRS member pairs
    are expanded together, vectorised; a larger one a row of members at a time."""
    sizes = np.array([m.size for m in members], np.int64)
    ptr = np.r_[0, np.cumsum(sizes)]
    flat = np.concatenate(members) if members else np.zeros(0, np.int64)
    s1, s2 = sizes[g1], sizes[g2]
    n = s1 * s2                                   # g1 == g2: the full square, halved below
    small = n <= CHUNK_PAIRS
    sg1, sg2, sn, ss2 = g1[small], g2[small], n[small], s2[small]
    cum = np.cumsum(sn)
    k0 = 0
    while k0 < sg1.size:
        base = cum[k0 - 1] if k0 else 0
        k1 = max(k0 + 1, int(np.searchsorted(cum, base + CHUNK_PAIRS, side="right")))
        c = sn[k0:k1]
        pair = np.repeat(np.arange(k0, k1), c)
        r = _ranks(c)
        ra, rb = r // ss2[pair], r % ss2[pair]
        same = sg1[pair] == sg2[pair]
        keep = ~same | (ra < rb)
        yield flat[ptr[sg1[pair]] + ra][keep], flat[ptr[sg2[pair]] + rb][keep]
        k0 = k1
    for x, y in zip(g1[~small].tolist(), g2[~small].tolist()):
        a_m, b_m = members[x], members[y]
        buf_a, buf_b, held = [], [], 0
        for row in range(a_m.size):
            other = a_m[row + 1:] if x == y else b_m
            buf_a.append(np.full(other.size, a_m[row]))
            buf_b.append(other)
            held += other.size
            if held >= CHUNK_PAIRS or row == a_m.size - 1:
                yield np.concatenate(buf_a), np.concatenate(buf_b)
                buf_a, buf_b, held = [], [], 0


def race_scan(schedule: Schedule, hb: HappensBefore | None = None, limit: int | None = None,
              access_list: list | None = None) -> RaceScan:
    """Every latent race (see the module doc): the count of racing (buffer, op
    pair)s and the first ``limit`` of them (``None``: all), each a dict with
    ``buffer``; ``a``, ``b`` (the ``Access`` of the earlier and the later op,
    the first conflicting access pair); ``ops`` (op indices, a < b); ``bytes``
    (conflicting bytes, all ranges); ``n_ranges``; ``starts``/``ends`` (the
    first ``MAX_RACE_RANGES`` merged ranges, ``limit=None``: all of them).

    Cost per buffer: sorting its intervals, the overlapping interval pairs of
    distinct interval sets, and one vectorised happens-before test per
    overlapping access pair (chunked, so memory holds the distinct
    overlapping interval-set pairs and one chunk, never all access pairs).
    ``access_list``: ``accesses(schedule)``, when the caller has it."""
    hb = hb or HappensBefore(schedule)
    stream = hb.stream_of()
    n_ops = len(schedule.ops)
    by_buffer: dict[str, list[Access]] = {}
    for acc in (accesses(schedule) if access_list is None else access_list):
        if acc.starts.size:
            by_buffer.setdefault(acc.buffer, []).append(acc)
    listed: list[dict] = []
    total = 0
    for buf, accs in by_buffer.items():
        members, S, E, G = _buffer_groups(accs)
        n_groups = len(members)
        keys = _overlapping_group_pairs(S, E, G, n_groups)
        multi = np.array([m.size > 1 for m in members])
        self_pairs = np.flatnonzero(multi)
        g1 = np.r_[keys // n_groups, self_pairs].astype(np.int64)
        g2 = np.r_[keys % n_groups, self_pairs].astype(np.int64)
        op_of = np.array([a.op for a in accs], np.int64)
        write = np.array([a.write for a in accs], bool)
        # ops with two accesses to this buffer (a copy within one buffer) may race another op twice
        ops_seen, dual_ops = set(), set()
        for a in accs:
            (dual_ops if a.op in ops_seen else ops_seen).add(a.op)
        dual = np.zeros(n_ops, bool)
        dual[list(dual_ops)] = True
        want = None if limit is None else max(0, limit - len(listed))
        best = np.zeros(0, np.int64)          # smallest racing op-pair keys (want of them)
        dual_keys = []
        # a large group of one interval set (k accesses of the same bytes, none by an op with
        # two accesses here): counted by happens-before windows, listed row by row
        sizes = np.array([m.size for m in members], np.int64)
        big_self = (g1 == g2) & (sizes[g1] * (sizes[g1] - 1) // 2 > CHUNK_PAIRS)
        big_self &= np.array([not dual[op_of[members[g]]].any() for g in g1.tolist()], bool) \
            if big_self.any() else big_self
        for g in g1[big_self].tolist():
            m = members[g]
            total += _count_racing_within(hb, stream, op_of[m], write[m])
            if want is None or want > 0:
                best = np.concatenate([best, _first_racing_within(hb, stream, op_of[m], write[m], n_ops,
                                                                  want)])
                if want is not None and best.size > want:
                    best = np.partition(best, want - 1)[:want]
        g1, g2 = g1[~big_self], g2[~big_self]
        blocks = ((g1[i:i + CHUNK_PAIRS], g2[i:i + CHUNK_PAIRS]) for i in range(0, g1.size, CHUNK_PAIRS))
        for ia, ib in (pair for b1, b2 in blocks for pair in _expand_group_pairs(b1, b2, members)):
            oa, ob = op_of[ia], op_of[ib]
            ok = (oa != ob) & (write[ia] | write[ib])
            ok[ok] = hb.concurrent_many(oa[ok], ob[ok], stream)
            lo, hi = np.minimum(oa[ok], ob[ok]), np.maximum(oa[ok], ob[ok])
            k = lo * n_ops + hi
            d = dual[lo] | dual[hi]
            if d.any():
                dual_keys.append(k[d])
                k = k[~d]
            total += int(k.size)
            if want is None or want > 0:
                best = np.concatenate([best, k])
                if want is not None and best.size > want:
                    best = np.partition(best, want - 1)[:want]
        if dual_keys:
            dk = _dedupe(np.concatenate(dual_keys))
            total += int(dk.size)
            best = np.concatenate([best, dk])
        best = np.sort(best)
        if want is not None:
            best = best[:want]
        if best.size:
            listed.extend(_race_entries(buf, accs, best // n_ops, best % n_ops, limit is None))
    return RaceScan(listed, total)


def _concurrent_pairs(hb: HappensBefore, stream, ops_a, ops_b) -> int:
    """How many (a, b) in ops_a x ops_b are concurrent (ordered pairs; each op
    at most once per list).  For b and a stream t other than b's, the ops of t
    concurrent with b are those after the prefix that happens before b
    (``pos > clock[b, t]``) and before the suffix that b happens before
    (``clock[a, stream(b)] >= pos(b)``, nondecreasing along t); both are
    binary searches, so the cost is O((|a| * streams + streams * |b|) log)
    instead of |a| * |b|."""
    total = 0
    sa, sb = stream[ops_a], stream[ops_b]
    for t in _dedupe(sa).tolist():
        at = ops_a[sa == t]
        at = at[np.argsort(hb.pos[at], kind="stable")]
        bm = ops_b[sb != t]
        if bm.size == 0:
            continue
        n = at.size
        first = n - np.searchsorted(hb.pos[at], hb.clock[bm, t], side="right")
        cols, col_of_b = np.unique(stream[bm], return_inverse=True)
        q = hb.clock[at][:, cols]                          # (n, cols), each column nondecreasing
        big = int(q.max(initial=0)) + int(hb.pos[bm].max()) + 2
        flat = (np.arange(cols.size, dtype=np.int64)[:, None] * big + q.T).ravel()
        key = col_of_b.ravel() * big + hb.pos[bm]
        second = (col_of_b.ravel() + 1) * n - np.searchsorted(flat, key, side="left")
        total += int((first - second).sum())
    return total


def _count_racing_within(hb, stream, ops, write) -> int:
    """Unordered pairs of distinct ``ops`` (all accessing the same bytes) that
    are concurrent with at least one a write."""
    reads = ops[~write]
    return (_concurrent_pairs(hb, stream, ops, ops) - _concurrent_pairs(hb, stream, reads, reads)) // 2


def _first_racing_within(hb, stream, ops, write, n_ops: int, want: int | None) -> np.ndarray:
    """The smallest ``want`` racing op-pair keys among ``ops`` (ascending, one
    access each, all on the same bytes): rows of the upper triangle in op
    order, stopping once ``want`` are found (later rows have larger keys)."""
    found, n_found = [], 0
    for r in range(ops.size - 1):
        a, b = np.full(ops.size - r - 1, ops[r]), ops[r + 1:]
        ok = write[r] | write[r + 1:]
        ok[ok] = hb.concurrent_many(a[ok], b[ok], stream)
        k = a[ok] * n_ops + b[ok]
        found.append(k)
        n_found += k.size
        if want is not None and n_found >= want:
            break
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def _race_entries(buf, accs, op_a, op_b, all_ranges: bool) -> list[dict]:
    by_op: dict[int, list[Access]] = {}
    for acc in accs:
        by_op.setdefault(acc.op, []).append(acc)
    out = []
    for a_op, b_op in zip(op_a.tolist(), op_b.tolist()):
        pieces_s, pieces_e, first = [], [], None
        for x in by_op[a_op]:
            for y in by_op[b_op]:
                if not (x.write or y.write):
                    continue
                s, e = intersect(x, y)
                if s.size:
                    pieces_s.append(s)
                    pieces_e.append(e)
                    first = first or (x, y)
        s, e = merge_intervals(np.concatenate(pieces_s), np.concatenate(pieces_e))
        n = None if all_ranges else MAX_RACE_RANGES
        out.append({"buffer": buf, "a": first[0], "b": first[1], "ops": (a_op, b_op),
                    "starts": s[:n], "ends": e[:n], "n_ranges": int(s.size),
                    "bytes": int((e - s).sum())})
    return out


def latent_races(schedule: Schedule, hb: HappensBefore | None = None, limit: int | None = None) -> list[dict]:
    """The racing (buffer, op pair)s of ``race_scan``, at most ``limit``
    (``None``: all, each with all its ranges)."""
    return race_scan(schedule, hb, limit).races


# ----------------------------------------------------------------------------
# intra-launch races

def _per_item_union(dst, end, item):
    """Union of each item's destination intervals: (starts, ends, item), sorted by start."""
    keep = end > dst
    dst, end, item = dst[keep], end[keep], item[keep]
    if dst.size == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    order = np.lexsort((dst, item))
    dst, end, item = dst[order], end[order], item[order]
    # a grouped running maximum of the ends: offset each item's ends above all
    # earlier items' (items ranked densely, so rank * span stays far from int64's limit)
    lo_bound = int(dst.min())
    span = np.int64(int(end.max()) - lo_bound + 1)
    rank = np.cumsum(np.r_[0, item[1:] != item[:-1]]).astype(np.int64)
    run_end = np.maximum.accumulate(rank * span + (end - lo_bound)) - rank * span + lo_bound
    new = np.r_[True, (item[1:] != item[:-1]) | (dst[1:] > run_end[:-1])]
    idx = np.flatnonzero(new)
    s, e, it = dst[idx], np.maximum.reduceat(run_end, idx), item[idx]
    order = np.argsort(s, kind="stable")
    return s[order], e[order], it[order]


@dataclass
class DoubleWritten:
    """Destination bytes of one copy written by more than one item.

    ``starts``/``ends``: the merged ranges; ``items[k]``: the sorted items
    writing some byte of range k.  ``piece_starts``/``piece_ends``: the same
    bytes cut where the set of writers changes; ``piece_items[k]``: the items
    writing every byte of piece k (at least two): the candidates for its bytes."""

    starts: np.ndarray
    ends: np.ndarray
    items: list
    piece_starts: np.ndarray
    piece_ends: np.ndarray
    piece_items: list

    @property
    def nbytes(self) -> int:
        return int((self.ends - self.starts).sum())


def _items_per_range(s, e, it, rs, re_):
    """For merged ranges (rs, re_): the sorted distinct items whose intervals overlap each."""
    ps, _, pi = _intersect_sets(s, e, rs, re_)
    rng = np.searchsorted(re_, ps, side="right")
    pairs = np.unique(np.stack([rng, it[pi]], axis=1), axis=0)
    cuts = np.searchsorted(pairs[:, 0], np.arange(1, rs.size))
    return np.split(pairs[:, 1], cuts)


def double_written(dst, end, item) -> DoubleWritten:
    """The bytes of ``[dst, end)`` (one interval per extent) covered by the
    extents of more than one ``item``: a sweep over the per-item unions."""
    dst, end, item = (np.asarray(a, np.int64) for a in (dst, end, item))
    z = np.zeros(0, np.int64)
    none = DoubleWritten(z, z, [], z, z, [])
    keep = end > dst
    d, e0 = (dst, end) if keep.all() else (dst[keep], end[keep])
    if d.size < 2:
        return none
    # NOTE: extents that are pairwise disjoint (most copies: a page or row each) write no byte
    # twice, whatever their items: sorted by start, each starting at or after the previous end
    order = np.argsort(d, kind="stable")
    if bool((d[order][1:] >= e0[order][:-1]).all()):
        return none
    s, e, it = _per_item_union(dst, end, item)
    if s.size < 2:
        return none
    bounds = np.r_[s, e]
    delta = np.r_[np.ones(s.size, np.int64), -np.ones(e.size, np.int64)]
    order = np.argsort(bounds, kind="stable")
    bounds, delta = bounds[order], delta[order]
    x, first = np.unique(bounds, return_index=True)
    cover = np.cumsum(delta)[np.r_[first[1:] - 1, bounds.size - 1]]   # coverage from x[k] to x[k+1]
    multi = cover[:-1] >= 2
    if not multi.any():
        return none
    ps, pe = x[:-1][multi], x[1:][multi]           # elementary pieces: one writer set each
    rs, re_ = merge_intervals(ps, pe)
    return DoubleWritten(rs, re_, _items_per_range(s, e, it, rs, re_),
                         ps, pe, _items_per_range(s, e, it, ps, pe))


def intra_launch_races(schedule: Schedule) -> list[dict]:
    """Per copy whose items double-write destination bytes: ``op`` (index),
    ``buffer`` (destination), ``starts``/``ends`` (all merged double-written
    ranges), ``bytes``, ``items`` (per range, the items writing into it),
    ``written`` (the :class:`DoubleWritten`, with the pieces of constant writer
    set) and ``clipped`` (the copy's clipped extents)."""
    out = []
    for op in schedule.ops:
        if op.op != "copy":
            continue
        src, dst = schedule.buffers[op.src], schedule.buffers[op.dst]
        c = clipped_plan(op.plan, src.nbytes, dst.nbytes)
        if c.item.size < 2 or bool((c.item == c.item[0]).all()):
            continue
        dw = double_written(c.dst, c.dst + c.fill_end, c.item)
        if dw.starts.size:
            out.append({"op": op.index, "buffer": op.dst, "starts": dw.starts, "ends": dw.ends,
                        "bytes": dw.nbytes, "items": dw.items, "written": dw, "clipped": c})
    return out


def indeterminate_read_bytes(schedule: Schedule, intra: list[dict] | None = None) -> dict[int, tuple]:
    """For every read (op index): the buffer bytes it reads that are
    indeterminate in the happens-before-order execution (see the module doc),
    as merged (starts, ends); reads with none are left out."""
    intra = intra_launch_races(schedule) if intra is None else intra
    if not intra:
        return {}
    racy = {r["op"]: r for r in intra}
    z = np.zeros(0, np.int64)
    state: dict[str, tuple] = {}            # buffer -> merged indeterminate (starts, ends)
    out = {}
    for op in schedule.ops:
        if op.op == "copy":
            src, dst = schedule.buffers[op.src], schedule.buffers[op.dst]
            c = racy[op.index]["clipped"] if op.index in racy else clipped_plan(op.plan, src.nbytes, dst.nbytes)
            ss, se = state.get(op.src, (z, z))
            # indeterminate source bytes that are copied, at their destination
            ps, pe, pi = _intersect_sets(c.src, c.src + c.copy_len, ss, se)
            moved_s, moved_e = ps + (c.dst - c.src)[pi], pe + (c.dst - c.src)[pi]
            ds, de = state.get(op.dst, (z, z))
            ws, we = merge_intervals(c.dst, c.dst + c.fill_end)
            ds, de = _subtract(ds, de, ws, we)
            add_s, add_e = [ds, moved_s], [de, moved_e]
            if op.index in racy:
                add_s.append(racy[op.index]["starts"])
                add_e.append(racy[op.index]["ends"])
            state[op.dst] = merge_intervals(np.concatenate(add_s), np.concatenate(add_e))
        elif op.op == "write" and op.buffer in state:
            ws, we = _merge(*op.extents)
            state[op.buffer] = _subtract(*state[op.buffer], ws, we)
        elif op.op == "read" and op.buffer in state:
            rs, re_ = _merge(*op.extents)
            s, e, _ = _intersect_sets(rs, re_, *state[op.buffer])
            if s.size:
                out[op.index] = merge_intervals(s, e)
    return out


# ----------------------------------------------------------------------------
# online: clocks and latent races as ops are issued, holding live state only

class OnlineClocks:
    """The vector clocks of :class:`HappensBefore`, computed one op at a time in
    issue order (every edge points forward, so an op's clock is known when it is
    issued), holding only what a later op can refer to: each stream's last op,
    each event's latest record (the ops a ``wait``, ``host_sync`` or positive
    ``host_query`` can bind to), each host's clock and the barriers not yet
    complete.  ``add(op)`` returns the op's ``(component, position, clock)``;
    the clock must not be modified."""

    def __init__(self, streams, hosts):
        names = list(streams)
        self.stream_idx = {n: i for i, n in enumerate(names)}
        self.host_idx = {h: len(names) + i for i, h in enumerate(hosts)}
        self.n_comp = len(names) + len(self.host_idx)
        self.count = [0] * self.n_comp                        # ops so far per component
        self.hc = {h: np.zeros(self.n_comp, np.int64) for h in hosts}
        self.last: dict[str, tuple[int, np.ndarray]] = {}     # stream -> (op index, clock)
        self.records: dict[str, tuple[int, np.ndarray]] = {}  # event -> (latest record index, clock)
        self._by_index: dict[int, np.ndarray] = {}            # clocks later ops may name (see _refs)
        self._refs: dict[int, int] = {}
        self._barrier: dict[str, list] = {}

    def _hold(self, i: int, clock) -> None:
        self._by_index[i] = clock
        self._refs[i] = self._refs.get(i, 0) + 1

    def _drop(self, i: int) -> None:
        n = self._refs[i] - 1
        if n:
            self._refs[i] = n
        else:
            del self._refs[i], self._by_index[i]

    def clock_of(self, i: int) -> np.ndarray:
        return self._by_index[i]

    def add(self, op):
        if op.stream is not None:
            k = self.stream_idx[op.stream]
            prev = self.last.get(op.stream)
            # a new array either way (the host's and the previous op's clocks are held)
            c = self.hc[op.host].copy() if prev is None else np.maximum(self.hc[op.host], prev[1])
            if op.op == "wait" and op.bound_record is not None:
                np.maximum(c, self._by_index[op.bound_record], out=c)
        else:
            c = self.hc[op.host].copy()
            k = self.host_idx[op.host]
            for t in op.sync_targets:
                np.maximum(c, self._by_index[t], out=c)
        n = self.count[k] = self.count[k] + 1
        c[k] = n
        if op.stream is not None:
            if prev is not None:
                self._drop(prev[0])
            self.last[op.stream] = (op.index, c)
            self._hold(op.index, c)
            if op.op == "record":
                old = self.records.get(op.event)
                if old is not None:
                    self._drop(old[0])
                self.records[op.event] = (op.index, c)
                self._hold(op.index, c)
        else:
            self.hc[op.host] = c
        if op.op == "barrier":
            inst = self._barrier.setdefault(op.barrier, [np.zeros(self.n_comp, np.int64), 0])
            np.maximum(inst[0], c, out=inst[0])
            inst[1] += 1
            if inst[1] == len(op.hosts):
                for h in op.hosts:
                    self.hc[h] = np.maximum(self.hc[h], inst[0])
                del self._barrier[op.barrier]
        return k, n, c

    def floor(self) -> np.ndarray:
        """A lower bound of the clock of every op issued from now on: a later op of
        stream ``s`` issued by host ``h`` is after ``s``'s last op and after ``h``'s clock
        (:meth:`add` joins both), so its clock is at least the elementwise maximum of the
        smallest last-op clock (zero while a stream has no op) and the smallest host clock.
        An op ``a`` with ``floor()[comp(a)] >= pos(a)`` happens before every later op.

        NOTE: the host term is what lets a stream that has gone idle (a HiCache run whose
        load-backs stop) not pin the others: its last op is old in every other stream's
        component, but the host that synchronized past the others' ops is not."""
        hosts = np.minimum.reduce(list(self.hc.values())) if self.hc else np.zeros(self.n_comp, np.int64)
        if len(self.last) < len(self.stream_idx):
            return hosts
        return np.maximum(np.minimum.reduce([c for _, c in self.last.values()]), hosts)


class _LiveBuffer:
    """One buffer's accesses that may still race a later op: one row per merged
    interval, ``(start, end, op index, the op's clock component, its position in it,
    write)``, as numpy columns (``columns``, in row order) for the queries that test many
    rows at once, and as a list of tuples (``rows``) for those that touch a few rows one at
    a time (plain Python).

    NOTE: the columns are the rows; the tuples of an access of a few intervals are made as
    it is appended (while every row before it has its tuple), the others when a Python query
    first needs them (only those not made yet), and a prune keeps those made.  A wide access
    (a forward's read, a batch's KV store: thousands of intervals) is mostly queried and
    pruned by the vectorised paths, so its tuples are never made: making them as rows were
    appended was about 4 % of a long engine run.

    Rows are indexed by the ``2**BUCKET_SHIFT``-byte buckets of the buffer they touch
    (intervals spanning more than ``MAX_BUCKETS`` buckets are kept in ``wide``), so
    the rows an interval can overlap are found without scanning every live row
    (``overlapping``).  A query that touches more than ``4 * MAX_BUCKETS`` buckets (a
    batch's KV store or a forward's read: hundreds of scattered pages) tests every
    live row instead, vectorised over the columns when at least ``NUMPY_ROWS`` rows
    are live."""

    BUCKET_SHIFT = 16                   # 64 KiB buckets
    MAX_BUCKETS = 8
    #: appends of at least this many intervals (given as arrays) are indexed vectorised
    INDEX_MANY = 16
    #: live rows from which a query that cannot use the buckets is vectorised
    NUMPY_ROWS = 32
    #: accesses of at most this many intervals get their tuples as they are appended
    EAGER_ROWS = 16

    def __init__(self):
        self._rows: list[tuple] = []        # the tuples of rows[:len(_rows)] (see rows)
        self._n = 0                         # live rows
        self.buckets: dict[int, list[int]] = {}
        self.wide: list[int] = []
        self._indexed = 0                   # rows[:_indexed] are in buckets / wide (see _index_rows)
        self.writes = 0                     # rows that are writes (none: a read cannot race here)
        # the largest position per clock component of the live rows, and of the live write rows:
        # an access whose clock reaches every one of them is after every row (racing's shortcut)
        self._top: dict[int, int] = {}
        self._top_w: dict[int, int] = {}
        # columns (start, end, op, comp, pos, write) of rows[:_n_cols]; rows appended since
        # are in _pending as (starts, ends, op, comp, pos, write) chunks until columns() is asked
        self._cols = tuple(np.zeros(0, np.int64) for _ in range(5)) + (np.zeros(0, bool),)
        self._n_cols = 0                    # the columns' entries in use (the rest is capacity)
        self._pending: list[tuple] = []

    @property
    def n(self) -> int:
        return self._n

    @property
    def rows(self) -> list[tuple]:
        """The live rows as tuples, in row order (the list is this buffer's: valid until the
        next call that changes the rows)."""
        made = self._rows
        r0 = len(made)
        if r0 < self._n:
            cols = self.columns()
            made.extend(zip(*(c[r0:].tolist() for c in cols)))
        return made

    def _rows_at(self, idx) -> list[tuple]:
        """The tuples of rows ``idx`` (ascending indices), as :attr:`rows` has them, made only
        for those rows: the made prefix's where it reaches, the rest read from the columns (and
        not kept: the made tuples stay a prefix of the rows)."""
        made = self._rows
        m = len(made)
        if not len(idx) or idx[-1] < m:
            return [made[r] for r in idx]
        k = bisect.bisect_left(idx, m)
        rest = np.asarray(idx[k:], np.int64)
        out = [made[r] for r in idx[:k]]
        out.extend(zip(*(c[rest].tolist() for c in self.columns())))
        return out

    def _index(self, r: int, s: int, e: int) -> None:
        sh = self.BUCKET_SHIFT
        b0, b1 = s >> sh, (e - 1) >> sh
        if b1 - b0 >= self.MAX_BUCKETS:
            self.wide.append(r)
            return
        buckets = self.buckets
        for b in range(b0, b1 + 1):
            lst = buckets.get(b)
            if lst is None:
                buckets[b] = [r]
            else:
                lst.append(r)

    def _index_many(self, r0: int, s_arr: np.ndarray, e_arr: np.ndarray) -> None:
        """``_index`` of rows ``r0, r0 + 1, ...`` (intervals ``[s_arr, e_arr)``), vectorised:
        the (row, bucket) pairs sorted by bucket (stably: each bucket's rows stay in row
        order), then one list extension per bucket."""
        sh = self.BUCKET_SHIFT
        b0 = s_arr >> sh
        nb = ((e_arr - 1) >> sh) - b0 + 1
        wide = nb > self.MAX_BUCKETS
        if wide.any():
            self.wide.extend((np.flatnonzero(wide) + r0).tolist())
            narrow = np.flatnonzero(~wide)
            b0, nb = b0[narrow], nb[narrow]
        else:
            narrow = np.arange(s_arr.size)
        row = np.repeat(narrow + r0, nb)
        bucket = np.repeat(b0, nb) + _ranks(nb)
        order = np.argsort(bucket, kind="stable")
        bucket, row = bucket[order], row[order]
        if not bucket.size:
            return
        head = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
        bounds = head.tolist() + [bucket.size]
        rows = row.tolist()
        buckets = self.buckets
        for b, lo, hi in zip(bucket[head].tolist(), bounds, bounds[1:]):
            lst = buckets.get(b)
            if lst is None:
                buckets[b] = rows[lo:hi]
            else:
                lst.extend(rows[lo:hi])

    def append(self, s: list, e: list, op: int, comp: int, pos: int, write: bool,
               s_arr: np.ndarray | None = None, e_arr: np.ndarray | None = None) -> None:
        """Rows for the merged intervals ``[s, e)`` (lists; ``s_arr``/``e_arr``: the same
        as int64 arrays, when the caller has them) of one access.

        NOTE: the rows are put in the buckets only when a query first needs the buckets
        (:meth:`_index_rows`): most rows of a wide access (a forward's reads and KV stores,
        hundreds of intervals each) are pruned before any bucket query looks at them, and the
        buckets hold the same lists whenever they are indexed (rows go in in row order).  A
        one-interval access appended when every row before it is indexed goes in at once."""
        made = self._rows
        if len(s) <= self.EAGER_ROWS and len(made) == self._n:
            if len(s) == 1:
                made.append((s[0], e[0], op, comp, pos, write))
                if self._indexed == self._n:        # what the next query's _index_rows would do
                    self._index(self._n, s[0], e[0])
                    self._indexed += 1
            else:
                made.extend(zip(s, e, repeat(op), repeat(comp), repeat(pos), repeat(write)))
        self._pending.append((s if s_arr is None else s_arr, e if e_arr is None else e_arr, op, comp, pos, write))
        self._n += len(s)
        if self._top.get(comp, 0) < pos:
            self._top[comp] = pos
        if write:
            self.writes += len(s)
            if self._top_w.get(comp, 0) < pos:
                self._top_w[comp] = pos

    def _index_rows(self) -> None:
        """Put the rows appended since the last call in the buckets (or ``wide``), in row
        order: what indexing each as it was appended gives."""
        r0, r1 = self._indexed, self._n
        if r1 <= r0:
            return
        if r1 - r0 >= self.INDEX_MANY:
            S, E = self.columns()[:2]
            self._index_many(r0, S[r0:], E[r0:])
        else:
            for r, row in zip(range(r0, r1), self._rows_at(range(r0, r1))):
                self._index(r, row[0], row[1])
        self._indexed = r1

    def _bucket_rows(self, s: list, e: list) -> list | None:
        """The live rows overlapping ``[s, e)``, in row order, when the merged intervals are one
        interval inside one bucket and no wide row is live: that bucket's list (the rows
        appended since the last query indexed first; a row is listed once per bucket, in the
        order rows were appended).  None otherwise."""
        sh = self.BUCKET_SHIFT
        if not (len(s) == 1 and (e[0] - 1) >> sh == s[0] >> sh):
            return None
        if self._indexed < self._n:
            self._index_rows()
        if self.wide:
            return None
        lo, hi = s[0], e[0]
        lst = self.buckets.get(lo >> sh)
        if not lst:
            return []
        made = self._rows
        rows = map(made.__getitem__, lst) if lst[-1] < len(made) else self._rows_at(lst)
        return [row for row in rows if row[0] < hi and row[1] > lo]

    def columns(self) -> tuple:
        """The live rows as numpy columns ``(start, end, op, comp, pos, write)``, in row order
        (views of the first ``len(rows)`` entries; valid until the next call that changes the
        rows).

        NOTE: the columns have spare capacity, doubled when full, so the rows appended since
        the last call are copied in once (amortised O(1) per row): re-concatenating the whole
        columns on every call made a query after each append cost O(live rows)."""
        pend = self._pending
        n = self._n_cols
        if pend:
            self._pending = []
            sizes = [len(p[0]) for p in pend]
            m = n + sum(sizes)
            cols = self._cols
            if m > len(cols[0]):
                cap = max(m, 2 * len(cols[0]), 64)
                grown = []
                for c in cols:
                    g = np.empty(cap, c.dtype)
                    g[:n] = c[:n]
                    grown.append(g)
                cols = self._cols = tuple(grown)
            S, E, OP, COMP, POS, W = cols
            at = n
            for (ps, pe, op, comp, pos, w), k in zip(pend, sizes):
                S[at:at + k] = ps
                E[at:at + k] = pe
                OP[at:at + k] = op
                COMP[at:at + k] = comp
                POS[at:at + k] = pos
                W[at:at + k] = w
                at += k
            n = self._n_cols = m
        return tuple(c[:n] for c in self._cols)

    def _touched_buckets(self, s: list, e: list, s_arr, e_arr) -> int:
        """How many (interval, bucket) pairs the merged intervals ``[s, e)`` touch."""
        sh = self.BUCKET_SHIFT
        if len(s) <= 8 or s_arr is None:
            return sum(((ei - 1) >> sh) - (si >> sh) + 1 for si, ei in zip(s, e))
        return int((((e_arr - 1) >> sh) - (s_arr >> sh)).sum()) + len(s)

    def _rows_overlapping(self, s: list, e: list, s_arr=None, e_arr=None):
        """Row indices (ascending) of the live rows overlapping ``[s, e)``, or None when
        the query is better answered by the buckets (``overlapping``'s Python paths)."""
        if self._n < self.NUMPY_ROWS or self._touched_buckets(s, e, s_arr, e_arr) <= 4 * self.MAX_BUCKETS:
            return None
        S, E = self.columns()[:2]
        return _overlap_rows(S, E, np.arange(S.size), s, e, s_arr, e_arr)

    def overlapping(self, s: list, e: list, s_arr=None, e_arr=None) -> list:
        """The live rows that overlap the merged intervals ``[s, e)`` (lists), in row order."""
        got = self._bucket_rows(s, e)
        if got is not None:
            return got
        idx = self._rows_overlapping(s, e, s_arr, e_arr)
        if idx is not None:
            return self._rows_at(idx.tolist())
        return self._overlapping_py(s, e)

    def racing(self, s: list, e: list, s_arr, e_arr, write: bool, clock: np.ndarray, cl: list | None):
        """Op indices (an iterable, repeats allowed) of the live rows that overlap ``[s, e)``
        and race an access of an op with clock ``clock`` (``cl``: the same as a list, or None):
        the row's op is not ordered before it (``clock[comp] < pos``) and one side writes.
        The same ops as filtering ``overlapping(s, e)``.

        NOTE: first, whether the clock reaches the largest position of each component among
        the rows that could race (every row for a write, the write rows for a read): then no
        row races whatever it overlaps (a load copy issued after the forward's reads it
        overwrites, a read after the loads it waited for), without looking at the rows."""
        if cl is None:
            cl = clock.tolist()
        for c, p in (self._top if write else self._top_w).items():
            if cl[c] < p:
                break
        else:
            return ()
        cand = self._bucket_rows(s, e)
        if cand is None and self._n >= self.NUMPY_ROWS and \
                self._touched_buckets(s, e, s_arr, e_arr) > 4 * self.MAX_BUCKETS:
            # NOTE: the clock and write tests first (cheap, vectorised), the interval test
            # only on the rows left
            S, E, OP, COMP, POS, W = self.columns()
            m = clock[COMP] < POS
            if not write:
                m &= W
            idx = np.flatnonzero(m)
            if not idx.size:
                return ()
            return OP[_overlap_rows(S, E, idx, s, e, s_arr, e_arr)].tolist()
        if cand is None:
            cand = self._overlapping_py(s, e)
        if not cand:
            return ()
        return [row[2] for row in cand if cl[row[3]] < row[4] and (write or row[5])]

    def _overlapping_py(self, s: list, e: list) -> list:
        sh = self.BUCKET_SHIFT
        if ((e[-1] - 1) >> sh) - (s[0] >> sh) < 4 * self.MAX_BUCKETS \
                or self._touched_buckets(s, e, None, None) <= 4 * self.MAX_BUCKETS:
            self._index_rows()
            cand = set(self.wide)
            buckets = self.buckets
            for si, ei in zip(s, e):
                for b in range(si >> sh, ((ei - 1) >> sh) + 1):
                    lst = buckets.get(b)
                    if lst:
                        cand.update(lst)
            if not cand:
                return []
            cand = self._rows_at(sorted(cand))
        else:
            cand = self.rows
        out = []
        if len(s) == 1:
            lo, hi = s[0], e[0]
            for row in cand:
                if row[0] < hi and row[1] > lo:
                    out.append(row)
            return out
        for row in cand:
            j = bisect.bisect_right(e, row[0])        # first interval ending after the row's start
            if j < len(s) and s[j] < row[1]:
                out.append(row)
        return out

    def keep_after(self, floor: list) -> None:
        """Keep the rows whose op does not happen before ``floor`` (a clock, as a list).

        NOTE: vectorised over the columns, unless every row has its tuple and rows are
        pending for the columns: copying them in costs six slice assignments per pending
        access (a static run's one-page accesses: 2,048 of them between prunes), a filter
        over the tuples a few list operations a row."""
        if self._n >= self.NUMPY_ROWS and not (self._pending and len(self._rows) == self._n):
            S, E, OP, COMP, POS, W = cols = self.columns()
            keep = np.asarray(floor, np.int64)[COMP] < POS
            if keep.all():
                return
            idx = np.flatnonzero(keep)
            # the tuples made already of the rows kept: a prefix of the kept rows
            made = self._rows
            self._rows = [made[r] for r in idx[:int(np.searchsorted(idx, len(made)))].tolist()]
            self._cols = tuple(c[idx] for c in cols)
            n, writes = idx.size, int(np.count_nonzero(W[idx]))
        else:
            rows = self.rows
            kept = [row for row in rows if floor[row[3]] < row[4]]
            if len(kept) == len(rows):
                return
            self._cols, self._pending = _columns_of(kept), []
            self._rows = kept
            n, writes = len(kept), sum(1 for row in kept if row[5])
        comp, pos, w = self._cols[3], self._cols[4], self._cols[5]
        self._top, self._top_w = _tops(comp, pos), _tops(comp[w], pos[w])
        self._n_cols = self._n = n
        self.writes = writes
        self.buckets, self.wide, self._indexed = {}, [], 0

    def ops(self) -> list:
        """The op index of every live row (repeats included)."""
        return self.columns()[2].tolist()


def _tops(comp: np.ndarray, pos: np.ndarray) -> dict[int, int]:
    """The largest ``pos`` per ``comp`` value (positions are at least 1)."""
    if not comp.size:
        return {}
    top = np.zeros(int(comp.max()) + 1, np.int64)
    np.maximum.at(top, comp, pos)
    return {c: p for c, p in enumerate(top.tolist()) if p}


def _columns_of(rows: list) -> tuple:
    """Numpy columns ``(start, end, op, comp, pos, write)`` of rows (tuples)."""
    a = np.array([row[:5] for row in rows], np.int64).reshape(-1, 5)
    return (*(np.ascontiguousarray(a[:, k]) for k in range(5)), np.array([row[5] for row in rows], bool))


def _overlap_rows(S, E, idx, s: list, e: list, s_arr=None, e_arr=None) -> np.ndarray:
    """The entries of ``idx`` (row indices, ascending) whose interval ``[S, E)`` overlaps
    the merged intervals ``[s, e)``, vectorised: the first query interval ending after a
    row's start is the only one that can overlap it."""
    rs, re_ = S[idx], E[idx]
    if len(s) == 1:
        return idx[(rs < e[0]) & (re_ > s[0])]
    qs = np.asarray(s, np.int64) if s_arr is None else s_arr
    qe = np.asarray(e, np.int64) if e_arr is None else e_arr
    j = np.searchsorted(qe, rs, side="right")
    inside = j < qs.size
    ok = inside.copy()
    ok[inside] = qs[j[inside]] < re_[inside]
    return idx[ok]


class RaceTracker:
    """Latent races found as ops are issued (the definition of :func:`race_scan`:
    one per (buffer, op pair) whose overlapping byte accesses, at least one a
    write, are unordered), without keeping every access: an access is dropped
    once it happens before every op that can still be issued
    (:meth:`OnlineClocks.floor`), which is what bounds memory by the accesses
    still live, not by the run's length.

    A new op's accesses are checked against the live accesses of their buffer
    (the op itself is issued last, so an earlier op is either before it or
    concurrent).  Every racing pair is counted (``total``); per buffer the
    ``limit`` smallest (earlier op, later op) pairs are kept with their entry,
    which is what ``race_scan(s, hb, limit)`` lists: buffers in order of first
    access, pairs in op order."""

    #: live accesses are pruned when this many ops were added since the last prune (and
    #: at least as many as were live after it)
    PRUNE_EVERY = 512
    #: ... or when this many intervals were added (a few wide ops: a batch's multi-layer KV stores
    #: and one-step reads add thousands of intervals each, so 512 ops held a long stretch of them)
    PRUNE_ROWS = 1 << 15

    def __init__(self, clocks: OnlineClocks, limit: int | None, describe=None):
        self.clocks = clocks
        self.limit = limit
        self.total = 0
        self.live: dict[str, _LiveBuffer] = {}          # in order of first access
        self.kept: dict[str, list] = {}                 # buffer -> max-heap [(-a, -b, n, entry)]
        self.describe = describe                        # (entry, a info, b info) -> entry
        self.info: dict[int, tuple] = {}                # live op index -> caller's info (for entries)
        self._accs: dict[int, list] = {}                # live op index -> [(buffer, write, starts, ends)]
        self._since_prune = 0                   # ops added since the last prune
        self._rows_since_prune = 0              # their intervals
        self._live_after_prune = 0
        self._prune_floor = None                # floor_of's clock for the prune running
        self._seq = 0
        #: called as ``on_race(a_ops, b)`` with the live ops ``a_ops`` found racing op ``b``
        #: (the op being added) on one of its buffers, every time some are (None: not called)
        self.on_race = None

    def add(self, op_index: int, comp: int, pos: int, clock: np.ndarray, accs: list, info=None) -> None:
        """Accesses ``accs`` ``[(buffer, write, starts, ends)]`` (merged intervals) of the
        op just issued, with its clock; ``info`` is kept for race entries."""
        accs = [a for a in accs if a[2].size]
        if not accs:
            return
        self.info[op_index] = info
        if len(accs) == 1 or (len(accs) == 2 and accs[0][0] != accs[1][0]):
            by_buf = {a[0]: [a] for a in accs}          # one access per buffer (reads, writes, most copies)
        else:
            by_buf: dict[str, list] = {}
            for a in accs:
                by_buf.setdefault(a[0], []).append(a)
        cl = None
        for buf, mine in by_buf.items():
            lb = self.live.get(buf)
            if lb is None:
                lb = self.live[buf] = _LiveBuffer()
                self.kept[buf] = []
            spans = [(w, s.tolist(), e.tolist(), s, e) for _, w, s, e in mine]
            if lb._n:
                hits = set()
                for w, s, e, sa, ea in spans:
                    if not (w or lb.writes):
                        continue                # a read where only reads are live: nothing to race
                    if cl is None:
                        cl = clock.tolist()
                    ops = lb.racing(s, e, sa, ea, w, clock, cl)
                    if ops:
                        hits.update(ops)
                if hits:
                    self.total += len(hits)
                    if self.on_race is not None:
                        self.on_race(hits, op_index)
                    if self.limit != 0:
                        self._keep(buf, sorted(hits), op_index, mine)
            for w, s, e, sa, ea in spans:
                lb.append(s, e, op_index, comp, pos, bool(w), sa, ea)
        self._accs[op_index] = accs
        self._since_prune += 1
        self._rows_since_prune += sum(a[2].size for a in accs)
        # NOTE: a prune costs O(live intervals); pruning once at least that many intervals
        # were added keeps its cost O(1) per interval added, and the live set within a
        # constant factor of what can race.  Counting ops instead let a run of wide writes
        # (a batch's KV store: hundreds of intervals an op) grow the live set unpruned.
        if ((self._since_prune >= self.PRUNE_EVERY or self._rows_since_prune >= self.PRUNE_ROWS)
                and self._rows_since_prune >= self._live_after_prune):
            self.prune()

    def _keep(self, buf: str, a_ops: list, b: int, mine: list) -> None:
        """Keep the pairs (a, b) among the ``limit`` smallest of ``buf`` (a max-heap)."""
        heap = self.kept[buf]
        for a in a_ops:
            full = self.limit is not None and len(heap) >= self.limit
            if full and (heap[0][0], heap[0][1]) >= (-a, -b):
                continue                       # not among the smallest `limit` pairs
            self._seq += 1
            item = (-a, -b, self._seq, self._entry(buf, a, b, mine))
            if full:
                heapq.heapreplace(heap, item)
            else:
                heapq.heappush(heap, item)

    def _entry(self, buf: str, a: int, b: int, b_accs: list) -> dict:
        """The race_scan entry of (a, b) on ``buf`` (a's accesses are live)."""
        pieces_s, pieces_e, first = [], [], None
        for x in self._accs[a]:
            if x[0] != buf:
                continue
            for y in b_accs:
                if not (x[1] or y[1]):
                    continue
                if x[2].size == 1 and y[2].size == 1:       # one interval each: plain integers
                    lo, hi = max(int(x[2][0]), int(y[2][0])), min(int(x[3][0]), int(y[3][0]))
                    s, e = (np.array([lo], np.int64), np.array([hi], np.int64)) if hi > lo else (None, None)
                else:
                    s, e, _ = _intersect_sets(x[2], x[3], y[2], y[3])
                if s is not None and s.size:
                    pieces_s.append(s)
                    pieces_e.append(e)
                    first = first or (x, y)
        if len(pieces_s) == 1 and pieces_s[0].size == 1:    # one interval: merged already
            s, e = pieces_s[0], pieces_e[0]
        else:
            s, e = merge_intervals(np.concatenate(pieces_s), np.concatenate(pieces_e))
        n = None if self.limit is None else MAX_RACE_RANGES     # as race_scan: limit None lists every range
        entry = {"buffer": buf, "ops": (a, b), "writes": (first[0][1], first[1][1]),
                 "starts": s[:n], "ends": e[:n], "n_ranges": int(s.size),
                 "bytes": int((e - s).sum())}
        if self.describe is not None:
            entry = self.describe(entry, self.info.get(a), self.info.get(b))
        return entry

    def floor_of(self, buf: str):
        """A lower bound (a clock, as a list) of the clock of every op still to be issued
        that can access ``buf``: here, of every op (:meth:`OnlineClocks.floor`).  A
        tracker that knows which streams can still access a buffer (a static schedule's:
        ``sim.verdicts.StaticRaceTracker``) overrides it; :meth:`prune` drops a buffer's
        accesses that happen before it."""
        if self._prune_floor is None:
            self._prune_floor = self.clocks.floor().tolist()
        return self._prune_floor

    def prune(self) -> None:
        """Drop, per buffer, the accesses that happen before every op still to be issued
        that can access the buffer (:meth:`floor_of`)."""
        self._since_prune = self._rows_since_prune = 0
        self._prune_floor = None
        alive_ops = set()
        for buf, lb in self.live.items():
            if lb._n:
                lb.keep_after(self.floor_of(buf))
                alive_ops.update(lb.ops())
        self._live_after_prune = self.live_accesses()
        for i in [i for i in self._accs if i not in alive_ops]:
            del self._accs[i]
            self.info.pop(i, None)

    def live_accesses(self) -> int:
        """Intervals held now (what the tracker's memory follows)."""
        return sum(lb.n for lb in self.live.values())

    def listed(self, limit: int | None = None) -> list[dict]:
        """The kept entries, as ``race_scan`` lists them: buffers in order of first
        access, each buffer's pairs in op order, at most ``limit`` in all."""
        out = []
        for buf, heap in self.kept.items():
            for item in sorted(heap, key=lambda x: (-x[0], -x[1])):
                if limit is not None and len(out) >= limit:
                    return out
                out.append(item[3])
        return out
