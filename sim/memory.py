"""The bytes of a schedule's buffers, in both representations, and their address arena.

``Memory`` holds a compact (provenance) model of every buffer and, when asked,
a materialised one (real bytes); every operation is applied to both, so they
stay equal (the differential tests check the byte models themselves).

Initial contents: unit ``u`` of layer ``L`` of a buffer holds unit ``u`` of
origin ``(kind, L, owner=-1, version=0)`` ("the previous owner's bytes") where
a layer's units are contiguous (device pools, ``layer_first`` host pools); a
host pool that interleaves layers (``page_first``, ``page_first_direct``)
starts as one origin ``(kind, layer=-1, owner=-1, v0)`` whose unit is one
(index, layer) row in address order, so its initial state is one segment at
any size.  A buffer's ``init`` fills replace chosen units by a request's data.

Copies are given as clipped extents (see :func:`clip_extents`): the part of an
extent that would write past the destination's end is dropped (and reported as
an out-of-bounds write by the caller); the part that reads past the source's
end writes bytes of an ``oob:<source>`` origin, so whatever lands is still named.

The arena places each location's buffers one after another in declaration order,
512 B aligned (the CUDA caching allocator's rounding), so an out-of-bounds write
can say which neighbour it would have hit.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from sim.bytes.compact import CompactBuffer, OriginTable
from sim.bytes.material import MaterialBuffer
from sim.bytes.pattern import Origin

ARENA_ALIGN = 512
OOB_UNIT_BYTES = 4096
# Real bytes held by one run, every copy counted: a run materialises its own Memory and
# verdicts.analyse's reference run materialises another (MATERIALISED_COPIES of the buffers).
# Beyond the limit a Memory keeps the compact model only; every result is the same (the
# compact model materialises to the same bytes), only slower to read back.
MATERIALISE_LIMIT_BYTES = 1 << 30
MATERIALISED_COPIES = 2
DIGEST_CHUNK_BYTES = 16 << 20        # Memory.digest materialises at most this much at a time
# Buffers up to this size are digested by their bytes (sha256, comparable with a GPU run);
# larger ones by their provenance (see Memory.digest).
BYTE_DIGEST_LIMIT = 64 << 20
#: byte digests remembered by provenance digest (Memory.digest)
BYTE_DIGEST_CACHE = 256
_BYTE_DIGESTS: dict[str, str] = {}


def oob_origin(src_name: str) -> Origin:
    return Origin(f"oob:{src_name}", 0, -1, 0, OOB_UNIT_BYTES)


@dataclass
class Clipped:
    """Extents of one copy split into what can be applied.

    Per original extent: ``copy_len`` bytes are copied from src; bytes
    ``[fill_start, fill_end)`` of the extent read past the source's end; bytes
    from ``max(copy_len, fill_end)`` on would be written past the destination.
    """

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    item: np.ndarray
    copy_len: np.ndarray
    fill_start: np.ndarray
    fill_end: np.ndarray
    src_nbytes: int

    _rows = None

    def row(self, k: int) -> tuple[int, int, int, int, int]:
        """Extent ``k`` as Python ints ``(src, dst, copy_len, fill_start, fill_end)`` (the rows
        are made once per Clipped: a run's copies share one per plan)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = list(zip(self.src.tolist(), self.dst.tolist(), self.copy_len.tolist(),
                                         self.fill_start.tolist(), self.fill_end.tolist()))
        return rows[k]


def clip_extents(ext, src_nbytes: int, dst_nbytes: int) -> Clipped:
    s, d, n = (np.asarray(a, dtype=np.int64) for a in (ext.src, ext.dst, ext.length))
    # np.clip(x, 0, n), without np.clip's per-call overhead (this runs once per copy)
    in_dst = np.minimum(np.maximum(dst_nbytes - d, 0), n)
    in_src = np.minimum(np.maximum(src_nbytes - s, 0), n)
    copy_len = np.minimum(in_dst, in_src)
    return Clipped(s, d, n, np.asarray(ext.item, dtype=np.int64), copy_len,
                   np.minimum(in_src, in_dst), in_dst, src_nbytes)


