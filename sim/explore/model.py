"""The race model of a schedule: what can be reordered, in steps whose order matters.

Exploration sees a schedule as **steps** that each touch their bytes at one instant:

* a ``read`` or a ``write`` is one step (the executor's semantics: a kernel touches its
  bytes ``kernel_launch_us`` after it starts, all at once);
* a ``copy`` is a sequence of **atoms** that land in order: item by item (the items of
  one launch land in index order, the timing model's contract), and inside an item in
  chunks of ``chunk_bytes`` of its concatenated extents (a prefix of the item has
  landed, as ``sim.transfers.timing.bytes_done`` says).  An atom reads its source bytes
  and writes its destination bytes when it lands (the executor samples a copy item's
  source when it lands).  ``chunk_bytes <= 0`` keeps items whole (item granularity:
  what a controlled GPU replay can force).  The chunk is rounded up to a multiple of the
  routine's own write granularity (``Launch.chunk_bytes``: 256 B for sgl-kernel's warp
  copies, 584 B for the DeepSeek V4 token copy, 1 B for ``cudaMemcpyAsync`` runs), so
  every tear explored is one the kernel can leave.

**One item in flight.**  Atoms of a copy land in one sequence (item 0's chunks, then item
1's, ...), so at any instant at most one item of a copy is part-way.  The timing model can
leave several items of one round part-way at once; those states are not explored (an
outcome with two torn items of one copy needs two tears; the reads that see them are torn
here too, at one item).

**Only racing ops are cut.**  Two ops *race* when their accesses overlap on some bytes, one
of them a write, and neither happens before the other (``sim.hb.latent_races``).  An op
that races nothing is ordered by happens-before against every op that touches its bytes,
so it stays one step.  A racing copy is cut into **blocks**: each atom that conflicts with
an atom of an op it races ends a block, and the atoms that conflict with nothing go with
the next such atom (the last ones with the last block).  Moving a non-conflicting atom
never changes a byte anyone sees, so the blocks lose nothing.  ``Node`` is one step of the
model: a whole op, or one block of a racing copy.

Constraints between nodes: happens-before between their ops (all of ``A`` before any of
``B`` when ``A`` happens before ``B``), and a racing copy's blocks in order.  A **conflict
pair** is two nodes of two racing ops whose bytes conflict; the order of every conflict
pair decides every byte every read sees and every final byte (Mazurkiewicz: two orders
that agree on every conflict pair are equivalent), so ``sim.explore.search`` enumerates
those orders and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sim.errors import InputError
from sim.hb import HappensBefore, latent_races, merge_intervals
from sim.memory import Clipped, clip_extents
from sim.schedule import Schedule

__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_BYTE_OPS", "MAX_NODES", "Node", "RaceModel", "build_model"]

#: default chunk: 4 KiB of an item's concatenated extents (an 8,448 B DSA index-K page lands
#: in 3 chunks: keys 0-4095, keys 4096-8191, then the last 256 B of keys with the scales, so
#: a read can see it torn at 4,096 B and at 8,192 B)
DEFAULT_CHUNK_BYTES = 4096
#: ops that touch bytes (copy, read, write) a model takes (happens-before between them is a
#: dense matrix)
MAX_BYTE_OPS = 2048
#: nodes (whole ops and blocks) a model takes
MAX_NODES = 20000

BYTE_OPS = ("copy", "read", "write")


@dataclass
class Node:
    """One step: a whole op (``k == 0``, ``parts == 1``) or block ``k`` of a racing copy.

    ``first``/``end``: the (item, byte in item) where the block starts and ends (a copy;
    ``end`` exclusive; ``(n, 0)`` is the copy's end).  ``clipped``: the extents it
    applies (a copy), cut to its bytes.  ``acc``: its byte accesses as
    ``(buffer, write, starts, ends)`` (merged intervals)."""

    id: int
    op: int
    k: int
    parts: int
    clipped: Clipped | None = None
    first: tuple[int, int] = (0, 0)
    end: tuple[int, int] = (0, 0)
    acc: list = field(default_factory=list)


@dataclass
class RaceModel:
    """What exploration reorders (see the module doc).

    ``nodes`` in issue order (an op's blocks consecutive); ``op_nodes[op index]``: its node
    ids; ``hb_edges``: (node, node) edges whose transitive closure, with the blocks' chain,
    is happens-before between byte ops (immediate edges only); ``pairs``: conflict pairs
    (node ids ``u < v``) of racing ops; ``racing``: racing op index pairs."""

    schedule: Schedule
    chunk_bytes: int
    nodes: list[Node]
    op_nodes: dict[int, list[int]]
    hb_edges: list[tuple[int, int]]
    pairs: list[tuple[int, int]]
    racing: list[tuple[int, int]]
    hb: HappensBefore

    @property
    def racing_ops(self) -> list[int]:
        return sorted({i for p in self.racing for i in p})

    def steps(self) -> int:
        """Nodes: the steps of one order (PCT's k)."""
        return len(self.nodes)

    def describe_node(self, nid: int) -> dict:
        """The node as the JSON of a witness order: op id, and for a copy block its item and
        byte bounds."""
        n = self.nodes[nid]
        op = self.schedule.ops[n.op]
        d = {"op": op.id}
        if op.op == "copy" and n.parts > 1:
            d["from"] = list(n.first)
            d["to"] = list(n.end)
        return d



def _overlap(a_s, a_e, b_s, b_e) -> bool:
    """Do two merged interval sets share a byte?"""
    if a_s.size == 0 or b_s.size == 0:
        return False
    lo = np.searchsorted(b_e, a_s, side="right")
    hi = np.searchsorted(b_s, a_e, side="left")
    return bool((hi > lo).any())


def conflict(acc_a: list, acc_b: list) -> bool:
    """Two access lists conflict: overlapping bytes of one buffer, at least one side writing."""
    for buf_a, wa, sa, ea in acc_a:
        for buf_b, wb, sb, eb in acc_b:
            if buf_a == buf_b and (wa or wb) and _overlap(sa, ea, sb, eb):
                return True
    return False


def _copy_access(op, c: Clipped) -> list:
    return [(op.src, False, *merge_intervals(c.src, c.src + np.minimum(c.length, c.fill_start))),
            (op.dst, True, *merge_intervals(c.dst, c.dst + c.fill_end))]


def _op_access(s: Schedule, op) -> tuple[list, Clipped | None]:
    if op.op == "copy":
        src, dst = s.buffers[op.src], s.buffers[op.dst]
        c = clip_extents(op.plan.extents, src.nbytes, dst.nbytes)
        return _copy_access(op, c), c
    offs, lens = op.extents
    offs = np.asarray(offs, np.int64)
    return [(op.buffer, op.op == "write", *merge_intervals(offs, offs + np.asarray(lens, np.int64)))], None


def _sub_clipped(c: Clipped, idx: np.ndarray, a: np.ndarray, b: np.ndarray) -> Clipped:
    """Bytes ``[a, b)`` of extents ``idx`` of ``c``, as extents of their own."""
    n = b - a
    return Clipped(c.src[idx] + a, c.dst[idx] + a, n, c.item[idx],
                   np.clip(c.copy_len[idx] - a, 0, n), np.clip(c.fill_start[idx] - a, 0, n),
                   np.clip(c.fill_end[idx] - a, 0, n), c.src_nbytes)


def _cat_clipped(parts: list[Clipped]) -> Clipped:
    if len(parts) == 1:
        return parts[0]
    cat = [np.concatenate([getattr(p, f) for p in parts]) for f in
           ("src", "dst", "length", "item", "copy_len", "fill_start", "fill_end")]
    return Clipped(*cat, parts[0].src_nbytes)


def copy_atoms(op, c: Clipped, chunk_bytes: int) -> list[tuple[tuple[int, int], tuple[int, int], Clipped]]:
    """The atoms of a copy, in landing order: ``(first, end, clipped part)`` with ``first``
    and ``end`` as (item, byte in item); see the module doc for the chunk rule."""
    ext = op.plan.extents
    n_items = int(ext.n_items)
    length = np.asarray(c.length, np.int64)
    item = np.asarray(c.item, np.int64)
    start = np.searchsorted(item, np.arange(n_items + 1))
    off = np.cumsum(length) - length
    granule = max(1, int(op.plan.launch.chunk_bytes))
    q = 0 if chunk_bytes <= 0 else -(-int(chunk_bytes) // granule) * granule
    atoms = []
    for i in range(n_items):
        e0, e1 = int(start[i]), int(start[i + 1])
        if e1 == e0:
            continue
        o = off[e0:e1] - off[e0]
        total = int(length[e0:e1].sum())
        if total == 0:
            continue
        bounds = [0, total] if q <= 0 or q >= total else list(range(0, total, q)) + [total]
        idx = np.arange(e0, e1)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            a = np.clip(lo - o, 0, length[e0:e1])
            b = np.clip(hi - o, 0, length[e0:e1])
            m = b > a
            part = _sub_clipped(c, idx[m], a[m], b[m])
            end = (i, hi) if hi < total else (i + 1, 0)
            atoms.append(((i, lo), end, part))
    # NOTE: the last block ends at the copy's end, whatever items without bytes follow
    if atoms:
        first, _, part = atoms[-1]
        atoms[-1] = (first, (n_items, 0), part)
    return atoms


def build_model(s: Schedule, chunk_bytes: int = DEFAULT_CHUNK_BYTES, hb: HappensBefore | None = None) -> RaceModel:
    """The race model of ``s`` (see the module doc)."""
    if not isinstance(chunk_bytes, (int, np.integer)) or isinstance(chunk_bytes, bool):
        raise InputError("chunk_bytes", f"expected a whole number of bytes (0: whole items), got {chunk_bytes!r}")
    hb = hb or HappensBefore(s)
    byte_ops = [op.index for op in s.ops if op.op in BYTE_OPS]
    if len(byte_ops) > MAX_BYTE_OPS:
        raise InputError("schedule", f"{len(byte_ops)} copies, reads and writes; exploration takes at most "
                         f"MAX_BYTE_OPS = {MAX_BYTE_OPS}: cut a window around the reads of interest "
                         "(sim.window.cut_window)")
    racing = sorted({tuple(sorted((r["a"].op, r["b"].op))) for r in latent_races(s, hb)})
    partners: dict[int, set] = {}
    for a, b in racing:
        partners.setdefault(a, set()).add(b)
        partners.setdefault(b, set()).add(a)

    access, clipped = {}, {}
    for i in byte_ops:
        access[i], clipped[i] = _op_access(s, s.ops[i])
    # atoms of racing copies; whole ops otherwise
    atoms: dict[int, list] = {}
    for i in partners:
        op = s.ops[i]
        if op.op == "copy":
            atoms[i] = [(f, e, part, _copy_access(op, part)) for f, e, part in copy_atoms(op, clipped[i], chunk_bytes)]
        else:
            atoms[i] = [((0, 0), (0, 0), None, access[i])]
    if sum(len(a) for a in atoms.values()) > MAX_NODES:
        raise InputError("chunk_bytes", f"the racing copies cut into more than MAX_NODES = {MAX_NODES} atoms; "
                         "expected a larger chunk (or 0: whole items)")
    # which atoms conflict with an atom of a racing partner, and with which
    hits: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for a, b in racing:
        for ka, (_, _, _, acc_a) in enumerate(atoms[a]):
            for kb, (_, _, _, acc_b) in enumerate(atoms[b]):
                if conflict(acc_a, acc_b):
                    hits.setdefault((a, ka), []).append((b, kb))
                    hits.setdefault((b, kb), []).append((a, ka))
    nodes: list[Node] = []
    op_nodes: dict[int, list[int]] = {}
    atom_node: dict[tuple[int, int], int] = {}
    for i in byte_ops:
        op = s.ops[i]
        if i not in atoms or op.op != "copy":
            nid = len(nodes)
            n_items = int(op.plan.extents.n_items) if op.op == "copy" else 0
            nodes.append(Node(nid, i, 0, 1, clipped[i], (0, 0), (n_items, 0), access[i]))
            op_nodes[i] = [nid]
            if i in atoms:
                atom_node[(i, 0)] = nid
            continue
        groups, cur = [], []
        for k, _ in enumerate(atoms[i]):
            cur.append(k)
            if (i, k) in hits:
                groups.append(cur)
                cur = []
        if cur:
            if groups:
                groups[-1].extend(cur)
            else:
                groups.append(cur)
        ids = []
        for k, g in enumerate(groups):
            nid = len(nodes)
            parts = [atoms[i][j][2] for j in g]
            part = _cat_clipped(parts)
            nodes.append(Node(nid, i, k, len(groups), part, atoms[i][g[0]][0], atoms[i][g[-1]][1],
                              _copy_access(op, part)))
            for j in g:
                atom_node[(i, j)] = nid
            ids.append(nid)
        op_nodes[i] = ids
    pairs = sorted({tuple(sorted((atom_node[x], atom_node[y]))) for x, ys in hits.items() for y in ys})
    return RaceModel(s, int(chunk_bytes), nodes, op_nodes, _hb_edges(hb, byte_ops, op_nodes), pairs, racing, hb)


def _hb_edges(hb: HappensBefore, byte_ops: list[int], op_nodes: dict) -> list[tuple[int, int]]:
    """Immediate happens-before edges between byte ops, as (last node of A, first node of B)."""
    if not byte_ops:
        return []
    idx = np.asarray(byte_ops, np.int64)
    # before[a, b]: byte op a happens before byte op b
    before = hb.clock[idx][:, hb.comp[idx]].T >= hb.pos[idx][:, None]
    np.fill_diagonal(before, False)
    m = before.astype(np.float32)
    implied = (m @ m) > 0
    direct = before & ~implied
    a, b = np.nonzero(direct)
    return [(op_nodes[byte_ops[x]][-1], op_nodes[byte_ops[y]][0]) for x, y in zip(a.tolist(), b.tolist())]