#: clipped plans remembered by clipped_plan, and their extents in all (cleared when either
#: is reached: the cache outlives a run, so what it holds stays bounded)
CLIPPED_CACHE_SIZE = 4096
CLIPPED_CACHE_EXTENTS = 1 << 20
_CLIPPED: dict = {}
_clipped_extents = [0]


def clipped_plan(plan, src_nbytes: int, dst_nbytes: int) -> Clipped:
    """``clip_extents(plan.extents, src_nbytes, dst_nbytes)``, made once per plan object and
    sizes while it is remembered: the passes over a schedule (reference run, accesses,
    intra-launch races, indeterminate bytes) clip each copy once between them.  The result
    is shared: its arrays must not be modified."""
    key = (id(plan), src_nbytes, dst_nbytes)
    got = _CLIPPED.get(key)
    if got is None or got[0] is not plan:
        c = clip_extents(plan.extents, src_nbytes, dst_nbytes)
        n = int(c.length.size)
        if n > CLIPPED_CACHE_EXTENTS // 16:            # a large copy: not worth holding
            return c
        if len(_CLIPPED) >= CLIPPED_CACHE_SIZE or _clipped_extents[0] + n > CLIPPED_CACHE_EXTENTS:
            _CLIPPED.clear()
            _clipped_extents[0] = 0
        got = _CLIPPED[key] = (plan, c)
        _clipped_extents[0] += n
    return got[1]


def clip_and_leaves(plan, src_nbytes: int, dst_nbytes: int) -> tuple[Clipped, bool]:
    """A copy plan's extents clipped to its buffers, and whether any extent leaves one."""
    c = clip_extents(plan.extents, src_nbytes, dst_nbytes)
    return c, bool(c.length.size and int((c.length - c.copy_len).max()) > 0)


def fits_materialised(buffers: dict) -> bool:
    """Whether real bytes for ``buffers`` may be held: MATERIALISED_COPIES copies of all
    of them together within MATERIALISE_LIMIT_BYTES."""
    return MATERIALISED_COPIES * sum(spec.nbytes for spec in buffers.values()) <= MATERIALISE_LIMIT_BYTES


def _fill_segments(models, segments) -> None:
    """Apply a general init fill (``Fill.segments``: disjoint ``(offset, nbytes, Origin,
    stream_offset)``) to every byte model, one batch per origin."""
    by_origin: dict = {}
    for off, n, origin, soff in segments:
        by_origin.setdefault(origin, []).append((off, n, soff))
    for origin, rows in by_origin.items():
        a = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        for m in models:
            m.fill(a[:, 0], a[:, 1], origin, a[:, 2])


def write_pattern(spec, layer, units, owner: int, version: int) -> tuple[list[Origin], np.ndarray]:
    """What a write of ``units`` stores (the one home of that rule): the origins, one per layer
    (``layer``: one layer or a sequence), and each extent's offset in its origin's pattern
    stream, layer by layer (unit ``u`` of the origin starts at byte ``u * unit_bytes``)."""
    ub = spec.layout.unit_bytes
    layers = [int(x) for x in layer] if isinstance(layer, (tuple, list)) else [layer]
    soffs = np.asarray(units, np.int64) * ub
    return ([Origin(spec.kind, x, owner, version, ub) for x in layers],
            soffs if len(layers) == 1 else np.tile(soffs, len(layers)))


class Memory:
    """Both byte models of a schedule's buffers.

    ``materialise=True`` asks for real bytes too; they are kept only when
    :func:`fits_materialised` (otherwise ``material`` is None, as with
    ``materialise=False``, and every view and digest comes from the compact model)."""

    def __init__(self, buffers: dict, *, materialise: bool = True, table: OriginTable | None = None):
        materialise = materialise and fits_materialised(buffers)
        self.specs = buffers
        self.table = table or OriginTable()
        self.compact: dict[str, CompactBuffer] = {}
        self.material: dict[str, MaterialBuffer] | None = {} if materialise else None
        self._same_start: dict = {}            # (kind, layout) -> a buffer set up from them (see _init_buffer)
        for name, spec in buffers.items():
            self._init_buffer(name, spec)
        self._same_start = {}
        self.arena = _arena(buffers)
        self._watchers: list = []                # (callback, buffer names or None): see watch

    def copy_compact(self) -> "Memory":
        """A compact-only Memory holding this one's current contents, sharing its origin
        table and specs, in O(blocks) per buffer (``CompactBuffer.clone``): how the
        happens-before-order memory and the report's initial memory of a run start."""
        return self.over({name: buf.clone() for name, buf in self.compact.items()})

    def over(self, compact: dict) -> "Memory":
        """A compact-only Memory of this one's specs and table holding the given
        ``CompactBuffer`` objects (``{name: buffer}``, not copied: operations on it change
        them), with no watchers: this module's operations applied to buffers held elsewhere."""
        out = Memory.__new__(Memory)
        out.specs, out.table = self.specs, self.table
        out.compact = dict(compact)
        out.material = None
        out.arena = self.arena
        out._same_start = {}
        out._watchers = []
        return out

    def adopt_watchers(self, other: "Memory") -> None:
        """Take ``other``'s watchers (``other`` is replaced by this memory: see
        ``sim.deferred``)."""
        self._watchers = other._watchers

    # ---------------------------------------------------------------- setup
    def _init_buffer(self, name, spec):
        # NOTE: buffers of one kind and layout with no init fills start with equal contents
        # (every TP rank's pool): the first one's segments are shared (compact model only)
        key = None
        if self.material is None and not spec.init:
            try:
                key = (spec.kind, spec.layout)
                first = self._same_start.get(key)
            except TypeError:                       # a layout with an unhashable field
                key = first = None
            if first is not None:
                self.compact[name] = first.clone()
                return
        self._init_buffer_models(name, spec)
        if key is not None:
            self._same_start[key] = self.compact[name].clone()

    def _init_buffer_models(self, name, spec):
        lay = spec.layout
        ub = lay.unit_bytes
        probe = np.asarray(lay.unit_offsets(0, np.array([0, lay.units - 1])), dtype=np.int64)
        per_layer = lay.units == 1 or int(probe[1] - probe[0]) == (lay.units - 1) * ub
        first = Origin(spec.kind, 0 if per_layer else -1, -1, 0, ub)
        models = [CompactBuffer(spec.nbytes, self.table, first)]
        if self.material is not None:
            models.append(MaterialBuffer(spec.nbytes, self.table, first))
        if per_layer:
            for layer in range(1, lay.layers):
                base = np.asarray(lay.unit_offsets(layer, np.array([0])), dtype=np.int64)
                for m in models:
                    m.fill(base, np.array([lay.units * ub]), Origin(spec.kind, layer, -1, 0, ub), np.array([0]))
        for f in spec.init:
            if f.segments:
                _fill_segments(models, f.segments)
                continue
            for layer in f.layers:
                origin = Origin(spec.kind, layer, f.owner, f.version, lay.unit_bytes)
                dst = np.asarray(lay.unit_offsets(layer, f.indices), dtype=np.int64)
                src = (f.first_unit + np.arange(f.indices.size, dtype=np.int64)) * lay.unit_bytes
                for m in models:
                    m.fill(dst, np.full(dst.size, lay.unit_bytes, np.int64), origin, src)
        self.compact[name] = models[0]
        if self.material is not None:
            self.material[name] = models[1]

    def _models(self, name):
        yield self.compact[name]
        if self.material is not None:
            yield self.material[name]

    # ---------------------------------------------------------------- mutation
    def watch(self, callback, buffers=None) -> None:
        """Call ``callback(buffer, offsets, lengths)`` (int64 arrays) right after each
        mutation of a buffer in ``buffers`` (default: any) through :meth:`write_units` or
        :meth:`apply_copy` (the only ways a run changes its memory's bytes);
        ``[offsets, offsets + lengths)`` covers every byte written (a copy's whole selected
        extents: an over-approximation where part of one lies past the destination's end).
        A watcher that forgets what it derived from those bytes never holds a stale
        conclusion (the KV oracle's remembered verdicts, ``sim.engine.oracle``)."""
        self._watchers.append((callback, None if buffers is None else frozenset(buffers)))

    @property
    def watched(self) -> bool:
        """Whether some watcher is registered (:meth:`watch`)."""
        return bool(self._watchers)

    def notify(self, name: str, offsets, lengths) -> None:
        """Tell the watchers of ``name`` that bytes ``[offsets, offsets + lengths)`` were
        written (what :meth:`write_units` and :meth:`apply_copy` do; a caller that keeps the
        bytes elsewhere, ``sim.deferred``, tells them itself)."""
        for callback, names in self._watchers:
            if names is None or name in names:
                callback(name, offsets, lengths)

    def apply_copy(self, src: str, dst: str, c: Clipped, sel=slice(None), done=None) -> None:
        """Apply extents ``sel`` of a clipped copy; ``done`` (bytes per selected
        extent) applies only that prefix of each (an in-flight item)."""
        self._apply_copy(src, dst, c, sel, done)
        if self._watchers:
            self.notify(dst, c.dst[sel], c.length[sel])

    def _apply_copy(self, src: str, dst: str, c: Clipped, sel, done) -> None:
        if done is None:
            a, b, step = sel.indices(c.copy_len.size)
            if b - a == 1 and step == 1:                     # one extent: plain integers
                s, d, n_copy, f0, f1 = c.row(a)
                if self.material is None:
                    if n_copy > 0:
                        self.compact[dst].copy_from(self.compact[src], s, d, n_copy)
                    if f1 > f0:
                        self.compact[dst].fill(d + f0, f1 - f0, oob_origin(src), s + f0 - c.src_nbytes)
                    return
                if n_copy > 0:
                    for m_src, m_dst in zip(self._models(src), self._models(dst)):
                        m_dst.copy_from(m_src, s, d, n_copy)
                if f1 > f0:
                    for m in self._models(dst):
                        m.fill(d + f0, f1 - f0, oob_origin(src), s + f0 - c.src_nbytes)
                return
        n_copy = c.copy_len[sel]
        f0, f1 = c.fill_start[sel], c.fill_end[sel]
        if done is not None:
            n_copy = np.minimum(n_copy, done)
            f1 = np.minimum(f1, done)
        s, d = c.src[sel], c.dst[sel]
        keep = n_copy > 0
        if keep.any():
            for m_src, m_dst in zip(self._models(src), self._models(dst)):
                m_dst.copy_from(m_src, s[keep], d[keep], n_copy[keep])
        fill = f1 > f0
        if fill.any():
            origin = oob_origin(src)
            for m in self._models(dst):
                m.fill(d[fill] + f0[fill], (f1 - f0)[fill], origin, s[fill] + f0[fill] - c.src_nbytes)

    def write_units(self, name: str, layer, units: np.ndarray, offsets, lengths, owner: int,
                    version: int) -> None:
        """Store pattern bytes of ``units`` at ``[offsets, offsets + lengths)``: unit ``u`` of
        origin (buffer kind, layer, owner, version).  ``layer``: one layer, or a sequence of
        layers whose extents come one after another (``len(units)`` each, the same units in
        every layer: :class:`sim.schedule.WriteOp`), each with its own layer's origin."""
        offsets, lengths = np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)
        origins, soffs = write_pattern(self.specs[name], layer, units, owner, version)
        for m in self._models(name):
            if len(origins) == 1:
                m.fill(offsets, lengths, origins[0], soffs)
            else:
                m.fill_groups(offsets, lengths, origins, soffs)
        if self._watchers:
            self.notify(name, offsets, lengths)

    def apply_write(self, op) -> None:
        """Apply a ``write`` op (:class:`sim.schedule.WriteOp`): every layer it writes."""
        offs, lens = op.extents
        self.write_units(op.buffer, op.layers, op.units, offs, lens, op.owner, op.version)

    # ---------------------------------------------------------------- views
    def view(self, name: str, offset: int, nbytes: int) -> "View":
        return View(self.compact[name].slice(offset, nbytes),
                    None if self.material is None else self.material[name].slice(offset, nbytes), offset)

    def views(self, name: str, offsets, lengths) -> list["View"]:
        """``[self.view(name, o, n) for o, n in zip(offsets, lengths)]`` (a read's views, one
        per extent), the compact slices looked up together (``CompactBuffer.slices``)."""
        offs = offsets.tolist() if isinstance(offsets, np.ndarray) else [int(x) for x in offsets]
        lens = lengths.tolist() if isinstance(lengths, np.ndarray) else [int(x) for x in lengths]
        compact = self.compact[name].slices(offs, lens)
        if self.material is None:
            return [View(c, None, o) for c, o in zip(compact, offs)]
        mat = self.material[name]
        return [View(c, mat.slice(o, n), o) for c, o, n in zip(compact, offs, lens)]

    def overlay(self, view: "View", src: str, s, d, n) -> None:
        """Copy src bytes into a view (d are absolute destination offsets)."""
        d = np.asarray(d, np.int64) - view.offset
        view.compact.copy_from(self.compact[src], s, d, n)
        if view.material is not None:
            view.material.copy_from(self.material[src], s, d, n)

    def overlay_fill(self, view: "View", origin: Origin, d, n, stream_off) -> None:
        d = np.asarray(d, np.int64) - view.offset
        view.compact.fill(d, n, origin, stream_off)
        if view.material is not None:
            view.material.fill(d, n, origin, stream_off)

    def final_bytes(self, name: str) -> np.ndarray:
        """The buffer's bytes now (materialised whole: for small buffers)."""
        if self.material is not None:
            return self.material[name].data
        return self.compact[name].materialise()

    def digest(self, name: str) -> str:
        """The buffer's digest now (one rule for reports and Snapshots):

        * up to BYTE_DIGEST_LIMIT bytes: sha256 (hex) of its bytes, equal to
          ``hashlib.sha256(final_bytes(name).tobytes()).hexdigest()`` (what a GPU run
          computes), from the real bytes in place or from the compact model
          DIGEST_CHUNK_BYTES at a time;
        * larger: ``"provenance:" + CompactBuffer.provenance_digest()``, whose cost
          grows with the buffer's segments, not its bytes (a host pool of tens of GB
          is hashed in milliseconds; generating its pattern bytes would take minutes).
        """
        buf = self.compact[name]
        if buf.nbytes > BYTE_DIGEST_LIMIT:
            return "provenance:" + buf.provenance_digest()
        h = hashlib.sha256()
        if self.material is not None:
            h.update(memoryview(np.ascontiguousarray(self.material[name].data)))
            return h.hexdigest()
        # NOTE: the bytes are a function of the provenance, so buffers with equal provenance
        # (the same pool on every TP rank, a buffer no op touched) are hashed once
        key = buf.provenance_digest()
        got = _BYTE_DIGESTS.get(key)
        if got is not None:
            return got
        for offset in range(0, buf.nbytes, DIGEST_CHUNK_BYTES):
            h.update(memoryview(buf.materialise(offset, min(DIGEST_CHUNK_BYTES, buf.nbytes - offset))))
        if len(_BYTE_DIGESTS) >= BYTE_DIGEST_CACHE:
            _BYTE_DIGESTS.clear()
        got = _BYTE_DIGESTS[key] = h.hexdigest()
        return got

    def neighbour(self, name: str, offset: int) -> str:
        """Which buffer an address ``offset`` bytes from ``name``'s base falls in."""
        loc, base = self.arena[name]
        addr = base + offset
        for other, (oloc, obase) in self.arena.items():
            if oloc == loc and obase <= addr < obase + self.specs[other].nbytes:
                return other
        return "unallocated memory"


@dataclass
class View:
    compact: CompactBuffer
    material: MaterialBuffer | None
    offset: int

    def bytes(self) -> np.ndarray:
        if self.material is not None:
            return self.material.read(0, self.material.nbytes)
        return self.compact.materialise()


def _arena(buffers: dict) -> dict[str, tuple[str, int]]:
    cursor: dict[str, int] = {}
    out = {}
    for name, spec in buffers.items():
        loc = "host" if spec.location == "host" else f"device{spec.device}"
        base = cursor.get(loc, 0)
        out[name] = (loc, base)
        cursor[loc] = base + -(-spec.nbytes // ARENA_ALIGN) * ARENA_ALIGN
    return out
